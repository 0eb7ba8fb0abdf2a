"""Every lake operation, and the filesystem above them, under injected faults:
``RetryingStore(FaultyStore(store))`` on the local lake, moto and Ceph RGW.

The fault-injecting store (aifs/lake/faulty.py) fails a share of the calls,
seeded, in one way at a time: before the store saw the request, after it acted
(the lost reply), with a cut body, late, or with 503 SlowDown. What must hold:
the right answer every time, no upload left behind, retries counted by cause.
The same at the TCP level in front of a real S3 server: tests/faults/test_faults.py.
"""

from __future__ import annotations

import os
import random

import pytest
import trio
from support.lakes import Lake, lake_uploads

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem
from aifs.errors import ObjectNotFound
from aifs.lake import open_store
from aifs.lake.counting import CountingStore
from aifs.lake.faulty import KINDS, FaultyStore
from aifs.lake.local import LocalStore
from aifs.lake.retry import RetryingStore, RetryPolicy
from aifs.meta.store import ROOT_INO, MetaStore
from aifs.metrics import prometheus_text

MiB = 1 << 20
RATE = 0.2
#: the retry cause each kind is counted under (a slow reply is no failure)
CAUSE = {"before": "connection", "after": "connection", "truncated": "truncated",
         "slowdown": "throttled", "slow": None}


def faulty(inner, seed: int, kinds=KINDS, rate: float = RATE):
    faults = FaultyStore(inner, rate, seed, kinds, slow_seconds=0.01)
    return CountingStore(RetryingStore(faults, RetryPolicy(attempts=12, base_delay=0.001,
                                                           max_delay=0.01))), faults


@pytest.fixture
async def base_store(lake, monkeypatch):
    for name, value in lake.env.items():
        monkeypatch.setenv(name, value)
    endpoint = lake.server.endpoint if lake.server else ""
    store = open_store(Config(lake=lake.url, endpoint_url=endpoint)).inner
    yield store
    await store.aclose()


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
async def test_every_lake_operation_rides_out_injected_faults(lake, base_store, kind, seed):
    store, faults = faulty(base_store, seed, (kind,))
    rng = random.Random(seed)
    part = rng.randbytes(5 * MiB)
    try:
        for i in range(6):
            body = rng.randbytes(1000 + i)
            await store.put(f"o/{i}", body, {"mode": "33188"})
            head = await store.head(f"o/{i}")
            assert (head.size, head.metadata.get("mode")) == (len(body), "33188")
            assert await store.get_range(f"o/{i}", 10, 100, if_match=head.etag) == body[10:110]
            copied = await store.copy(f"o/{i}", f"c/{i}", {"mode": "33261"})
            assert (await store.head(f"c/{i}")).etag == copied
            assert (await store.head(f"c/{i}")).metadata.get("mode") == "33261"
            keys = [o.key for page in [p async for p in store.iter_list("o/")]
                    for o in page.objects]
            assert keys == [f"o/{n}" for n in range(i + 1)]
            page = await store.list_page("", "/", None, 1)
            assert page.prefixes == ["c/"] and page.next_token
            await store.delete_many([f"c/{i}", "never/was"])
            with pytest.raises(ObjectNotFound):
                await store.head(f"c/{i}")
            upload = await store.create_multipart(f"m/{i}", {"mode": "33188"})
            placed = i % 2 == 1  # sent with their offsets, as promotion sends them
            parts = [(1, await store.upload_part(f"m/{i}", upload, 1, part,
                                                 0 if placed else None)),
                     (2, await store.upload_part(f"m/{i}", upload, 2, body,
                                                 len(part) if placed else None))]
            info = await store.complete_multipart(f"m/{i}", upload, parts)
            assert info.size == len(part) + len(body)
            assert await store.get_range(f"m/{i}", 5 * MiB - 10, 20) == part[-10:] + body[:10]
            dropped = await store.create_multipart(f"d/{i}")
            assert [u for _, u, _ in await store.list_uploads(f"d/{i}")] == [dropped]
            await store.abort_multipart(f"d/{i}", dropped)
        faults.enabled = False
        assert await store.list_uploads("") == []
        assert lake_uploads(lake) == []
    finally:
        await store.aclose()
    assert faults.faults[kind] >= 10, faults.faults
    retries = store.retries
    if CAUSE[kind]:
        assert retries[CAUSE[kind]] >= faults.faults[kind] // 2, (retries, faults.faults)
    else:
        assert sum(retries.values()) == 0


