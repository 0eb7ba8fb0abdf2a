"""Small cached blocks in shared segment files: what a restart finds, what
eviction frees, and that a damaged block is a miss (through a mount, a
damaged block fetched again, never served: tests/mount/test_read_mount.py)."""

from __future__ import annotations

import os
from pathlib import Path

from aifs.cache.blocks import DATASET_CLASS, PINNED, REGULAR, BlockCache, ObjectVersion
from aifs.cache.segments import SMALL, Location

KiB, MiB = 1 << 10, 1 << 20


def read(where: Location) -> bytes:
    with open(where.path, "rb") as f:
        f.seek(where.offset)
        return f.read(where.size)


def files_under(path: Path) -> list[str]:
    return sorted(os.path.join(top, name) for top, _, names in os.walk(path) for name in names)


def test_small_blocks_share_segment_files_and_survive_a_restart(tmp_path):
    cache = BlockCache(tmp_path, 64 * MiB)
    versions = [ObjectVersion(f"k{i}", "etag", 16 * KiB, policy="dataset" if i % 3 == 0
                              else "default", pinned=i == 7) for i in range(100)]
    blobs = {v.key: os.urandom(16 * KiB - v.key.__len__()) for v in versions}
    for v in versions:
        assert cache.store(v, 0, blobs[v.key])
    big = ObjectVersion("big", "etag", 2 * SMALL)
    big_data = os.urandom(SMALL + 1)
    assert cache.store(big, 0, big_data)
    # one file of its own for the large block, none for the 100 small ones
    assert len(files_under(tmp_path / "blocks")) == 1
    assert [n for n in os.listdir(tmp_path / "segments") if n.endswith(".seg")] == ["1.seg"]
    classes = dict(cache.by_class)
    cache.close()

    again = BlockCache(tmp_path, 64 * MiB)
    for v in versions:
        where = again.locate(v, 0)
        assert where is not None and read(where) == blobs[v.key]
    assert read(again.locate(big, 0)) == big_data
    assert dict(again.by_class) == classes
    assert again.by_class[PINNED] == len(blobs["k7"])
    assert again.by_class[DATASET_CLASS] == sum(len(blobs[f"k{i}"]) for i in range(0, 100, 3))
    assert again.used == sum(map(len, blobs.values())) + len(big_data)
    again.close()


def test_evicted_blocks_stay_gone_and_an_empty_segment_is_deleted(tmp_path):
    cache = BlockCache(tmp_path, 1 * MiB)
    cache.segments.segment_size = 256 * KiB  # several segments
    versions = [ObjectVersion(f"k{i}", "etag", 16 * KiB) for i in range(200)]
    data = os.urandom(16 * KiB)
    for v in versions:
        assert cache.store(v, 0, data)
    assert cache.used <= 1 * MiB
    kept = {v.key for v in versions if cache.locate(v, 0) is not None}
    assert 0 < len(kept) < len(versions)  # the oldest were evicted
    segments = [n for n in os.listdir(tmp_path / "segments") if n.endswith(".seg")]
    assert len(segments) <= 6  # segments whose blocks all went are deleted
    # evicted ranges give their disk space back
    allocated = sum(os.stat(tmp_path / "segments" / n).st_blocks * 512 for n in segments)
    assert allocated <= 1 * MiB + 256 * KiB
    cache.close()

    again = BlockCache(tmp_path, 1 * MiB)
    assert {v.key for v in versions if again.locate(v, 0) is not None} == kept
    assert again.used == len(kept) * len(data)
    assert again.evict(10 * MiB) == len(kept) * len(data)
    again.close()
    third = BlockCache(tmp_path, 1 * MiB)
    assert third.used == 0 and not any(third.locate(v, 0) for v in versions)
    assert [n for n in os.listdir(tmp_path / "segments") if n.endswith(".seg")] == []
    third.close()


def test_a_torn_index_line_loses_that_block_only(tmp_path):
    """A power loss may cut the last line of a segment's index anywhere: the
    cache opens with the blocks whose lines are whole."""
    cache = BlockCache(tmp_path, 64 * MiB)
    kept = ObjectVersion("kept", "etag", 10 * KiB)
    data = os.urandom(10 * KiB)
    assert cache.store(kept, 0, data)
    cache.close()
    index = tmp_path / "segments" / "1.idx"
    whole = index.read_bytes()
    for torn in (b"+ 0123 0 8192 4096 9f3\xff\xfe default regu", b"+ 0123 0 81", b"+ 0123 0",
                 b"c 0123", b"- 0123 x", b"+ 0123 0 8192 4096 zz default regular",
                 b"- kept 0"):
        index.write_bytes(whole + torn)
        again = BlockCache(tmp_path, 64 * MiB)
        assert read(again.locate(kept, 0)) == data
        assert again.used == len(data)
        assert index.read_bytes() == whole  # cut back: the next line starts a line
        again.close()


def test_a_segment_left_without_its_index_is_removed_and_its_number_not_reused(tmp_path):
    """A crash between making a segment and its index, or a disk that refused
    the index: the segment is dropped at the next start and new blocks go to
    a segment of a new number (not one a reader may still hold open)."""
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "7.seg").write_bytes(b"x" * 4096)
    cache = BlockCache(tmp_path, 64 * MiB)
    version = ObjectVersion("k", "etag", 5 * KiB)
    data = os.urandom(5 * KiB)
    assert cache.store(version, 0, data)
    assert read(cache.locate(version, 0)) == data
    assert sorted(os.listdir(tmp_path / "segments")) == ["8.idx", "8.seg"]
    cache.close()


def test_a_pin_of_segment_blocks_survives_a_restart(tmp_path):
    cache = BlockCache(tmp_path, 64 * MiB)
    version = ObjectVersion("weights", "etag", 40 * KiB)
    assert cache.store(version, 0, os.urandom(40 * KiB))
    cache.reclass(ObjectVersion("weights", "etag", 40 * KiB, pinned=True))
    assert cache.by_class[PINNED] == 40 * KiB
    cache.close()
    again = BlockCache(tmp_path, 64 * MiB)
    assert again.by_class[PINNED] == 40 * KiB
    again.reclass(version)  # unpinned
    again.close()
    third = BlockCache(tmp_path, 64 * MiB)
    assert third.by_class[PINNED] == 0 and third.by_class[REGULAR] == 40 * KiB
    third.close()
