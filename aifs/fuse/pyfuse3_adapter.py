"""Thin pyfuse3 adapter over :class:`aifs.core.Filesystem`.

Converts arguments and results, and maps errors to FUSEError in one place:
nothing but FUSEError leaves a handler.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3

from aifs.core import Filesystem, Inode, SetAttributes
from aifs.errors import FsError
from aifs.fuse.errors import errno_for

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _replies(fn: F) -> F:
    """Answer every failure with an errno; log what was not expected."""

    @functools.wraps(fn)
    async def handler(self: Operations, *args: Any) -> Any:
        self.served += 1
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise pyfuse3.FUSEError(errno_for(exc, fn.__name__)) from None
    return handler  # type: ignore[return-value]


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    # Off: with it the kernel trusts its own size of a file for good, so an
    # object another node replaced would keep its old size.
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem) -> None:
        super().__init__()
        self.fs = fs
        self.served = 0  # requests answered (promotion yields to them: flush.pacing)
        fs.count_requests(lambda: self.served)
        self.timeout = fs.config.metadata_ttl
        self.blksize = min(fs.block_size, 1 << 20)

    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = self.fs.attributes(inode)
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = a.ino
        entry.generation = 0
        entry.entry_timeout = self.timeout
        entry.attr_timeout = self.timeout
        entry.st_mode = a.mode
        entry.st_nlink = a.nlink
        entry.st_uid = a.uid
        entry.st_gid = a.gid
        entry.st_rdev = a.rdev
        entry.st_size = a.size
        entry.st_blksize = self.blksize
        entry.st_blocks = (a.size + 511) // 512
        entry.st_mtime_ns = a.mtime_ns
        entry.st_atime_ns = a.atime_ns
        entry.st_ctime_ns = a.ctime_ns
        if self.fs.object_attrs.unknown(inode):
            # Ask again: a lookup reads the object's own attributes (and type) first.
            entry.attr_timeout = entry.entry_timeout = 0
        return entry

    @_replies
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        inode = await self.fs.lookup(parent_inode, name)
        if inode is None:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0  # cache the absence for the TTL
            negative.entry_timeout = self.timeout
            return negative
        return self._entry(inode)

    # (pyfuse3 passes a list, handlers.pxi; its stub says Sequence)
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:  # type: ignore[override]
        try:
            self.fs.forget(inode_list)
        except Exception:  # forget is acknowledged already: never raise
            log.exception("forget failed")

    @_replies
    async def getattr(self, inode: int,
                      ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.getattr(inode))

    @_replies
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.fs.opendir(inode)

    @_replies
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        while True:
            batch = await self.fs.readdir(fh, start_id)
            if not batch:
                return
            for cookie, name, inode in batch:
                if not pyfuse3.readdir_reply(token, name, self._entry(inode), cookie):
                    return
                if name not in (b".", b".."):  # the kernel takes no reference to these
                    self.fs.remember(inode.ino)
                start_id = cookie

    @_replies
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @_replies
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        changes = SetAttributes(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None)
        return self._entry(await self.fs.setattr(inode, changes, fh))

    @_replies
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid,
                                               ctx.gid))

    @_replies
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_replies
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.symlink(parent_inode, name, target, ctx.uid,
                                                 ctx.gid))

    @_replies
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(inode)

    @_replies
    async def unlink(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> None:
        await self.fs.unlink(parent_inode, name)

    @_replies
    async def rmdir(self, parent_inode: int, name: bytes,
                    ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_replies
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_replies
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.link(inode, new_parent_inode, new_name))

    @_replies
    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh, keep_cache = await self.fs.open(inode, flags, ctx.uid)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache,
                                direct_io=self.fs.writes_direct(flags))

    @_replies
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, inode = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=fh, direct_io=self.fs.writes_direct(flags)), \
            self._entry(inode)

    @_replies
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(fh, off, buf)

    @_replies
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    @_replies
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are in LMDB; durable with the next fsync

    @_replies
    # (pyfuse3 replies with any buffer, PyObject_GetBuffer; its stub says bytes)
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return await self.fs.read(fh, off, size)

    @_replies
    async def release(self, fh: int) -> None:
        self.fs.release(fh)

    @_replies
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    @_replies
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        facts = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = facts["bsize"]
        out.f_frsize = facts["frsize"]
        out.f_blocks = facts["blocks"]
        out.f_bfree = facts["bfree"]
        out.f_bavail = facts["bavail"]
        out.f_files = facts["files"]
        out.f_ffree = out.f_favail = facts["ffree"]
        out.f_namemax = facts["namemax"]
        return out

    @_replies
    async def getxattr(self, inode: int, name: bytes,
                       ctx: pyfuse3.RequestContext) -> bytes:
        try:
            return await self.fs.getxattr(inode, name)
        except FsError as exc:
            if exc.errno == errno.ENODATA:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            raise

    @_replies
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.fs.listxattr(inode)

    @_replies
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        self.fs.setxattr(inode, name, value)

    @_replies
    async def removexattr(self, inode: int, name: bytes,
                          ctx: pyfuse3.RequestContext) -> None:
        try:
            self.fs.removexattr(inode, name)
        except FsError as exc:
            if exc.errno == errno.ENODATA:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            raise
