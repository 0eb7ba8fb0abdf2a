"""Cache files written past the page cache (O_DIRECT), and the fallback for
filesystems that refuse it."""

from __future__ import annotations

import os
import subprocess

import pytest
from test_read_ahead import resident_pages

from aifs.cache.blocks import BlockCache, ObjectVersion
from aifs.cache.direct import DirectWriter

MiB = 1 << 20
SIZES = [1, 511, 4095, 4096, 4097, 8 * MiB - 1, 8 * MiB]


@pytest.mark.parametrize("size", SIZES)
def test_written_bytes_and_size_are_exact(tmp_path, size):
    data = os.urandom(size)
    writer = DirectWriter()
    writer.write_file(tmp_path / "block", data)
    assert (tmp_path / "block").read_bytes() == data
    assert os.stat(tmp_path / "block").st_size == size


def test_views_and_reused_buffers_keep_each_files_bytes(tmp_path):
    """A buffer is reused: a shorter file after a longer one must not carry
    the longer one's tail; a memoryview is written like bytes."""
    writer = DirectWriter()
    long, short = os.urandom(3 * MiB), os.urandom(5000)
    writer.write_file(tmp_path / "long", long)
    writer.write_file(tmp_path / "short", short)
    writer.write_file(tmp_path / "view", memoryview(long)[100:100 + 2 * MiB])
    assert (tmp_path / "long").read_bytes() == long
    assert (tmp_path / "short").read_bytes() == short
    assert (tmp_path / "view").read_bytes() == long[100:100 + 2 * MiB]


def test_blocks_are_not_left_in_the_page_cache(tmp_path):
    """The point of it: a cached block is in memory already; the block file
    must not take page-cache pages as well."""
    writer = DirectWriter()
    data = os.urandom(8 * MiB)
    writer.write_file(tmp_path / "block", data)
    if not writer.enabled:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    fd = os.open(tmp_path / "block", os.O_RDWR)
    try:
        assert resident_pages(fd, len(data)) == 0
    finally:
        os.close(fd)


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs (it refuses O_DIRECT; tmpfs takes it since Linux 6.6), unmounted
    after the test."""
    where = tmp_path / "ramfs"
    where.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_filesystem_without_o_direct_gets_ordinary_writes(ramfs):
    writer = DirectWriter()
    data = os.urandom(MiB + 3)
    writer.write_file(ramfs / "first", data)
    writer.write_file(ramfs / "second", data[:10])
    assert not writer.enabled
    assert (ramfs / "first").read_bytes() == data
    assert (ramfs / "second").read_bytes() == data[:10]
    assert sorted(os.listdir(ramfs)) == ["first", "second"]


def test_block_cache_on_ramfs_stores_and_finds_blocks(ramfs):
    cache = BlockCache(ramfs, 16 * MiB)
    version = ObjectVersion("k", "etag", 3 * MiB)
    data = os.urandom(MiB + 1)
    assert cache.store(version, 2, data)
    found = cache.locate(version, 2)
    assert found is not None
    with open(found.path, "rb") as f:
        f.seek(found.offset)
        assert f.read(found.size) == data
    small = ObjectVersion("small", "etag", 5000)  # into a segment file, written plainly
    assert cache.store(small, 0, data[:5000])
    found = cache.locate(small, 0)
    assert found is not None and found.checksum is not None
    with open(found.path, "rb") as f:
        f.seek(found.offset)
        assert f.read(found.size) == data[:5000]
    assert cache.evict(16 * MiB) == MiB + 1 + 5000  # no hole punching there: still freed
    cache.close()
