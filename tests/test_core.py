"""core.Filesystem driven directly (no mount) over a real local lake."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from aifs.cache.blocks import BlockCache
from aifs.config import Config
from aifs.core import Filesystem
from aifs.errors import FsError
from aifs.lake.local import LocalStore
from aifs.meta.store import ROOT_INO, MetaStore

MiB = 1 << 20


class CountingStore(LocalStore):
    """A real local lake that counts range GETs."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gets: list[tuple[str, int]] = []

    async def get_range(self, key, start, length, if_match=None):
        self.gets.append((key, start))
        await trio.sleep(0.01)  # let concurrent readers pile up
        return await super().get_range(key, start, length, if_match)


@pytest.fixture
async def fs(tmp_path, nursery):
    (tmp_path / "lake" / "d").mkdir(parents=True)
    data = os.urandom(8 * MiB + 3)
    (tmp_path / "lake" / "d" / "big").write_bytes(data)
    (tmp_path / "lake" / "small").write_bytes(b"small")
    config = Config(lake=f"file://{tmp_path}/lake", block_size=MiB, cache_size=64 * MiB,
                    readahead_max=4 * MiB, metadata_ttl=60)
    store = CountingStore(str(tmp_path / "lake"))
    filesystem = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                            BlockCache(tmp_path / "cache", config.cache_size))
    filesystem.start(nursery)
    filesystem.data = data  # type: ignore[attr-defined]
    return filesystem


async def test_lookup_counts_and_forget(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    assert d.is_dir and fs.lookups[d.ino] == 1
    await fs.lookup(ROOT_INO, b"d")
    assert fs.lookups[d.ino] == 2
    fs.forget([(d.ino, 2)])
    assert d.ino not in fs.lookups
    assert await fs.lookup(ROOT_INO, b"missing") is None
    with pytest.raises(FsError) as info:
        await fs.lookup((await fs.lookup(ROOT_INO, b"small")).ino, b"x")
    assert info.value.errno == errno.ENOTDIR


async def test_concurrent_readers_cause_one_get_per_block(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    big = await fs.lookup(d.ino, b"big")
    handles = [fs.open(big.ino, os.O_RDONLY)[0] for _ in range(8)]
    results: dict[int, bytes] = {}

    async def read(fh: int) -> None:
        results[fh] = await fs.read(fh, MiB - 10, 20)
    async with trio.open_nursery() as nursery:
        for fh in handles:
            nursery.start_soon(read, fh)
    assert set(results.values()) == {fs.data[MiB - 10:MiB + 10]}
    assert len(fs.store.gets) == len(set(fs.store.gets))  # never two GETs of one block
    assert {("d/big", 0), ("d/big", MiB)} <= set(fs.store.gets)


async def test_sequential_reads_grow_readahead(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    big = await fs.lookup(d.ino, b"big")
    fh, _ = fs.open(big.ino, os.O_RDONLY)
    out = bytearray()
    for offset in range(0, len(fs.data), 128 * 1024):
        out += await fs.read(fh, offset, 128 * 1024)
    assert bytes(out) == fs.data
    starts = sorted(s for _, s in fs.store.gets)
    assert starts == [i * MiB for i in range(9)]  # every block exactly once
    assert fs.files[fh].readahead.window == 4 * MiB  # grew to the maximum


async def test_write_flags_are_refused(fs):
    small = await fs.lookup(ROOT_INO, b"small")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(FsError) as info:
            fs.open(small.ino, flags)
        assert info.value.errno == errno.EROFS


async def test_keep_cache_only_for_unchanged_objects(fs, tmp_path):
    small = await fs.lookup(ROOT_INO, b"small")
    fh1, keep1 = fs.open(small.ino, os.O_RDONLY)
    fh2, keep2 = fs.open(small.ino, os.O_RDONLY)
    assert (keep1, keep2) == (False, True)
    (tmp_path / "lake" / "small").write_bytes(b"changed")
    fs.clock = lambda: 1e12  # the TTL has passed
    fresh = await fs.getattr(small.ino)
    assert fresh.size == 7
    fh3, keep3 = fs.open(small.ino, os.O_RDONLY)
    assert keep3 is False
    assert await fs.read(fh3, 0, 100) == b"changed"