async def test_retries_are_counted_by_cause_in_the_metrics(tmp_path):
    from aifs.metrics import Metrics
    store, faults = faulty(LocalStore(str(tmp_path / "lake")), 3, ("truncated", "slowdown"),
                           rate=0.5)
    for i in range(40):
        await store.put(f"k{i}", b"x")
    config = Config(lake=f"file://{tmp_path}/lake", cache_size=64 * MiB)
    fs = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", config.cache_size),
                    LocalFiles(tmp_path / "cache"))
    text = prometheus_text(Metrics(fs.figures).snapshot())
    counted = {cause: store.retries[cause] for cause in ("truncated", "throttled")}
    assert all(counted.values()), counted
    for cause, n in counted.items():
        assert f'aifs_lake_retries_total{{cause="{cause}"}} {float(n)}' in text


def _tree(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    tree = {f"small/{i:03d}.txt": rng.randbytes(rng.randrange(0, 3000)) for i in range(60)}
    tree |= {f"ckpt/shard{i}.pt": rng.randbytes(3 * MiB + i) for i in range(3)}
    return tree


async def _write(fs: Filesystem, path: str, data: bytes) -> None:
    parent = ROOT_INO
    *dirs, name = path.split("/")
    for d in dirs:
        found = await fs.lookup(parent, d.encode())
        parent = found.ino if found else (await fs.mkdir(parent, d.encode(), 0o755, 0, 0)).ino
    fh, _ = await fs.create(parent, name.encode(), 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, data)
    fs.release(fh)


async def _read(fs: Filesystem, path: str) -> bytes:
    parent = ROOT_INO
    for name in path.split("/"):
        found = await fs.lookup(parent, name.encode())
        assert found is not None, path
        parent = found.ino
    fh, _ = await fs.open(parent, os.O_RDONLY)
    try:
        return bytes(await fs.read(fh, 0, 8 * MiB))
    finally:
        fs.release(fh)


@pytest.mark.parametrize(("kinds", "seed"), [((kind,), 1) for kind in KINDS]
                         + [(KINDS, seed) for seed in range(1, 6)])
async def test_the_filesystem_rides_out_injected_faults(tmp_path, kinds, seed):
    """Writes, renames and deletes promoted (multipart, packs of small files)
    through 20 % faults of each kind and of all kinds mixed (5 seeds), then
    read on a fresh node through them too: every byte right, no upload left."""
    lake = tmp_path / "lake"
    lake.mkdir()
    config = Config(lake=f"file://{lake}", block_size=MiB, cache_size=256 * MiB,
                    promote_delay=0, multipart_threshold=2 * MiB, part_size=MiB,
                    pack_wait=0.1, metadata_ttl=0)

    def node(name: str):
        store, faults = faulty(LocalStore(str(lake)), seed, kinds)
        return Filesystem(config, store, MetaStore(tmp_path / name / "meta"),
                          BlockCache(tmp_path / name / "cache", config.cache_size),
                          LocalFiles(tmp_path / name / "cache")), faults

    tree = _tree(seed)
    writer, faults = node("a")
    async with trio.open_nursery() as nursery:
        writer.start(nursery)
        for path, data in tree.items():
            await _write(writer, path, data)
        small = (await writer.lookup(ROOT_INO, b"small")).ino
        await writer.rename(small, b"000.txt", small, b"moved.txt", 0)
        tree["small/moved.txt"] = tree.pop("small/000.txt")
        await writer.unlink(small, b"001.txt")
        del tree["small/001.txt"]
        with trio.fail_after(120):
            await writer.sync(ROOT_INO)
        nursery.cancel_scope.cancel()
    writer.meta.env.close()
    assert sum(faults.faults.values()) > 10, faults.faults

    reader, faults = node("b")
    async with trio.open_nursery() as nursery:
        reader.start(nursery)
        for path, data in tree.items():
            assert await _read(reader, path) == data, path
        assert await reader.lookup(small_ino := (await reader.lookup(
            ROOT_INO, b"small")).ino, b"001.txt") is None, small_ino
        nursery.cancel_scope.cancel()
    reader.meta.env.close()
    assert sum(faults.faults.values()) > 5, faults.faults
    assert lake_uploads(Lake("local", f"file://{lake}", {}, [], root=lake)) == []
