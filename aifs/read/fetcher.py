"""Block fetcher: the one path by which object bytes are read.

Tiers, fastest first: an in-memory LRU of blocks recently fetched from the
lake, the on-disk :class:`~aifs.cache.BlockCache` (read in place, request by
request, with the kernel reading ahead into its page cache), then a range GET
from the lake. Every fetch
runs as a task in the service nursery, so any number of readers waiting for
one block cause one GET, and a reader whose request is interrupted does not
cancel the fetch others wait on.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from aifs.buffers import Body
from aifs.cache.blocks import BlockCache, ObjectVersion
from aifs.cache.segments import SMALL, Location, checksum
from aifs.errors import CorruptData, LakeError, PreconditionFailed
from aifs.lake.base import ObjectStore
from aifs.pack.index import checksum as pack_checksum

log = logging.getLogger(__name__)

STORE_THREADS = 4  # threads storing small blocks behind their readers, at most
STORE_BATCH = 32  # small blocks waiting per store thread before another starts
STORE_DELAY = 0.02  # seconds the first small block of a batch waits for others
STORE_BEHIND = 64 << 20  # bytes fetched and not yet stored, above which a fetch waits


async def read_at(fd: int, offset: int, length: int,
                  limiter: trio.CapacityLimiter) -> bytes | memoryview:
    """Read a local file: inline when the page cache has it, else in a thread."""
    buf = bytearray(length)
    try:
        got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        got = 0
    except OSError as exc:  # tmpfs (a cache in /dev/shm) has no RWF_NOWAIT: all in memory
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        got = os.preadv(fd, [buf], offset)
    if got < length:
        # The thread reads a descriptor of its own: the caller's may be closed
        # (a cache of open files closes its oldest) and its number reused by
        # another file while the thread waits for the limiter or the disk.
        own = os.dup(fd)
        try:
            view = memoryview(buf)[got:]
            got += await trio.to_thread.run_sync(os.preadv, own, [view], offset + got,
                                                  limiter=limiter)
        finally:
            os.close(own)
    return memoryview(buf)[:got]


FALLBACK_ADVISE_STEP = 2 << 20  # bytes per WILLNEED where the device is unknown


@functools.cache
def advise_step(device: int) -> int:
    """Bytes one WILLNEED reads ahead on ``device``: the kernel caps a call at
    the larger of the device's readahead window and its largest request."""
    base = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    queue = base / ("../queue" if (base / "partition").exists() else "queue")
    try:
        kib = max(int((queue / name).read_text())
                  for name in ("read_ahead_kb", "max_sectors_kb"))
    except (OSError, ValueError):
        return FALLBACK_ADVISE_STEP
    return max(4 << 10, kib << 10)


