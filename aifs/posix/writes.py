"""Writes, truncates and setattr: changes to a file land in a whole local copy.

A write goes to the file's local copy (:class:`~aifs.cache.files.LocalFiles`)
at local-disk speed; the copy is fetched from the lake first if the file has
one there. Its size and mtime stay in memory (:class:`~aifs.posix.inodes.Inodes`)
until flush, fsync or release. Room on the cache disk is made before data
grows (clean blocks, then clean copies, then promotion); a disk found full
anyway makes the writer wait for promotion, and gets ENOSPC only if none frees
space.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from aifs.cache.blocks import BlockCache
from aifs.cache.files import EVICT_FIRST
from aifs.config import Config
from aifs.errors import FsError
from aifs.flush.promoter import Promoter
from aifs.meta.store import DATA, MAYBE_IN_LAKE, META, Inode, MetaStore
from aifs.posix.inodes import Inodes
from aifs.posix.reads import Reads
from aifs.read.fetcher import BlockFetcher

log = logging.getLogger(__name__)

DISK_FULL_WAIT = 30.0  # seconds a write waits on a full cache disk for promotion
DISK_FULL_EVICT = 64 << 20  # bytes of clean data evicted at least when the disk is full
#: free cache disk below which the parts of streamed files the lake has leave
#: their copies (flush.stream, spilling) before a write grows a file
SPILL_BELOW = 1 << 30


@dataclass(frozen=True)
class SetAttributes:
    """The changes a setattr asks for (None: unchanged)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    mtime_ns: int | None = None
    atime_ns: int | None = None


