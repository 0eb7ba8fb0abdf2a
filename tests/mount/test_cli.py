"""The aifs command: daemonized mount, umount, and one clear line for mistakes."""

from __future__ import annotations

import os
import signal

import pytest
from support.mounts import process_alive, wait_for

from aifs import __version__


def _one_clear_line(result) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_version(aifs_cli):
    result = aifs_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"aifs {__version__}"


def test_daemon_mount_and_umount_leave_nothing(lake, tmp_path, aifs_cli):
    lake.put("hello.txt", b"hello")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = aifs_cli("mount", lake.url, str(mountpoint), "--cache-dir",
                      str(tmp_path / "cache"), *lake.args, env=lake.env)
    assert result.returncode == 0, result.stderr
    try:
        assert (mountpoint / "hello.txt").read_bytes() == b"hello"
        pid = int(os.getxattr(mountpoint, "user.aifs.pid"))
        assert pid != os.getpid() and process_alive(pid)
    finally:
        umount = aifs_cli("umount", str(mountpoint))
    assert umount.returncode == 0, umount.stderr
    assert not os.path.ismount(mountpoint)
    assert not process_alive(pid)
    with open("/proc/mounts") as fp:
        assert str(mountpoint) not in fp.read()


def test_mountpoint_missing(aifs_cli, tmp_path):
    line = _one_clear_line(aifs_cli("mount", f"file://{tmp_path}", str(tmp_path / "nope")))
    assert "does not exist" in line


def test_mountpoint_busy(lake, mounter, aifs_cli, tmp_path):
    mount = mounter(lake)
    line = _one_clear_line(aifs_cli("mount", lake.url, str(mount.path), "--cache-dir",
                                    str(tmp_path / "other"), *lake.args, env=lake.env))
    assert "busy" in line


def test_cache_dir_in_use(lake, mounter, aifs_cli, tmp_path):
    mount = mounter(lake)
    (tmp_path / "second").mkdir()
    line = _one_clear_line(aifs_cli("mount", lake.url, str(tmp_path / "second"),
                                    "--cache-dir", str(mount.cache_dir), *lake.args,
                                    env=lake.env))
    assert "in use" in line
    assert not os.path.ismount(tmp_path / "second")


def test_a_mountpoint_with_files_is_refused_unless_nonempty(aifs_cli, tmp_path):
    (tmp_path / "lake").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "mine.txt").write_text("keep me")
    args = ("mount", f"file://{tmp_path}/lake", str(tmp_path / "mnt"),
            "--cache-dir", str(tmp_path / "c"))
    line = _one_clear_line(aifs_cli(*args))
    assert "not empty" in line and "-o nonempty" in line
    assert not os.path.ismount(tmp_path / "mnt")
    assert (tmp_path / "mnt" / "mine.txt").read_text() == "keep me"
    result = aifs_cli(*args, "-o", "nonempty")
    assert result.returncode == 0, result.stderr
    try:
        assert os.path.ismount(tmp_path / "mnt")
        assert os.listdir(tmp_path / "mnt") == []  # the lake's view, hiding the file
    finally:
        assert aifs_cli("umount", str(tmp_path / "mnt")).returncode == 0
    assert (tmp_path / "mnt" / "mine.txt").read_text() == "keep me"


def test_missing_local_lake(aifs_cli, tmp_path):
    (tmp_path / "mnt").mkdir()
    line = _one_clear_line(aifs_cli("mount", f"file://{tmp_path}/no-lake",
                                    str(tmp_path / "mnt"), "--cache-dir",
                                    str(tmp_path / "c")))
    assert "does not exist" in line


def test_unreachable_endpoint(aifs_cli, tmp_path):
    (tmp_path / "mnt").mkdir()
    line = _one_clear_line(aifs_cli(
        "mount", "s3://bucket/x", str(tmp_path / "mnt"), "--endpoint-url",
        "http://127.0.0.1:9", "--retries", "2", "--cache-dir", str(tmp_path / "c"),
        env={"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}))
    assert "cannot reach http://127.0.0.1:9" in line
    assert not os.path.ismount(tmp_path / "mnt")


def test_missing_bucket(s3_lake, aifs_cli, tmp_path):
    (tmp_path / "mnt").mkdir()
    line = _one_clear_line(aifs_cli(
        "mount", "s3://no-such-bucket-here", str(tmp_path / "mnt"), *s3_lake.args,
        "--cache-dir", str(tmp_path / "c"), env=s3_lake.env))
    assert "no-such-bucket-here" in line and "does not exist" in line


def test_bad_credentials(s3_lake, aifs_cli, tmp_path):
    if s3_lake.kind == "moto":
        pytest.skip("moto accepts any credentials; checked against Ceph RGW")
    (tmp_path / "mnt").mkdir()
    env = dict(s3_lake.env, AWS_ACCESS_KEY_ID="wrong", AWS_SECRET_ACCESS_KEY="wrong")
    line = _one_clear_line(aifs_cli("mount", s3_lake.url, str(tmp_path / "mnt"),
                                    *s3_lake.args, "--cache-dir", str(tmp_path / "c"),
                                    env=env))
    assert "access denied" in line


def test_bad_option_value(aifs_cli, tmp_path):
    line = _one_clear_line(aifs_cli("mount", str(tmp_path), str(tmp_path),
                                    "--cache-size", "lots"))
    assert "lots" in line


def test_killed_daemon_leaves_a_mount_that_umount_clears(lake, tmp_path, aifs_cli):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    assert aifs_cli("mount", lake.url, str(mountpoint), "--cache-dir",
                    str(tmp_path / "cache"), *lake.args, env=lake.env).returncode == 0
    pid = int(os.getxattr(mountpoint, "user.aifs.pid"))
    os.kill(pid, 9)
    wait_for(lambda: not process_alive(pid), 10, "daemon killed")
    line = _one_clear_line(aifs_cli("mount", lake.url, str(mountpoint), "--cache-dir",
                                    str(tmp_path / "cache"), *lake.args, env=lake.env))
    assert "dead mount" in line
    assert aifs_cli("umount", str(mountpoint)).returncode == 0
    assert not os.path.ismount(mountpoint)
    assert aifs_cli("mount", lake.url, str(mountpoint), "--cache-dir",
                    str(tmp_path / "cache"), *lake.args, env=lake.env).returncode == 0
    assert aifs_cli("umount", str(mountpoint)).returncode == 0


def test_sigterm_unmounts_cleanly(lake, mounter):
    mount = mounter(lake)
    os.kill(mount.proc.pid, 15)
    assert mount.proc.wait(30) == 0
    assert not os.path.ismount(mount.path)


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_sigusr1_writes_every_threads_stack_to_the_log_and_serving_goes_on(lake, mounter):
    """How an operator (or the tests' hang watchdog) sees where a daemon is stuck."""
    mount = mounter(lake)
    os.kill(mount.proc.pid, signal.SIGUSR1)
    wait_for(lambda: "Current thread" in mount.log_text() or None, 10, "a stack dump")
    assert "aifs/daemon.py" in mount.log_text().split("Current thread")[-1]
    (mount.path / "after").write_bytes(b"still serving")
    assert (mount.path / "after").read_bytes() == b"still serving"
