"""Requests answered on their caller's CPU: FUSE over io_uring, one ring and
one thread per CPU (:mod:`aifs.fuse.kernel.uring`), beside the trio thread.

Why: on a small VM whose idle CPUs halt at once, a request answered on the
other CPU costs ~40 us more than one answered on the caller's own
(``docs/kernel-binding.md``, "FUSE over io_uring"). So a ring's thread
answers its requests itself, with the same handlers the trio session runs.

How that is safe. The handlers and the core they call were written for one
trio thread. :class:`CoreLock` keeps it that way: the trio thread holds it
at all times but while it sleeps in epoll, and a ring thread takes it to
answer a request, so core code never runs in two threads at once, and
trio's own state is at rest while a ring thread runs. The ring
thread runs the handler under the identity of a parked trio task (a
:class:`Carrier`): trio calls that only schedule (starting a task, setting an
event) work as in the trio thread, and trio is woken to run what they
scheduled. A handler that has to wait (the lake, a lock, a worker thread)
has already registered its wait under the carrier's identity; the carrier,
which trio sees as blocked, then finishes it in the trio thread like any task,
and the answer goes back to the ring's thread, which commits it.

INTERRUPT and FORGET still come on ``/dev/fuse``; an interrupted request that
waits is answered EINTR through its ring entry (:meth:`Rings.interrupt`).

This leans on trio's internals (0.35: the thread's run context, a task's
abort function, the epoll I/O manager): where they are not as expected the
session stays on ``/dev/fuse`` (``tests/test_fuse_uring.py`` and CI's run
of the conformance and program suites over the rings check them).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import outcome
import trio

try:  # trio's internals (see above): without them, no rings
    from trio._core._run import GLOBAL_RUN_CONTEXT  # the runner a thread acts for
    from trio._core._traps import CancelShieldedCheckpoint, WaitTaskRescheduled
except ImportError:  # pragma: no cover - another trio
    GLOBAL_RUN_CONTEXT = CancelShieldedCheckpoint = WaitTaskRescheduled = None

from aifs.fuse.errors import errno_for
from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel import uring
from aifs.fuse.kernel.operations import Reply, Request, reply_parts

if TYPE_CHECKING:
    from aifs.fuse.kernel.session import Session

log = logging.getLogger(__name__)

CARRIERS = 16  # handlers that may wait at once after starting on a ring thread
ENTRIES_PER_QUEUE = 8  # requests in flight per CPU (more wait in the kernel)
PAYLOAD = 1 << 20  # an entry holds the session's largest request (max_write, MAX_PAGES)
DONE, WAITS, NO_CARRIER = 0, 1, 2  # what Lender.run did


class CoreLock:
    """Held by the trio thread except while it sleeps in epoll; taken by a
    ring thread to answer requests.

    Released around the epoll call itself (trio's I/O manager's
    ``get_events``, wrapped: :func:`_wrap_get_events`), not in an
    instrument's ``before_io_wait`` / ``after_io_wait``: between those two
    trio also runs ``process_events``, which reschedules tasks and changes
    epoll registrations a handler waiting on a socket changes too.

    Nobody waits on it but trio: a ring thread that finds it taken queues its
    request for the holder, who answers the queue before it lets go, and
    looks again after (:meth:`Rings._leave`; trio in the wrapper). Two threads
    handing a lock back and forth across CPUs (and the GIL with it) cost more,
    under load, than one answering for both. While trio waits to take it
    back, ring threads queue rather than take it (``trio_wants``): trio would
    lose every race to threads already running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.trio_wants = False
        self.drain: Callable[[], None] = _nothing  # answer the queue (holding the lock)
        self.queued: Callable[[], bool] = lambda: False

    def install(self, io_manager: Any) -> None:
        """From the trio thread: it holds the lock from now on."""
        self._lock.acquire()
        _LOCKS[id(io_manager)] = self

    def uninstall(self, io_manager: Any) -> None:
        _LOCKS.pop(id(io_manager), None)

    def around_epoll(self, wait: Callable[[], Any]) -> Any:
        """The trio thread's epoll call, with the lock let go for it."""
        self._answer_queue()
        self._lock.release()
        while self.queued() and self._lock.acquire(False):  # queued meanwhile
            self._answer_queue()
            self._lock.release()
        try:
            return wait()
        finally:
            self.trio_wants = True
            self._lock.acquire()
            self.trio_wants = False
            self._answer_queue()

    def _answer_queue(self) -> None:
        try:
            self.drain()
        except Exception:  # in trio's own loop: never raise
            log.exception("answering queued ring requests")

    def try_enter(self) -> bool:
        return not self.trio_wants and self._lock.acquire(False)

    def leave(self) -> None:
        self._lock.release()


