"""Directory prefetch: readers going through a directory of small lake objects
find the rest of it fetched ahead.

A training job's first epoch opens every sample of a directory once, in
order or shuffled, each a small object the kernel asks for only when it is
opened: one GET after another per reader, the lake's latency each time. Once
several small objects of one directory are opened within ``WINDOW`` seconds,
the rest of that directory (from the entry opened on, then from its start) is
fetched with many GETs at once into the block cache, where the opens that
follow find it. What all scans together fetched and no reader opened yet is
bounded (``budget`` bytes, a share of the cache): a scan that runs ahead
waits for the readers, and one whose readers stopped for ``WINDOW`` seconds
ends and gives its share back. Readers in a shuffled order may open any
object next, so their directory is scanned only if all of its objects fit
the budget; readers in order get a scan whatever the directory's size. Only
opens that miss count towards a scan: a directory fetched ahead is not
scanned again while its readers find what they open. Packed files are left
to the pack's own read-ahead (their bytes share one object); large objects
to per-file read-ahead.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from aifs.cache.blocks import ObjectVersion
from aifs.errors import LakeError
from aifs.meta.store import FILE, Inode, MetaStore
from aifs.read.fetcher import BlockFetcher

log = logging.getLogger(__name__)

OPENS = 3  # small objects of one directory opened within WINDOW seconds: a scan
WINDOW = 10.0
BATCH = 256  # entries read from the metadata store at a time
MAX_DIRECTORIES = 1024  # directories whose opens are counted
NEAR = 4  # a miss at most this many entries after a recent one: readers in order
RECENT = 8  # misses remembered per directory (several readers in order interleave)
RECHECK = 60.0  # seconds before a directory too big for a shuffled scan is weighed again


@dataclass
class _Directory:
    opens: int = 0
    since: float = 0.0
    last: float = 0.0  # the latest open
    near: int = 0  # misses since ``since`` that came NEAR after a recent one
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))  # their cookies
    too_big: float = -math.inf  # when a shuffled scan was found not to fit the budget
    running: bool = False
    # fetched and not opened yet, in the order fetched: ident -> (size, when)
    ahead: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def in_order(self) -> bool:
        """Three in four misses came just after a recent one: readers going
        through in order (one, or several interleaved), not shuffled."""
        return self.opens > 1 and 4 * self.near >= 3 * (self.opens - 1)


class DirectoryPrefetch:
    def __init__(self, meta: MetaStore, fetcher: BlockFetcher, budget: int, at_once: int,
                 version_of: Callable[[Inode], ObjectVersion],
                 is_local: Callable[[int], bool], clock: Callable[[], float]) -> None:
        self.meta = meta
        self.fetcher = fetcher
        self.budget = budget
        self.version_of = version_of
        self.is_local = is_local
        self.clock = clock
        self._dirs: dict[int, _Directory] = {}
        self.ahead_bytes = 0  # fetched by all scans, not opened yet: at most budget
        self._progress = trio.Event()  # set when an open takes bytes out of ahead_bytes
        self._slots = trio.Semaphore(at_once)  # GETs of all scans in flight at once
        self._nursery: trio.Nursery | None = None
        self.scans = 0  # scans started (stats)
        self.fetched = 0  # objects fetched ahead of their open (stats)
        self.peak_bytes = 0  # the most ahead_bytes ever were (stats)

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def _small(self, inode: Inode) -> bool:
        """A plain (not packed) lake object of one block, not held locally."""
        return (inode.kind == FILE and inode.in_lake and not inode.packed
                and not inode.pending and 0 < inode.size <= self.fetcher.block_size
                and not self.is_local(inode.ino))

    def opened(self, inode: Inode, version: ObjectVersion) -> None:
        """Count an open for reading of ``inode``; start a scan of its
        directory once several came in a row."""
        if version.source or not self._small(inode):
            return
        directory = self._dirs.get(inode.parent)
        now = self.clock()
        if directory is None:
            if len(self._dirs) >= MAX_DIRECTORIES:
                self._forget_idle()
            directory = self._dirs[inode.parent] = _Directory(since=now)
        fetched = directory.ahead.pop(version.ident, None)
        if fetched is not None:
            self._give_back(fetched[0])
        directory.last = now
        if fetched is not None or self.fetcher.available(version, 0):
            return  # found fetched: only misses start a scan (not one per few hits)
        cookie = self.meta.cookie_of(inode.parent, inode.key.rsplit("/", 1)[-1].encode(
            "utf-8", "surrogateescape")) or 0
        if now - directory.since > WINDOW:
            directory.opens, directory.near, directory.since = 0, 0, now
            directory.recent.clear()
        if any(0 < cookie - earlier <= NEAR for earlier in directory.recent):
            directory.near += 1
        directory.recent.append(cookie)
        directory.opens += 1
        in_order = directory.in_order
        if (directory.opens >= OPENS and not directory.running and self._nursery
                and (in_order or now - directory.too_big > RECHECK)):
            directory.running = True
            # from the earliest recent miss: readers in order that interleave are behind it
            self._nursery.start_soon(self._scan, inode.parent, directory,
                                     min(directory.recent), in_order)

    def _forget_idle(self) -> None:
        for ino in [ino for ino, d in self._dirs.items() if not d.running]:
            self._give_back(sum(size for size, _ in self._dirs.pop(ino).ahead.values()))

    def _give_back(self, size: int) -> None:
        """``size`` bytes fetched ahead are opened (or no reader will come for them)."""
        if size:
            self.ahead_bytes -= size
            self._progress.set()
            self._progress = trio.Event()

    def _release_stale(self) -> None:
        """Give back what was fetched for directories whose readers stopped, and
        what no reader opened within WINDOW of its fetch (files the readers
        skip, as the ``.json`` beside each ``.jpg`` they read): one directory's
        leftovers must not hold every scan back."""
        now = self.clock()
        for directory in self._dirs.values():
            if directory.ahead and now - directory.last > WINDOW:
                self._give_back(sum(size for size, _ in directory.ahead.values()))
                directory.ahead.clear()
                continue
            stale = []
            for ident, (_, when) in directory.ahead.items():  # oldest first
                if now - when <= WINDOW:
                    break
                stale.append(ident)
            for ident in stale:
                self._give_back(directory.ahead.pop(ident)[0])

    async def _scan(self, parent: int, directory: _Directory, first: int,
                    in_order: bool) -> None:
        """Fetch the small objects of ``parent`` from cookie ``first`` on (for
        shuffled readers, then those before it), while readers keep opening
        them. Readers in a shuffled order open any of them next: the scan runs
        only if all of them fit the budget (else most of what it fetched would
        wait, or be evicted before its open and fetched twice)."""
        try:
            if not in_order and not await self._fits(parent):
                directory.too_big = self.clock()
                return
            self.scans += 1
            async with trio.open_nursery() as nursery:
                # (readers in order that began part way through end at the end)
                parts = ((first, None),) if in_order else ((first, None), (0, first))
                for start, stop in parts:
                    if not await self._fetch_range(parent, directory, nursery, start, stop):
                        break
        finally:  # what it fetched stays counted until opened or its readers stop
            directory.running = False
            directory.opens = 0

    async def _fits(self, parent: int) -> bool:
        """Whether the small objects of ``parent`` not at hand fit the budget."""
        total, after = 0, 0
        while batch := self.meta.readdir(parent, after, BATCH):
            for cookie, _, inode in batch:
                after = cookie
                if self._small(inode) and not self.fetcher.available(self.version_of(inode),
                                                                     0):
                    total += inode.size
                    if total > self.budget:
                        return False
            await trio.lowlevel.checkpoint()
        return True

    async def _fetch_range(self, parent: int, directory: _Directory,
                           nursery: trio.Nursery, after: int, stop: int | None) -> bool:
        """Fetch entries with cookies in (after, stop); False once readers stopped."""
        while True:
            batch = self.meta.readdir(parent, after, BATCH)
            if not batch:
                return True
            for cookie, _, inode in batch:
                if stop is not None and cookie >= stop:
                    return True
                after = cookie
                if not self._small(inode):
                    continue
                version = self.version_of(inode)
                if version.source or self.fetcher.available(version, 0):
                    continue
                if inode.size > self.budget:
                    continue  # (a cache of a few blocks: larger than all it may fetch ahead)
                if not await self._room(directory, inode.size):
                    return False  # the readers stopped
                earlier = directory.ahead.pop(version.ident, None)  # fetched, then evicted
                if earlier is not None:
                    self._give_back(earlier[0])
                directory.ahead[version.ident] = (inode.size, self.clock())
                self.ahead_bytes += inode.size
                self.peak_bytes = max(self.peak_bytes, self.ahead_bytes)
                nursery.start_soon(self._fetch_one, directory, version)

    async def _room(self, directory: _Directory, size: int) -> bool:
        """Wait for a GET slot and ``size`` bytes of the budget; False once
        ``directory``'s readers stopped."""
        while True:
            while self.ahead_bytes + size > self.budget:
                if self.clock() - directory.last > WINDOW:
                    return False
                self._release_stale()
                if self.ahead_bytes + size > self.budget:
                    with trio.move_on_after(WINDOW):
                        await self._progress.wait()
            if self.clock() - directory.last > WINDOW:
                return False
            await self._slots.acquire()  # (other scans may take the budget meanwhile)
            if self.ahead_bytes + size <= self.budget:
                return True
            self._slots.release()

    async def _fetch_one(self, directory: _Directory, version: ObjectVersion) -> None:
        try:
            await self.fetcher.fetch_ahead(version, 0)
            self.fetched += 1
        except LakeError as exc:  # the reader that opens it tries again, and says why
            log.debug("prefetch of %s failed: %s", version.key, exc)
            self._give_back(directory.ahead.pop(version.ident, (0, 0.0))[0])
        finally:
            self._slots.release()
