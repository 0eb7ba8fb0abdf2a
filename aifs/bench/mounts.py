"""What ``aifs bench`` measures with: FUSE daemons it starts and stops (aifs
of one binding, s3fs), a process's CPU time, whole reads, and dropping the
page cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aifs.errors import ConfigError

MiB = 1 << 20
BUFFER = bytearray(MiB)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fp:
        fp.write("1\n")


def daemon_cpu(pid: int) -> float:
    """CPU seconds the process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def read_all(path: Path) -> None:
    with open(path, "rb", buffering=0) as fp:
        while fp.readinto(BUFFER):
            pass


def read_with_cpu(path: Path, pid: int) -> tuple[float, float]:
    """(seconds, CPU seconds of process ``pid``) of one whole read of ``path``,
    the page cache dropped first."""
    drop_caches()
    cpu = daemon_cpu(pid)
    seconds = timed(read_all, path)
    return seconds, daemon_cpu(pid) - cpu


class Daemon:
    """A FUSE daemon run in the foreground, waited for until it serves ``path``;
    :meth:`stop` unmounts it with ``unmount`` (lazily if that will not do) and
    reaps the process."""

    def __init__(self, command: list[str], path: Path, log: Path, what: str,
                 unmount: list[str], env: dict[str, str] | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.unmount = unmount
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while not os.path.ismount(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"bench: {what} did not come up (log: {log})")
            time.sleep(0.05)

    def stop(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(self.unmount, capture_output=True, timeout=600)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if os.path.ismount(self.path):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class Mount(Daemon):
    """``aifs mount LAKE PATH --foreground`` with one binding (``uring``: the
    kernel binding over FUSE over io_uring) and the mount options ``options``."""

    def __init__(self, lake: str, path: Path, cache: Path, binding: str, log: Path,
                 options: list[str] | None = None) -> None:
        env = dict(os.environ, AIFS_FUSE_TRANSPORT="uring" if binding == "uring" else "dev")
        command = [sys.executable, "-m", "aifs", "mount", lake, str(path), "--foreground",
                   "--cache-dir", str(cache), "--fuse-binding",
                   "kernel" if binding == "uring" else binding, "--log-level", "warning",
                   *(options or [])]
        super().__init__(command, path, log, f"the {binding} mount",
                         [sys.executable, "-m", "aifs", "umount", str(path)], env)


class S3fsMount(Daemon):
    """``s3fs BUCKET PATH -f`` with its defaults (no local cache: every read
    from the lake). The credentials go in its environment, never on its
    command line or in a file."""

    def __init__(self, binary: str, bucket: str, path: Path, log: Path, endpoint: str,
                 path_style: bool, credentials: dict[str, str]) -> None:
        options = ["use_path_request_style"] if path_style else []
        if endpoint:
            options.append(f"url={endpoint}")
        command = [binary, bucket, str(path), "-f"] + (["-o", ",".join(options)]
                                                       if options else [])
        super().__init__(command, path, log, "s3fs", ["fusermount3", "-u", str(path)],
                         dict(os.environ, **credentials))
