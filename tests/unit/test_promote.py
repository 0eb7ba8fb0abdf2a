"""Multipart planning: any object S3 allows fits in 10,000 parts."""

from __future__ import annotations

import pytest

from aifs.errors import LakeError
from aifs.flush.promoter import MAX_PARTS, MIN_PART, plan_parts

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize("size", [0, 1, 8 * MiB - 1, 8 * MiB, 8 * MiB + 1, 300 * MiB + 7,
                                  8000 * MiB, 100 * GiB, 5 * 1024 * GiB])
def test_parts_cover_the_object_within_s3_limits(size):
    parts = plan_parts(size, 8 * MiB)
    assert len(parts) <= MAX_PARTS
    assert [number for number, _, _ in parts] == list(range(1, len(parts) + 1))
    offset = 0
    for i, (_, start, length) in enumerate(parts):
        assert start == offset
        assert length <= 5 * GiB
        if i < len(parts) - 1:
            assert length >= MIN_PART
        offset += length
    assert offset == size


def test_parts_grow_only_after_a_thousand():
    parts = plan_parts(20_000 * MiB, 8 * MiB)
    assert {length for _, _, length in parts[:1000]} == {8 * MiB}
    assert parts[1000][2] == 16 * MiB


def test_parts_never_exceed_5_gib():
    parts = plan_parts(5 * 1024 * GiB, 3 * GiB)  # would double to 6 GiB without the cap
    assert max(length for _, _, length in parts) == 5 * GiB and len(parts) <= MAX_PARTS


def test_too_big_is_refused():
    with pytest.raises(LakeError):
        plan_parts(1 << 60, 5 * MiB)


def test_a_front_to_back_writer_may_land_a_little_out_of_order():
    """One write() may reach the daemon as several requests served out of
    order: a write past a gap within AHEAD waits for the gap; a gap left
    open, or one too far, is no front-to-back writer's."""
    from aifs.flush.stream import AHEAD, Front

    front = Front()
    assert front.wrote(0, 100)
    assert front.wrote(200, 100) and front.end == 100 and front.ahead
    assert front.wrote(100, 100) and front.end == 300 and not front.ahead
    assert front.wrote(150, 10) and front.end == 300  # a rewrite below the front
    assert not front.wrote(300 + AHEAD + 1, 1)  # a hole: sparse, not front to back
