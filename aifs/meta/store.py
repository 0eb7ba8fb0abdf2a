"""LMDB metadata store: a node's fast index of the lake plus its own dirty state.

Every method is synchronous and runs one transaction; nothing awaits inside a
transaction. Deleting the store costs a re-listing and whatever was dirty.

The databases, their keys and values are tabled in :mod:`aifs.meta.schema`.
``MetaStore`` is assembled from one module per responsibility:

- :mod:`aifs.meta.base`: the environment, its databases and the primitives
  inside a transaction that the others share
- this module: reads (lookup, readdir, subtrees) and the plain writes of one
  inode or entry (create, update, remove, orphans)
- :mod:`aifs.meta.listing`: a directory's LIST merged in (``apply_listing``)
- :mod:`aifs.meta.names`: renames and hard links
- :mod:`aifs.meta.promotion`: what the lake still lacks (pending, markers,
  tombstones, uploads, unclosed files)

The records themselves (``Inode``, its kinds and flags, ``Listed``) are in
:mod:`aifs.meta.inode`; this module re-exports them, and the schema's key
helpers, under the names other modules import from here.

A lookup is one get in ``dentry``; readdir is a range scan of ``cookie`` from
the last cookie the kernel saw, so entries added or removed meanwhile never
shift the others. Cookies are allocated from one counter and never reused.
The environment is opened without fsync per commit (a killed daemon loses
nothing: commits are in the page cache); ``sync()`` makes it durable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from aifs.meta.base import RESERVE_BYTES
from aifs.meta.inode import (
    BLK,
    CHR,
    DATA,
    DECODED_KEPT,
    DIR,
    FIFO,
    FILE,
    LINK,
    MAYBE_IN_LAKE,
    META,
    ROOT_INO,
    SOCK,
    SPECIAL,
    Inode,
    Listed,
    record_is_dir,
    valid_name,
)
from aifs.meta.listing import ListingMixin
from aifs.meta.names import NamesMixin
from aifs.meta.promotion import PromotionMixin
from aifs.meta.schema import (
    KEY_KEPT,
    KEY_RAW_MAX,
    MIGRATIONS,
    SCHEMA_VERSION,
    SYS_NEXT_COOKIE,
    SYS_NEXT_INO,
    U64,
    U64X2,
    SchemaError,
    compact_json,
    is_hashed,
    key_bytes,
    scan_prefix,
    u64,
)

__all__ = [
    "BLK", "CHR", "DATA", "DECODED_KEPT", "DIR", "FIFO", "FILE", "KEY_KEPT", "KEY_RAW_MAX",
    "LINK", "MAYBE_IN_LAKE", "META", "MIGRATIONS", "RESERVE_BYTES", "ROOT_INO",
    "SCHEMA_VERSION", "SOCK", "SPECIAL", "Inode", "Listed", "MetaStore", "SchemaError",
    "compact_json", "is_hashed", "key_bytes", "scan_prefix", "u64", "valid_name",
]


class MetaStore(ListingMixin, NamesMixin, PromotionMixin):
    def __init__(self, path: Path, map_size: int = 1 << 36, batches: bool = True) -> None:
        """``batches``: keep a first listing's plain files as one record per
        directory (:mod:`aifs.meta.batches`); off only to compare with."""
        super().__init__(path, map_size)
        self._init_batches(batches)

    # -- reads (a batched entry is read from its batch) ---------------------
    def get(self, ino: int) -> Inode | None:
        with self.env.begin() as txn:
            raw = txn.get(u64(ino), db=self.inodes)
            if raw is None:
                return self._virtual(txn, ino)
        return Inode.decode(raw)

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        with self.env.begin() as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
            if value is None:
                found = self._virtual_entry(txn, parent, name)
                return found[0].inode(found[1]) if found else None
            raw = txn.get(value[:8], db=self.inodes)
        return Inode.decode(raw) if raw else None

    def cookie_of(self, parent: int, name: bytes) -> int | None:
        """The readdir cookie of entry ``name`` of ``parent`` (None: no such entry)."""
        with self.env.begin() as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
            if value is None:
                found = self._virtual_entry(txn, parent, name)
                return found[0].first_cookie + found[1] if found else None
        cookie: int = U64X2.unpack(value[:16])[1]
        return cookie

    def exists(self, parent: int, name: bytes) -> bool:
        with self.env.begin() as txn:
            return txn.get(u64(parent) + name, db=self.dentries) is not None \
                or self._virtual_entry(txn, parent, name) is not None

    def owner_of(self, key: str) -> int | None:
        """The live inode that owns lake key ``key``, if any."""
        with self.env.begin() as txn:
            raw_key = key_bytes(key)
            raw = txn.get(raw_key, db=self.objkeys)
            if raw is None:
                found = self._virtual_key(txn, raw_key)
                return found[0].first_ino + found[1] if found else None
        ino: int = U64.unpack(raw)[0]
        return ino

    def readdir(self, parent: int, after_cookie: int,
                limit: int) -> list[tuple[int, bytes, Inode]]:
        """Up to ``limit`` children with cookie > ``after_cookie``, in cookie order."""
        out: list[tuple[int, bytes, Inode]] = []
        prefix = u64(parent)
        with self.env.begin() as txn:
            batch = self._batch(txn, parent)
            if batch is not None:  # its cookies come before any other child's
                start = max(0, after_cookie + 1 - batch.first_cookie)
                for i in range(start, min(len(batch), start + limit)):
                    out.append((batch.first_cookie + i, batch.names[i], batch.inode(i)))
                after_cookie = max(after_cookie, batch.first_cookie + len(batch) - 1)
                if len(out) >= limit:
                    return out
            cursor = txn.cursor(db=self.cookies)
            if not cursor.set_range(prefix + u64(after_cookie + 1)):
                return out
            for key, name in cursor:
                if not key.startswith(prefix) or len(out) >= limit:
                    break
                value = txn.get(prefix + name, db=self.dentries)
                raw = txn.get(value[:8], db=self.inodes) if value else None
                if raw:
                    out.append((U64.unpack(key[8:])[0], bytes(name), Inode.decode(raw)))
        return out

    def subtree_files(self, ino: int) -> Iterator[Inode]:
        """Every known non-directory inode at or below ``ino``."""
        stack = [ino]
        while stack:
            current = stack.pop()
            with self.env.begin() as txn:  # closed before yielding: callers may write
                raw = txn.get(u64(current), db=self.inodes)
                inode = Inode.decode(raw) if raw else None
                if inode is None:
                    inode = self._virtual(txn, current)
                if inode is not None and inode.is_dir:
                    stack += [U64.unpack(value[:8])[0]
                              for _, value in self._children(current, txn)]
                    stack += [U64.unpack(value[:8])[0]
                              for _, value in self._virtual_children(txn, current)]
            if inode is not None and not inode.is_dir:
                yield inode

    def subdir_count(self, parent: int) -> int:
        """How many children of ``parent`` are directories."""
        with self.env.begin() as txn:
            count = 0
            for _, value in self._children(parent, txn):
                raw = txn.get(value[:8], db=self.inodes)
                if raw is not None and record_is_dir(raw):
                    count += 1
        return count

    def children_count(self, parent: int) -> int:
        with self.env.begin() as txn:
            batch = self._batch(txn, parent)
            return sum(1 for _ in self._children(parent, txn)) + (len(batch) if batch else 0)

    # -- writes -----------------------------------------------------------
    def put(self, inode: Inode) -> None:
        """Store an inode record as it is (and index its pending state)."""
        with self._write() as txn:
            self._put(txn, inode)

    def update(self, ino: int, closed: bool = False, **changes: object) -> Inode | None:
        """Change some fields of a stored inode; return it as stored.
        ``closed``: in the same transaction, its writer closed it (see
        :meth:`clear_unclosed`)."""
        with self._write() as txn:
            if closed:
                txn.delete(u64(ino), db=self.unclosed_db)
            raw = txn.get(u64(ino), db=self.inodes)
            if not raw:
                return None
            inode = Inode.decode(raw)
            for name, value in changes.items():
                setattr(inode, name, value)
            self._put(txn, inode)
        return inode

    def set_times(self, times: dict[int, tuple[int, float]]) -> None:
        """Set (mtime_ns, ctime) of several inodes in one transaction."""
        with self._write() as txn:
            for ino, (mtime_ns, ctime) in times.items():
                raw = txn.get(u64(ino), db=self.inodes)
                if raw:
                    inode = Inode.decode(raw)
                    inode.mtime_ns, inode.ctime = mtime_ns, ctime
                    txn.put(u64(ino), inode.encode(), db=self.inodes)

    def create(self, parent: int, name: bytes, inode: Inode, unclosed: bool = False) -> Inode:
        """Add a new child ``name`` of ``parent``; ``inode.ino`` is assigned here
        unless set.
        ``unclosed``: created by an open for writing (see :meth:`mark_unclosed`),
        recorded in the same transaction, so no crash can publish it half made."""
        with self._write() as txn:
            objkey = key_bytes(inode.key)
            if txn.get(objkey, db=self.tombs) is not None and not inode.etag:
                inode.etag = MAYBE_IN_LAKE  # an old object there is deleted or replaced
            if not inode.ino:
                inode.ino = self._counter(txn, SYS_NEXT_INO, 2)
            cookie = self._counter(txn, SYS_NEXT_COOKIE, 1)
            txn.put(u64(parent) + name, U64X2.pack(inode.ino, cookie), db=self.dentries)
            txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
            txn.put(objkey, u64(inode.ino), db=self.objkeys)
            self._put(txn, inode)
            if unclosed:
                txn.put(u64(inode.ino), b"", db=self.unclosed_db)
        return inode

    def reincarnate(self, inode: Inode) -> Inode:
        """Give an entry whose file type turned out different (a symlink object
        listed as a file) a new inode number: the kernel cannot change the
        type of an inode it knows. The old number becomes an orphan."""
        with self._write() as txn:
            parent = self._entry_of(txn, inode)
            if parent is None:
                return inode
            name, value = parent
            self._remove(txn, inode.parent, name, value, tomb=False)
            inode.ino = self._counter(txn, SYS_NEXT_INO, 2)
            inode.orphan = False
            cookie = self._counter(txn, SYS_NEXT_COOKIE, 1)
            txn.put(u64(inode.parent) + name, U64X2.pack(inode.ino, cookie), db=self.dentries)
            txn.put(u64(inode.parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(inode.key), u64(inode.ino), db=self.objkeys)
            self._put(txn, inode)
        return inode

    def remove(self, parent: int, name: bytes) -> Inode | None:
        """Unlink ``name`` from ``parent``: the inode becomes an orphan and, if
        the lake may hold its object, that key is tombstoned."""
        with self._write() as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
            if value is None:
                return None
            return self._remove(txn, parent, name, bytes(value), tomb=True)

    # -- orphans and stale listings ---------------------------------------------
    def delete_orphan(self, ino: int) -> None:
        """Drop an orphan's record (and, for a directory, its subtree)."""
        with self._write() as txn:
            self._delete_tree(txn, ino)

    def purge_orphans(self) -> list[int]:
        """At mount time no kernel reference exists: drop every orphan."""
        with self._write() as txn:
            orphans = [Inode.decode(v).ino for _, v in txn.cursor(db=self.inodes)
                       if b'"orphan":true' in v]
            for ino in orphans:
                self._delete_tree(txn, ino)
        return orphans

    def expire_all(self) -> None:
        """Mark every directory listing stale (for a remount after a long pause)."""
        with self._write() as txn:
            updates = []
            for key, raw in txn.cursor(db=self.inodes):
                inode = Inode.decode(raw)
                if inode.is_dir and inode.listed_at:
                    inode.listed_at = 0.0
                    updates.append((bytes(key), inode.encode()))
            for key, raw in updates:
                txn.put(key, raw, db=self.inodes)
