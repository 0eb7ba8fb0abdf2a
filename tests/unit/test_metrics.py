"""The figures behind ``aifs status`` and /metrics, without a mount: the lake
wrapper counts what was asked of the lake, the renderer writes valid
Prometheus text."""

from __future__ import annotations

import os
import re
import time

import pytest
import trio

from aifs.cache.blocks import BlockCache, ObjectVersion
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem
from aifs.errors import ObjectNotFound
from aifs.figures import Figures
from aifs.lake.counting import CountingStore
from aifs.lake.local import LocalStore
from aifs.meta.store import ROOT_INO, MetaStore
from aifs.metrics import Metrics, prometheus_text
from aifs.read.fetcher import BlockFetcher


@pytest.mark.trio
async def test_counting_store_counts_requests_bytes_and_pages(tmp_path):
    store = CountingStore(LocalStore(str(tmp_path)))
    await store.put("a/x", b"12345")
    assert await store.get_range("a/x", 1, 3) == b"234"
    with pytest.raises(ObjectNotFound):
        await store.head("a/missing")
    for i in range(2500):
        (tmp_path / "a" / f"f{i:05d}").write_bytes(b"")
    pages = [page async for page in store.iter_list("a/")]
    assert store.requests["PutObject"] == 1 and store.requests["GetObject"] == 1
    assert store.requests["HeadObject"] == 1
    assert store.errors["HeadObject"] == 0  # "not found" is an answer, not a failure
    assert store.requests["ListObjectsV2"] == len(pages) == 3  # 1000 keys a page
    assert store.bytes_written == 5 and store.bytes_read == 3


@pytest.mark.trio
async def test_a_block_fetched_at_open_counts_as_a_miss_when_read_not_a_hit(tmp_path):
    """A small file's block is fetched as the file is opened; its first read
    may come after the GET is done, but it is still a read the cache missed
    (the bytes came from the lake), so the hit ratio stays honest."""
    (tmp_path / "lake").mkdir()
    store = CountingStore(LocalStore(str(tmp_path / "lake")))
    await store.put("s.bin", b"x" * 1000)
    version = ObjectVersion("s.bin", (await store.head("s.bin")).etag, 1000)
    cache = BlockCache(tmp_path / "cache", 1 << 20)
    fetcher = BlockFetcher(store, cache, 1 << 20, 1 << 20, max_prefetch=4)
    async with trio.open_nursery() as nursery:
        fetcher.start(nursery)
        fetcher.fetch_for_open(version, 0)
        await fetcher.block(version, 0)  # the GET is done before the read comes
        fetcher.stats.memory_hits = 0
        assert bytes(await fetcher.read(version, 0, 0, 1000)) == b"x" * 1000
        assert (fetcher.stats.misses, fetcher.stats.memory_hits) == (1, 0)
        assert bytes(await fetcher.read(version, 0, 0, 10)) == b"x" * 10  # now a hit
        assert (fetcher.stats.misses, fetcher.stats.memory_hits) == (1, 1)
        assert store.requests["GetObject"] == 1
        assert await trio.to_thread.run_sync(fetcher.wait_stored, 10)
    cache.close()


def test_prometheus_text_is_well_formed():
    snapshot = {
        "version": "0.1.0", "lake_url": 's3://b/"odd"', "uptime_s": 3.0,
        "cache": {"capacity_bytes": 100, "bytes": {"memory": 1, "blocks": 2, "files": 3},
                  "dirty_bytes": 0, "by_policy": {"dataset": 2}, "by_class": {"pinned": 0},
                  "hits": {"memory": 1, "disk": 2, "local": 0}, "misses": 1,
                  "hit_ratio": 0.75, "evictions": 0, "refused": 0},
        "promotion": {"pending_files": 0, "pending_bytes": 0, "pending_deletes": 0,
                      "uploading": 0, "oldest_age_s": 0.0, "uploads": 1, "upload_bytes": 9,
                      "deletes": 0, "metadata_updates": 0, "failures": 0},
        "lake": {"requests": {"GetObject": 4}, "errors": {"GetObject": 0},
                 "request_seconds": {"GetObject": 0.5}, "retries": 0, "read_bytes": 4,
                 "written_bytes": 9},
        "fs": {"read_requests": 1, "lookup_requests": 3, "read_bytes": 4, "write_requests": 1,
               "write_bytes": 9, "open_files": 0},
        "prefetch": {"directory_scans": 1, "directory_objects": 5, "attributes_ahead": 7},
    }
    text = prometheus_text(snapshot)
    families = re.findall(r"^# TYPE (\S+) (counter|gauge)$", text, re.M)
    assert len(families) == len({name for name, _ in families}) > 20
    for name, kind in families:
        assert f"# HELP {name} " in text
        if kind == "counter":
            assert name.endswith("_total"), name
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    for line in samples:
        assert re.fullmatch(r'[a-z_]+(\{[a-z_]+="(?:[^"\\]|\\.)*"(,[a-z_]+="(?:[^"\\]|\\.)*")*\})? '
                            r"[0-9.e+-]+", line), line
    assert 'aifs_lake_requests_total{op="GetObject"} 4.0' in samples  # prometheus_client's floats
    assert 'lake="s3://b/\\"odd\\""' in text


