"""Requests answered on their caller's CPU: FUSE over io_uring, one ring and
one thread per CPU (:mod:`aifs.fuse.kernel.uring`), beside the trio thread.

Why: on a small VM whose idle CPUs halt at once, a request answered on the
other CPU costs ~40 us more than one answered on the caller's own
(``docs/kernel-binding.md``, "FUSE over io_uring"). So a ring's thread
answers its requests itself, with the same handlers the trio session runs.

How that is safe. The handlers and the core they call were written for one
trio thread. :class:`CoreLock` keeps it that way: the trio thread holds it
at all times but while it waits for I/O (a trio instrument), and a ring
thread takes it to answer a request, so core code never runs in two threads
at once, and trio's own state is at rest while a ring thread runs. The ring
thread runs the handler under the identity of a parked trio task (a
:class:`Carrier`): trio calls that only schedule (starting a task, setting an
event) work as in the trio thread, and trio is woken to run what they
scheduled. A handler that has to wait (the lake, a lock, a worker thread)
has already registered its wait under the carrier's identity; the carrier,
which trio sees as blocked, then finishes it in the trio thread like any task,
and the answer goes back to the ring's thread, which commits it.

Not over the rings: INTERRUPT (the kernel still sends it on ``/dev/fuse``,
and an answer can only go back through the ring entry): a request answered
on a ring runs to its end. FORGET comes on ``/dev/fuse`` as before.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

import outcome
import trio
from trio._core._run import GLOBAL_RUN_CONTEXT  # the runner a thread acts for
from trio._core._traps import CancelShieldedCheckpoint, WaitTaskRescheduled

from aifs.fuse.errors import errno_for
from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel import uring
from aifs.fuse.kernel.operations import Reply, Request

if TYPE_CHECKING:
    from aifs.fuse.kernel.session import Session

log = logging.getLogger(__name__)

CARRIERS = 16  # handlers that may wait at once after starting on a ring thread
ENTRIES_PER_QUEUE = 8  # requests in flight per CPU (more wait in the kernel)
PAYLOAD = 1 << 20  # an entry holds the session's largest request (max_write, MAX_PAGES)
DONE, WAITS, NO_CARRIER = 0, 1, 2  # what Lender.run did


class CoreLock(trio.abc.Instrument):
    """Held by the trio thread except while it waits for I/O; taken by a ring
    thread to answer requests. Nobody waits on it: a ring thread that finds
    it taken queues its request for the holder, who answers the queue before
    it lets go (:meth:`Rings._leave`; the trio thread in ``before_io_wait``).
    Two threads handing a lock back and forth across CPUs (and the GIL with
    it) cost more, under load, than one answering for both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.on_release: Callable[[], None] = _nothing

    def install(self) -> None:
        """From the trio thread."""
        self._lock.acquire()
        trio.lowlevel.add_instrument(self)

    def before_io_wait(self, timeout: float) -> None:
        try:
            self.on_release()
        except Exception:  # an instrument that raises is dropped by trio: never
            log.exception("answering queued ring requests")
        self._lock.release()

    def after_io_wait(self, timeout: float) -> None:
        self._lock.acquire()

    def try_enter(self) -> bool:
        return self._lock.acquire(False)

    def leave(self) -> None:
        self._lock.release()


Finish = Callable[[Any, BaseException | None], None]


class Carrier:
    """A trio task, parked, whose identity a ring thread borrows to run a
    handler; if the handler has to wait, the task finishes it."""

    def __init__(self, idle: list[Carrier]) -> None:
        self.idle = idle
        self.task: trio.lowlevel.Task | None = None
        self.coro: Coroutine[Any, Any, Any] | None = None
        self.finish: Finish | None = None

    async def run(self) -> None:
        await _Parked(self)


