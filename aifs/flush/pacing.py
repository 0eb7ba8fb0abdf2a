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
after (a DataLoader's opens between its batches). Reads and writes in
passthrough reach no daemon: so the processes that hold files open direct
are watched too (:class:`ProcessIo`), and the mount is busy while they move
at least :data:`BUSY_IO` bytes per second to or from storage (a 1 GiB
checkpoint written direct while the last one is promoted: in aifs bench the
write ran at 0.84-0.87x local unpaced). A process that holds a file it does
not use (a mapped weights file) does not slow promotion.

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
from collections import Counter
from collections.abc import Callable, Iterator

import trio

TICK = 0.1  # seconds over which the request rate is measured
BUSY_RATE = 200.0  # requests per second that make the mount busy
HOLD = 1.0  # seconds it stays busy after the rate fell below BUSY_RATE
HURRY = 2.0  # seconds a hurry() (cache full) turns pacing off
RAMP = 6  # ticks from ``rate`` to full speed (rate doubles each tick; 64x: unpaced)
BUSY_IO = 16 << 20  # bytes per second of direct holders' storage I/O that make it busy


class ProcessIo:
    """The storage I/O of the processes that hold files open direct: bytes
    they had read from or written to storage since they were first seen
    holding one (``read_bytes`` and ``write_bytes`` of ``/proc/PID/io``,
    summed over the process's threads: the FUSE header names the thread that
    opened). Opens and closes only count holders; ``/proc`` is read by
    :meth:`moved`, at most once a tick and only while promotion is paced
    (reading it at each open and close cost 100 us a file: half the time of
    a cached open + read)."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # direct handle -> pid of its opener
        self._handles: Counter[int] = Counter()  # pid -> direct handles it holds
        self._last: dict[int, int] = {}  # pid -> its I/O when last read
        self._moved = 0

    def watch(self, fh: int, pid: int) -> None:
        self._holders[fh] = pid
        self._handles[pid] += 1

    def unwatch(self, fh: int) -> None:
        pid = self._holders.pop(fh, None)
        if pid is not None:
            self._handles[pid] -= 1
            if self._handles[pid] <= 0 and pid not in self._last:
                del self._handles[pid]  # never looked at: nothing to count
            # (else its last bytes are counted by the next moved(), then it goes)

    def moved(self) -> int:
        """Bytes moved by the watched processes (monotonic). A process seen
        for the first time counts from now; one that closed its last direct
        handle since the last call counts until now, then is forgotten."""
        for pid, last in list(self._last.items()):
            now = _storage_io(pid)
            if now > last:
                self._moved += now - last
                self._last[pid] = now
            if self._handles[pid] <= 0:
                del self._last[pid], self._handles[pid]
        for pid, held in list(self._handles.items()):
            if held <= 0:
                del self._handles[pid]  # (held a moment between two calls: not counted)
            elif pid not in self._last:
                self._last[pid] = _storage_io(pid)
        return self._moved


def _storage_io(pid: int) -> int:
    """read_bytes + write_bytes of a process (0: gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as fp:
            fields = dict(line.split(b": ") for line in fp.read().splitlines())
        return int(fields[b"read_bytes"]) + int(fields[b"write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0


class Pacer:
    def __init__(self, rate: int) -> None:
        self.rate = rate  # bytes per second while busy; 0: never paced
        self.requests: Callable[[], int] | None = None  # the binding's count, if any
        self.io = ProcessIo()  # (passthrough's holders: the kernel binding's)
        self._sample = (-float("inf"), 0, 0)  # (when, requests, io) rates are measured from
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
        when, count, io = self._sample
        if now - when < TICK:
            return now < self._busy_until
        current, moved = self.requests(), self.io.moved()
        self._sample = (now, current, moved)
        if now - when < 2 * TICK and ((current - count) / (now - when) >= BUSY_RATE
                                      or (moved - io) / (now - when) >= BUSY_IO):
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