#: the keys of the status JSON, section by section, in their order (aifs status
#: and scripts read them; the Prometheus families are derived from them)
SHAPE = {
    "cache": ["capacity_bytes", "bytes", "dirty_bytes", "by_policy", "by_class", "refused",
              "hits", "misses", "hit_ratio", "evictions", "disk_full"],
    "recovered": ["directory", "files"],
    "promotion": ["pending_files", "pending_bytes", "pending_deletes", "uploading",
                  "oldest_age_s", "uploads", "upload_bytes", "deletes", "metadata_updates",
                  "failures"],
    "lake": ["requests", "errors", "request_seconds", "retries", "read_bytes",
             "written_bytes"],
    "fs": ["read_requests", "read_bytes", "write_requests", "write_bytes", "lookup_requests",
           "open_files"],
    "prefetch": ["directory_scans", "directory_objects", "directory_peak_bytes",
                 "attributes_ahead"],
    "throughput": ["read_bytes_per_s", "write_bytes_per_s", "lake_read_bytes_per_s",
                   "lake_written_bytes_per_s"],
}


async def test_the_snapshot_renders_the_figures_the_facade_hands_out(tmp_path):
    """Metrics sees only ``Filesystem.figures``: values, gathered below the
    facade, the policy of each local copy looked up once until the policies
    change, throughput from the totals sampled once a second."""
    (tmp_path / "lake").mkdir()
    config = Config(lake=f"file://{tmp_path}/lake", cache_size=64 << 20)
    meta, local = MetaStore(tmp_path / "meta"), LocalFiles(tmp_path / "cache")
    cache = BlockCache(tmp_path / "cache", config.cache_size)
    fs = Filesystem(config, LocalStore(str(tmp_path / "lake")), meta, cache, local)
    try:
        fh, _ = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, 0, 0)
        await fs.write(fh, 0, b"x" * 5000)
        fs.tally.sample(time.monotonic() - 2)  # two seconds ago, 5000 bytes written
        await fs.write(fh, 5000, b"x" * 1000)
        fs.release(fh)
        asked = []
        policy_of = fs.checkpoints.policy_of
        fs.checkpoints.policy_of = lambda inode: asked.append(inode.ino) or policy_of(inode)

        figures = fs.figures()
        assert isinstance(figures, Figures)
        assert figures.fs.write_requests == 2 and figures.fs.write_bytes == 6000
        assert figures.cache.bytes["files"] == figures.cache.dirty_bytes == 6000
        assert figures.cache.by_policy == {"default": 6000}
        assert figures.promotion.pending_files == 1
        assert 400 < figures.throughput.write_bytes_per_s <= 500
        assert figures.throughput.read_bytes_per_s == 0.0
        fs.figures()
        assert len(asked) == 1  # once per local copy, not once per snapshot
        fs.checkpoints.generation += 1
        fs.figures()
        assert len(asked) == 2  # the policies may have changed: asked again

        metrics = Metrics(fs.figures)
        snapshot = metrics.snapshot()
        assert list(snapshot) == ["version", "pid", "lake_url", "uptime_s", "metrics_url",
                                  *SHAPE]
        assert {section: list(snapshot[section]) for section in SHAPE} == SHAPE
        assert snapshot["lake_url"] == config.resolved_lake()
        assert snapshot["fs"]["write_bytes"] == 6000
        assert "aifs_fs_write_bytes_total 6000.0" in prometheus_text(snapshot)
    finally:
        local.close()
        cache.close()
        meta.close()