def read_ahead(ranges: list[tuple[int, int, int]]) -> None:
    """Have the kernel read ``(fd, offset, length)`` ranges of local files into
    its page cache, without waiting for it.

    One WILLNEED reads at most a device-given amount (``advise_step``: 128 KiB
    on many NVMe defaults), so a range is advised in steps of it: a single
    call for 64 MiB read only 16 MiB ahead here, and most reads then waited
    for the disk. Allocating the pages costs about 0.3 s of CPU per GiB, so it
    runs in a worker thread, off the event loop. A file may be closed (its fd
    even reused) by then: the worst that does is a wasted read-ahead.
    """
    def advise() -> None:
        try:
            for fd, offset, length in ranges:
                step = advise_step(os.fstat(fd).st_dev)
                for at in range(offset, offset + length, step):
                    os.posix_fadvise(fd, at, min(step, offset + length - at),
                                     os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    trio.lowlevel.start_thread_soon(advise, lambda outcome: None)


def verify(data: Body, expected: str, what: str) -> None:
    """Raise CorruptData unless ``data`` has the checksum a pack recorded."""
    if pack_checksum(data) != expected:
        raise CorruptData(f"{what}: checksum mismatch (the pack is damaged); "
                          "no bytes are returned")


@dataclass
class _Flight:
    done: trio.Event = field(default_factory=trio.Event)  # data (or error) at hand
    stored: trio.Event = field(default_factory=trio.Event)  # ... and on the cache disk
    data: Body | None = None
    error: BaseException | None = None
    admitted: bool = False  # the cache took the block
    #: under the fetcher's store lock: stored, or never will be ...
    finished: bool = False
    #: ... and someone waits for ``stored`` (a store thread sets it then)
    watched: bool = False


@dataclass
class FetchStats:
    memory_hits: int = 0
    disk_hits: int = 0
    lake_gets: int = 0
    lake_bytes: int = 0
    errors: int = 0
    misses: int = 0  # reads that waited for the lake (a fetch of theirs or a prefetch)


class BlockFetcher:
    def __init__(self, store: ObjectStore, cache: BlockCache, block_size: int,
                 memory_bytes: int, max_prefetch: int) -> None:
        self.store = store
        self.cache = cache
        self.block_size = block_size
        self.memory_bytes = memory_bytes
        self._memory: OrderedDict[tuple[str, int], Body] = OrderedDict()
        self._memory_used = 0
        self._flights: dict[tuple[str, int], _Flight] = {}
        self._prefetch_slots = trio.Semaphore(max_prefetch)
        self._disk_limiter = trio.CapacityLimiter(8)
        # Stores write to the disk synchronously (past the page cache): their
        # own threads, so that a burst of them never keeps readers from the disk.
        self._store_limiter = trio.CapacityLimiter(4)
        self._nursery: trio.Nursery | None = None
        #: called on the trio thread before a block is stored: frees space held
        #: outside the block cache (whole local copies) where blocks alone cannot
        self.make_room: Callable[[int], None] = lambda incoming: None
        self._storing = 0  # bytes of blocks fetched and not yet stored
        self._store_lock = threading.Lock()
        self._drained = threading.Condition(self._store_lock)
        self._pending: deque[tuple[ObjectVersion, int, Body, _Flight]] = deque()
        self._queued_slots: Counter[tuple[str, int]] = Counter()  # the blocks of _pending
        self._store_threads = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._fds: OrderedDict[str, int] = OrderedDict()  # path -> descriptor
        self._advised: OrderedDict[tuple[str, int], None] = OrderedDict()
        #: blocks fetched for a file as it was opened (``fetch_for_open``) whose
        #: first read has not come yet: that read counts as the miss it is
        self._opened: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.max_open_blocks = 64
        self.stats = FetchStats()

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()

    @property
    def memory_used(self) -> int:
        """Bytes of blocks kept in memory."""
        return self._memory_used

    def blocks_of(self, version: ObjectVersion) -> int:
        return (version.size + self.block_size - 1) // self.block_size

    async def read(self, version: ObjectVersion, index: int, lo: int,
                   hi: int) -> bytes | memoryview:
        """Bytes [lo, hi) of block ``index``: from memory, the disk cache, or the lake."""
        slot = (version.ident, index)
        # the first read of a block fetched at its file's open: a miss even if
        # the GET was done before the read came
        opened = self._opened.pop(slot, 0) is None
        if opened:
            self.stats.misses += 1
        data = self._memory.get(slot)
        if data is not None:
            self._memory.move_to_end(slot)
            if not opened:
                self.stats.memory_hits += 1
            return memoryview(data)[lo:hi]
        if slot not in self._flights:
            found = self._block_fd(version, index)
            if found is not None:
                fd, where = found
                if where.checksum is None:
                    if not opened:
                        self.stats.disk_hits += 1
                    return await read_at(fd, where.offset + lo, hi - lo, self._disk_limiter)
                # a segment block: read whole and checked (it may have been
                # evicted, its range punched out, while this read looked it up)
                data = await read_at(fd, where.offset, where.size, self._disk_limiter)
                if checksum(data) == where.checksum:
                    if not opened:
                        self.stats.disk_hits += 1
                    return data[lo:hi]
                trio.lowlevel.start_thread_soon(  # (its disk I/O: a thread's)
                    lambda: self.cache.drop(version, index, where), lambda outcome: None)
        if not opened:
            self.stats.misses += 1
        return memoryview(await self.block(version, index))[lo:hi]

    def fetch_for_open(self, version: ObjectVersion, index: int) -> None:
        """Start fetching a block a reader is about to ask for (its file was
        just opened), unless it is at hand or on its way: a demand fetch, not
        read-ahead (no read-ahead slot; its first read counts as a miss)."""
        if self.available(version, index):
            return
        slot = (version.ident, index)
        # (a failure is logged by the read that meets it, not here too)
        self._launch(version, index, prefetch=True, take_slot=False)
        self._opened[slot] = None
        while len(self._opened) > 1024:  # opened and never read: forgotten
            self._opened.popitem(last=False)

    def _block_fd(self, version: ObjectVersion, index: int) -> tuple[int, Location] | None:
        """An open descriptor of the file holding the cached block and where in
        it the block is, or None if it is not cached.

        A block file never changes (its name includes the ETag), so an open
        descriptor stays right even if eviction unlinks the file meanwhile; a
        segment block is checked by checksum when read.
        """
        where = self.cache.locate(version, index)
        if where is None:
            return None
        fd = self._fds.get(where.path)
        if fd is not None:
            self._fds.move_to_end(where.path)
            return fd, where
        try:
            fd = os.open(where.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        self._fds[where.path] = fd
        while len(self._fds) > self.max_open_blocks:
            os.close(self._fds.popitem(last=False)[1])
        return fd, where

    async def block(self, version: ObjectVersion, index: int) -> Body:
        """The whole block ``index`` of ``version``."""
        slot = (version.ident, index)
        data = self._memory.get(slot)
        if data is not None:
            self._memory.move_to_end(slot)
            self.stats.memory_hits += 1
            return data
        flight = self._flights.get(slot) or self._launch(version, index)
        await flight.done.wait()
        if flight.error is not None:
            err = flight.error
            if isinstance(err, LakeError):
                raise type(err)(str(err))
            raise LakeError(f"reading {version.key}: {err!r}")
        if flight.data is None:
            raise LakeError(f"reading {version.key}: fetch was cancelled")
        return flight.data

    def available(self, version: ObjectVersion, index: int) -> bool:
        """Whether a block is in memory, on its way, or on the cache disk."""
        slot = (version.ident, index)
        return (slot in self._memory or slot in self._flights
                or self.cache.locate(version, index) is not None)

    def prefetch(self, version: ObjectVersion, first: int, last: int) -> None:
        """Start fetching blocks [first, last] that are not at hand or on the way."""
        last = min(last, self.blocks_of(version) - 1)
        on_disk = self._prefetch(version, first, last)
        if on_disk:
            read_ahead(on_disk)

    def _prefetch(self, version: ObjectVersion, first: int, last: int
                  ) -> list[tuple[int, int, int]]:
        """Launch the fetches; return the blocks on the local disk to read ahead."""
        on_disk: list[tuple[int, int, int]] = []
        for index in range(first, last + 1):
            slot = (version.ident, index)
            if slot in self._memory or slot in self._flights or slot in self._advised:
                continue
            found = self._block_fd(version, index)
            if found is not None:
                # On the local disk: let the kernel read it ahead into the page cache.
                fd, where = found
                on_disk.append((fd, where.offset, where.size))
                self._advised[slot] = None
                if len(self._advised) > 4 * self.max_open_blocks:
                    self._advised.popitem(last=False)
                continue
            if self._prefetch_slots.value == 0:
                break
            self._launch(version, index, prefetch=True)
        return on_disk

    async def fetch_ahead(self, version: ObjectVersion, index: int) -> None:
        """Fetch a block for a reader still to come (a directory prefetch),
        unless it is at hand or on its way; the caller bounds how many run."""
        flight = self._flights.get((version.ident, index))
        if flight is None:
            if self.available(version, index):
                return
            flight = self._launch(version, index, prefetch=True, take_slot=False)
        await flight.done.wait()
        if flight.error is not None:
            raise LakeError(f"reading {version.key}: {flight.error}")

    def _launch(self, version: ObjectVersion, index: int, prefetch: bool = False,
                take_slot: bool = True) -> _Flight:
        """Start fetching a block. ``prefetch``: for no reader yet (a failure
        is only logged at debug), taking one of the read-ahead slots unless
        ``take_slot`` is False (the caller bounds its own fetches)."""
        assert self._nursery is not None, "fetcher not started"
        flight = _Flight()
        slot = (version.ident, index)
        self._flights[slot] = flight
        holds_slot = prefetch and take_slot
        if holds_slot:
            self._prefetch_slots.acquire_nowait()
        self._nursery.start_soon(self._fetch, version, index, slot, flight, prefetch,
                                 holds_slot)
        return flight

    async def _fetch(self, version: ObjectVersion, index: int, slot: tuple[str, int],
                     flight: _Flight, prefetch: bool, holds_slot: bool) -> None:
        queued = False  # handed to the store threads, which finish the flight
        try:
            offset = index * self.block_size
            length = min(self.block_size, version.size - offset)
            if version.source:  # a packed file: a range of its (immutable) pack
                data = await self.store.get_block(version.source, version.base + offset,
                                                  length)
            else:
                data = await self.store.get_block(version.key, offset, length,
                                                  if_match=version.etag or None)
            self.stats.lake_gets += 1
            self.stats.lake_bytes += len(data)
            if len(data) != length:
                raise PreconditionFailed(f"{version.key} changed in the lake "
                                         f"(short read at {offset})")
            if version.source and length == version.size:
                verify(data, version.etag, version.key)
            self._remember(slot, data)
            flight.data = data
            flight.done.set()
            del self._flights[slot]
            with self._store_lock:
                self._storing += len(data)
                behind = len(data) <= SMALL and self._storing <= STORE_BEHIND
            try:
                self.make_room(self._storing)  # blocks on their way to disk count too
                if behind:  # small: stored behind the reader, no trip back here
                    self._store_later(version, index, data, flight)
                    queued = True
                    return
                flight.admitted = await trio.to_thread.run_sync(
                    self.cache.store, version, index, data, limiter=self._store_limiter)
            finally:
                if not queued:
                    with self._store_lock:
                        self._storing -= len(data)
        except Exception as exc:  # handed to every waiter
            self.stats.errors += 1
            if not prefetch:
                log.warning("fetch of %s block %d failed: %s", version.key, index, exc)
            else:
                log.debug("prefetch of %s block %d failed: %s", version.key, index, exc)
            flight.error = exc
        finally:
            if self._flights.get(slot) is flight:
                del self._flights[slot]
            flight.done.set()
            if not queued:
                with self._store_lock:
                    flight.finished = True
                flight.stored.set()
            if holds_slot:
                self._prefetch_slots.release()

    # -- small blocks stored behind the reader --------------------------------
    # A trip to a trio worker thread and back costs two wake-ups (the thread,
    # then the event loop): 100-170 us of CPU on this machine, as much as
    # storing a small block. Small blocks are queued instead and drained by at
    # most STORE_THREADS threads of trio's cache, which report back only where
    # ``warm`` waits for a block.

    def _store_later(self, version: ObjectVersion, index: int, data: Body,
                     flight: _Flight) -> None:
        with self._store_lock:
            self._pending.append((version, index, data, flight))
            self._queued_slots[version.ident, index] += 1
            backlog = len(self._pending)
        if backlog >= STORE_BATCH * (self._store_threads + 1):
            self._start_store_thread()
        elif backlog == 1 and not self._store_threads and self._nursery is not None:
            self._nursery.start_soon(self._store_soon)

    async def _store_soon(self) -> None:
        """Start a store thread a moment after the first block of a batch came:
        one wake-up of a thread for the blocks of that moment, not one each."""
        await trio.sleep(STORE_DELAY)
        self._start_store_thread()

    def _start_store_thread(self) -> None:
        with self._store_lock:
            if self._store_threads >= STORE_THREADS or not self._pending or (
                    self._store_threads and len(self._pending) < STORE_BATCH
                    * (self._store_threads + 1)):
                return
            self._store_threads += 1
        trio.lowlevel.start_thread_soon(self._drain_stores, lambda outcome: None)

    def _drain_stores(self) -> None:
        while True:
            with self._store_lock:
                if not self._pending:
                    self._store_threads -= 1
                    self._drained.notify_all()
                    return
                version, index, data, flight = self._pending.popleft()
            try:
                admitted = self.cache.store(version, index, data)
            except Exception:  # the cache logs what it cannot write: this is a bug
                log.exception("storing block %d of %s", index, version.key)
                admitted = False
            with self._store_lock:
                self._storing -= len(data)
                slot = (version.ident, index)
                self._queued_slots[slot] -= 1
                if self._queued_slots[slot] <= 0:
                    del self._queued_slots[slot]
                flight.admitted = admitted
                flight.finished = True
                tell = flight.watched
            if tell:
                assert self._token is not None  # (set by start: a block is watched after)
                self._token.run_sync_soon(flight.stored.set)

    def cached(self, version: ObjectVersion, index: int) -> bool:
        """Whether a block is on the cache disk, or fetched and queued to be."""
        return self.cache.locate(version, index) is not None \
            or (version.ident, index) in self._queued_slots

    async def _stored(self, flight: _Flight) -> None:
        """Wait until ``flight``'s block is stored (or will not be)."""
        with self._store_lock:
            if flight.finished:
                return
            flight.watched = True
        await flight.stored.wait()

    def wait_stored(self, timeout: float) -> bool:
        """Block until the queued small blocks are stored (before unmounting):
        those no thread took yet are stored here."""
        with self._store_lock:
            if not self._store_threads and self._pending:
                self._store_threads += 1
                start = True
            else:
                start = False
        if start:
            self._drain_stores()
        with self._store_lock:
            return self._drained.wait_for(lambda: not self._store_threads, timeout)

    async def warm(self, version: ObjectVersion, parallel: int = 4) -> tuple[int, int]:
        """Fetch every block of ``version`` that is not on the cache disk (``aifs
        warmup``); return the bytes fetched and how many blocks the cache refused."""
        fetched = refused = 0

        async def one(index: int) -> None:
            nonlocal fetched, refused
            if self.cache.locate(version, index) is not None:
                return
            flight = self._flights.get((version.ident, index)) or self._launch(version, index)
            await self._stored(flight)
            if flight.error is not None:
                raise LakeError(f"warming {version.key}: {flight.error}")
            fetched += len(flight.data or b"")
            refused += not flight.admitted

        slots = trio.Semaphore(parallel)

        async def bounded(index: int) -> None:
            async with slots:
                await one(index)

        async with trio.open_nursery() as nursery:
            for index in range(self.blocks_of(version)):
                nursery.start_soon(bounded, index)
        return fetched, refused

    def _remember(self, slot: tuple[str, int], data: Body) -> None:
        if len(data) > self.memory_bytes:
            return
        old = self._memory.pop(slot, None)
        if old is not None:
            self._memory_used -= len(old)
        self._memory[slot] = data
        self._memory_used += len(data)
        while self._memory_used > self.memory_bytes:
            _, evicted = self._memory.popitem(last=False)
            self._memory_used -= len(evicted)

    def forget_object(self, ident: str) -> None:
        """Drop memory blocks of an object version that is gone."""
        for slot in [s for s in self._memory if s[0] == ident]:
            self._memory_used -= len(self._memory.pop(slot))

    def stored(self, version: ObjectVersion, index: int) -> bool:
        """Whether a block is on the cache disk (not only queued to be)."""
        return self.cache.locate(version, index) is not None

    def copy_block(self, version: ObjectVersion, index: int, fd: int, offset: int) -> bool:
        """Write cached block ``index`` of ``version`` into ``fd`` (from
        ``cache.writer.open``) at ``offset``: a block file copied past the page
        cache, a segment block read and checked. False if the block is not
        cached (or read back damaged). Blocking: a worker thread's."""
        where = self.cache.locate(version, index)
        length = min(self.block_size, version.size - index * self.block_size)
        if where is None or where.size != length:
            return False
        if where.checksum is None:
            return self.cache.writer.copy(where.path, where.offset, fd, offset, length)
        try:
            src = os.open(where.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # evicted since it was located
        try:
            data = os.pread(src, length, where.offset)
        finally:
            os.close(src)
        if checksum(data) != where.checksum:
            self.cache.drop(version, index, where)
            return False
        self.cache.writer.pwrite(fd, data, offset)
        return True

    async def forget_version(self, version: ObjectVersion) -> None:
        """Drop every cached block of ``version`` (its bytes are kept elsewhere
        now: a local copy); no reader may be reading them."""
        self.forget_object(version.ident)
        for path in await trio.to_thread.run_sync(self.cache.forget, version,
                                                  limiter=self._disk_limiter):
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)  # (an unlinked file's space is freed at its last close)

