"""What ``aifs bench`` measures with: FUSE daemons it starts and stops (aifs
of one binding, s3fs), a process's CPU time, whole reads, and dropping the
page cache."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aifs.daemon import mount_type
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


def read_all(path: Path) -> int:
    """Read ``path`` to its end; the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as fp:
        while got := fp.readinto(BUFFER):
            total += got
    return total


def read_with_cpu(path: Path, pid: int, size: int) -> tuple[float, float]:
    """(seconds, CPU seconds of process ``pid``) of one whole read of ``path``,
    the page cache dropped first; its ``size`` bytes must all come back."""
    drop_caches()
    cpu = daemon_cpu(pid)
    start = time.perf_counter()
    try:
        got = read_all(path)
    except OSError as exc:
        raise ConfigError(f"bench: reading {path} failed: {exc}") from None
    seconds = time.perf_counter() - start
    if got != size:
        raise ConfigError(f"bench: {path} gave {got} of its {size} bytes")
    return seconds, daemon_cpu(pid) - cpu


def mounted(path: Path) -> bool:
    """Whether something is mounted on ``path``, a dead FUSE mount too (which
    :func:`os.path.ismount` cannot stat)."""
    return mount_type(os.path.join(os.path.realpath(path.parent), path.name)) is not None


class Daemon:
    """A FUSE daemon run in the foreground, waited for until it serves ``path``;
    :meth:`stop` unmounts it with ``unmount`` (lazily if that will not do) and
    reaps the process."""

    def __init__(self, command: list[str], path: Path, log: Path, what: str,
                 unmount: list[str], env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.unmount = unmount
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        try:
            deadline = time.monotonic() + 60
            while not os.path.ismount(path):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    said = [line for line in log.read_text(errors="replace").splitlines()
                            if line.strip()]  # (the work directory and its log go)
                    raise ConfigError(f"bench: {what} did not come up"
                                      + (f": {said[-1].strip()}" if said else ""))
                time.sleep(0.05)
        except BaseException:  # (an interrupt too): no daemon or mount left
            self.stop()
            raise

    def stop(self) -> None:
        if mounted(self.path):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(self.unmount, capture_output=True, timeout=600)
        elif self.proc.poll() is None:  # never mounted: nothing to drain
            self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if mounted(self.path):  # a dead mount, or one the daemon did not release
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


class Mount(Daemon):
    """``aifs mount LAKE PATH --foreground`` with one binding and the mount
    options ``options``."""

    def __init__(self, lake: str, path: Path, cache: Path, binding: str, log: Path,
                 options: list[str] | None = None) -> None:
        command = [sys.executable, "-m", "aifs", "mount", lake, str(path), "--foreground",
                   "--cache-dir", str(cache), "--fuse-binding", binding, "--log-level",
                   "warning", *(options or [])]
        super().__init__(command, path, log, f"the {binding} mount",
                         [sys.executable, "-m", "aifs", "umount", str(path)])


class S3fsMount(Daemon):
    """``s3fs BUCKET PATH -f`` with its defaults (no local cache: every read
    from the lake), its temporary files in ``tmpdir`` (the disk aifs caches
    on). The credentials go in its environment (s3fs 1.90 and later read
    ``AWS_ACCESS_KEY_ID`` and the others there first), never on its command
    line or in a file."""

    def __init__(self, binary: str, bucket: str, path: Path, log: Path, tmpdir: Path,
                 endpoint: str, region: str, path_style: bool,
                 credentials: dict[str, str]) -> None:
        options = [f"url={endpoint}", f"endpoint={region}", f"tmpdir={tmpdir}"]
        if path_style:
            options.append("use_path_request_style")
        env = {name: value for name, value in os.environ.items()
               if name not in CREDENTIAL_NAMES}
        super().__init__([binary, bucket, str(path), "-f", "-o", ",".join(options)], path,
                         log, "s3fs", ["umount", str(path)], dict(env, **credentials))


#: where s3fs looks for credentials in its environment (none may be stale)
CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "AWSACCESSKEYID", "AWSSECRETACCESSKEY", "AWSSESSIONTOKEN")
