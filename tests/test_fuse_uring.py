"""FUSE over io_uring (aifs/fuse/kernel/uring.py, rings.py): a session
served by one ring per CPU answers what a program asks, and ends cleanly at
unmount; aifs over the rings (``fuse_transport = uring``) gives the same
files as over /dev/fuse, requests that wait on the lake included."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _make_lake

from aifs.fuse.kernel import mount as kmount

FLOOR = Path(__file__).parent / "bench" / "transport_floor.py"


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


def _served_on_rings(log: str) -> int:
    found = re.findall(r"; (\d+) of them on \d+ io_uring rings", log)
    assert found, "the session did not use io_uring rings"
    return int(found[-1])


def test_aifs_over_the_rings_writes_and_reads_what_dev_reads_back(
        request, tmp_path, mounter, monkeypatch, uring_enabled):
    lake = _make_lake("local", request, tmp_path)
    files = {f"d/f{i}.bin": os.urandom(16384) for i in range(40)}
    files["big.bin"] = os.urandom(3 << 20 | 123)
    monkeypatch.setenv("AIFS_FUSE_TRANSPORT", "uring")
    mount = mounter(lake, name="ring", cache="ring")
    (mount.path / "d").mkdir()
    for name, data in files.items():
        with open(mount.path / name, "wb") as fp:
            fp.write(data)
    os.rename(mount.path / "d/f0.bin", mount.path / "d/renamed.bin")
    files["d/renamed.bin"] = files.pop("d/f0.bin")
    os.unlink(mount.path / "d/f1.bin")
    del files["d/f1.bin"]
    assert sorted(os.listdir(mount.path / "d")) == sorted(n[2:] for n in files if "/" in n)
    for name, data in files.items():
        assert (mount.path / name).stat().st_size == len(data)
        assert (mount.path / name).read_bytes() == data
    mount.unmount()
    assert _served_on_rings(mount.log_text()) > 300
    # the same cache over /dev/fuse, then a fresh one: the lake has them too
    monkeypatch.setenv("AIFS_FUSE_TRANSPORT", "dev")
    for cache in ("ring", "fresh"):
        again = mounter(lake, name=f"dev-{cache}", cache=cache)
        for name, data in files.items():
            assert hashlib.sha256((again.path / name).read_bytes()).digest() == \
                hashlib.sha256(data).digest(), name
        again.unmount()


def test_reads_that_wait_on_the_lake_finish_over_the_rings(
        request, tmp_path, mounter, monkeypatch, uring_enabled):
    """A fresh cache: each first read waits for the lake, so its handler is
    finished by a parked trio task, and its answer goes back through the ring."""
    lake = _make_lake("local", request, tmp_path)
    files = {f"f{i}": os.urandom(50_000 + i) for i in range(30)}
    writer = mounter(lake, name="writer")
    for name, data in files.items():
        (writer.path / name).write_bytes(data)
    writer.unmount()
    monkeypatch.setenv("AIFS_FUSE_TRANSPORT", "uring")
    reader = mounter(lake, name="reader")
    for name, data in files.items():
        assert (reader.path / name).read_bytes() == data
    reader.unmount()
    log = reader.log_text()
    assert _served_on_rings(log) > 60
    assert re.search(r"\(\d+ waited\)", log.split("requests served")[-1])
