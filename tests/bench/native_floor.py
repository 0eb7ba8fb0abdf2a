"""What any FUSE daemon can reach here for aifs bench's small-file rows, and
what aifs reaches, side by side: 2,000 creates of 16 KiB and 2,000 opens +
reads of them (``aifs.bench.creates``/``opens``), alternated over

- ``local``: a directory of the same disk;
- ``native``: ``native_floor.c`` (beside this file, built here with ``cc``), a
  single-threaded C loopback over a directory of that disk with aifs's mount
  options and INIT flags, passthrough, and a system call or two per request:
  the floor of the kernel's requests themselves, for a daemon with no work;
- ``native-noflush``: the same, its writable opens answered FOPEN_NOFLUSH (a
  close sends no FLUSH; aifs needs that FLUSH for its close promise);
- ``python``: the same loopback as a plain, lean Python loop (``serve_python``
  below, on aifs's wire structs): the floor of a daemon whose request path is
  Python, whatever it does per request;
- ``aifs``: ``aifs mount`` of a local-directory lake, the kernel binding.

Medians and ranges over ``--runs``; root only. The table says how much of a
row is the kernel's and the program's (the native floor) and how much is the
daemon's work.

    python tests/bench/native_floor.py [--files 2000] [--runs 5]
        [--work-dir /var/tmp] [--json]
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import FuseDaemon  # noqa: E402

from aifs.bench.mounts import Mount, timed  # noqa: E402
from aifs.bench.nvme import creates, opens  # noqa: E402
from aifs.fuse.kernel import mount as kmount  # noqa: E402
from aifs.fuse.kernel import protocol as p  # noqa: E402

SOURCE = Path(__file__).with_name("native_floor.c")
TTL = 3600


def serve_python(mountpoint: str, backing: str) -> None:
    """What native_floor.c does (flushes kept), in plain Python: nodeid = the
    backing inode number, one ``lstat`` or ``open`` and one ioctl per request."""
    fd = kmount.mount(mountpoint, {"subtype=pyfloor", "nosuid", "nodev",
                                   "default_permissions", "allow_other"})
    paths = {1: backing}
    buffer = bytearray((1 << 20) + 4096)

    def entry(path: str) -> bytes:
        st = os.lstat(path)
        paths.setdefault(st.st_ino, path)
        return p.ENTRY_HEAD.pack(st.st_ino, 0, TTL, TTL, 0, 0) + attr(st, st.st_ino)

    def attr(st: os.stat_result, ino: int) -> bytes:
        return p.ATTR.pack(ino, st.st_size, st.st_blocks, int(st.st_atime),
                           int(st.st_mtime), int(st.st_ctime), st.st_atime_ns % 10**9,
                           st.st_mtime_ns % 10**9, st.st_ctime_ns % 10**9, st.st_mode,
                           st.st_nlink, st.st_uid, st.st_gid, 0, 4096, 0)

    def passthrough(path: str, flags: int, mode: int = 0) -> bytes:
        local = os.open(path, flags & ~os.O_NOCTTY, mode)
        try:
            backing_id = fcntl.ioctl(fd, p.DEV_IOC_BACKING_OPEN,
                                     bytearray(p.BACKING_MAP.pack(local, 0, 0)), True)
        finally:
            os.close(local)
        noflush = p.FOPEN_NOFLUSH if flags & os.O_ACCMODE == os.O_RDONLY else 0
        return p.OPEN_OUT.pack(backing_id, p.FOPEN_PASSTHROUGH | noflush, backing_id)

    def name(body: memoryview, at: int) -> str:
        return os.fsdecode(bytes(body[at:]).split(b"\0", 1)[0])

    while True:
        try:
            n = os.readv(fd, [buffer])
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                continue
            return  # ENODEV: unmounted
        view = memoryview(buffer)[:n]
        _, opcode, unique, nodeid = p.IN_HEADER.unpack_from(view)[:4]
        body = view[p.IN_HEADER.size:]
        error, reply = 0, b""
        try:
            if opcode == p.INIT:
                flags = p.INIT_IN.unpack_from(body)[3]
                flags |= int.from_bytes(body[16:20], "little") << 32
                chosen = flags & (p.ASYNC_READ | p.ATOMIC_O_TRUNC | p.BIG_WRITES
                                  | p.AUTO_INVAL_DATA | p.DO_READDIRPLUS | p.READDIRPLUS_AUTO
                                  | p.ASYNC_DIO | p.PARALLEL_DIROPS | p.MAX_PAGES
                                  | p.CACHE_SYMLINKS | p.HANDLE_KILLPRIV_V2 | p.INIT_EXT
                                  | p.PASSTHROUGH)
                reply = p.INIT_OUT.pack(7, 45, 1 << 20, chosen & 0xFFFFFFFF, 64, 48, 1 << 20,
                                        1, 256, 0, chosen >> 32, 1)
            elif opcode == p.LOOKUP:
                try:
                    reply = entry(os.path.join(paths[nodeid], name(body, 0)))
                except FileNotFoundError:
                    reply = p.ENTRY_HEAD.pack(0, 0, TTL, 0, 0, 0) + bytes(p.ATTR.size)
            elif opcode == p.GETATTR:
                reply = p.ATTR_OUT_HEAD.pack(TTL, 0, 0) + attr(os.lstat(paths[nodeid]), nodeid)
            elif opcode == p.MKDIR:
                mode, umask = p.MKDIR_IN.unpack_from(body)
                path = os.path.join(paths[nodeid], name(body, p.MKDIR_IN.size))
                os.mkdir(path, mode & ~umask)
                reply = entry(path)
            elif opcode == p.CREATE:
                flags, mode, umask, _ = p.CREATE_IN.unpack_from(body)
                path = os.path.join(paths[nodeid], name(body, p.CREATE_IN.size))
                opened = passthrough(path, flags | os.O_CREAT, mode & ~umask)
                reply = entry(path) + opened
            elif opcode == p.OPEN:
                reply = passthrough(paths[nodeid], p.OPEN_IN.unpack_from(body)[0])
            elif opcode == p.RELEASE:
                fcntl.ioctl(fd, p.DEV_IOC_BACKING_CLOSE, bytearray(body[:4]), True)
            elif opcode in (p.FORGET, p.BATCH_FORGET, p.INTERRUPT):
                continue
            elif opcode == p.GETXATTR:
                error = errno.ENODATA
            elif opcode == p.IOCTL:
                error = errno.ENOTTY
            elif opcode == p.STATFS:
                reply = p.STATFS_OUT.pack(1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 4096,
                                          255, 4096, 0)
            elif opcode != p.FLUSH:
                error = errno.ENOSYS
        except OSError as exc:
            error = exc.errno or errno.EIO
        if error:
            reply = b""
        try:
            os.writev(fd, [p.OUT_HEADER.pack(16 + len(reply), -error, unique), reply])
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return


def run(files: int, runs: int, work_dir: str) -> dict[str, dict[str, list[float]]]:
    work = Path(tempfile.mkdtemp(prefix="native-floor-", dir=work_dir))
    mounts: list[FuseDaemon | Mount] = []
    try:
        binary = work / "native_floor"
        subprocess.run(["cc", "-O2", "-o", str(binary), str(SOURCE)], check=True)
        roots = {"local": work / "local"}
        roots["local"].mkdir()
        for side, argv in (("native", [str(binary)]),
                           ("native-noflush", [str(binary), "--noflush"]),
                           ("python", [sys.executable, __file__, "--serve-python"])):
            backing = work / f"back-{side}"
            backing.mkdir()
            mounts.append(FuseDaemon([*argv, str(work / f"mnt-{side}"), str(backing)],
                                     work / f"mnt-{side}", None, side))
            roots[side] = mounts[-1].path
        (work / "lake").mkdir()
        mounts.append(Mount(work / "lake", work / "mnt-aifs", work / "cache-aifs", "kernel",
                            work / "aifs.log"))
        roots["aifs"] = mounts[-1].path
        times: dict[str, dict[str, list[float]]] = {side: {} for side in roots}
        sides = list(roots)
        for rep in range(runs):
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                os.sync()
                root = roots[side] / f"run{rep}"
                times[side].setdefault("creates", []).append(timed(creates, root, files))
                times[side].setdefault("opens", []).append(timed(opens, root, files))
        return times
    finally:
        for mount in mounts:
            mount.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--work-dir", default="/var/tmp")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-python", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_python:
        serve_python(*args.serve_python)
        return
    times = run(args.files, args.runs, args.work_dir)
    if args.json:
        print(json.dumps(times))
        return
    print(f"| {args.files:,} files, {args.runs} runs | " + " | ".join(times) + " |")
    print("|---" * (len(times) + 1) + "|")
    for row in ("creates", "opens"):
        cells = [f"{statistics.median(t[row]):.3f} s ({min(t[row]):.3f}-{max(t[row]):.3f})"
                 for t in times.values()]
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
