"""Promotion yields to the applications using the mount.

A checkpoint closed while training goes on is promoted while the job's
DataLoader reads its dataset from the same local disk. At full speed the
promotion's reads of the local copy (and, on a local-directory lake, its
writes) fill the disk's queue, and each small-file read waits behind them: on
the 2-core test machine an epoch over 2,000 cached files took 2.0 s instead
of 0.5 s while a 1 GiB checkpoint went to the lake (docs/benchmarks.md,
sixteenth stop). So while the mount is busy, promotion reads its local
copies at most ``promote_busy_rate`` bytes per second, and at full speed
otherwise.

*Busy* is what the FUSE binding serves: at least :data:`BUSY_RATE`
requests per second over the last :data:`TICK`, and for :data:`HOLD` seconds
after (a DataLoader's opens between its batches). Reads in passthrough reach
no daemon, so a lone reader of one large file does not slow promotion.

Parts streamed while a file is still written are not paced: the writer is
the application, and streaming exists to finish the upload soon after close.
Nothing waits on a paced upload: a sync (``aifs sync``, fsync with
``fsync = lake``, unmount, SIGTERM) and writers waiting for cache space
(:meth:`hurry`) turn pacing off while they wait.

The limiter meters the bytes read against the clock; hand-written because it
is ten lines and must sleep on trio's clock (no library here does both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import trio

TICK = 0.1  # seconds over which the request rate is measured
BUSY_RATE = 200.0  # requests per second that make the mount busy
HOLD = 1.0  # seconds it stays busy after the rate fell below BUSY_RATE
HURRY = 2.0  # seconds a hurry() (cache full) turns pacing off
RAMP = 6  # ticks from ``rate`` to full speed (rate doubles each tick; 64x: unpaced)


class Pacer:
    def __init__(self, rate: int) -> None:
        self.rate = rate  # bytes per second while busy; 0: never paced
        self.requests: Callable[[], int] | None = None  # the binding's count, if any
        self._sample = (-float("inf"), 0)  # (when, count) the rate is measured from
        self._busy_until = -float("inf")
        self._urgent = 0  # syncs waiting
        self._hurry_until = -float("inf")
        self._free_at = 0.0  # when the bytes read so far are paid for
        self._calm_since = 0.0  # the ramp to full speed started then
        self._last_take = -float("inf")

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """While this is held, nothing is paced (someone waits on promotion)."""
        self._urgent += 1
        try:
            yield
        finally:
            self._urgent -= 1

    def hurry(self) -> None:
        """Writers wait for cache space: full speed for a while."""
        self._hurry_until = trio.current_time() + HURRY

    def _exempt(self) -> bool:
        return not self.rate or self.requests is None or bool(self._urgent) \
            or trio.current_time() < self._hurry_until

    def _busy(self) -> bool | None:
        """Whether the mount is busy; None when the last measure is too old
        to tell (a new one starts now)."""
        assert self.requests is not None
        now = trio.current_time()
        when, count = self._sample
        if now - when < TICK:
            return now < self._busy_until
        current = self.requests()
        self._sample = (now, current)
        if now - when < 2 * TICK and (current - count) / (now - when) >= BUSY_RATE:
            self._busy_until = now + HOLD
        if now < self._busy_until:
            return True
        return None if now - when >= 2 * TICK else False

    async def take(self, size: int) -> None:
        """Before promotion reads ``size`` bytes of a local copy: wait until
        its share of the allowed rate is due (a read waits for its own bytes
        first, so one large read is held back too). The allowed rate is
        ``rate`` while the mount is busy; when it is idle, and when promotion
        starts after a pause, it doubles every tick up to full speed
        (:data:`RAMP` ticks), so a reader that starts just after promotion
        did (a DataLoader's workers starting) finds no burst of reads queued."""
        due: float | None = None  # when this read may go, once it took its turn
        while not self._exempt():
            busy = self._busy()
            if busy is None:
                await trio.sleep(TICK)  # measure over one tick first
                continue
            now = trio.current_time()
            if busy or now - self._last_take > HOLD:
                self._calm_since = now  # (re)start the ramp
            self._last_take = now
            ticks = (now - self._calm_since) / TICK
            if ticks >= RAMP:
                self._free_at = now
                return
            if due is None:  # its turn: after the reads before it, a tick of credit at most
                due = max(self._free_at, now - TICK) + size / (self.rate * 2 ** ticks)
                self._free_at = due
            if due <= now + 1e-6:  # (a sleep shorter than this may not move the clock)
                return
            await trio.sleep(min(TICK, due - now))
