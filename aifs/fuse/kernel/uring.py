"""FUSE over io_uring: the kernel hands requests to per-CPU queues of ring entries.

With ``/dev/fuse`` every request is a ``read`` and its answer a ``write``, and
the daemon thread that reads runs on whatever CPU the scheduler picks. Over
io_uring (``FUSE_OVER_IO_URING``, Linux 6.14+, module parameter
``fuse.enable_uring=1``) the kernel queues a request on the queue of the CPU
its caller runs on; a thread pinned to that CPU takes it, and answers it and
fetches the next in one ``io_uring_enter``. On a small virtual machine the
caller and the daemon then stay on one CPU, and no request wakes a sleeping
CPU: ``tests/bench/transport_floor.py`` measured the round trip of a request
at 9-31 us over io_uring against 41-68 us over ``/dev/fuse`` (2 CPUs,
``docs/kernel-binding.md``).

One :class:`FuseRing` is one io_uring (128-byte SQEs, which carry
``struct fuse_uring_cmd_req``) with entries registered on one or more queues.
Each entry is a header buffer (``struct fuse_uring_req_header``: the in/out
header, the operation's own header, ``fuse_uring_ent_in_out``) and a payload
buffer of at least the session's largest request. FORGET and INTERRUPT still
come through ``/dev/fuse`` reads, and notifications are still written there.

Built on raw syscalls (ctypes) and ``mmap``: no liburing binding is packaged
for Python, and the part used here is small.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from aifs.fuse.kernel.protocol import IN_HEADER as _IN_HEADER
from aifs.fuse.kernel.protocol import OUT_HEADER as _OUT_HEADER

log = logging.getLogger(__name__)

ENABLE_PARAMETER = Path("/sys/module/fuse/parameters/enable_uring")

_SYS_SETUP, _SYS_ENTER = 425, 426  # x86_64 and arm64 alike (the unified table)
# (The rings are read with plain loads: enough on x86's ordering, the only
# machines this has run on; weaker orderings would want acquire loads.)
_SETUP_SQE128 = 1 << 10
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
_OFF_SQES = 0x10000000
_OP_READ, _OP_URING_CMD = 22, 46
_WAKE = 1 << 63  # user_data of the read of the wake-up eventfd
_CMD_REGISTER, _CMD_COMMIT_AND_FETCH = 1, 2

_PARAMS_SIZE = 120
_SQE_SIZE = 128
_CQE = struct.Struct("<QiI")  # user_data res flags
#: opcode flags ioprio fd cmd_op pad addr len op_flags user_data
_SQE_HEAD = struct.Struct("<BBHiIIQIIQ")
_CMD_REQ = struct.Struct("<QQH")  # fuse_uring_cmd_req: flags commit_id qid (at byte 48 of the SQE)
_U32 = struct.Struct("<I")
_ENT_IN_OUT = struct.Struct("<QQI")  # flags commit_id payload_sz (at byte 256 of the header)
HEADER_SIZE = 288  # struct fuse_uring_req_header
_OP_IN, _ENT = 128, 256

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

#: answer(entry, request) -> (errno, reply body), or None when the answer
#: comes later (given to :meth:`FuseRing.serve`'s ``done``). The request is
#: the in-header, the operation's header and its payload, laid out as a
#: /dev/fuse read gives them.
Answer = Callable[[int, bytes], "tuple[int, bytes] | None"]


def enabled() -> bool:
    """Whether this kernel lets a FUSE session use io_uring now."""
    try:
        return ENABLE_PARAMETER.read_text().strip() in ("Y", "1")
    except OSError:
        return False


@contextmanager
def switched_on() -> Iterator[None]:
    """``fuse.enable_uring`` on for a while (root), then as it was (raises
    OSError where it cannot be)."""
    was = ENABLE_PARAMETER.read_text().strip()
    ENABLE_PARAMETER.write_text("Y")
    try:
        yield
    finally:
        ENABLE_PARAMETER.write_text(was)


def _enter(ring_fd: int, submit: int, wait: int) -> int:
    while True:
        done = _libc.syscall(_SYS_ENTER, ring_fd, submit, wait,
                             _ENTER_GETEVENTS if wait else 0, None, 0)
        if done >= 0:
            return done
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


class FuseRing:
    """An io_uring whose entries serve FUSE queues ``qids`` of session ``devfd``.

    Call from the thread that will serve it (io_uring runs the kernel's side
    of each request in that thread), after INIT was answered."""

    def __init__(self, devfd: int, qids: list[int], per_queue: int, payload: int,
                 depth: int = 64) -> None:
        self.devfd = devfd
        params = bytearray(_PARAMS_SIZE)
        _U32.pack_into(params, 8, _SETUP_SQE128)
        self.fd = _libc.syscall(_SYS_SETUP, depth,
                                (ctypes.c_char * _PARAMS_SIZE).from_buffer(params))
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        try:
            sq_entries, cq_entries, _, _, _, features = struct.unpack_from("<6I", params)
            sq = struct.unpack_from("<7I", params, 40)  # head tail mask entries flags dropped array
            cq = struct.unpack_from("<6I", params, 80)  # head tail mask entries overflow cqes
            if not features & _FEAT_SINGLE_MMAP:
                raise OSError(errno.ENOSYS, "io_uring without IORING_FEAT_SINGLE_MMAP")
            size = max(sq[6] + sq_entries * 4, cq[5] + cq_entries * _CQE.size)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self.ring = mmap.mmap(self.fd, size, mmap.MAP_SHARED, prot, offset=0)
            self.sqes = mmap.mmap(self.fd, sq_entries * _SQE_SIZE, mmap.MAP_SHARED, prot,
                                  offset=_OFF_SQES)
        except BaseException:
            os.close(self.fd)
            raise
        self._sq_tail, self._sq_array = sq[1], sq[6]
        self._sq_mask = _U32.unpack_from(self.ring, sq[2])[0]
        self._cq_head, self._cq_tail, self._cqes = cq[0], cq[1], cq[5]
        self._cq_mask = _U32.unpack_from(self.ring, cq[2])[0]
        self._unsubmitted = 0
        # entry i: (queue, header buffer, payload buffer, iovec pair the kernel keeps)
        self.entries: list[tuple[int, mmap.mmap, mmap.mmap, ctypes.Array[ctypes.c_uint64]]] = []
        for qid in qids:
            for _ in range(per_queue):
                header, body = mmap.mmap(-1, 4096), mmap.mmap(-1, payload)
                iov = (ctypes.c_uint64 * 4)(_address(header), HEADER_SIZE, _address(body), payload)
                self.entries.append((qid, header, body, iov))
        # answers that come later (from another thread) wake the ring's thread
        # through an eventfd it keeps a read queued on
        self.event = os.eventfd(0, os.EFD_CLOEXEC)
        self._event_buffer = (ctypes.c_uint64 * 1)()
        self._payload = payload
        for i, (qid, _, _, iov) in enumerate(self.entries):
            self._queue(i, _CMD_REGISTER, 0, qid, ctypes.addressof(iov))
        self._queue_wake_read()
        self._unsubmitted -= _enter(self.fd, self._unsubmitted, 0)
        self._served: set[int] = set()  # entries that got a request: registered

    def _slot(self) -> tuple[int, int]:
        tail = _U32.unpack_from(self.ring, self._sq_tail)[0]
        at = (tail & self._sq_mask) * _SQE_SIZE
        self.sqes[at:at + _SQE_SIZE] = bytes(_SQE_SIZE)
        return tail, at

    def _push(self, tail: int) -> None:
        slot = tail & self._sq_mask
        _U32.pack_into(self.ring, self._sq_array + slot * 4, slot)
        _U32.pack_into(self.ring, self._sq_tail, tail + 1)  # the syscall orders it after the rest
        self._unsubmitted += 1

    def _queue(self, entry: int, cmd: int, commit_id: int, qid: int, iov: int = 0) -> None:
        tail, at = self._slot()
        _SQE_HEAD.pack_into(self.sqes, at, _OP_URING_CMD, 0, 0, self.devfd, cmd, 0, iov,
                            2 if iov else 0, 0, entry)
        _CMD_REQ.pack_into(self.sqes, at + 48, 0, commit_id, qid)
        self._push(tail)

    def _queue_wake_read(self) -> None:
        tail, at = self._slot()
        _SQE_HEAD.pack_into(self.sqes, at, _OP_READ, 0, 0, self.event, 0, 0,
                            ctypes.addressof(self._event_buffer), 8, 0, _WAKE)
        struct.pack_into("<q", self.sqes, at + 8, -1)  # off: the eventfd's own
        self._push(tail)

    def wake(self) -> None:
        """Make the ring's thread look at answers given to it (any thread)."""
        os.eventfd_write(self.event, 1)

    def serve(self, answer: Answer, done: deque[tuple[int, int, bytes]] | None = None) -> None:
        """Answer requests until the session ends (unmount or abort); answers
        that came later are taken from ``done`` (entry, errno, body) when
        :meth:`wake` is called."""
        ring = self.ring
        while True:
            head = _U32.unpack_from(ring, self._cq_head)[0]
            tail = _U32.unpack_from(ring, self._cq_tail)[0]
            if head == tail:  # answers go in, and the thread waits, in one call
                self._unsubmitted -= _enter(self.fd, self._unsubmitted, 1)
                continue
            while head != tail:
                entry, result, _ = _CQE.unpack_from(ring, self._cqes + (head & self._cq_mask) * 16)
                head += 1
                _U32.pack_into(ring, self._cq_head, head)
                if entry == _WAKE:
                    while done:
                        self._commit(*done.popleft())
                    self._queue_wake_read()
                    continue
                if result < 0:
                    if result in (-errno.ENOTCONN, -errno.ECONNABORTED, -errno.ECANCELED):
                        return  # the session ended
                    self._failed(entry, -result)
                    continue
                self._served.add(entry)
                self._answer(entry, answer)

    def _failed(self, entry: int, error: int) -> None:
        """An entry's command failed: a commit (the kernel had dropped the
        request) is followed by a new registration of the entry; a
        registration that failed leaves the entry out."""
        if entry not in self._served:
            log.error("FUSE io_uring: registering an entry failed: %s", os.strerror(error))
            return
        log.warning("FUSE io_uring: an answer was refused (%s); entry registered again",
                    os.strerror(error))
        self._served.discard(entry)
        qid, _, _, iov = self.entries[entry]
        self._queue(entry, _CMD_REGISTER, 0, qid, ctypes.addressof(iov))

    def _answer(self, entry: int, answer: Answer) -> None:
        _, header, body, _ = self.entries[entry]
        try:
            length = _U32.unpack_from(header)[0]
            payload = _ENT_IN_OUT.unpack_from(header, _ENT)[2]
            own = length - _IN_HEADER.size - payload  # the operation's header: first argument
            result = answer(entry, header[:_IN_HEADER.size] + header[_OP_IN:_OP_IN + own]
                            + body[:payload])
        except Exception:  # the entry must be answered, or its caller waits for good
            log.exception("answering a FUSE request from an io_uring entry")
            result = errno.EIO, b""
        if result is not None:
            self._commit(entry, *result)

    def _commit(self, entry: int, error: int, reply: bytes) -> None:
        qid, header, body, _ = self.entries[entry]
        unique = _IN_HEADER.unpack_from(header)[2]
        commit_id = _ENT_IN_OUT.unpack_from(header, _ENT)[1]
        if error or len(reply) > self._payload:
            if not error:
                log.error("answer of %d bytes does not fit a ring entry", len(reply))
            error, reply = error or errno.EIO, b""
        header[:_OUT_HEADER.size] = _OUT_HEADER.pack(_OUT_HEADER.size + len(reply), -error,
                                                     unique)
        body[:len(reply)] = reply
        _U32.pack_into(header, _ENT + 16, len(reply))
        self._queue(entry, _CMD_COMMIT_AND_FETCH, commit_id, qid)

    def close(self) -> None:
        self.ring.close()
        self.sqes.close()
        os.close(self.fd)
        os.close(self.event)


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
