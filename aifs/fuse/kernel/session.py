"""A FUSE session on ``/dev/fuse``, served under trio without libfuse.

One worker at a time is the *reader*: it reads a request (a read returns one
whole request) and answers it at once, without a trip through trio's
scheduler, as long as the answer needs nothing to wait on (most requests:
LMDB and local files only). When a handler has to wait (the lake, a lock),
the reader hands the role to an idle worker, or starts one, up to
:data:`MAX_WORKERS`, and finishes that request as an ordinary trio task; so a
slow request never holds up the others, and a quiet mount costs one task.
Each worker reads into a buffer of its own, which the request's handler may
use until it replies (a WRITE's bytes reach the local copy without a copy of
their own). Measured why (``docs/kernel-binding.md``): a ``trio.Lock`` taken
per request and a scheduler pass per answer cost more than most handlers.

INIT is answered here: what the kernel offers and aifs wants. FORGET and
BATCH_FORGET are answered inline (no reply). INTERRUPT comes for any signal
that reaches a program waiting on a request; a local filesystem never fails
a ``stat`` or a ``read`` with EINTR, so aifs answers EINTR only where the
signal is one that stops the program (SIGINT, SIGTERM, SIGHUP, SIGQUIT,
SIGKILL; not blocked or ignored) and only for requests that change nothing
and are not READs (a READ may serve an mmap fault, which EINTR would turn
into SIGBUS): Ctrl-C or ``kill`` of a program whose ``stat`` waits on a lake
that does not answer ends it at once (even SIGKILL waits for a request the
daemon has read). The handler is left to finish (a fetch others may share)
and its late answer is dropped, a LOOKUP's count given back. Any other
request ends by itself, as on a local disk.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import trio

from aifs.fuse.errors import errno_for
from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel.operations import Handler, Operations, Reply, Request, reply_parts
from aifs.fuse.kernel.passthrough import Passthrough

log = logging.getLogger(__name__)

MAX_WORKERS = 64
MAX_WRITE = 1 << 20  # with MAX_PAGES 256: 1 MiB reads and writes
BUFFER = MAX_WRITE + 4096  # header and a WRITE's fields, ahead of its bytes
MAX_READAHEAD = 1 << 20
MAX_PARTS = 64  # pieces of a reply written as they are; more are joined first
FAIR_TURNS = 16  # requests a reader answers in a row before it lets other tasks run
STOP_GRACE = 10.0  # seconds requests being answered may take once the session stops
#: requests answered EINTR when a signal that stops the program interrupts
#: them: they change nothing (a LOOKUP's count is given back when its late
#: answer is dropped); not READ (an mmap fault would get SIGBUS)
INTERRUPTIBLE = frozenset({p.LOOKUP, p.GETATTR, p.READLINK, p.STATFS, p.GETXATTR,
                           p.LISTXATTR, p.ACCESS, p.READDIR})
INTERRUPTED = -1  # (Session.pending) answered EINTR
#: signals that stop a program (bit n-1 for signal n, as /proc shows them)
STOPPING = sum(1 << (sig - 1) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                          signal.SIGQUIT, signal.SIGKILL))


class Session:
    def __init__(self, fd: int, ops: Operations, forget: Callable[[list[tuple[int, int]]], None],
                 passthrough: Passthrough, max_background: int = 12,
                 want_passthrough: bool = False, poll: float = 0.0) -> None:
        self.fd = fd
        self.ops = ops
        self.forget = forget
        self.passthrough = passthrough
        self.max_background = max_background
        self.want_passthrough = want_passthrough
        self.poll = poll
        self._close_together = True  # the last request came within `poll` of the one before
        # requests waiting on something (the lake, the disk): while there are,
        # the reader does not poll (its CPU is better spent on what they wait for)
        self.waiting = 0
        self.workers = 0
        self.reading = False  # a worker holds the reader role
        self.idle = trio.lowlevel.ParkingLot()  # workers waiting for the role
        self.done = trio.Event()
        self.counts: collections.Counter[int] = collections.Counter()  # requests by opcode
        self.waited: collections.Counter[int] = collections.Counter()  # those that had to wait
        #: unique -> caller's pid of the INTERRUPTIBLE requests being served;
        #: INTERRUPTED once answered EINTR (their own answer is then dropped)
        self.pending: dict[int, int] = {}
        self._workers: trio.Nursery | None = None
        os.set_blocking(fd, False)

    async def run(self) -> None:
        """Serve until the kernel ends the session (unmount) or :meth:`terminate`."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_done, nursery)
            async with trio.open_nursery() as workers:
                self._workers = workers
                self._spawn()
            nursery.cancel_scope.cancel()  # every worker is done: no grace to wait out

    def served(self) -> int:
        return self.counts.total()

    def summary(self) -> str:
        """The requests served, by kind, most first (and how many had to wait)."""
        served = ", ".join(f"{p.NAMES.get(op, op)} {n}"
                           + (f" ({self.waited[op]} waited)" if self.waited[op] else "")
                           for op, n in self.counts.most_common())
        return served

    def terminate(self) -> None:
        self.done.set()

    async def _stop_when_done(self, nursery: trio.Nursery) -> None:
        """Read no more requests; let those being answered finish (a create
        cut in half would leave half a file), for a while."""
        await self.done.wait()
        trio.lowlevel.notify_closing(self.fd)  # wakes the reader waiting on it
        await trio.sleep(STOP_GRACE)
        nursery.cancel_scope.cancel()

    def _spawn(self) -> None:
        assert self._workers is not None
        self.workers += 1
        self._workers.start_soon(self._worker)

    def _hand_over(self) -> None:
        """The reader's request has to wait: another worker reads meanwhile."""
        self.reading = False
        self.waiting += 1
        if self.idle:
            self.idle.unpark()
        elif self.workers < MAX_WORKERS:
            self._spawn()

    async def _worker(self) -> None:
        buf = bytearray(BUFFER)
        view = memoryview(buf)
        turns = 0
        while not self.done.is_set():
            if self.reading:  # another worker reads: wait for the role
                await self.idle.park()
                continue
            self.reading = True
            while True:  # the reader, until a request has to wait
                n = await self._read(buf)
                if n is None:  # unmounted, or stopped: the loop above ends
                    self.reading = False
                    self.done.set()
                    break
                watched = _Watched(self._serve(view[:n]), self._hand_over)
                try:
                    await watched
                finally:  # (cancelled at shutdown too: the count stays right)
                    if watched.waited:
                        self.waiting -= 1
                if watched.waited:
                    self.waited[p.IN_HEADER.unpack_from(view)[1]] += 1  # its opcode
                    break  # answered as a task of its own; the role went on
                turns += 1
                if turns >= FAIR_TURNS:  # a flood of requests: let the rest of aifs run
                    turns = 0
                    await trio.lowlevel.checkpoint()
        self.idle.unpark_all()

    def _poll(self, buf: bytearray, since: float) -> int | None:
        """Read the next request if it comes within ``poll`` of ``since``.

        Where a program sends request after request (opens of small files, a
        walk), the next one comes tens of microseconds after the answer; a
        daemon asleep in epoll must first be woken, and on a virtual machine
        waking an idle CPU costs more than that (``docs/kernel-binding.md``:
        a request/answer round trip of ~58 us against ~19 us with one side
        polling). So the reader polls for a while, and only while requests
        keep coming that close together: a sparse stream costs one missed poll,
        then sleeps as before."""
        deadline = since + self.poll
        while time.perf_counter() < deadline:
            try:
                return os.readv(self.fd, [buf])
            except BlockingIOError:
                continue
            except OSError:
                return None  # read again the ordinary way, which reports it
        self._close_together = False
        return None

    async def _read(self, buf: bytearray) -> int | None:
        since = time.perf_counter()
        while not self.done.is_set():
            try:
                n = os.readv(self.fd, [buf])
                if self.poll:
                    self._close_together = time.perf_counter() - since < self.poll
                return n
            except BlockingIOError:
                if self.poll and self._close_together and not self.waiting:
                    polled = self._poll(buf, since)
                    if polled is not None:
                        return polled
                    if self.done.is_set():  # stopped while it polled
                        break
                try:
                    await trio.lowlevel.wait_readable(self.fd)
                except trio.ClosedResourceError:  # the session stops
                    continue
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the request was interrupted: next
                    continue
                if exc.errno != errno.ENODEV:  # ENODEV: unmounted
                    log.error("reading /dev/fuse: %s", exc)
                return None
        return None

    async def _serve(self, data: memoryview) -> None:
        (length, opcode, unique, nodeid, uid, gid, pid, extlen,
         _) = p.IN_HEADER.unpack_from(data)
        self.counts[opcode] += 1
        body = data[p.IN_HEADER.size:length - extlen * 8]
        if opcode == p.FORGET:
            self._forget([(nodeid, p.FORGET_IN.unpack_from(body)[0])])
            return
        if opcode == p.BATCH_FORGET:
            (count, _) = p.BATCH_FORGET_IN.unpack_from(body)
            self._forget([p.FORGET_ONE.unpack_from(body, p.BATCH_FORGET_IN.size + 16 * i)
                          for i in range(count)])
            return
        if opcode == p.INTERRUPT:
            (which,) = p.INTERRUPT_IN.unpack_from(body)
            caller = self.pending.get(which, INTERRUPTED)
            if caller != INTERRUPTED and _stopping(caller):
                self.pending[which] = INTERRUPTED
                self._reply(which, errno.EINTR, b"")
            return
        if opcode == p.INIT:
            self._reply(unique, 0, self._init(body))
            return
        if opcode == p.DESTROY:
            self._reply(unique, 0, b"")
            self.done.set()
            return
        handler = self.ops.handlers.get(opcode)
        if handler is None:
            self._reply(unique, self.ops.answered.get(opcode, errno.ENOSYS), b"")
            return
        await self._handle(handler, opcode, unique, nodeid, uid, gid, pid, body)

    async def _handle(self, handler: Handler, opcode: int, unique: int, nodeid: int, uid: int,
                      gid: int, pid: int, body: memoryview) -> None:
        interruptible = opcode in INTERRUPTIBLE
        if interruptible:
            self.pending[unique] = pid
        try:
            reply = await handler(Request(opcode, unique, nodeid, uid, gid, pid), body)
        except Exception as exc:
            if not interruptible or self._answered(unique, None):
                self._reply(unique, errno_for(exc, p.NAMES.get(opcode, str(opcode)).lower()),
                            b"")
            return
        if interruptible and not self._answered(unique, reply if opcode == p.LOOKUP else None):
            return
        try:
            self._reply(unique, 0, reply)
        except Exception:  # a reply that cannot be encoded: the caller must not wait on
            log.exception("encoding the reply to %s", p.NAMES.get(opcode, opcode))
            self._reply(unique, errno.EIO, b"")

    def _answered(self, unique: int, lookup: Reply | None) -> bool:
        """An INTERRUPTIBLE request is done: False if it was answered EINTR
        already. ``lookup``: a LOOKUP's reply, whose count goes back if dropped."""
        if self.pending.pop(unique, None) != INTERRUPTED:
            return True
        self._give_back_lookup(lookup)
        return False

    def _give_back_lookup(self, reply: Reply | None) -> None:
        """A LOOKUP answered EINTR already: the count its late reply took goes back."""
        if isinstance(reply, bytes | bytearray) and (nodeid := int.from_bytes(reply[:8],
                                                                             "little")):
            self._forget([(nodeid, 1)])

    def _forget(self, items: list[tuple[int, int]]) -> None:
        try:
            self.forget(items)
        except Exception:  # no reply to give: never raise
            log.exception("forget failed")

    def _reply(self, unique: int, error: int, body: Reply) -> None:
        parts = [] if error else reply_parts(body)
        if len(parts) > MAX_PARTS:  # a big directory page: writev takes 1,024 pieces at most
            parts = [b"".join(parts)]
        length = p.OUT_HEADER.size + sum(len(part) for part in parts)
        try:
            os.writev(self.fd, [p.OUT_HEADER.pack(length, -error, unique), *parts])
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                return
            # The kernel refused the reply: answer EIO, or the caller waits for ever.
            log.error("answering request %d: %s; answered EIO", unique, exc)
            with contextlib.suppress(OSError):
                os.write(self.fd, p.OUT_HEADER.pack(p.OUT_HEADER.size, -errno.EIO, unique))

    def _init(self, body: memoryview) -> bytes:
        major, minor, _readahead, flags = p.INIT_IN.unpack_from(body)
        if major != p.KERNEL_VERSION:
            raise RuntimeError(f"FUSE protocol {major}.{minor}: aifs speaks 7.x only")
        if flags & p.INIT_EXT and len(body) >= p.INIT_IN.size + 4:
            flags |= int.from_bytes(body[p.INIT_IN.size:p.INIT_IN.size + 4], "little") << 32
        want = (p.ASYNC_READ | p.ATOMIC_O_TRUNC | p.BIG_WRITES | p.AUTO_INVAL_DATA
                | p.DO_READDIRPLUS | p.READDIRPLUS_AUTO | p.ASYNC_DIO | p.PARALLEL_DIROPS
                | p.MAX_PAGES | p.CACHE_SYMLINKS | p.HANDLE_KILLPRIV_V2 | p.INIT_EXT)
        if self.want_passthrough:
            want |= p.PASSTHROUGH
        chosen = flags & want
        self.passthrough.enabled = bool(chosen & p.PASSTHROUGH)
        log.info("FUSE protocol 7.%d; kernel offered %#x, using %#x", minor, flags, chosen)
        return p.INIT_OUT.pack(
            p.KERNEL_VERSION, min(minor, p.KERNEL_MINOR), MAX_READAHEAD, chosen & 0xFFFFFFFF,
            self.max_background, self.max_background * 3 // 4, MAX_WRITE, 1,
            MAX_WRITE // 4096, 0, chosen >> 32, 1 if self.passthrough.enabled else 0)


def _stopping(pid: int) -> bool:
    """Whether thread ``pid`` has a signal pending that stops its program."""
    masks: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn"):
                    masks[name] = int(value, 16)
    except (OSError, ValueError):
        return False
    pending = masks.get("SigPnd", 0) | masks.get("ShdPnd", 0)
    return bool(pending & STOPPING & ~(masks.get("SigBlk", 0) | masks.get("SigIgn", 0)))


class _Watched:
    """Await a coroutine, calling ``on_wait`` the first time it has to wait.

    Like ``await coro`` (each value it yields goes to trio and back), but tells
    whether it waited: most handlers finish without waiting, and then cost no
    task switch at all. Returns True when the coroutine waited.
    """

    __slots__ = ("coro", "on_wait", "waited")

    def __init__(self, coro: Coroutine[Any, Any, None], on_wait: Callable[[], None]) -> None:
        self.coro = coro
        self.on_wait = on_wait
        self.waited = False  # on_wait was called (however the coroutine ended)

    def __await__(self) -> Generator[Any, Any, bool]:
        coro = self.coro
        try:
            value = coro.send(None)
        except StopIteration:
            return False
        self.waited = True
        self.on_wait()
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine, as await would
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return True
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return True
