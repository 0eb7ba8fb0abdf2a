"""Cached lake files given a local copy of their own, so that their next
opens go direct (FUSE passthrough, :mod:`aifs.posix.direct`): the kernel
reads the copy and the daemon sees only the open and the close.

Two kinds, both made in the background after a reader served by the daemon
closes, never on its path:

- *small* files (up to :data:`ADMIT_MAX`) read again while the block cache
  held all their bytes when they were opened (a dataset's second epoch):
  their bytes are copied out of the cache, which keeps its blocks. A file
  read for the first time gets none, even where its bytes came in with a
  neighbour's (a pack's block): a first epoch does not write its dataset to
  the disk a second time. Only what the cache kept becomes a copy: its
  policy (a scan larger than the cache keeps a stable subset) decides.
- *large* objects (weights, checkpoints: the regular class) read whole, at
  the close of the reader that brought the last block in: the blocks are
  copied into one file past the page cache (O_DIRECT through one reused
  buffer: ``copy_file_range`` cost 0.5 CPU-s per GiB in page-cache pages),
  the copy made durable, and the blocks dropped (at the file's last close
  if it is still open), so the disk holds the object once, as a file the
  kernel can read alone. Dataset-class
  objects stay blocks (their admission keeps a stable subset under a cache
  smaller than the dataset, which LRU copies would not), pinned ones too
  (copies are evicted, pinned blocks never). The copy is paced like
  promotion (:mod:`aifs.flush.pacing`): it yields to a busy mount.

A copy is installed only if the file still has none and its lake version
is the one copied (another node may have replaced it meanwhile).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from aifs.cache.blocks import REGULAR, ObjectVersion
from aifs.cache.direct import ALIGN
from aifs.config import Config
from aifs.meta.store import MetaStore
from aifs.posix.inodes import Inodes
from aifs.posix.reads import Reads
from aifs.posix.writes import Writes

log = logging.getLogger(__name__)

ADMIT_MAX = 1 << 20  # largest cached file given a local copy when read again
ADMIT_QUEUE = 4096  # admissions waiting at most (beyond: dropped, a later close asks again)
ADMIT_BATCH = 64  # small copies written in one trip to a worker thread
ADMIT_WAIT = 0.05  # seconds between batches
READ_BEFORE_MAX = 1 << 28  # inode numbers the read-before bitmap covers (32 MiB at most)
#: a large object's last blocks are stored by threads after its reader closes:
#: how long its admission waits for them
STORED_WAIT = 10.0
ROOM_LEFT = 1 << 30  # free disk bytes a large copy must leave


class _Gone(Exception):
    """A block a large copy is made from is no longer cached."""


class ReadBefore:
    """Which inodes a small reader opened since the mount: one bit each, in a
    bitmap grown to the largest inode number seen (inode numbers are dense:
    a counter). Past :data:`READ_BEFORE_MAX` every inode counts as read."""

    def __init__(self) -> None:
        self.bits = bytearray()

    def test_and_set(self, ino: int) -> bool:
        if ino >= READ_BEFORE_MAX:
            return True
        byte, bit = ino >> 3, 1 << (ino & 7)
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits))))
        seen = bool(self.bits[byte] & bit)
        self.bits[byte] |= bit
        return seen


class Admissions:
    def __init__(self, inodes: Inodes, config: Config, meta: MetaStore, reads: Reads,
                 writes: Writes, disk_free: Callable[[], int]) -> None:
        self.disk_free = disk_free  # free bytes on the cache disk (Direct's reading)
        self.inodes = inodes
        self.config = config
        self.meta = meta
        self.reads = reads
        self.fetcher = reads.fetcher
        self.cache = writes.cache
        self.promoter = writes.promoter
        self.local = inodes.local
        self.read_before = ReadBefore()  # small files a reader opened
        #: inode -> version: local copies to make (:meth:`closed`)
        self._small: dict[int, ObjectVersion] = {}
        self._large: dict[int, ObjectVersion] = {}
        #: copies made while the file was open: its blocks go at its last close
        self._forget_later: dict[int, ObjectVersion] = {}
        self._forget_now: list[ObjectVersion] = []
        # set when a small copy (or a forget) / a large copy is queued
        self._queued_small = trio.Event()
        self._queued_large = trio.Event()

    def opened(self, ino: int, version: ObjectVersion) -> bool:
        """A reader the daemon serves opens ``ino`` (no local copy): whether
        to look at admitting it when it closes (``OpenFile.admit``)."""
        if not version.size:
            return False
        if version.size <= ADMIT_MAX:
            return self.read_before.test_and_set(ino) and self.reads.cached_whole(version)
        return version.block_class == REGULAR and not version.source  # (packs: small files)

    def closed(self, fh: int) -> None:
        """Reader ``fh`` (served by the daemon, ``admit`` set at open) closes:
        queue its file's copy."""
        handle = self.inodes.files.get(fh)
        if handle is not None and handle.ino in self._forget_later \
                and self.inodes.opens.get(handle.ino, 0) <= 1:  # (this one is closing)
            self._forget_now.append(self._forget_later.pop(handle.ino))
            self._queued_small.set()
        if handle is None or not handle.admit:
            return
        ino, version = handle.ino, handle.version
        queue = self._small if version.size <= ADMIT_MAX else self._large
        if ino in queue or len(queue) >= ADMIT_QUEUE or self.local.has(ino):
            return
        if queue is self._large and not self._read_whole(version):
            return
        log.debug("inode %d closes: a local copy of it is queued", ino)
        queue[ino] = version
        (self._queued_small if queue is self._small else self._queued_large).set()

    async def run(self) -> None:
        """Make the copies :meth:`closed` queued: small and large ones in
        tasks of their own, since a large copy is paced like promotion and
        may take minutes, and the small files an epoch reads again must not
        wait for it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_small)
            nursery.start_soon(self._run_large)

    async def _run_small(self) -> None:
        while True:
            if not self._small and not self._forget_now:
                self._queued_small = trio.Event()
                await self._queued_small.wait()
            await trio.sleep(ADMIT_WAIT)  # more closes join the batch
            while self._forget_now:
                await self.fetcher.forget_version(self._forget_now.pop())
            if self._small:
                await self._admit_small()

    async def _run_large(self) -> None:
        while True:
            if not self._large:
                self._queued_large = trio.Event()
                await self._queued_large.wait()
            ino = next(iter(self._large))
            await self._admit_large(ino, self._large.pop(ino))

    async def _admit_small(self) -> None:
        batch: list[tuple[int, ObjectVersion, bytes]] = []
        for ino in list(self._small)[:ADMIT_BATCH]:
            version = self._small.pop(ino)
            if not self._admissible(ino, version):
                continue
            try:
                data = await self.reads.cached(version)  # (None: evicted meanwhile)
            except Exception as exc:  # no copy, no harm
                log.debug("no local copy of inode %d: %s", ino, exc)
                continue
            if data is not None:
                batch.append((ino, version, data))
        if not batch:
            return
        files = await trio.to_thread.run_sync(
            self._fill, [(ino, data) for ino, _, data in batch], limiter=self.inodes.disk)
        for (ino, version, data), made in zip(batch, files, strict=True):
            if made is not None:
                self._install(ino, version, *made, len(data))

    def _fill(self, items: list[tuple[int, bytes]]) -> list[tuple[str, int] | None]:
        filled: list[tuple[str, int] | None] = []
        for ino, data in items:
            try:
                filled.append(self.local.filled(ino, data))
            except OSError as exc:  # a full disk: no copy, reads stay with the daemon
                log.debug("no local copy of inode %d: %s", ino, exc)
                filled.append(None)
        return filled

    async def _admit_large(self, ino: int, version: ObjectVersion) -> None:
        blocks = self.fetcher.blocks_of(version)
        stored = 0  # blocks [0, stored) are on the disk
        with trio.move_on_after(STORED_WAIT):
            while stored < blocks:
                if self.fetcher.stored(version, stored):
                    stored += 1
                elif self.fetcher.available(version, stored):
                    await trio.sleep(ADMIT_WAIT)  # (a store thread has it)
                else:
                    return  # not admitted, or evicted: stays blocks
        if stored < blocks or not self._admissible(ino, version) \
                or not self._room_for(version):
            return
        try:
            name, fd = await trio.to_thread.run_sync(self.local.blank, ino,
                                                     limiter=self.inodes.disk)
        except OSError as exc:
            log.debug("no local copy of inode %d: %s", ino, exc)
            return
        bs = self.fetcher.block_size
        into = -1
        try:
            # written past the page cache (as blocks are): a GiB copied through
            # it cost 0.5 CPU-s here, in pages allocated and freed
            into = self.cache.writer.open(name, os.O_WRONLY) if bs % ALIGN == 0 else fd
            for index in range(blocks):
                await self.promoter.paced(min(bs, version.size - index * bs))
                if not await trio.to_thread.run_sync(
                        self.fetcher.copy_block, version, index, into, index * bs,
                        limiter=self.inodes.disk):
                    raise _Gone  # evicted meanwhile (or damaged): stays blocks
            await trio.to_thread.run_sync(self._finish, fd, into, version.size,
                                          limiter=self.inodes.disk)
        except BaseException as exc:  # a full or failing disk: no copy, no harm
            self.local.discard(name, fd)
            if not isinstance(exc, (OSError, _Gone)):
                raise
            log.debug("no local copy of inode %d: %r", ino, exc)
            return
        finally:
            if into not in (-1, fd):
                os.close(into)
        if self._install(ino, version, name, fd, version.size):
            # the copy holds the object now: its blocks go (a reader still open
            # may be reading them: then at the file's last close)
            if self.inodes.is_open(ino):
                self._forget_later[ino] = version
            else:
                await self.fetcher.forget_version(version)

    @staticmethod
    def _finish(fd: int, into: int, size: int) -> None:
        """A copy's last piece was written padded: cut to size, and made
        durable before the blocks it replaces go."""
        os.ftruncate(fd, size)
        os.fdatasync(into)

    def _install(self, ino: int, version: ObjectVersion, name: str, fd: int,
                 size: int) -> bool:
        """Make a filled file the clean copy of ``ino`` if still admissible."""
        if not self._admissible(ino, version):
            self.local.discard(name, fd)  # changed meanwhile: not this copy
            return False
        try:
            self.local.adopt(ino, name, fd, size)
        except OSError as exc:
            log.debug("no local copy of inode %d: %s", ino, exc)
            self.local.discard(name, fd)
            return False
        self.local.mark_clean(ino)
        self.inodes.counters.admitted += 1
        return True

    def _read_whole(self, version: ObjectVersion) -> bool:
        """Every block of ``version`` is cached, in memory or on its way to
        the disk (a large block is stored by a thread after it is served).
        Asked at a reader's close: the last block first, which a reader of
        part of the file most often lacks."""
        return all(self.fetcher.available(version, i)
                   for i in reversed(range(self.fetcher.blocks_of(version))))

    def _admissible(self, ino: int, version: ObjectVersion) -> bool:
        """``ino`` has no copy and its lake version is still ``version``."""
        if self.local.has(ino):
            return False
        inode = self.meta.get(ino)
        if inode is None or inode.orphan:
            return False
        now = self.reads.version(inode)  # (== compares key and ETag only)
        return now == version and (version.size <= ADMIT_MAX or now.block_class == REGULAR)

    def _room_for(self, version: ObjectVersion) -> bool:
        """Room for a large copy beside the blocks it is made from."""
        # within the budget once the blocks are dropped; the disk holds both a while
        budget = self.config.cache_size - self.cache.used - self.local.used
        return budget + self.cache.cached_bytes(version) >= version.size \
            and self.disk_free() >= version.size + ROOM_LEFT
