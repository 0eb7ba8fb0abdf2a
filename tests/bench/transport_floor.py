"""The floor of one FUSE request on this machine, by transport: ``/dev/fuse``
read and write against FUSE over io_uring (``aifs/fuse/kernel/uring.py``).

A do-nothing filesystem (one file, ``/x``) is served by a plain-Python daemon
that speaks the protocol itself, once per transport, alternated; the caller
times what a program pays per request:

- ``ioctl``: ``isatty()`` on an open file, one IOCTL request (the daemon
  answers ENOTTY at once), as Python's ``open()`` asks;
- ``open+fstat+close`` of ``/x``: an OPEN and a RELEASE.

Transports: ``dev``, one thread reading ``/dev/fuse`` (sleeping between
requests, as any daemon that does not spin); ``uring``, one ring and thread
per CPU, each pinned to its CPU (the kernel queues a request on its caller's
CPU). The second needs ``fuse.enable_uring=1``; ``--enable-uring`` sets it for
the run and puts it back (root only).

    python tests/bench/transport_floor.py [--runs 3] [--requests 10000]
        [--files 2000] [--work-us 0] [--enable-uring] [--json]

``--work-us N`` makes each answer take N us of CPU (a busy loop), as the
handlers of a real daemon do (aifs's: 4-270 us): the scheduler places a
daemon that works per request differently from one that answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from aifs.fuse.kernel import mount as kmount  # noqa: E402
from aifs.fuse.kernel import protocol as p  # noqa: E402
from aifs.fuse.kernel import uring  # noqa: E402

MAX_WRITE = 128 * 1024
TIMEOUT = 3600  # entries and attributes never expire in a run


def _attr(ino: int) -> bytes:
    mode, nlink, size = (0o40755, 2, 0) if ino == 1 else (0o100644, 1, 5)
    return p.ATTR.pack(ino, size, 8, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)


SERVED = {"dev": 0, "uring": 0}  # requests answered, by transport (told at exit)
WORK = 0.0  # seconds of CPU each answer takes besides (--work-us): a real daemon's share


def handle(request: bytes, transport: str = "uring") -> tuple[int, bytes]:
    """The do-nothing filesystem: (errno, reply body) for one request."""
    length, opcode, _, nodeid = p.IN_HEADER.unpack_from(request)[:4]
    SERVED[transport] += 1
    if WORK:
        until = time.perf_counter() + WORK
        while time.perf_counter() < until:
            pass
    if opcode == p.LOOKUP:
        if request[p.IN_HEADER.size:length].rstrip(b"\0") != b"x":
            return errno.ENOENT, b""
        return 0, p.ENTRY_HEAD.pack(2, 0, TIMEOUT, TIMEOUT, 0, 0) + _attr(2)
    if opcode == p.GETATTR:
        return 0, p.ATTR_OUT_HEAD.pack(TIMEOUT, 0, 0) + _attr(nodeid)
    if opcode in (p.OPEN, p.OPENDIR):
        return 0, p.OPEN_OUT.pack(0, 0, 0)
    if opcode in (p.RELEASE, p.RELEASEDIR, p.FLUSH):
        return 0, b""
    if opcode == p.IOCTL:
        return errno.ENOTTY, b""
    if opcode == p.STATFS:
        return 0, p.STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
    return errno.ENOSYS, b""


def _serve_dev(fd: int, transport: str, until_init: bool = False) -> None:
    """Read /dev/fuse until the session ends (or, ``until_init``, INIT is
    answered): every request (``dev``), or those the kernel still sends
    there (``uring``)."""
    buffer = bytearray(MAX_WRITE + 4096)
    while True:
        try:
            n = os.readv(fd, [buffer])
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                continue
            return  # ENODEV: unmounted
        request = bytes(buffer[:n])
        opcode, unique = p.IN_HEADER.unpack_from(request)[1:3]
        if opcode in (p.FORGET, p.BATCH_FORGET, p.INTERRUPT):
            continue
        if opcode == p.INIT:
            major, minor, _, flags = p.INIT_IN.unpack_from(request, p.IN_HEADER.size)
            flags2 = struct.unpack_from("<I", request, p.IN_HEADER.size + 16)[0]
            want2 = (p.OVER_IO_URING >> 32) if transport == "uring" else 0
            reply = p.INIT_OUT.pack(7, min(minor, 45), 1 << 20, flags & (1 << 30 | 1 << 22), 12,
                                  9, MAX_WRITE, 1, MAX_WRITE // 4096, 0, flags2 & want2, 0)
            os.writev(fd, [p.OUT_HEADER.pack(16 + len(reply), 0, unique), reply])
            if transport == "uring" and not flags2 & want2:
                raise SystemExit("this kernel offers no FUSE over io_uring")
            if until_init:
                return
            continue
        error, reply = handle(request, "dev")
        reply = b"" if error else reply
        try:
            os.writev(fd, [p.OUT_HEADER.pack(16 + len(reply), -error, unique), reply])
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # the request was interrupted and is gone
                continue
            if exc.errno == errno.ENODEV:  # unmounted while answering
                return
            raise


def serve(mountpoint: str, transport: str) -> None:
    """Mount and serve until unmounted."""
    fd = kmount.mount(mountpoint, {"subtype=floor", "nosuid", "nodev"})
    failed: list[BaseException] = []

    def ring_worker(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})
        try:
            ring = uring.FuseRing(fd, [cpu], per_queue=2, payload=MAX_WRITE)
            try:
                ring.serve(lambda entry, request: handle(request))
            finally:
                ring.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failed.append(exc)

    threads = [threading.Thread(target=ring_worker, args=(cpu,), daemon=True)
               for cpu in sorted(os.sched_getaffinity(0))] if transport == "uring" else []
    _serve_dev(fd, transport, until_init=True)  # the rings register after INIT
    for thread in threads:
        thread.start()
    _serve_dev(fd, transport)
    for thread in threads:
        thread.join(10)
    print(f"served dev={SERVED['dev']} uring={SERVED['uring']}", file=sys.stderr)
    if failed or any(thread.is_alive() for thread in threads):
        raise SystemExit(f"io_uring transport failed: {failed[0] if failed else 'hung'}")


def measure(mountpoint: Path, requests: int, files: int) -> dict[str, float]:
    path = mountpoint / "x"
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        for _ in range(requests):
            os.isatty(fd)
        ioctl = (time.perf_counter() - start) / requests
    finally:
        os.close(fd)
    start = time.perf_counter()
    for _ in range(files):
        fd = os.open(path, os.O_RDONLY)
        os.fstat(fd)
        os.close(fd)
    return {"ioctl_us": ioctl * 1e6, "opens_s": time.perf_counter() - start}


def one_run(transport: str, requests: int, files: int, work_us: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aifs-floor-") as tmp:
        mountpoint = Path(tmp)
        daemon = subprocess.Popen([sys.executable, __file__, "--serve", tmp, "--transport",
                                   transport, "--work-us", str(work_us)],
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(tmp):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{transport} daemon did not mount: "
                                     f"{daemon.stderr.read() if daemon.stderr else ''}")
                time.sleep(0.02)
            (mountpoint / "x").stat()  # the session is up (and the rings registered)
            time.sleep(0.2)
            return measure(mountpoint, requests, files)
        finally:
            kmount.unmount(tmp)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--work-us", type=int, default=0,
                        help="CPU each answer takes (busy), as a real daemon's handlers do")
    parser.add_argument("--enable-uring", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", metavar="MOUNTPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="dev", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        global WORK
        WORK = args.work_us / 1e6
        serve(args.serve, args.transport)
        return
    transports = ["dev"]
    switch = contextlib.ExitStack()
    if args.enable_uring and not uring.enabled():
        switch.enter_context(uring.switched_on())
    if uring.enabled():
        transports.append("uring")
    else:
        print("uring skipped: fuse.enable_uring is off (pass --enable-uring as root)",
              file=sys.stderr)
    results: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    with switch:
        for run in range(args.runs):
            for transport in transports if run % 2 == 0 else transports[::-1]:
                figures = one_run(transport, args.requests, args.files, args.work_us)
                results[transport].append(figures)
                print(f"run {run + 1} {transport:5}  ioctl {figures['ioctl_us']:5.1f} us  "
                      f"{args.files} open+fstat+close {figures['opens_s']:.3f} s",
                      file=sys.stderr)
    table = {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for t, rs in results.items()}
    if args.json:
        print(json.dumps({"runs": results, "median": table}, indent=1))
        return
    print(f"{'transport':10} {'ioctl round trip':>17} {f'{args.files} opens':>12}")
    for transport, figures in table.items():
        print(f"{transport:10} {figures['ioctl_us']:14.1f} us {figures['opens_s']:10.3f} s")
    if "uring" in table:
        print(f"dev / uring: ioctl {table['dev']['ioctl_us'] / table['uring']['ioctl_us']:.2f}x, "
              f"opens {table['dev']['opens_s'] / table['uring']['opens_s']:.2f}x")


if __name__ == "__main__":
    main()
