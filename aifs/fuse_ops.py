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

from aifs.core import Filesystem
from aifs.errors import FsError, LakeError
from aifs.meta.store import Inode

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _replies(fn: F) -> F:
    """Answer every failure with an errno; log what was not expected."""

    @functools.wraps(fn)
    async def handler(self: Operations, *args: Any) -> Any:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except LakeError as exc:
            log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return handler  # type: ignore[return-value]


def _read_only(name: str) -> Callable[..., Awaitable[Any]]:
    async def refuse(self: Operations, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)
    refuse.__name__ = name
    return refuse


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem) -> None:
        super().__init__()
        self.fs = fs
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
        entry.st_rdev = 0
        entry.st_size = a.size
        entry.st_blksize = self.blksize
        entry.st_blocks = (a.size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = a.mtime_ns
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

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
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
            batch = self.fs.readdir(fh, start_id)
            if not batch:
                return
            for cookie, name, inode in batch:
                if not pyfuse3.readdir_reply(token, name, self._entry(inode), cookie):
                    return
                self.fs.remember(inode.ino)
                start_id = cookie

    @_replies
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @_replies
    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh, keep_cache = self.fs.open(inode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache)

    @_replies
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await self.fs.read(fh, off, size)

    @_replies
    async def release(self, fh: int) -> None:
        self.fs.release(fh)

    @_replies
    async def flush(self, fh: int) -> None:
        return None

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
            return self.fs.getxattr(inode, name)
        except FsError as exc:
            if exc.errno == errno.ENODATA:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            raise

    @_replies
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return list(self.fs.xattrs(inode))

    # Writes answer EROFS until the write path exists.
    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    create = _read_only("create")
    write = _read_only("write")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")