#: io manager (by id) -> the core lock its epoll calls let go of
_LOCKS: dict[int, CoreLock] = {}


def _wrap_get_events() -> bool:
    """Wrap trio's epoll I/O manager's ``get_events`` once (class-wide; it
    acts only for io managers with a core lock). False where trio has none."""
    try:
        from trio._core._io_epoll import EpollIOManager
    except ImportError:
        return False
    original = EpollIOManager.get_events
    if getattr(original, "_aifs_core_lock", False):
        return True

    def get_events(self: Any, timeout: float) -> Any:
        lock = _LOCKS.get(id(self))
        if lock is None:
            return original(self, timeout)
        return lock.around_epoll(lambda: original(self, timeout))

    get_events._aifs_core_lock = True  # type: ignore[attr-defined]
    EpollIOManager.get_events = get_events  # type: ignore[method-assign]
    return True


Finish = Callable[[Any, BaseException | None], None]


class Carrier:
    """A trio task, parked, whose identity a ring thread borrows to run a
    handler; if the handler has to wait, the task finishes it."""

    def __init__(self, idle: list[Carrier]) -> None:
        self.idle = idle
        self.task: trio.lowlevel.Task | None = None
        self.coro: Coroutine[Any, Any, Any] | None = None
        self.finish: Finish | None = None
        self.ended = False

    async def run(self) -> None:
        try:
            await _Parked(self)
        finally:
            self.ended = True
            if self in self.idle:
                self.idle.remove(self)

    def free(self) -> bool:
        """Parked and waiting for nothing: may be lent."""
        task = self.task
        return not self.ended and task is not None and task._next_send_fn is None


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
            thrown: BaseException | None = None
            while True:  # the handler's own waits, one after the other
                try:
                    message = coro.send(sent) if thrown is None else coro.throw(thrown)
                except StopIteration as stop:
                    finish(stop.value, None)
                    break
                except BaseException as exc:  # noqa: BLE001 - it is the request's answer
                    finish(None, exc)
                    break
                thrown = None
                try:
                    sent = yield message
                except BaseException as exc:  # noqa: BLE001 - trio throws in: the handler's
                    thrown = exc
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
        if GLOBAL_RUN_CONTEXT is None or not hasattr(trio.lowlevel.Task, "_abort_func") \
                or not _wrap_get_events():
            raise OSError(errno.ENOSYS, f"trio {trio.__version__} lacks what the rings use")
        self.runner = GLOBAL_RUN_CONTEXT.runner
        self.token = trio.lowlevel.current_trio_token()
        self.lock.install(self.runner.io_manager)
        self.carriers = carriers
        for _ in range(carriers):
            nursery.start_soon(Carrier(self.idle).run)

    def stop(self) -> None:
        """From the trio thread, as its run ends."""
        if self.runner is not None:
            self.lock.uninstall(self.runner.io_manager)

    def run(self, coro: Coroutine[Any, Any, Any], finish: Finish) -> int:
        """Run ``coro`` in this (ring) thread, holding the core lock: DONE if it
        ended here (``finish`` called), WAITS if a carrier finishes it in trio
        (and calls ``finish`` there), NO_CARRIER if it was not started."""
        carrier = None
        while self.idle:
            candidate = self.idle.pop()
            if candidate.free():
                carrier = candidate
                break
        if carrier is None:  # every carrier busy: the caller has trio run it
            coro.close()
            return NO_CARRIER
        task = carrier.task
        assert task is not None
        task._abort_func = None  # lent: a cancellation waits until it is given back
        context = GLOBAL_RUN_CONTEXT
        context.runner = self.runner
        context.task = task
        scheduled = len(self.runner.runq)
        try:
            try:
                message = coro.send(None)
                while message is CancelShieldedCheckpoint:  # a checkpoint: go on at once
                    message = coro.send(outcome.Value(None))
            except StopIteration as stop:
                self._give_back(carrier)
                finish(stop.value, None)
                return DONE
            except BaseException as exc:  # noqa: BLE001 - it is the request's answer
                self._give_back(carrier)
                finish(None, exc)
                return DONE
            if type(message) is not WaitTaskRescheduled:
                coro.close()
                self._give_back(carrier)
                finish(None, RuntimeError(f"unexpected trio trap {message!r}"))
                return DONE
            # It waits, registered under the carrier's name: the carrier (blocked
            # as far as trio knows) takes the wait over, as trio would have.
            carrier.coro, carrier.finish = coro, finish
            task._abort_func = message.abort_func
            task._attempt_delivery_of_any_pending_cancel()
            scheduled = -1  # trio must look at its deadlines again
            return WAITS
        finally:
            del context.task
            if len(self.runner.runq) != scheduled:
                self._wake_trio()

    def _give_back(self, carrier: Carrier) -> None:
        """The handler ended here: the carrier is parked again (unless a
        cancellation came for it meanwhile: then it ends)."""
        task = carrier.task
        assert task is not None
        task._abort_func = _abort_idle
        task._attempt_delivery_of_any_pending_cancel()
        if carrier.free():
            self.idle.append(carrier)

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


