"""Directory prefetch: readers going through a directory of small lake objects
find the rest of it fetched ahead.

A training job's first epoch opens every sample of a directory once, in
order or shuffled, each a small object the kernel asks for only when it is
opened: one GET after another per reader, the lake's latency each time. Once
several small objects of one directory are opened within ``WINDOW`` seconds,
the rest of that directory (from the entry opened on, then from its start) is
fetched with many GETs at once into the block cache, where the opens that
follow find it. What is fetched and not opened yet is bounded (``budget``
bytes): a scan that runs ahead waits for the readers, and one whose readers
stopped for ``WINDOW`` seconds ends. Packed files are left to the pack's own
read-ahead (their bytes share one object); large objects to per-file
read-ahead.
"""

from __future__ import annotations

import logging
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


@dataclass
class _Directory:
    opens: int = 0
    since: float = 0.0
    last: float = 0.0  # the latest open
    running: bool = False
    ahead: dict[str, int] = field(default_factory=dict)  # fetched, not opened: ident -> size
    ahead_bytes: int = 0
    progress: trio.Event = field(default_factory=trio.Event)  # set at each open


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
        self._slots = trio.Semaphore(at_once)  # GETs of all scans in flight at once
        self._nursery: trio.Nursery | None = None
        self.scans = 0  # scans started (stats)
        self.fetched = 0  # objects fetched ahead of their open (stats)

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
        size = directory.ahead.pop(version.ident, None)
        if size is not None:
            directory.ahead_bytes -= size
        directory.progress.set()
        directory.progress = trio.Event()
        directory.last = now
        if now - directory.since > WINDOW:
            directory.opens, directory.since = 0, now
        directory.opens += 1
        if directory.opens >= OPENS and not directory.running and self._nursery:
            cookie = self.meta.cookie_of(inode.parent, inode.key.rsplit("/", 1)[-1].encode(
                "utf-8", "surrogateescape"))
            directory.running = True
            self.scans += 1
            self._nursery.start_soon(self._scan, inode.parent, directory, cookie or 0)

    def _forget_idle(self) -> None:
        for ino in [ino for ino, d in self._dirs.items() if not d.running]:
            del self._dirs[ino]

    async def _scan(self, parent: int, directory: _Directory, first: int) -> None:
        """Fetch the small objects of ``parent`` from cookie ``first`` on, then
        those before it, while readers keep opening them."""
        try:
            async with trio.open_nursery() as nursery:
                for start, stop in ((first, None), (0, first)):
                    if not await self._fetch_range(parent, directory, nursery, start, stop):
                        break
        finally:
            directory.running = False
            directory.opens = 0
            directory.ahead.clear()
            directory.ahead_bytes = 0

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
                while directory.ahead_bytes + inode.size > self.budget:
                    with trio.move_on_after(WINDOW) as waited:
                        await directory.progress.wait()
                    if waited.cancelled_caught:
                        return False  # the readers stopped (or skip these)
                if self.clock() - directory.last > WINDOW:
                    return False  # the readers stopped
                await self._slots.acquire()
                directory.ahead[version.ident] = inode.size
                directory.ahead_bytes += inode.size
                nursery.start_soon(self._fetch_one, version)

    async def _fetch_one(self, version: ObjectVersion) -> None:
        try:
            await self.fetcher.fetch_ahead(version, 0)
            self.fetched += 1
        except LakeError as exc:  # the reader that opens it tries again, and says why
            log.debug("prefetch of %s failed: %s", version.key, exc)
        finally:
            self._slots.release()
