"""Write-back cache space, unmount durability and other writers, through a real mount."""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time

import pytest
from support.mounts import AIFS, HELPER, wait_for

MiB = 1 << 20


def _in_lake(lake, key: str) -> bytes | None:
    try:
        return lake.get(key)
    except Exception:
        return None


def _sync(aifs_cli, path) -> None:
    result = aifs_cli("sync", str(path))
    assert result.returncode == 0, result.stderr


def _local_bytes(mount) -> int:
    files = mount.cache_dir / "files"
    return sum(f.stat().st_size for f in files.iterdir() if f.is_file())


def test_writers_wait_for_promotion_when_the_cache_is_full(lake, mounter, aifs_cli):
    """Dirty data over --cache-size is promoted at once (despite a long delay)
    and clean copies are evicted; nothing fails and nothing is lost."""
    mount = mounter(lake, "--cache-size", "8M", "--block-size", "1M",
                    "--promote-delay", "3600")
    contents = {f"f{i}": random.Random(i).randbytes(3 * MiB) for i in range(8)}
    for name, data in contents.items():
        (mount.path / name).write_bytes(data)
        assert _local_bytes(mount) <= 8 * MiB + 3 * MiB  # at most one file over
    # 24 MiB written into an 8 MiB cache: most of it had to reach the lake already
    in_lake = [name for name in contents if _in_lake(lake, name) == contents[name]]
    assert len(in_lake) >= 4, in_lake
    for name, data in contents.items():
        assert (mount.path / name).read_bytes() == data
    _sync(aifs_cli, mount.path)
    assert all(lake.get(name) == data for name, data in contents.items())


def test_umount_promotes_everything(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "3600")
    (mount.path / "d").mkdir()
    (mount.path / "d" / "a").write_bytes(b"a" * 1000)
    (mount.path / "b").write_bytes(b"b")
    assert _in_lake(lake, "b") is None  # the delay has not passed
    result = aifs_cli("umount", str(mount.path))
    assert result.returncode == 0, result.stderr
    assert lake.get("d/a") == b"a" * 1000 and lake.get("b") == b"b"


def test_umount_no_flush_leaves_changes_for_the_next_mount(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "3600", name="first")
    (mount.path / "kept").write_bytes(b"in the cache only")
    result = aifs_cli("umount", "--no-flush", str(mount.path))
    assert result.returncode == 0, result.stderr
    mount.proc.wait(30)
    assert _in_lake(lake, "kept") is None
    again = mounter(lake, "--promote-delay", "0.2", name="second", cache="first")
    assert (again.path / "kept").read_bytes() == b"in the cache only"
    _sync(aifs_cli, again.path)
    assert lake.get("kept") == b"in the cache only"


