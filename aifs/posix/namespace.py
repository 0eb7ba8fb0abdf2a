"""The namespace: create, mknod, mkdir, symlink, readlink, unlink, rmdir,
link and rename.

Every change is made in LMDB at once (atomic for this node) and reaches the
lake through promotion: new entries are scheduled, removed names become
tombstones, a rename copies what the lake holds server side
(:mod:`~aifs.posix.moves`) and moves packed files by records.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from aifs.checkpoint import Checkpoints
from aifs.errors import FsError
from aifs.flush.promoter import Promoter
from aifs.lake.base import ObjectStore
from aifs.meta.objattrs import kind_of
from aifs.meta.store import (
    BLK,
    CHR,
    DATA,
    DIR,
    FILE,
    LINK,
    META,
    ROOT_INO,
    SPECIAL,
    Inode,
    MetaStore,
)
from aifs.pack.index import deletion
from aifs.pack.packer import Packer
from aifs.posix.files import Files
from aifs.posix.inodes import Inodes, name_of
from aifs.posix.listing import RESERVED_PREFIX, Listings
from aifs.posix.moves import Moves
from aifs.posix.writes import Writes

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Namespace:
    def __init__(self, inodes: Inodes, listings: Listings, files: Files, writes: Writes,
                 moves: Moves, store: ObjectStore, meta: MetaStore, packer: Packer,
                 promoter: Promoter, checkpoints: Checkpoints) -> None:
        self.inodes = inodes
        self.listings = listings
        self.files = files
        self.writes = writes
        self.moves = moves
        self.store = store
        self.meta = meta
        self.packer = packer
        self.promoter = promoter
        self.checkpoints = checkpoints
        self.local = inodes.local

    async def _new_entry(self, parent: int, name: bytes) -> Inode:
        """The parent directory, checked and listed, where ``name`` may be created."""
        directory = self.inodes.directory(parent)
        if len(name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if name in (b".", b"..") or b"/" in name or b"\0" in name:
            raise FsError(errno.EINVAL)
        if parent == ROOT_INO and name == RESERVED_PREFIX.encode():
            raise FsError(errno.EPERM)  # the lake's reserved prefix
        directory = await self.listings.ensure_listed(directory)
        if directory.orphan:
            raise FsError(errno.ENOENT)  # removed by the listing
        if self.meta.exists(parent, name):
            raise FsError(errno.EEXIST)
        return directory

    def _add(self, directory: Inode, name: bytes, kind: str, mode: int, uid: int, gid: int,
             pending: int, unclosed: bool = False, **extra: object) -> Inode:
        now = self.inodes.clock()
        key = directory.key + name_of(name) + ("/" if kind == DIR else "")
        self.check_key(key)
        mode = stat.S_IMODE(mode)
        if directory.mode >= 0 and directory.mode & stat.S_ISGID:
            # A set-group-ID directory: its group is inherited, and by
            # directories the bit too (as ext4 and tmpfs do).
            gid = self.inodes.gid if directory.gid < 0 else directory.gid
            if kind == DIR:
                mode |= stat.S_ISGID
        inode = Inode(0, kind, key, directory.ino, mtime_ns=time.time_ns(), mode=mode,
                      uid=uid, gid=gid, ctime=now,
                      attrs_known=True, pending=pending, **extra)  # type: ignore[arg-type]
        inode = self.meta.create(directory.ino, name, inode, unclosed)
        if unclosed:
            self.inodes.unclosed.add(inode.ino)
        self.inodes.touch_dir(directory.ino, subdirs=inode.is_dir)
        self.inodes.remember(inode.ino)
        return inode

    def check_key(self, key: str) -> None:
        """A name whose lake key the lake cannot hold gets ENAMETOOLONG (S3
        keys have at most 1,024 bytes): refused now, not lost at promotion."""
        if len(key.encode("utf-8", "surrogateescape")) > self.store.max_key_bytes:
            raise FsError(errno.ENAMETOOLONG)

    async def _new_file(self, parent: int, name: bytes, mode: int, uid: int,
                        gid: int, unclosed: bool = False) -> Inode:
        directory = await self._new_entry(parent, name)
        inode = self._add(directory, name, FILE, mode, uid, gid, DATA, unclosed)
        self.local.create(inode.ino)
        self.inodes.kernel_etag[inode.ino] = inode.etag
        return inode

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Inode]:
        # opened for writing: a crash before its close must never publish it
        inode = await self._new_file(parent, name, mode, uid, gid,
                                     unclosed=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        return self._open_new(inode, uid), inode

    def _open_new(self, inode: Inode, uid: int) -> int:
        # new, empty and dirty: the writes and a direct open find it so
        # without reading the metadata (Writes.make_local's common case)
        self.inodes.written[inode.ino] = (0, inode.mtime_ns)
        self.inodes.marked_dirty.add(inode.ino)
        fh = self.files.open_handle(inode, writable=True)
        self.inodes.files[fh].kill_setid = uid != 0
        self.files.maybe_stream(inode)
        return fh

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        """A regular file, or a FIFO, socket or device: an inode with no
        content, kept in the lake as an empty object whose mode says its type
        (s3fs's form). Their I/O never reaches aifs: the kernel serves it."""
        kind = kind_of(mode) or FILE
        if kind == FILE:
            inode = await self._new_file(parent, name, mode, uid, gid)
        elif kind in SPECIAL:
            directory = await self._new_entry(parent, name)
            inode = self._add(directory, name, kind, mode, uid, gid, DATA,
                              rdev=rdev if kind in (CHR, BLK) else 0)
        else:
            raise FsError(errno.EINVAL)
        self.inodes.schedule(inode.ino)
        return inode

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        directory = await self._new_entry(parent, name)
        inode = self._add(directory, name, DIR, mode, uid, gid, META,
                          listed_at=self.inodes.clock())
        self.inodes.schedule(inode.ino)
        return inode

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Inode:
        directory = await self._new_entry(parent, name)
        inode = self._add(directory, name, LINK, 0o777, uid, gid, DATA,
                          target=name_of(target), size=len(target))
        self.inodes.schedule(inode.ino)
        return inode

    async def readlink(self, ino: int) -> bytes:
        inode = self.inodes.get(ino)
        if inode.kind != LINK:
            raise FsError(errno.EINVAL)
        if not inode.target and inode.size and inode.in_lake:
            data = await self.store.get_range(inode.key, 0, inode.size)
            inode = self.meta.update(ino, target=name_of(data)) or inode
        return inode.target.encode("utf-8", "surrogateescape")

    async def unlink(self, parent: int, name: bytes) -> None:
        if (await self.listings.child(parent, name)).is_dir:
            raise FsError(errno.EISDIR)
        self._remove(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        child = await self.listings.child(parent, name)
        if not child.is_dir:
            raise FsError(errno.ENOTDIR)
        await self.listings.ensure_listed(child)
        if self.meta.children_count(child.ino):
            raise FsError(errno.ENOTEMPTY)
        self._remove(parent, name)

    def _remove(self, parent: int, name: bytes) -> None:
        key = self.inodes.get(parent).key + name_of(name)
        removed = self.meta.remove(parent, name)
        self.inodes.touch_dir(parent, subdirs=removed is None or removed.is_dir)
        if removed is not None and removed.packed:
            self.packer.queue_records([deletion(key)])
        if removed is not None and removed.orphan:
            self.promoter.streams.cancel(removed.ino, "deleted")
            self.inodes.unlinked(removed.ino)
        elif removed is not None:  # a hard link: the other names stay
            self.inodes.changed(removed.ino)
            self.inodes.schedule(removed.ino)
        self.promoter.tombstones_changed()

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A hard link: one inode, one more name. In the lake each name is an
        object of its own with the same bytes (a server-side copy) and the
        group's id in its metadata (see objattrs)."""
        inodes = self.inodes
        await self.writes.before_change(ino)  # (a spilled file's upload completes first)
        inode = inodes.get(ino)
        if inode.is_dir:
            raise FsError(errno.EPERM)
        if inode.orphan:
            raise FsError(errno.ENOENT)
        directory = await self._new_entry(new_parent, new_name)
        key = directory.key + name_of(new_name)
        self.check_key(key)
        if inode.packed:
            await self.writes.make_local(ino)  # names of a packed file become objects
            if not inodes.writers.get(ino):
                inodes.forget_written(ino)
        inodes.save_written(ino)
        self.promoter.streams.cancel(ino, "linked")
        inodes.changed(ino)
        linked = self.meta.link(ino, new_parent, new_name, key,
                                f"{self.meta.node_id()}-{ino}")
        inodes.touch_dir(new_parent, subdirs=False)
        inodes.remember(ino)
        inodes.schedule(ino)
        return inodes.with_written(linked)

    async def _spilled_uploads_first(self, source: Inode) -> bool:
        """A file that is moved, or every file under a moved directory, whose
        first bytes are only in its streamed upload (flush.stream, spilling)
        has that upload complete under its old key first (or the move is
        refused while a writer holds it): the upload cannot follow a rename."""
        spilled = self.promoter.streams.spilled
        if source.is_dir:
            inos = [ino for ino in list(spilled) if (inode := self.meta.get(ino)) is not None
                    and self.inodes.is_under(inode, source.ino)]
        else:
            inos = [source.ino] if source.ino in spilled else []
        for ino in inos:
            await self.writes.before_change(ino)
        return bool(inos)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int,
                     new_name: bytes, flags: int) -> None:
        if flags & RENAME_EXCHANGE or flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)
        inodes, ensure_listed = self.inodes, self.listings.ensure_listed
        await ensure_listed(inodes.directory(old_parent))
        source = self.meta.lookup(old_parent, old_name)
        if source is None:
            raise FsError(errno.ENOENT)
        if await self._spilled_uploads_first(source):  # (a wait: the names are looked at after)
            source = self.meta.lookup(old_parent, old_name)
            if source is None:
                raise FsError(errno.ENOENT)
        if len(new_name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if new_parent == ROOT_INO and new_name == RESERVED_PREFIX.encode():
            raise FsError(errno.EPERM)
        target_dir = inodes.directory(new_parent)
        await ensure_listed(target_dir)
        target = self.meta.lookup(new_parent, new_name)
        if target is not None:
            if target.ino == source.ino:
                return
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if source.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not source.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir:
                await ensure_listed(target)
                if self.meta.children_count(target.ino):
                    raise FsError(errno.ENOTEMPTY)
        if source.is_dir and inodes.is_under(target_dir, source.ino):
            raise FsError(errno.EINVAL)  # into its own subtree
        if source.is_dir:  # its packed files below, in directories never listed too
            await self.packer.journals.ensure_complete()
        inodes.save_written(source.ino)
        source = inodes.get(source.ino)
        new_key = target_dir.key + name_of(new_name) + ("/" if source.is_dir else "")
        self.check_key(new_key)
        if target is not None and not target.is_dir:
            inodes.changed(target.ino)  # replaced: its upload in flight, if any, stops
        tombstones: list[str]
        etags: dict[str, str]
        with self.promoter.reserving([new_key]):  # no upload to it starts meanwhile
            if source.links:  # a name of a hard-linked file: the promoter copies it anew
                tombstones, etags = [], {}
            else:
                tombstones, etags = await self.moves.in_lake(source, new_key)
            moved, replaced = self.meta.rename(old_parent, old_name, new_parent, new_name,
                                               new_key, tombstones, etags, self.local.has)
        self.moves.packed(source.key, new_key, source.is_dir)
        if source.is_dir:  # descendants to upload again under their new keys
            for inode in self.meta.pending_inodes():
                if inode.pending and inodes.is_under(inode, moved.ino):
                    inodes.schedule(inode.ino, sooner=True)
        inodes.touch_dir(old_parent, subdirs=moved.is_dir)
        if new_parent != old_parent:
            inodes.touch_dir(new_parent, subdirs=moved.is_dir)
        self.checkpoints.committed_by_rename(moved)
        if not moved.is_dir:
            self.promoter.streams.cancel(moved.ino, "renamed")
        if replaced is not None and replaced.orphan:
            self.promoter.streams.cancel(replaced.ino, "replaced")
            inodes.unlinked(replaced.ino)
        elif replaced is not None:
            inodes.changed(replaced.ino)
            inodes.schedule(replaced.ino)
        if moved.pending:
            inodes.schedule(moved.ino, sooner=True)
        self.promoter.tombstones_changed()
