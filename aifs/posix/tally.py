"""The figures of a running mount: the counters the parts keep anyway (the
fetcher's hits and misses, the promoter's uploads, the lake wrapper's requests,
the request counters) gathered into one :class:`~aifs.figures.Figures`, the
snapshot the facade hands to :mod:`aifs.metrics` (``aifs status``, the metrics
endpoint); and byte totals sampled once a second for the throughput figures.

A snapshot is taken per scrape and per read of the status xattr, so it stays
cheap: counters are read as they stand, and the policy of each local copy is
looked up once, remembered until the checkpoint policies change
(:attr:`~aifs.checkpoint.Checkpoints.generation`).
"""

from __future__ import annotations

import time
from collections import Counter, deque

import trio

from aifs.cache.blocks import CLASSES, BlockCache
from aifs.cache.files import LocalFiles
from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.figures import (
    CacheFigures,
    Figures,
    LakeFigures,
    PrefetchFigures,
    PromotionFigures,
    RecoveredFigures,
    RequestFigures,
    Throughput,
)
from aifs.flush.promoter import Promoter
from aifs.lake.counting import OPERATIONS, CountingStore
from aifs.meta.store import MetaStore
from aifs.posix.inodes import Inodes
from aifs.posix.recovery import Recovery
from aifs.read.attrs import ObjectAttributes
from aifs.read.fetcher import BlockFetcher
from aifs.read.scan import DirectoryPrefetch

RATE_WINDOW = 10.0  # seconds of history behind the throughput figures
SAMPLE_EVERY = 1.0

#: read_bytes, write_bytes (through the mount), lake_read_bytes, lake_written_bytes
Totals = tuple[int, int, int, int]


class Tally:
    def __init__(self, config: Config, store: CountingStore, cache: BlockCache,
                 local: LocalFiles, meta: MetaStore, inodes: Inodes, fetcher: BlockFetcher,
                 promoter: Promoter, checkpoints: Checkpoints, recovery: Recovery,
                 dir_prefetch: DirectoryPrefetch, object_attrs: ObjectAttributes) -> None:
        self.config = config
        self.store = store
        self.cache = cache
        self.local = local
        self.meta = meta
        self.inodes = inodes
        self.fetcher = fetcher
        self.promoter = promoter
        self.checkpoints = checkpoints
        self.recovery = recovery
        self.dir_prefetch = dir_prefetch
        self.object_attrs = object_attrs
        self._local_policy: dict[int, str] = {}  # ino of a local copy -> its policy
        self._policies_seen = -1  # the checkpoints' generation _local_policy is of
        self._samples: deque[tuple[float, Totals]] = deque()

    # -- throughput ------------------------------------------------------
    def _totals(self) -> Totals:
        counters, store = self.inodes.counters, self.store
        return (counters.read_bytes, counters.write_bytes, store.bytes_read,
                store.bytes_written)

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, self._totals()))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW:
            self._samples.popleft()

    async def run(self) -> None:
        """Sample byte totals once a second (for the throughput figures)."""
        while True:
            self.sample()
            await trio.sleep(SAMPLE_EVERY)

    def throughput(self) -> Throughput:
        """Bytes per second over the last ``RATE_WINDOW`` seconds."""
        now = time.monotonic()
        current = self._totals()
        if not self._samples or now - self._samples[0][0] <= 0:
            return Throughput()
        then, old = self._samples[0]
        read, write, lake_read, lake_written = (
            round((value - was) / (now - then), 1) for value, was in zip(current, old, strict=True))
        return Throughput(read, write, lake_read, lake_written)

    # -- the snapshot ----------------------------------------------------
    def _bytes_by_policy(self) -> dict[str, int]:
        checkpoints = self.checkpoints
        by_policy: Counter[str] = Counter(
            {p: n for p, n in self.cache.by_policy.items() if n > 0})
        if self._policies_seen != checkpoints.generation:
            self._policies_seen = checkpoints.generation
            self._local_policy.clear()
        sizes = self.local.sizes()
        for ino, size in sizes.items():
            policy = self._local_policy.get(ino)
            if policy is None:  # once per local file, not once per scrape
                inode = self.meta.get(ino)
                policy = checkpoints.policy_of(inode) if inode is not None else "default"
                self._local_policy[ino] = policy
            by_policy[policy] += size
        if len(self._local_policy) > 2 * len(sizes) + 1000:
            self._local_policy = {ino: self._local_policy[ino] for ino in sizes
                                  if ino in self._local_policy}
        return dict(sorted(by_policy.items()))

    def figures(self) -> Figures:
        cache, local, store, counters = self.cache, self.local, self.store, self.inodes.counters
        fetched, promoted, scans = self.fetcher.stats, self.promoter.stats, self.dir_prefetch
        hits = {"memory": fetched.memory_hits, "disk": fetched.disk_hits,
                "local": counters.local_reads}
        served = sum(hits.values()) + fetched.misses
        queue = self.promoter.summary()
        return Figures(
            lake_url=self.config.resolved_lake(),
            cache=CacheFigures(
                capacity_bytes=cache.capacity,
                bytes={"memory": self.fetcher.memory_used, "blocks": cache.used,
                       "files": local.used},
                dirty_bytes=local.dirty_bytes,
                by_policy=self._bytes_by_policy(),
                by_class={c: max(0, cache.by_class[c]) for c in CLASSES},
                refused=cache.refused,
                hits=hits,
                misses=fetched.misses,
                hit_ratio=round(sum(hits.values()) / served, 4) if served else 0.0,
                evictions=cache.evictions + local.evictions,
                disk_full=counters.disk_full),
            recovered=RecoveredFigures(directory=str(self.recovery.recovered_dir),
                                       files=self.recovery.recovered_files),
            promotion=PromotionFigures(
                pending_files=queue["files"], pending_bytes=queue["bytes"],
                pending_deletes=queue["deletes"], uploading=queue["uploading"],
                oldest_age_s=queue["oldest_age"],
                uploads=promoted.uploads, upload_bytes=promoted.upload_bytes,
                deletes=promoted.deletes, metadata_updates=promoted.metadata_updates,
                failures=promoted.failures),
            lake=LakeFigures(
                requests={op: store.requests[op] for op in OPERATIONS},
                errors={op: store.errors[op] for op in OPERATIONS},
                request_seconds={op: round(store.seconds[op], 3) for op in OPERATIONS},
                retries=store.retries,
                read_bytes=store.bytes_read,
                written_bytes=store.bytes_written),
            fs=RequestFigures(
                read_requests=counters.read_requests, read_bytes=counters.read_bytes,
                write_requests=counters.write_requests, write_bytes=counters.write_bytes,
                lookup_requests=counters.lookup_requests, open_files=len(self.inodes.files)),
            prefetch=PrefetchFigures(directory_scans=scans.scans,
                                     directory_objects=scans.fetched,
                                     directory_peak_bytes=scans.peak_bytes,
                                     attributes_ahead=self.object_attrs.read_ahead),
            throughput=self.throughput())