def test_sync_reports_a_path_outside_any_mount(aifs_cli, tmp_path):
    result = aifs_cli("sync", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "not in an aifs mount" in result.stderr


def test_another_writers_version_is_never_hidden_by_a_local_copy(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", "--metadata-ttl", "1")
    path = mount.path / "shared.txt"
    path.write_bytes(b"version 1 from this node")
    _sync(aifs_cli, mount.path)
    assert path.read_bytes() == b"version 1 from this node"  # a clean local copy now
    lake.put("shared.txt", b"version 2, written by another tool")
    wait_for(lambda: path.read_bytes() == b"version 2, written by another tool", 20,
             "the other writer's version through the mount")
    with open(path, "r+b") as fp:
        fp.write(b"VERSION 3")
    _sync(aifs_cli, mount.path)
    assert lake.get("shared.txt") == b"VERSION 3, written by another tool"


def test_this_nodes_write_wins_over_an_unseen_change_with_a_warning(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", "--metadata-ttl", "3600")
    path = mount.path / "shared.txt"
    path.write_bytes(b"version 1")
    _sync(aifs_cli, mount.path)
    lake.put("shared.txt", b"version 2 from elsewhere")
    with open(path, "ab") as fp:  # this node has not seen version 2
        fp.write(b"!")
    _sync(aifs_cli, mount.path)
    assert lake.get("shared.txt") == b"version 1!"
    assert "changed in the lake since this node read it" in mount.log_text()


def test_sigterm_promotes_before_the_daemon_exits(lake, mounter):
    """systemd stops a mount with SIGTERM: what is pending reaches the lake first."""
    mount = mounter(lake, "--promote-delay", "3600")
    (mount.path / "late.bin").write_bytes(b"written just before the stop")
    assert _in_lake(lake, "late.bin") is None
    mount.proc.terminate()
    assert mount.proc.wait(60) == 0
    assert not os.path.ismount(mount.path)
    assert lake.get("late.bin") == b"written just before the stop"


def _detach_lazily_while_writing(lake, mounter, command: list[str]) -> None:
    mount = mounter(lake, "--promote-delay", "3600")
    (mount.path / "closed.bin").write_bytes(b"c" * 5000)
    first, second = random.Random(1).randbytes(3 * MiB), random.Random(2).randbytes(MiB)
    with open(mount.path / "open.bin", "wb") as fp:
        fp.write(first)
        fp.flush()
        result = subprocess.run([*command, str(mount.path)], capture_output=True, text=True,
                                env=dict(os.environ, AIFS=str(AIFS)), timeout=120)
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mount.path)
        fp.write(second)
        assert mount.proc.poll() is None  # the open file keeps the daemon serving
    assert mount.proc.wait(60) == 0
    assert lake.get("closed.bin") == b"c" * 5000
    assert lake.get("open.bin") == first + second
    again = mounter(lake, name="again")
    assert (again.path / "open.bin").read_bytes() == first + second


def test_umount_l_while_a_writer_holds_a_file_loses_none_of_its_writes(lake, mounter):
    """``umount -l`` (the kernel's lazy detach, as a person or a script runs it)
    while a program still has a file open for writing: the mountpoint is free at
    once, the program's descriptor keeps working, and when it closes the daemon
    promotes everything and exits 0. A new mount on an empty cache reads every
    byte, as ext4 keeps a lazily detached file's writes."""
    _detach_lazily_while_writing(lake, mounter, ["umount", "-i", "-l"])  # (-i: no helper)


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # the command's logic only
@pytest.mark.parametrize("how", ["helper", "aifs"])
def test_umount_l_through_the_helper_and_aifs_umount_lazy_detach_too(lake, mounter,
                                                                     tmp_path, how):
    """The same through umount(8)'s helper (``/sbin/umount.fuse.aifs``, which
    the install puts there: it once made ``umount -l`` a plain unmount that
    failed as busy) and through ``aifs umount --lazy``."""
    if how == "helper":
        helper = tmp_path / "umount.fuse.aifs"  # the name says which helper it is
        helper.symlink_to(HELPER)
        command = [str(helper), "-l"]
    else:
        command = [str(AIFS), "umount", "--lazy"]
    _detach_lazily_while_writing(lake, mounter, command)


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_promotion_yields_to_a_busy_mount_and_a_sync_does_not_wait_for_it(lake, mounter,
                                                                           aifs_cli):
    """While a program keeps the mount busy (thousands of opens a second, as a
    DataLoader's workers do), promotion reads its copies at ``promote_busy_rate``;
    ``aifs sync`` does not wait for that pace, and once the program stops,
    promotion goes at full speed (flush.pacing)."""
    mount = mounter(lake, "--promote-delay", "0.2", "--promote-busy-rate", "1M")
    (mount.path / "sample").write_bytes(b"a sample")
    stop = threading.Event()
    opens = [0]

    def dataloader() -> None:
        while not stop.is_set():
            os.close(os.open(mount.path / "sample", os.O_RDONLY))
            opens[0] += 1

    reader = threading.Thread(target=dataloader)
    reader.start()
    try:
        wait_for(lambda: opens[0] > 1000, 30, "the reader under way")
        first = random.Random(4).randbytes(8 * MiB)  # 8 s at the busy rate
        (mount.path / "first.bin").write_bytes(first)
        due = time.monotonic() + 0.2
        # held back: still out of the lake 2 s after it fell due (unpaced: ~0.1 s)
        while time.monotonic() < due + 2:
            assert _in_lake(lake, "first.bin") is None, "promoted at full speed while busy"
            time.sleep(0.1)
        started = time.monotonic()
        _sync(aifs_cli, mount.path)
        assert lake.get("first.bin") == first
        assert time.monotonic() - started < 5  # what the pace still needed: 5-6 s
        second = random.Random(5).randbytes(32 * MiB)  # 32 s at the busy rate
        (mount.path / "second.bin").write_bytes(second)
    finally:
        stop.set()
        reader.join()
    wait_for(lambda: _in_lake(lake, "second.bin") == second, 20,
             "second.bin at full speed once the mount is idle")
