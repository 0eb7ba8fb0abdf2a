"""FUSE over io_uring (aifs/fuse/kernel/uring.py): a session served by one
ring per CPU answers what a program asks, and ends cleanly at unmount."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aifs.fuse.kernel import mount as kmount
from aifs.fuse.kernel import uring

FLOOR = Path(__file__).parent / "bench" / "transport_floor.py"


@pytest.fixture
def uring_enabled():
    """fuse.enable_uring on for the test (root), put back after."""
    if not uring.ENABLE_PARAMETER.exists():
        pytest.skip("this kernel has no FUSE over io_uring")
    was = uring.ENABLE_PARAMETER.read_text().strip()
    try:
        uring.ENABLE_PARAMETER.write_text("Y")
    except OSError as exc:
        pytest.skip(f"cannot enable fuse.enable_uring: {exc}")
    yield
    uring.ENABLE_PARAMETER.write_text(was)


def _serve(mountpoint: Path, transport: str) -> subprocess.Popen[str]:
    daemon = subprocess.Popen([sys.executable, str(FLOOR), "--serve", str(mountpoint),
                               "--transport", transport], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mountpoint):
        assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
        assert time.monotonic() < deadline, "no mount"
        time.sleep(0.02)
    return daemon


def _stop(mountpoint: Path, daemon: subprocess.Popen[str]) -> str:
    kmount.unmount(str(mountpoint))
    try:
        _, err = daemon.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.communicate()
        pytest.fail("the daemon did not end after unmount")
    assert daemon.returncode == 0, err
    assert not os.path.ismount(mountpoint)
    return err


def test_requests_go_through_the_rings_and_unmount_ends_them(tmp_path, uring_enabled):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    daemon = _serve(mountpoint, "uring")
    try:
        assert (mountpoint / "x").stat().st_size == 5
        for _ in range(50):
            fd = os.open(mountpoint / "x", os.O_RDONLY)
            try:
                assert not os.isatty(fd)  # an IOCTL, answered ENOTTY
                assert os.fstat(fd).st_size == 5
            finally:
                os.close(fd)
        with pytest.raises(FileNotFoundError):
            (mountpoint / "missing").stat()
    finally:
        err = _stop(mountpoint, daemon)
    served = dict(part.split("=") for part in err.split("served ")[-1].split())
    assert int(served["uring"]) >= 100  # the opens, ioctls and releases above
    assert int(served["dev"]) < 10  # (INIT aside) what may come before the rings are up


def test_dev_transport_serves_the_same(tmp_path):
    """The same filesystem over /dev/fuse (the floor benchmark's other side)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    daemon = _serve(mountpoint, "dev")
    try:
        fd = os.open(mountpoint / "x", os.O_RDONLY)
        try:
            assert not os.isatty(fd)
        finally:
            os.close(fd)
    finally:
        err = _stop(mountpoint, daemon)
    assert "uring=0" in err
