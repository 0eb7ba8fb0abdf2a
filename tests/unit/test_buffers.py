"""Reused receive buffers (aifs.buffers): a buffer is handed out again only
once no view of it is left, and the cache writes a body from it as it is."""

from __future__ import annotations

import os

from aifs import buffers
from aifs.cache.direct import DirectWriter

MiB = 1 << 20


def test_a_buffer_is_not_handed_out_while_a_view_of_it_lives() -> None:
    body = buffers.take(3 * MiB)
    body[:5] = b"first"
    part = body[MiB:2 * MiB]  # a reader's slice outlives the body's own view
    del body
    other = buffers.take(3 * MiB)
    other[:5] = b"other"
    assert part.obj is not other.obj
    assert bytes(memoryview(part.obj)[:5]) == b"first"
    mapping = part.obj
    del part, mapping
    again = buffers.take(3 * MiB)  # the first is free now: taken again, not a new one
    assert bytes(again[:5]) == b"first"


def test_only_a_whole_body_is_written_from_its_buffer(tmp_path) -> None:
    body = buffers.take(MiB + 100)
    data = os.urandom(MiB + 100)
    body[:] = data
    assert buffers.aligned(body[:MiB]) is None  # a slice: its "padding" is the body
    assert buffers.aligned(body[4096:]) is None
    assert buffers.aligned(memoryview(bytearray(data))) is None
    whole = buffers.aligned(body)
    assert whole is not None and len(whole) % 4096 == 0
    assert bytes(whole[:len(data)]) == data and not any(whole[len(data):])
    DirectWriter().write_file(tmp_path / "block", body)
    assert (tmp_path / "block").read_bytes() == data


def test_the_pool_keeps_no_more_than_the_memory_cache_needs() -> None:
    """A node given a small memory cache keeps few idle mappings: past the
    limit a body gets a mapping of its own, freed with it, and idle ones
    past a lowered limit are unmapped."""
    try:
        buffers.limit(512 * MiB)
        bodies = [buffers.take(8 * MiB) for _ in range(8)]  # 64 MiB, all pooled
        assert all(buffers.aligned(b) is not None for b in bodies)
        del bodies
        assert buffers._pooled >= 64 * MiB
        buffers.limit(0)  # the headroom only
        assert buffers._pooled <= buffers.POOL_HEADROOM
        held = [buffers.take(8 * MiB) for _ in range(buffers.POOL_HEADROOM // (8 * MiB) + 2)]
        assert buffers._pooled <= buffers.POOL_HEADROOM
        assert any(buffers.aligned(b) is None for b in held)  # (not pooled: not reused)
        del held
    finally:
        buffers.limit(256 * MiB)
