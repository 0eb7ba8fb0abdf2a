"""Names: renames (with the lake keys of a moved subtree) and hard links.

``NamesMixin.rename`` moves an entry and re-keys everything below it
(``_rekey``; a name of a hard-linked inode moves alone, ``_move_name``);
``link`` gives an inode one more name and ``join_link_group`` puts back
together, on a fresh node, the names of a hard-linked file it finds in the
lake. The steps that drop a name (``_remove``, ``_drop_name``) are shared
with unlink and listings and live in :mod:`aifs.meta.base`. A mixin over
:class:`aifs.meta.base.StoreBase` (see there why mixins).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from aifs.meta.base import Txn
from aifs.meta.batches import BatchesMixin
from aifs.meta.inode import DATA, DIR, MAYBE_IN_LAKE, META, Inode
from aifs.meta.schema import SYS_NEXT_COOKIE, U64X2, key_bytes, u64


class NamesMixin(BatchesMixin):
    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               new_key: str, tombstones: Iterable[str] = (),
               etags: dict[str, str] | None = None,
               has_local: Callable[[int], bool] = lambda ino: False,
               ) -> tuple[Inode, Inode | None]:
        """Move an entry (and, for a directory, the keys of its whole listed
        subtree) to ``new_parent``/``new_name`` with lake key ``new_key``.

        An entry already at the target is unlinked and returned. ``tombstones``
        are old lake keys to delete; ``etags`` are the new ETags of objects
        copied in the lake (by new key). ``has_local`` tells which inodes have
        a local copy to upload again if their object could not be copied.
        """
        etags = etags or {}
        with self._write() as txn:
            value = txn.get(u64(old_parent) + old_name, db=self.dentries)
            if value is None:
                raise KeyError(old_name)
            ino, _ = U64X2.unpack(value[:16])
            replaced = None
            target = txn.get(u64(new_parent) + new_name, db=self.dentries)
            if target is not None:
                replaced = self._remove(txn, new_parent, new_name, bytes(target), tomb=True)
            self._remove_dentry(txn, old_parent, old_name, bytes(value))
            cookie = self._counter(txn, SYS_NEXT_COOKIE, 1)
            txn.put(u64(new_parent) + new_name, U64X2.pack(ino, cookie), db=self.dentries)
            txn.put(u64(new_parent) + u64(cookie), new_name, db=self.cookies)
            now = time.time()
            self._rekey(txn, ino, new_key, etags, now, has_local, parent=new_parent,
                        old_key=self._key_of(txn, old_parent, old_name))
            for key in tombstones:
                if txn.get(key_bytes(key), db=self.objkeys) is None:
                    self._tomb(txn, key, 0)
            raw = txn.get(u64(ino), db=self.inodes)
            assert raw is not None  # (just re-keyed)
            moved = Inode.decode(raw)
        return moved, replaced

    def _rekey(self, txn: Txn, ino: int, new_key: str, etags: dict[str, str],
               now: float, has_local: Callable[[int], bool],
               parent: int | None = None, old_key: str | None = None) -> None:
        raw = txn.get(u64(ino), db=self.inodes)
        assert raw is not None  # (a dentry's inode has a record)
        inode = Inode.decode(raw)
        if inode.links and old_key is not None:
            self._move_name(txn, inode, old_key, new_key, parent)
            return
        old_key = inode.key
        old = key_bytes(old_key)
        if txn.get(old, db=self.objkeys) == u64(ino):
            txn.delete(old, db=self.objkeys)
        inode.key = new_key
        if parent is not None:
            inode.parent = parent
        if new_key in etags:
            inode.etag = etags[new_key]
            inode.pack, inode.pack_offset, inode.checksum = "", 0, ""
        elif inode.packed and not inode.pending & DATA:
            pass  # the pack index moves it (no object of its own to copy)
        elif inode.is_dir:
            if inode.in_lake:
                # Its marker (only this node's own markers have an etag) landed
                # while the move was under way, after its listing: not copied.
                # Delete it; write the marker under the new key.
                self._tomb(txn, old_key, 0)
                inode.etag = ""
                inode.pending |= META
        else:
            if inode.in_lake and inode.etag != MAYBE_IN_LAKE:
                # Landed while the move was under way (after its listing): its
                # object under the old key was not copied. Delete it; upload the
                # local copy. Also when the file changed meanwhile and is pending
                # again: its etag is all that says the old key holds an object.
                self._tomb(txn, old_key, 0)
                if has_local(ino):
                    inode.pending |= DATA
            # No object of its own under the new key; an older one may be there.
            tombed = txn.get(key_bytes(new_key), db=self.tombs) is not None
            inode.etag = MAYBE_IN_LAKE if tombed else ""
        inode.ctime = now
        txn.put(key_bytes(new_key), u64(ino), db=self.objkeys)
        self._put(txn, inode)
        if inode.is_dir:
            for name, value in list(self._children(ino, txn)):
                child = U64X2.unpack(value[:16])[0]
                raw_child = txn.get(u64(child), db=self.inodes)
                assert raw_child is not None  # (a dentry's inode has a record)
                kind = Inode.decode(raw_child).kind
                suffix = "/" if kind == DIR else ""
                text = name.decode("utf-8", "surrogateescape") + suffix
                self._rekey(txn, child, new_key + text, etags, now, has_local,
                            old_key=old_key + text)

    def _move_name(self, txn: Txn, inode: Inode, old_key: str, new_key: str,
                   parent: int | None) -> None:
        """Rename one name of a hard-linked inode. Its old object is deleted;
        the promoter makes the new one (a copy, with the group's metadata)."""
        if old_key == inode.key:
            inode.key = new_key
            if parent is not None:
                inode.parent = parent
        else:
            for link in inode.links:
                if link[1] == old_key:
                    link[1] = new_key
                    if parent is not None:
                        link[0] = parent
        raw = key_bytes(old_key)
        if txn.get(raw, db=self.objkeys) == u64(inode.ino):
            txn.delete(raw, db=self.objkeys)
        self._tomb(txn, old_key, 0)
        txn.put(key_bytes(new_key), u64(inode.ino), db=self.objkeys)
        inode.ctime = time.time()
        inode.pending |= META
        self._put(txn, inode)

    def link(self, ino: int, parent: int, name: bytes, key: str, link_id: str) -> Inode:
        """Give ``ino`` one more name: ``name`` in ``parent``, lake key ``key``."""
        with self._write() as txn:
            raw = txn.get(u64(ino), db=self.inodes)
            assert raw is not None  # (the caller holds the inode: it has a record)
            inode = Inode.decode(raw)
            cookie = self._counter(txn, SYS_NEXT_COOKIE, 1)
            txn.put(u64(parent) + name, U64X2.pack(ino, cookie), db=self.dentries)
            txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(key), u64(ino), db=self.objkeys)
            inode.links.append([parent, key])
            if not inode.link_id:
                inode.link_id = link_id
                txn.put(link_id.encode(), u64(ino), db=self.link_groups)
            inode.nlink_hint = 0
            inode.ctime = time.time()
            inode.pending |= META  # the new name's object is made with the metadata
            self._put(txn, inode)
        return inode

    def join_link_group(self, inode: Inode) -> Inode:
        """A fresh node found a name whose object belongs to a hard-link group:
        if another inode here holds the group, the name becomes one of its
        names (this inode an orphan); else this inode holds the group."""
        with self._write() as txn:
            raw_owner = txn.get(inode.link_id.encode(), db=self.link_groups)
            owner_raw = txn.get(raw_owner, db=self.inodes) if raw_owner else None
            owner = Inode.decode(owner_raw) if owner_raw else None
            if owner is None or owner.orphan or owner.link_id != inode.link_id \
                    or owner.ino == inode.ino:
                txn.put(inode.link_id.encode(), u64(inode.ino), db=self.link_groups)
                self._put(txn, inode)
                return inode
            if inode.key in owner.keys():
                return owner
            entry = self._entry_of(txn, inode)
            if entry is None:
                return inode
            name, value = entry
            self._remove_dentry(txn, inode.parent, name, value)
            cookie = self._counter(txn, SYS_NEXT_COOKIE, 1)
            txn.put(u64(inode.parent) + name, U64X2.pack(owner.ino, cookie), db=self.dentries)
            txn.put(u64(inode.parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(inode.key), u64(owner.ino), db=self.objkeys)
            owner.links.append([inode.parent, inode.key])
            owner.nlink_hint = max(owner.nlink_hint, inode.nlink_hint)
            self._put(txn, owner)
            inode.orphan = True
            self._put(txn, inode)
        return owner