class Writes:
    def __init__(self, inodes: Inodes, config: Config, meta: MetaStore, cache: BlockCache,
                 fetcher: BlockFetcher, reads: Reads, promoter: Promoter) -> None:
        self.inodes = inodes
        self.config = config
        self.meta = meta
        self.cache = cache
        self.local = inodes.local
        self.fetcher = fetcher
        self.reads = reads
        self.promoter = promoter
        self._materializing: dict[int, trio.Lock] = {}

    async def write(self, fh: int, offset: int, data: bytes | memoryview) -> int:
        inodes = self.inodes
        handle = inodes.files.get(fh)
        if handle is None or not handle.writable:
            raise FsError(errno.EBADF)
        if handle.set_aside:
            raise FsError(errno.EIO)  # (see OpenFile.set_aside)
        ino = handle.ino
        if handle.kill_setid:
            handle.kill_setid = False
            self.kill_setid(ino)
        end = offset + len(data)
        try:
            await self.before_change(ino, offset)
            size, _ = await self.make_local(ino)
            if end > size:
                await self.reserve(end - size)
            written = await self._pwrite(ino, data, offset)
        except FsError as exc:
            inodes.mark_unclosed(ino)
            inodes.write_failed[ino] = os.strerror(exc.errno)
            raise
        inodes.mark_unclosed(ino)
        inodes.counters.write_requests += 1
        inodes.counters.write_bytes += written
        self.promoter.streams.wrote(ino, offset, written)
        size = max(inodes.written[ino][0], offset + written)
        inodes.written[ino] = (size, time.time_ns())
        inodes.unsaved.add(ino)
        inodes.changed(ino)
        self.local.resized(ino, size)
        return written

    async def before_change(self, ino: int, offset: int | None = None) -> None:
        """Before a change of a file whose first bytes may be only in its
        streamed upload (flush.stream, spilling): a writer still holding it
        may only append (else ENOSPC: its copy lacks the bytes the change
        needs); once closed, the change waits for the upload to complete and
        then finds the file in the lake; a file whose upload failed is EIO.
        ``offset``: a write's (None: a truncate, rename or link)."""
        state = self.promoter.streams.state(ino, offset)
        if state == "lost":
            raise FsError(errno.EIO)
        if state == "refuse":
            raise FsError(errno.ENOSPC)
        if state == "wait":
            await self.promoter.sync(lambda inode: inode.ino == ino, None)

    async def setattr(self, ino: int, changes: SetAttributes) -> Inode:
        inodes = self.inodes
        inode = inodes.get(ino)
        if changes.size is not None:
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            await self.truncate(inode, changes.size)
        updates: dict[str, Any] = {}  # (Any: for update's **changes, never its closed)
        if changes.mode is not None:
            updates["mode"] = stat.S_IMODE(changes.mode)
        if changes.uid is not None:
            updates["uid"] = changes.uid
        if changes.gid is not None:
            updates["gid"] = changes.gid
        if changes.atime_ns is not None:
            updates["atime_ns"] = changes.atime_ns
        if changes.mtime_ns is not None:
            updates["mtime_ns"] = changes.mtime_ns
            inodes.dir_times.pop(ino, None)  # an explicit time beats a batched one
            if ino in inodes.written:
                # The written size stays; it is saved with the new time below
                # (cp -p and tar x set times through the fd of a file they wrote).
                inodes.written[ino] = (inodes.written[ino][0], changes.mtime_ns)
                inodes.unsaved.add(ino)
        if updates:
            inodes.save_written(ino)
            current = inodes.get(ino)
            inodes.changed(ino)
            self.meta.update(ino, pending=current.pending | META, ctime=self.inodes.clock(),
                             attrs_known=True, **updates)
            inodes.schedule(ino)
        return inodes.get(ino)

    def kill_setid(self, ino: int) -> None:
        """Clear set-user-ID (and set-group-ID with group execute), as Linux does
        after a write or truncate by a user without CAP_FSETID."""
        inode = self.meta.get(ino)
        if inode is None or inode.mode < 0:
            return
        mode = inode.mode & ~stat.S_ISUID
        if mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID | stat.S_IXGRP:
            mode &= ~stat.S_ISGID
        if mode != inode.mode:
            self.inodes.changed(ino)
            self.meta.update(ino, mode=mode, pending=inode.pending | META,
                             ctime=self.inodes.clock())

    async def _pwrite(self, ino: int, data: bytes | memoryview, offset: int) -> int:
        """Write to a local copy, inline: a write into the page cache takes
        microseconds, less than handing it to a thread and back. A disk that
        fills during the write (all of it refused, or the rest after a short
        write) first gets room made (:meth:`_free_disk`), and the rest is
        written: a short count or ENOSPC only if no room can be made."""
        view = memoryview(data)
        done = 0
        stuck = 0  # room made, and still nothing written (no inodes left, a quota)
        while done < len(view):
            if not self.local.has(ino):  # set aside while this write waited for room
                raise FsError(errno.EIO)
            try:  # (the descriptor asked each time: a wait may have closed the last)
                done += os.pwrite(self.local.fd(ino), view[done:], offset + done)
                stuck = 0
                continue  # (a short write: the disk filled; the next one says so)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise FsError(exc.errno or errno.EIO) from None
            stuck += 1
            if stuck > 3 or not await self._free_disk(len(view) - done):
                if done:
                    return done  # what fitted, as a local disk answers
                log.error("local cache disk full: a write is refused (ENOSPC); what is "
                          "not in the lake yet fills it")
                raise FsError(errno.ENOSPC)
        return done

    async def _free_disk(self, wanted: int) -> bool:
        """The cache disk is full (another tenant filled it, sparse copies
        grew behind the accounting, or files stream through a short disk):
        the parts of streaming files the lake has leave their copies, clean
        blocks and clean local copies are evicted, and promotion makes dirty
        copies clean, until ``wanted`` bytes are free (True) or for at most
        DISK_FULL_WAIT seconds. The mount goes on by itself once space returns."""
        streams = self.promoter.streams
        amount = max(wanted, DISK_FULL_EVICT)
        if streams.spill(amount) and self.local.disk_free() >= wanted:
            return True  # (the common case on a short disk: no log line)
        self.inodes.counters.disk_full += 1
        # Files streaming through a short disk wait for their parts as a rule:
        # no warning for that (it came several times per GiB written).
        log.log(logging.DEBUG if streams.spillable() else logging.WARNING,
                "local cache disk full: evicting clean data, waiting up to %.0fs for "
                "promotion", DISK_FULL_WAIT)
        await trio.to_thread.run_sync(self.cache.evict, amount, limiter=self.inodes.disk)
        self.local.evict(amount)
        with trio.move_on_after(DISK_FULL_WAIT):
            await self._wait_for_room(lambda: wanted - self.local.disk_free())
        return self.local.disk_free() >= wanted

    async def make_local(self, ino: int, needed: int | None = None) -> tuple[int, int]:
        """Make sure ``ino`` has a local copy marked dirty; return (size, mtime_ns).

        A copy is fetched from the lake once (its first ``needed`` bytes, default
        all: a truncate needs no more), however many writers ask at once.
        """
        inodes = self.inodes
        if ino in inodes.marked_dirty and ino in inodes.written and self.local.has(ino):
            return inodes.written[ino]  # the common case: no metadata transaction
        if not self.local.has(ino):  # (a copy appears whole: fetched aside, then renamed)
            lock = self._materializing.setdefault(ino, trio.Lock())
            async with lock:
                if not self.local.has(ino):
                    await self._materialize(inodes.get(ino), needed)
                if self._materializing.get(ino) is lock and not lock.statistics().tasks_waiting:
                    del self._materializing[ino]
        stored = None
        if ino not in inodes.written:  # no lock taken when nothing is fetched: no task switch
            stored = inodes.get(ino)
            inodes.written[ino] = (stored.size, stored.mtime_ns)
        self.mark_dirty(ino, stored)
        return inodes.written[ino]

    def mark_dirty(self, ino: int, stored: Inode | None = None) -> None:
        """The local copy of ``ino`` holds changes the lake lacks (pending DATA).
        ``stored``: the inode as stored, if the caller just read it."""
        inode = stored if stored is not None else self.meta.get(ino)
        if inode is not None and not inode.pending & DATA:
            self.meta.update(ino, pending=inode.pending | DATA, ctime=self.inodes.clock())
            self.local.mark_dirty(ino)
        self.inodes.marked_dirty.add(ino)

    async def _materialize(self, inode: Inode, size: int | None = None) -> None:
        """Fetch the first ``size`` bytes (default all) of the lake object into a local copy."""
        size = inode.size if size is None else min(size, inode.size)
        if size == 0 or not inode.in_lake or inode.etag == MAYBE_IN_LAKE:
            self.local.create(inode.ino)
            return
        await self.reserve(size)
        version = self.reads.version(inode)
        bs = self.config.block_size
        count = (size + bs - 1) // bs
        tmp = self.local.tmp_path(inode.ino)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for index in range(count):
                self.fetcher.prefetch(version, index + 1, min(count - 1, index + 8))
                block = await self.fetcher.block(version, index)
                piece = memoryview(block)[:size - index * bs]
                await trio.to_thread.run_sync(os.pwrite, fd, piece, index * bs,
                                              limiter=self.inodes.disk)
        except BaseException as exc:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(exc, OSError):  # a full cache disk is ENOSPC, not EIO
                raise FsError(exc.errno or errno.EIO) from None
            raise
        os.close(fd)
        self.local.adopt(inode.ino, tmp)
        log.debug("materialized %s (%d bytes) for writing", inode.key, size)

    async def truncate(self, inode: Inode, size: int) -> None:
        inodes = self.inodes
        ino = inode.ino
        if size:
            await self.before_change(ino)
        self.promoter.streams.cancel(ino, "truncated")
        if size == 0:
            inodes.write_failed.pop(ino, None)  # written anew from nothing

        current, _ = await self.make_local(ino, needed=size)
        if size > current:
            await self.reserve(size - current)
        try:
            os.ftruncate(self.local.fd(ino), size)
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO) from None
        inodes.written[ino] = (size, time.time_ns())
        inodes.unsaved.add(ino)
        inodes.changed(ino)
        self.local.resized(ino, size)
        inodes.save_written(ino)
        if not inodes.writers.get(ino):
            inodes.forget_written(ino)  # saved; no writer keeps it in memory
            inodes.schedule(ino)

    async def reserve(self, incoming: int) -> None:
        """Make room in the cache for ``incoming`` bytes of local data: evict
        clean blocks, then clean local copies, then wait for room (streamed
        parts leaving, promotion)."""
        streams = self.promoter.streams
        def over() -> int:
            return self.cache.used + self.local.used + incoming - self.config.cache_size
        if streams.spillable() and self.local.disk_free() < SPILL_BELOW:
            streams.spill(SPILL_BELOW)  # the disk runs short: uploaded parts leave first
        if over() <= 0:
            return
        await trio.to_thread.run_sync(self.cache.evict, over(), limiter=self.inodes.disk)
        if over() > 0:
            self.local.evict(over())
        await self._wait_for_room(over)

    async def _wait_for_room(self, short: Callable[[], int]) -> None:
        """While ``short()`` bytes are missing: the parts of streaming files
        the lake has leave their copies; else wait for more parts to land, an
        abandoned stream to end or promotion to make dirty copies clean (and
        evict them). Returns when nothing more can come."""
        streams = self.promoter.streams
        while (missing := short()) > 0:
            if streams.spill(missing):
                continue
            hurried = self.promoter.hurry()
            if streams.busy():
                await streams.wait_progress(1.0)
            elif hurried:
                await self.promoter.wait_progress()
            else:
                return
            self.local.evict(max(0, short()))

    def room_for_blocks(self, incoming: int) -> None:
        """A fetched block needs room: old checkpoints' local copies go before
        any block, other clean copies only where blocks cannot free enough."""
        over = self.cache.used + self.local.used + incoming - self.config.cache_size
        if over > 0:
            over -= self.local.evict(over, up_to_rank=EVICT_FIRST)
            if over > self.cache.used:
                self.local.evict(over - self.cache.used)
        short = incoming - self.local.disk_free()  # a disk smaller than cache_size
        if short > 0:  # (blocks make room for blocks themselves: BlockCache.store)
            self.local.evict(short)
