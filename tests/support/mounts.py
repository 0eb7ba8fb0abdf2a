"""Real FUSE mounts in subprocesses (``Mount``, the ``mounter`` fixture), the
``aifs`` command (``aifs_cli``), a tmpfs to compare with, and small helpers every
kind of test uses: ``wait_for``, ``process_alive``, ``file_digest``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import xxhash

from aifs.cli import process_alive  # noqa: F401  (re-exported for the tests)

if TYPE_CHECKING:
    from support.lakes import Lake

REPO = Path(__file__).resolve().parent.parent.parent
HELPER = REPO / "mount" / "mount.aifs"  # mount(8)'s and umount(8)'s helper
AIFS = Path(sys.executable).parent / "aifs"  # the command, as installed with the tests


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             interval: float = 0.05) -> object:
    """Poll ``condition`` until it returns a true value, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Mount:
    """``aifs mount --foreground`` in a subprocess (pyfuse3 allows one mount per
    process); unmounted with ``aifs umount`` on close."""

    #: daemons running now, for the hang watchdog
    live: set[Mount] = set()

    def __init__(self, lake: Lake, mountpoint: Path, cache_dir: Path, log: Path,
                 extra: list[str]) -> None:
        self.lake = lake
        self.path = mountpoint
        self.cache_dir = cache_dir
        self.log = log
        mountpoint.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **lake.env)
        self.env = env
        with open(log, "ab") as fp:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aifs", "mount", lake.url, str(mountpoint),
                 "--foreground", "--cache-dir", str(cache_dir), "--log-level", "debug",
                 *lake.args, *extra], env=env, stdout=fp, stderr=subprocess.STDOUT)
        Mount.live.add(self)
        try:
            wait_for(lambda: os.path.ismount(mountpoint) or self.proc.poll() is not None,
                     60, f"mount on {mountpoint}")
        except AssertionError:
            self.kill()
            raise
        if self.proc.poll() is not None:
            raise AssertionError(f"aifs mount exited with {self.proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")

    def unmount(self) -> None:
        if self.proc.poll() is None or os.path.ismount(self.path):
            result = subprocess.run([sys.executable, "-m", "aifs", "umount", str(self.path)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0 and os.path.ismount(self.path):
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("aifs daemon did not exit after unmount") from None
        finally:
            Mount.live.discard(self)
        assert not os.path.ismount(self.path)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        Mount.live.discard(self)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                       capture_output=True)

    def dump_stacks_and_kill(self) -> None:
        """For a daemon that stopped answering: its threads' stacks go to its
        log (SIGUSR1), then SIGKILL, which ends the kernel's wait of whatever
        test call was blocked on the mount (ENOTCONN)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
        self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def mounter(tmp_path) -> Iterator[Callable[..., Mount]]:
    """Mount a lake: ``mounter(lake, *extra_args, name="m")``; all unmounted at the end."""
    mounts: list[Mount] = []

    def make(lake: Lake, *extra: str, name: str = "m", cache: str | None = None) -> Mount:
        mount = Mount(lake, tmp_path / f"mnt-{name}", tmp_path / f"cache-{cache or name}",
                      tmp_path / f"{name}.log", list(extra))
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        if mount.proc.poll() is None or os.path.ismount(mount.path):
            mount.unmount()


@pytest.fixture
def aifs_cli() -> Callable[..., subprocess.CompletedProcess]:
    def run(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aifs", *args], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    return run


def file_digest(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as fp:
        while chunk := fp.read(4 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


# -- a tmpfs as the reference (Linux, not our opinion): the conformance suite
# (tests/conformance/conftest.py) and the mount tests compare with it.


@pytest.fixture(scope="session")
def tmpfs(tmp_path_factory) -> Iterator[Path]:
    """A tmpfs, the reference every case is also run on."""
    path = open_dir() / "tmpfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(path)],
                   check=True)
    os.chmod(path, 0o777)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)
    shutil.rmtree(path.parent, ignore_errors=True)


def open_dir() -> Path:
    """A new directory other users can reach (pytest's tmp_path is root's
    alone): permission cases switch to nobody."""
    path = Path(tempfile.mkdtemp(prefix="aifs-conf-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path
