"""Promotion yields to a busy mount (aifs.flush.pacing), on trio's virtual clock:
the reads a promotion asks for are held to the busy rate while the binding
serves many requests, go at full speed otherwise, and are never held while
someone waits on promotion."""

from __future__ import annotations

import pytest
import trio

from aifs.flush.pacing import HOLD, RAMP, TICK, Pacer

MiB = 1 << 20
RATE = 32 * MiB


def _serving(per_second: float) -> int:
    """A binding's request count that grows at ``per_second`` on trio's clock."""
    return int(trio.current_time() * per_second)


async def _read(pacer: Pacer, parts: int, size: int = 8 * MiB) -> float:
    """Seconds (virtual) it takes to be allowed ``parts`` reads of ``size``."""
    start = trio.current_time()
    for _ in range(parts):
        await pacer.take(size)
    return trio.current_time() - start


async def test_a_busy_mount_holds_promotion_to_the_busy_rate(autojump_clock):
    pacer = Pacer(RATE)
    pacer.requests = lambda: _serving(3000)  # a DataLoader's opens
    took = await _read(pacer, 16)  # 128 MiB
    assert took >= 128 * MiB / RATE - TICK
    assert took <= 128 * MiB / RATE + 3 * TICK


async def test_several_readers_share_the_busy_rate(autojump_clock):
    pacer = Pacer(RATE)
    pacer.requests = lambda: _serving(3000)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(8):  # parts in flight
            nursery.start_soon(_read, pacer, 2)
    assert trio.current_time() - start >= 128 * MiB / RATE - TICK


async def test_an_idle_mount_lets_promotion_reach_full_speed_at_once(autojump_clock):
    pacer = Pacer(RATE)
    pacer.requests = lambda: 5  # nothing served
    took = await _read(pacer, 128)  # 1 GiB
    # only the ramp's first ticks are paced: not the 32 s of the busy rate
    assert took <= (RAMP + 2) * TICK


async def test_promotion_speeds_up_once_the_mount_turns_idle(autojump_clock):
    pacer = Pacer(RATE)
    busy_until = 2.0
    pacer.requests = lambda: _serving(3000) if trio.current_time() < busy_until \
        else int(busy_until * 3000)
    took = await _read(pacer, 128)  # 1 GiB
    assert took <= busy_until + HOLD + (RAMP + 2) * TICK + 0.5


async def test_a_sync_is_never_paced(autojump_clock):
    pacer = Pacer(RATE)
    pacer.requests = lambda: _serving(3000)
    with pacer.urgent():
        assert await _read(pacer, 128) == 0


async def test_writers_waiting_for_cache_space_are_not_held_up(autojump_clock):
    pacer = Pacer(RATE)
    pacer.requests = lambda: _serving(3000)
    await _read(pacer, 2)  # busy: measured, paced
    pacer.hurry()
    assert await _read(pacer, 16) == 0


@pytest.mark.parametrize("rate, source", [(0, True), (RATE, False)])
async def test_no_pacing_when_off_or_without_a_binding(autojump_clock, rate, source):
    pacer = Pacer(rate)
    if source:
        pacer.requests = lambda: _serving(3000)
    assert await _read(pacer, 128) == 0


async def test_processes_reading_or_writing_direct_make_the_mount_busy(autojump_clock,
                                                                       monkeypatch):
    # Passthrough I/O reaches no daemon: the storage I/O of the processes that
    # hold files open direct counts instead, while they hold them.
    from aifs.flush import pacing
    moved = {4242: 0}
    monkeypatch.setattr(pacing, "_storage_io",
                        lambda pid: moved.get(pid, 0) + int(trio.current_time() * 200 * MiB))
    pacer = Pacer(RATE)
    pacer.requests = lambda: 5  # the daemon serves nothing
    pacer.io.watch(7, 4242)  # a writer of 200 MiB/s holds handle 7
    took = await _read(pacer, 16)
    assert took >= 128 * MiB / RATE - TICK
    pacer.io.unwatch(7)
    assert await _read(pacer, 128) <= HOLD + (RAMP + 2) * TICK


def test_storage_io_of_a_process_is_what_it_wrote(tmp_path):
    import os

    from aifs.flush.pacing import ProcessIo
    io = ProcessIo()
    io.watch(1, os.getpid())
    before = io.moved()
    with open(tmp_path / "f", "wb") as fp:  # counted as the pages are dirtied
        fp.write(os.urandom(4 * MiB))
    assert io.moved() - before >= 4 * MiB
    io.unwatch(1)  # (counted until the next look, then forgotten)
    after = io.moved()
    with open(tmp_path / "g", "wb") as fp:
        fp.write(os.urandom(4 * MiB))
    assert io.moved() == after