def _abort_idle(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.SUCCEEDED


class _Parked:
    """A carrier's body: parked until a ring thread leaves it a handler that
    waits, then that handler's steps, then parked again."""

    __slots__ = ("carrier",)

    def __init__(self, carrier: Carrier) -> None:
        self.carrier = carrier

    def __await__(self) -> Generator[Any, Any, None]:
        carrier = self.carrier
        carrier.task = trio.lowlevel.current_task()
        carrier.idle.append(carrier)
        while True:
            sent = yield WaitTaskRescheduled(_abort_idle)
            coro, finish = carrier.coro, carrier.finish
            if coro is None or finish is None:
                sent.unwrap()  # cancelled (the session ends): raises
                continue
            while True:  # the handler's own waits, one after the other
                try:
                    message = coro.send(sent)
                except StopIteration as stop:
                    finish(stop.value, None)
                    break
                except BaseException as exc:  # noqa: BLE001 - it is the request's answer
                    finish(None, exc)
                    break
                sent = yield message
            carrier.coro = carrier.finish = None
            carrier.idle.append(carrier)


class Lender:
    """Runs handler coroutines on ring threads as parked trio tasks."""

    def __init__(self) -> None:
        self.lock = CoreLock()
        self.idle: list[Carrier] = []
        self.runner: Any = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.carriers = 0

    def start(self, nursery: trio.Nursery, carriers: int = CARRIERS) -> None:
        """From the trio thread."""
        self.runner = GLOBAL_RUN_CONTEXT.runner
        self.token = trio.lowlevel.current_trio_token()
        self.lock.install()
        self.carriers = carriers
        for _ in range(carriers):
            nursery.start_soon(Carrier(self.idle).run)

    def run(self, coro: Coroutine[Any, Any, Any], finish: Finish) -> int:
        """Run ``coro`` in this (ring) thread, holding the core lock: DONE if it
        ended here (``finish`` called), WAITS if a carrier finishes it in trio
        (and calls ``finish`` there), NO_CARRIER if it was not started."""
        carrier = self.idle.pop() if self.idle else None
        if carrier is None:  # every carrier busy: the caller has trio run it
            coro.close()
            return NO_CARRIER
        context = GLOBAL_RUN_CONTEXT
        context.runner = self.runner
        context.task = carrier.task
        scheduled = len(self.runner.runq)
        try:
            try:
                message = coro.send(None)
                while message is CancelShieldedCheckpoint:  # a checkpoint: go on at once
                    message = coro.send(outcome.Value(None))
            except StopIteration as stop:
                self.idle.append(carrier)
                finish(stop.value, None)
                return DONE
            except BaseException as exc:  # noqa: BLE001 - it is the request's answer
                self.idle.append(carrier)
                finish(None, exc)
                return DONE
            if type(message) is not WaitTaskRescheduled:
                coro.close()
                self.idle.append(carrier)
                finish(None, RuntimeError(f"unexpected trio trap {message!r}"))
                return DONE
            # It waits, registered under the carrier's name: the carrier (blocked
            # as far as trio knows) takes the wait over, as trio would have.
            task = carrier.task
            assert task is not None
            carrier.coro, carrier.finish = coro, finish
            task._abort_func = message.abort_func
            task._attempt_delivery_of_any_pending_cancel()
            scheduled = -1  # trio must look at its deadlines again
            return WAITS
        finally:
            del context.task
            if len(self.runner.runq) != scheduled:
                self._wake_trio()

    def _wake_trio(self) -> None:
        self.call_soon(_nothing)

    def call_soon(self, function: Callable[..., object], *args: Any) -> None:
        """Have the trio thread call ``function`` (any thread)."""
        assert self.token is not None
        try:
            self.token.run_sync_soon(function, *args)
        except trio.RunFinishedError:
            pass


def _nothing() -> None:
    pass


Answer = Callable[["RingThread", int, bytes], tuple[int, bytes] | None]


class RingThread:
    """One CPU's ring and the thread, pinned to that CPU, that serves it."""

    def __init__(self, devfd: int, cpu: int, payload: int, answer: Answer) -> None:
        self.devfd, self.cpu, self.payload, self.answer = devfd, cpu, payload, answer
        self.ring: uring.FuseRing | None = None
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.done: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.thread = threading.Thread(target=self._run, name=f"aifs-ring-{cpu}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def complete(self, entry: int, error: int, body: bytes) -> None:
        """The answer to a request that waited (any thread)."""
        self.done.append((entry, error, body))
        ring = self.ring
        if ring is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: the session ended
                ring.wake()

    def _run(self) -> None:
        try:
            os.sched_setaffinity(0, {self.cpu})
            self.ring = uring.FuseRing(self.devfd, [self.cpu], ENTRIES_PER_QUEUE,
                                       self.payload)
        except BaseException as exc:  # noqa: BLE001 - told to the session
            self.failed = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            self.ring.serve(lambda entry, request: self.answer(self, entry, request),
                            self.done)
        except Exception:
            log.exception("FUSE ring of CPU %d failed", self.cpu)
        finally:
            ring, self.ring = self.ring, None  # answers that come late go nowhere
            ring.close()


class Rings:
    """A session's rings: one per CPU, started once INIT chose io_uring."""

    def __init__(self, session: Session, interruptible: frozenset[int],
                 stopping: Callable[[int], bool]) -> None:
        self.session = session
        # requests that wait and may be answered EINTR (see Session): unique ->
        # (ring, entry, caller's pid); an answer given EINTR is dropped when it comes
        self.interruptible, self.stopping = interruptible, stopping
        self.waiting: dict[int, tuple[RingThread, int, int]] = {}
        self.chosen = False  # by INIT: the kernel offered it
        self.stopped = False
        self.lender = Lender()
        self.threads: list[RingThread] = []
        self.answered = 0  # requests that came through the rings
        # requests whose ring's thread found the core lock taken: its holder
        # answers them (ring, entry, request)
        self.queued: collections.deque[tuple[RingThread, int, bytes]] = collections.deque()
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """From the trio thread, after the INIT answer."""
        self._nursery = nursery
        self.lender.lock.on_release = self._drain  # trio answers the queue before it waits
        self.lender.start(nursery)
        for cpu in range(os.cpu_count() or 1):  # every CPU's queue needs entries
            thread = RingThread(self.session.fd, cpu, PAYLOAD, self._answer)
            thread.start()
            self.threads.append(thread)
        log.info("FUSE over io_uring: %d rings", len(self.threads))

    async def stop(self, grace: float) -> None:
        """As the session ends: later requests fail; those a carrier is
        finishing get ``grace`` seconds (then the carriers are cancelled)."""
        self.stopped = True
        with trio.move_on_after(grace):
            while len(self.lender.idle) < self.lender.carriers:
                await trio.sleep(0.01)

    def _answer(self, ring: RingThread, entry: int, request: bytes) -> tuple[int, bytes] | None:
        """Answer one request in ring thread ``ring`` (None: answered later)."""
        if self.stopped:
            return errno.EIO, b""
        lock = self.lender.lock
        if not lock.try_enter():  # the holder answers it before it lets go
            self.queued.append((ring, entry, request))
            if lock.try_enter():  # it let go meanwhile: the queue is ours to answer
                self._leave()
            return None
        try:
            return self._serve(ring, entry, request, inline=True)
        finally:
            self._leave()

    def _leave(self) -> None:
        """Answer what was queued, then let the core lock go (and take it
        again if more came meanwhile)."""
        lock = self.lender.lock
        while True:
            self._drain()
            lock.leave()
            if not self.queued or not lock.try_enter():
                return

    def _drain(self) -> None:
        """Holding the core lock: answer the requests other rings queued."""
        queued = self.queued
        while queued:
            ring, entry, request = queued.popleft()
            answer = self._serve(ring, entry, request, inline=False)
            if answer is not None:
                ring.complete(entry, *answer)

    def _serve(self, ring: RingThread, entry: int, request: bytes,
               inline: bool) -> tuple[int, bytes] | None:
        """Holding the core lock: answer a request of ``ring`` (None: its
        answer goes to the ring later, from wherever its handler ends)."""
        try:
            return self._serve_one(ring, entry, request, inline)
        except Exception:  # the entry must be answered, or its caller waits for good
            log.exception("answering a request of the ring of CPU %d", ring.cpu)
            return errno.EIO, b""

    def _serve_one(self, ring: RingThread, entry: int, request: bytes,
                   inline: bool) -> tuple[int, bytes] | None:
        session, lender = self.session, self.lender
        (length, opcode, unique, nodeid, uid, gid, pid, extlen,
         _) = p.IN_HEADER.unpack_from(request)
        body = memoryview(request)[p.IN_HEADER.size:length - extlen * 8]
        if self.stopped:
            return errno.EIO, b""
        if opcode == p.DESTROY:
            lender.call_soon(session.done.set)
            return 0, b""
        handler = session.ops.handlers.get(opcode)
        if handler is None:
            return errno.ENOSYS, b""
        later = False
        answer: tuple[int, bytes] | None = None

        def finish(value: Reply, exc: BaseException | None) -> None:
            nonlocal answer
            try:
                result = _encoded(opcode, value, exc)
            except Exception:  # a reply that cannot be encoded: the caller must not wait on
                log.exception("encoding the reply to %s", p.NAMES.get(opcode, opcode))
                result = errno.EIO, b""
            if not later:
                answer = result
            elif opcode not in self.interruptible or self.waiting.pop(unique, None):
                ring.complete(entry, *result)
            elif opcode == p.LOOKUP and not result[0] and (node := int.from_bytes(
                    result[1][:8], "little")):  # answered EINTR already: its count goes back
                session._forget([(node, 1)])

        session.counts[opcode] += 1
        self.answered += 1
        request_ = Request(opcode, unique, nodeid, uid, gid, pid)
        done = lender.run(handler(request_, body), finish)
        if done == WAITS:
            later = True
            session.waited[opcode] += 1
        elif done == NO_CARRIER:
            later = True
            lender.call_soon(self._start_task, handler, request_, body, finish)
        if later and opcode in self.interruptible:
            self.waiting[unique] = (ring, entry, pid)
        return answer

    def interrupt(self, unique: int) -> bool:
        """From the trio thread: INTERRUPT of a request on a ring (False: not
        one of theirs). Answered EINTR if its signal stops the program."""
        item = self.waiting.get(unique)
        if item is None:
            return False
        ring, entry, pid = item
        if self.stopping(pid):
            del self.waiting[unique]
            ring.complete(entry, errno.EINTR, b"")
        return True

    def _start_task(self, *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._as_task, *args)

    @staticmethod
    async def _as_task(handler: Any, request: Request, body: memoryview,
                       finish: Finish) -> None:
        try:
            value, exc = await handler(request, body), None
        except BaseException as error:  # noqa: BLE001 - it is the request's answer
            value, exc = None, error
        finish(value, exc)


def _encoded(opcode: int, value: Reply, exc: BaseException | None) -> tuple[int, bytes]:
    if exc is not None:
        if not isinstance(exc, Exception):
            return errno.EIO, b""
        return errno_for(exc, p.NAMES.get(opcode, str(opcode)).lower()), b""
    if value is None:
        return 0, b""
    if isinstance(value, list):
        return 0, b"".join(value)
    return 0, bytes(value)
