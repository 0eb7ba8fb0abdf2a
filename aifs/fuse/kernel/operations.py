"""Requests of the FUSE protocol answered by :class:`aifs.core.Filesystem`.

The twin of :mod:`aifs.fuse.pyfuse3_adapter`: it decodes a request's body,
calls the facade, encodes the reply; no semantics of its own. What only this
binding can do lives here too: open replies that name a backing file
(passthrough, :mod:`aifs.fuse.kernel.passthrough`) and the flags the kernel
sends instead of extra requests (kill set-user-ID, O_TRUNC).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aifs.core import Attributes, Filesystem, Inode, PlainEntries, SetAttributes
from aifs.errors import FsError
from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel.passthrough import Passthrough

log = logging.getLogger(__name__)

Reply = bytes | memoryview | list[bytes | memoryview] | None


@dataclass(frozen=True, slots=True)
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int


Handler = Callable[[Request, memoryview], Awaitable[Reply]]


def reply_parts(body: Reply) -> list[bytes | memoryview]:
    """A handler's reply as the pieces that follow the reply's header."""
    return [] if body is None else body if isinstance(body, list) else [body]


class Operations:
    """One method per opcode; each returns the reply's body (an errno leaves as
    :class:`~aifs.errors.FsError`)."""

    def __init__(self, fs: Filesystem, passthrough: Passthrough) -> None:
        self.fs = fs
        self.passthrough = passthrough
        self.ttl = p.split_time(fs.config.metadata_ttl)
        self.blksize = min(fs.block_size, 1 << 20)
        self.handlers: dict[int, Handler] = {
            p.LOOKUP: self.lookup, p.GETATTR: self.getattr, p.SETATTR: self.setattr,
            p.READLINK: self.readlink, p.SYMLINK: self.symlink, p.MKNOD: self.mknod,
            p.MKDIR: self.mkdir, p.UNLINK: self.unlink, p.RMDIR: self.rmdir,
            p.RENAME: self.rename, p.RENAME2: self.rename2, p.LINK: self.link,
            p.OPEN: self.open, p.CREATE: self.create, p.READ: self.read, p.WRITE: self.write,
            p.FLUSH: self.flush, p.RELEASE: self.release, p.FSYNC: self.fsync,
            p.FSYNCDIR: self.fsyncdir, p.OPENDIR: self.opendir, p.READDIR: self.readdir,
            p.READDIRPLUS: self.readdirplus, p.RELEASEDIR: self.releasedir,
            p.STATFS: self.statfs, p.GETXATTR: self.getxattr, p.LISTXATTR: self.listxattr,
            p.SETXATTR: self.setxattr, p.REMOVEXATTR: self.removexattr,
        }
        #: requests answered at once with an errno, without a handler: IOCTL,
        #: which ``isatty()`` of every Python ``open()`` sends (ENOSYS does not
        #: stop the kernel asking; no terminal here). A handler's coroutine and
        #: its raised error cost more than the rest of such a request.
        self.answered: dict[int, int] = {p.IOCTL: errno.ENOTTY}

    # -- encoding -------------------------------------------------------------------
    def attributes(self, inode: Inode) -> Attributes:
        return self.fs.attributes(inode)

    def attr(self, a: Attributes) -> bytes:
        return p.ATTR.pack(*self.attr_fields(a))

    def attr_fields(self, a: Attributes) -> tuple[int, ...]:
        """``fuse_attr``'s fields, in order (:data:`protocol.ATTR`)."""
        return (a.ino, a.size, (a.size + 511) // 512,
                a.atime_ns // 10**9, a.mtime_ns // 10**9, a.ctime_ns // 10**9,
                a.atime_ns % 10**9, a.mtime_ns % 10**9, a.ctime_ns % 10**9,
                a.mode, a.nlink, a.uid & 0xFFFFFFFF, a.gid & 0xFFFFFFFF, a.rdev,
                self.blksize, 0)

    def timeout(self, inode: Inode) -> tuple[int, int]:
        if self.fs.object_attrs.unknown(inode):
            # Ask again: a lookup reads the object's own attributes (and type) first.
            return 0, 0
        return self.ttl

    def entry(self, inode: Inode, a: Attributes | None = None) -> bytes:
        seconds, nanos = self.timeout(inode)
        return p.ENTRY_HEAD.pack(inode.ino, 0, seconds, seconds, nanos, nanos) + \
            self.attr(a or self.attributes(inode))

    def attr_out(self, inode: Inode) -> bytes:
        seconds, nanos = self.timeout(inode)
        return p.ATTR_OUT_HEAD.pack(seconds, nanos, 0) + self.attr(self.attributes(inode))

    # -- names and attributes -------------------------------------------------------
    async def lookup(self, req: Request, body: memoryview) -> Reply:
        name, _ = p.cstring(body)
        inode = await self.fs.lookup(req.nodeid, name)
        if inode is None:  # cache the absence for the TTL
            seconds, nanos = self.ttl
            return p.ENTRY_HEAD.pack(0, 0, seconds, 0, nanos, 0) + bytes(p.ATTR.size)
        return self.entry(inode)

    async def getattr(self, req: Request, body: memoryview) -> Reply:
        return self.attr_out(await self.fs.getattr(req.nodeid))

    async def setattr(self, req: Request, body: memoryview) -> Reply:
        (valid, _, fh, size, _, atime, mtime, _, atimensec, mtimensec, _, mode, _, uid, gid,
         _) = p.SETATTR_IN.unpack_from(body)
        now = time.time_ns()
        if valid & p.FATTR_KILL_SUIDGID and not valid & p.FATTR_MODE:
            self.fs.kill_setid(req.nodeid)  # a truncate by an unprivileged user
        changes = SetAttributes(
            mode=mode if valid & p.FATTR_MODE else None,
            uid=uid if valid & p.FATTR_UID else None,
            gid=gid if valid & p.FATTR_GID else None,
            size=size if valid & p.FATTR_SIZE else None,
            mtime_ns=(now if valid & p.FATTR_MTIME_NOW else mtime * 10**9 + mtimensec)
            if valid & p.FATTR_MTIME else None,
            atime_ns=(now if valid & p.FATTR_ATIME_NOW else atime * 10**9 + atimensec)
            if valid & p.FATTR_ATIME else None)
        return self.attr_out(await self.fs.setattr(req.nodeid, changes,
                                                   fh if valid & p.FATTR_FH else None))

    async def readlink(self, req: Request, body: memoryview) -> Reply:
        return await self.fs.readlink(req.nodeid)

    async def symlink(self, req: Request, body: memoryview) -> Reply:
        name, end = p.cstring(body)
        target, _ = p.cstring(body, end)
        return self.entry(await self.fs.symlink(req.nodeid, name, target, req.uid, req.gid))

    async def mknod(self, req: Request, body: memoryview) -> Reply:
        mode, rdev, umask, _ = p.MKNOD_IN.unpack_from(body)
        name, _ = p.cstring(body, p.MKNOD_IN.size)
        return self.entry(await self.fs.mknod(req.nodeid, name, mode & ~umask, rdev,
                                              req.uid, req.gid))

    async def mkdir(self, req: Request, body: memoryview) -> Reply:
        mode, umask = p.MKDIR_IN.unpack_from(body)
        name, _ = p.cstring(body, p.MKDIR_IN.size)
        return self.entry(await self.fs.mkdir(req.nodeid, name, stat.S_IFDIR | mode & ~umask,
                                              req.uid, req.gid))

    async def unlink(self, req: Request, body: memoryview) -> Reply:
        await self.fs.unlink(req.nodeid, p.cstring(body)[0])
        return b""

    async def rmdir(self, req: Request, body: memoryview) -> Reply:
        await self.fs.rmdir(req.nodeid, p.cstring(body)[0])
        return b""

    async def rename(self, req: Request, body: memoryview) -> Reply:
        (newdir,) = p.RENAME_IN.unpack_from(body)
        return await self._rename(req, newdir, 0, body, p.RENAME_IN.size)

    async def rename2(self, req: Request, body: memoryview) -> Reply:
        newdir, flags, _ = p.RENAME2_IN.unpack_from(body)
        return await self._rename(req, newdir, flags, body, p.RENAME2_IN.size)

    async def _rename(self, req: Request, newdir: int, flags: int, body: memoryview,
                      start: int) -> Reply:
        old, end = p.cstring(body, start)
        new, _ = p.cstring(body, end)
        await self.fs.rename(req.nodeid, old, newdir, new, flags)
        return b""

    async def link(self, req: Request, body: memoryview) -> Reply:
        (oldnodeid,) = p.LINK_IN.unpack_from(body)
        name, _ = p.cstring(body, p.LINK_IN.size)
        return self.entry(await self.fs.link(oldnodeid, req.nodeid, name))

    # -- files ------------------------------------------------------------------------
    async def open(self, req: Request, body: memoryview) -> Reply:
        flags, open_flags = p.OPEN_IN.unpack_from(body)
        fh, keep_cache = await self.fs.open(req.nodeid, flags, req.uid)
        if open_flags & p.OPEN_KILL_SUIDGID:  # O_TRUNC by an unprivileged user
            self.fs.kill_setid(req.nodeid)
        return await self._opened(req.nodeid, fh, flags, keep_cache, req.pid)

    async def create(self, req: Request, body: memoryview) -> Reply:
        flags, mode, umask, _ = p.CREATE_IN.unpack_from(body)
        name, _ = p.cstring(body, p.CREATE_IN.size)
        fh, inode = await self.fs.create(req.nodeid, name, mode & ~umask, flags, req.uid,
                                         req.gid)
        return [self.entry(inode), await self._opened(inode.ino, fh, flags, False,
                                                          req.pid)]

    async def _opened(self, ino: int, fh: int, flags: int, keep_cache: bool,
                      pid: int) -> bytes:
        try:
            backing = await self.passthrough.backing_for(ino, fh, pid)
        except BaseException:
            self.fs.release(fh)
            raise
        # A close of a read-only handle has nothing to flush: the kernel need not ask.
        noflush = p.FOPEN_NOFLUSH if flags & os.O_ACCMODE == os.O_RDONLY else 0
        if backing:
            return p.OPEN_OUT.pack(fh, p.FOPEN_PASSTHROUGH | noflush, backing)
        open_flags = noflush | (p.FOPEN_KEEP_CACHE if keep_cache else 0)
        if self.fs.writes_direct(flags):
            open_flags |= p.FOPEN_DIRECT_IO
        return p.OPEN_OUT.pack(fh, open_flags, 0)

    async def read(self, req: Request, body: memoryview) -> Reply:
        fh, offset, size, *_ = p.READ_IN.unpack_from(body)
        return await self.fs.read(fh, offset, size)

    async def write(self, req: Request, body: memoryview) -> Reply:
        fh, offset, size, *_ = p.WRITE_IN.unpack_from(body)
        data = body[p.WRITE_IN.size:p.WRITE_IN.size + size]
        # (a view of the request, written as it is)
        return p.WRITE_OUT.pack(await self.fs.write(fh, offset, data), 0)

    async def flush(self, req: Request, body: memoryview) -> Reply:
        (fh, *_) = p.FLUSH_IN.unpack_from(body)
        await self.fs.flush(fh)
        return b""

    async def release(self, req: Request, body: memoryview) -> Reply:
        (fh, *_) = p.RELEASE_IN.unpack_from(body)
        try:  # the core first (a direct writer's writes taken), then the backing id
            self.fs.release(fh, self.passthrough.direct(fh))
        finally:
            self.passthrough.released(fh)
        return b""

    async def fsync(self, req: Request, body: memoryview) -> Reply:
        fh, flags, _ = p.FSYNC_IN.unpack_from(body)
        await self.fs.fsync(fh, bool(flags & p.FSYNC_FDATASYNC))
        return b""

    async def fsyncdir(self, req: Request, body: memoryview) -> Reply:
        return b""  # directory changes are in LMDB; durable with the next fsync

    # -- directories ------------------------------------------------------------------
    async def opendir(self, req: Request, body: memoryview) -> Reply:
        return p.OPEN_OUT.pack(await self.fs.opendir(req.nodeid), 0, 0)

    async def readdir(self, req: Request, body: memoryview) -> Reply:
        return await self._readdir(body, plus=False)

    async def readdirplus(self, req: Request, body: memoryview) -> Reply:
        return await self._readdir(body, plus=True)

    async def _readdir(self, body: memoryview, plus: bool) -> Reply:
        fh, cookie, size, *_ = p.READ_IN.unpack_from(body)
        out: list[bytes | memoryview] = []  # (the reply's pieces: see Reply)
        sent: list[int] = []  # the kernel holds a reference to each entry of a plus reply
        ranges: list[tuple[int, int]] = []  # (first, count): plain entries sent
        room = size
        attributes, timeout = self.attributes, self.timeout
        pack, attr_fields = p.DIRENTPLUS_HEAD.pack, self.attr_fields
        head = p.ENTRY_HEAD.size + p.ATTR.size
        full = False
        while not full:
            rows = self.fs.plain_entries(fh, cookie) if plus else None
            if rows is not None:  # files as listed: packed from the rows, no inode each
                full, packed, room = self._pack_plain(rows, out, room)
                if packed:
                    ranges.append((rows.ino, packed))
                    cookie = rows.cookie + packed - 1
                continue
            # as many entries as may fit (an inode each); only . and .. where
            # the files that follow may be plain entries
            limit = 0 if plus and cookie < 2 else room // (SMALLEST_PLUS if plus else SMALLEST) + 1
            batch = await self.fs.readdir(fh, cookie, limit)
            if not batch:
                break
            for next_cookie, name, inode in batch:
                dot = name == b"." or name == b".."
                if dot:
                    record = p.dirent(inode.ino, next_cookie, name, DT_DIR)
                    if plus:  # the kernel takes no reference to . and .., nor to nodeid 0
                        record = bytes(head) + record
                elif plus:  # one pack for the entry, its attributes and the dirent
                    a = attributes(inode)
                    seconds, nanos = timeout(inode)
                    record = p.padded(pack(
                        a.ino, 0, seconds, seconds, nanos, nanos, *attr_fields(a),
                        a.ino, next_cookie, len(name), stat.S_IFMT(a.mode) >> 12) + name)
                else:
                    a = attributes(inode)
                    record = p.dirent(a.ino, next_cookie, name, stat.S_IFMT(a.mode) >> 12)
                if len(record) > room:
                    full = True
                    break
                out.append(record)
                room -= len(record)
                if plus and not dot:
                    sent.append(inode.ino)
                cookie = next_cookie
        if sent:  # (counted once the reply is whole: a failed one reaches no kernel)
            self.fs.remember(*sent)
        for first, count in ranges:
            self.fs.remember_range(first, count)
        return out

    def _pack_plain(self, rows: PlainEntries, out: list[bytes | memoryview],
                    room: int) -> tuple[bool, int, int]:
        """READDIRPLUS records of ``rows`` while they fit ``room`` (what
        ``_readdir`` packs for the same entries, byte for byte): whether the
        reply is full, how many entries were packed, the room left."""
        seconds, nanos = self.ttl
        pack, blksize = p.DIRENTPLUS_HEAD.pack, self.blksize
        mode, uid, gid = rows.mode, rows.uid & 0xFFFFFFFF, rows.gid & 0xFFFFFFFF
        ino, cookie = rows.ino, rows.cookie
        for name, size, mtime in zip(rows.names, rows.sizes, rows.mtimes, strict=True):
            s, ns = divmod(int(mtime * 1e9), 10**9)
            record = p.padded(pack(
                ino, 0, seconds, seconds, nanos, nanos, ino, size, (size + 511) // 512,
                s, s, s, ns, ns, ns, mode, 1, uid, gid, 0, blksize, 0,
                ino, cookie, len(name), DT_REG) + name)
            if len(record) > room:
                return True, ino - rows.ino, room
            out.append(record)
            room -= len(record)
            ino += 1
            cookie += 1
        return False, ino - rows.ino, room

    async def releasedir(self, req: Request, body: memoryview) -> Reply:
        (fh, *_) = p.RELEASE_IN.unpack_from(body)
        self.fs.releasedir(fh)
        return b""

    # -- the rest ---------------------------------------------------------------------
    async def statfs(self, req: Request, body: memoryview) -> Reply:
        f = self.fs.statfs()
        return p.STATFS_OUT.pack(f["blocks"], f["bfree"], f["bavail"], f["files"], f["ffree"],
                                 f["bsize"], f["namemax"], f["frsize"], 0)

    async def getxattr(self, req: Request, body: memoryview) -> Reply:
        size, _ = p.GETXATTR_IN.unpack_from(body)
        name, _ = p.cstring(body, p.GETXATTR_IN.size)
        return _sized(await self.fs.getxattr(req.nodeid, name), size)

    async def listxattr(self, req: Request, body: memoryview) -> Reply:
        size, _ = p.GETXATTR_IN.unpack_from(body)
        names = await self.fs.listxattr(req.nodeid)
        return _sized(b"".join(name + b"\0" for name in names), size)

    async def setxattr(self, req: Request, body: memoryview) -> Reply:
        size, flags = p.SETXATTR_IN.unpack_from(body)
        name, end = p.cstring(body, p.SETXATTR_IN.size)
        if flags & ~(os.XATTR_CREATE | os.XATTR_REPLACE):
            raise FsError(errno.EINVAL)
        if flags:  # CREATE: must not exist yet; REPLACE: must exist (as libfuse checks)
            try:
                await self.fs.getxattr(req.nodeid, name)
                exists = True
            except FsError as exc:
                if exc.errno != errno.ENODATA:
                    raise
                exists = False
            if flags & os.XATTR_CREATE and exists:
                raise FsError(errno.EEXIST)
            if flags & os.XATTR_REPLACE and not exists:
                raise FsError(errno.ENODATA)
        self.fs.setxattr(req.nodeid, name, bytes(body[end:end + size]))
        return b""

    async def removexattr(self, req: Request, body: memoryview) -> Reply:
        self.fs.removexattr(req.nodeid, p.cstring(body)[0])
        return b""


DT_DIR = stat.S_IFDIR >> 12
DT_REG = stat.S_IFREG >> 12
SMALLEST = len(p.padded(bytes(p.DIRENT_HEAD.size + 1)))  # records of a 1-byte name
SMALLEST_PLUS = len(p.padded(bytes(p.DIRENTPLUS_HEAD.size + 1)))


def _sized(value: bytes, size: int) -> bytes:
    """An xattr reply: its length when asked with size 0, ERANGE if it does not fit."""
    if size == 0:
        return p.GETXATTR_OUT.pack(len(value), 0)
    if len(value) > size:
        raise FsError(errno.ERANGE)
    return value