def _possible_cpus() -> list[int]:
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


class RingThread:
    """One CPU's ring and the thread, pinned to that CPU, that serves it."""

    def __init__(self, devfd: int, cpu: int, payload: int, answer: Answer,
                 set_up: Callable[[RingThread, BaseException | None], None],
                 failed: Callable[[RingThread], None]) -> None:
        self.devfd, self.cpu, self.payload, self.answer = devfd, cpu, payload, answer
        self.on_set_up, self.on_failure = set_up, failed
        self._closing = threading.Lock()  # complete() against the ring's close
        self.ring: uring.FuseRing | None = None
        self.done: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.thread = threading.Thread(target=self._run, name=f"aifs-ring-{cpu}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def complete(self, entry: int, error: int, body: bytes) -> None:
        """The answer to a request that waited (any thread)."""
        self.done.append((entry, error, body))
        with self._closing:
            if self.ring is not None:
                self.ring.wake()

    def _run(self) -> None:
        try:
            try:
                os.sched_setaffinity(0, {self.cpu})
            except OSError as exc:  # not ours to run on (a cpuset): served from elsewhere
                log.debug("ring of CPU %d not pinned: %s", self.cpu, exc)
            self.ring = uring.FuseRing(self.devfd, [self.cpu], ENTRIES_PER_QUEUE,
                                       self.payload)
        except BaseException as exc:  # noqa: BLE001 - told to the session
            self.on_set_up(self, exc)
            return
        self.on_set_up(self, None)
        try:
            self.ring.serve(lambda entry, request: self.answer(self, entry, request),
                            self.done)
        except Exception:
            log.exception("FUSE ring of CPU %d failed", self.cpu)
            self.on_failure(self)
        finally:
            with self._closing:
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
        self._up: Callable[[], None] = _nothing
        self._to_set_up = 0  # rings still to be registered (-1: one failed)

    def start(self, nursery: trio.Nursery, up: Callable[[], None]) -> None:
        """From the trio thread, after the INIT answer; ``up`` is called (in
        the trio thread) once every ring is set up. Where one cannot be, the
        kernel keeps sending requests on /dev/fuse."""
        self._nursery = nursery
        lock = self.lender.lock
        lock.drain, lock.queued = self._drain, lambda: bool(self.queued)
        try:
            self.lender.start(nursery)
        except OSError as exc:
            log.warning("FUSE over io_uring not used: %s", exc)
            return
        cpus = _possible_cpus()  # the kernel has a queue per possible CPU
        self._up, self._to_set_up = up, len(cpus)
        for cpu in cpus:
            thread = RingThread(self.session.fd, cpu, PAYLOAD, self._answer,
                                self._set_up, self._failed)
            thread.start()
            self.threads.append(thread)

    def _set_up(self, ring: RingThread, failure: BaseException | None) -> None:
        """(A ring's thread) its ring is registered, or could not be."""
        self.lender.call_soon(self._ring_set_up, ring, failure)

    def _ring_set_up(self, ring: RingThread, failure: BaseException | None) -> None:
        if failure is not None:
            log.warning("FUSE over io_uring not used: the ring of CPU %d: %s", ring.cpu,
                        failure)
            self._to_set_up = -1
        elif self._to_set_up > 0:
            self._to_set_up -= 1
            if not self._to_set_up:
                log.info("FUSE over io_uring: %d rings", len(self.threads))
                self._up()

    def _failed(self, ring: RingThread) -> None:
        """A ring's thread ended on an error: its CPU's requests would wait for
        good, so the session ends (the mount fails loudly instead)."""
        log.error("the FUSE ring of CPU %d failed: ending the session", ring.cpu)
        self.lender.call_soon(self.session.terminate)

    async def stop(self, grace: float) -> None:
        """As the session ends: later requests fail; those a carrier is
        finishing get ``grace`` seconds (then the carriers are cancelled)."""
        self.stopped = True
        with trio.move_on_after(grace):
            while len(self.lender.idle) < self.lender.carriers:
                await trio.sleep(0.01)
        self._drain()  # (answered EIO now)
        self.lender.stop()

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
        session.counts[opcode] += 1
        self.answered += 1
        handler = session.ops.handlers.get(opcode)
        if handler is None:
            return session.ops.answered.get(opcode, errno.ENOSYS), b""
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
            elif opcode == p.LOOKUP and not result[0]:  # answered EINTR already
                session.give_back_lookup(result[1])

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
    return 0, b"".join(reply_parts(value))
