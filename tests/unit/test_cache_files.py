"""Local copies (the write-back files): the empty files made ahead for creates."""

from __future__ import annotations

import os
import threading

from support.mounts import wait_for

from aifs.cache.files import SPARES_MIN, LocalFiles


def _spares(local: LocalFiles) -> list[str]:
    return sorted(name for name in os.listdir(local.root) if name.startswith("spare-"))


def _inode_numbers(local: LocalFiles, names: list[str]) -> set[int]:
    return {os.stat(local.root / name).st_ino for name in names}


def test_a_burst_of_creates_takes_the_spares_and_the_next_finds_twice_as_many(tmp_path):
    local = LocalFiles(tmp_path, idle=lambda: True)
    local.start_spares()
    try:
        wait_for(lambda: len(_spares(local)) == SPARES_MIN, 20, "the first spares")
        made = _inode_numbers(local, _spares(local))
        burst = SPARES_MIN + 36
        fds = [local.create(ino) for ino in range(2, 2 + burst)]
        copies = {os.fstat(fd).st_ino for fd in fds}
        assert made <= copies  # every spare became a copy
        assert all(os.fstat(fd).st_size == 0 for fd in fds)
        assert all(local.path(ino).exists() for ino in range(2, 2 + burst))
        wait_for(lambda: len(_spares(local)) >= 2 * burst, 30,
                 "spares for a burst twice the size of the last")
    finally:
        local.close()


def test_spares_outlive_the_mount_and_one_holding_bytes_is_dropped(tmp_path):
    """A spare an admission was writing into when the daemon died holds
    bytes: the next mount deletes it; the empty ones serve its creates."""
    local = LocalFiles(tmp_path, idle=lambda: True)
    local.start_spares()
    wait_for(lambda: len(_spares(local)) == SPARES_MIN, 20, "the first spares")
    local.close()
    names = _spares(local)
    (local.root / names[0]).write_bytes(b"an admission cut short")
    kept = _inode_numbers(local, names[1:])

    again = LocalFiles(tmp_path, idle=lambda: True)  # (no maker: only what was kept)
    try:
        assert _spares(again) == names[1:]
        fd = again.create(7)
        assert os.fstat(fd).st_ino in kept
        assert os.fstat(fd).st_size == 0
        assert again.path(7).read_bytes() == b""
    finally:
        again.close()


def test_no_spare_is_made_while_the_cpus_are_busy(tmp_path):
    asked = threading.Semaphore(0)

    def busy() -> bool:
        asked.release()
        return False

    local = LocalFiles(tmp_path, idle=busy)
    local.start_spares()
    try:
        for _ in range(3):  # the maker asked three times, and was told no each time
            assert asked.acquire(timeout=20)
        assert _spares(local) == []
        fd = local.create(2)  # a create makes its own file meanwhile
        assert os.fstat(fd).st_size == 0
    finally:
        local.close()


def test_the_recovery_directory_keeps_its_cap_dropping_the_oldest_first(tmp_path):
    """Files set aside (a write failed, a crash came) fill the recovery
    directory up to recovered_max: a newer one pushes out the oldest; one
    larger than the cap is not kept at all, and keeps what was kept."""
    from aifs.posix.recovery import Recovery

    local = LocalFiles(tmp_path, idle=lambda: True)
    recovery = Recovery(None, local, keep_max=5 << 20)  # type: ignore[arg-type]
    for ino, key, size in [(1, "old.bin", 2), (2, "mid.bin", 2), (3, "new.bin", 2),
                           (4, "huge.bin", 6)]:
        local.create(ino)
        with open(local.path(ino), "wb") as fp:
            fp.write(b"x" * (size << 20))
        local.resized(ino, size << 20)
        recovery.set_aside(ino, key, "test")
        assert not local.has(ino) and not local.path(ino).exists()
        kept = recovery.recovered_dir / recovery.stamp / key
        if kept.exists():
            os.utime(kept, (ino, ino))  # set aside in this order, seconds apart
    kept = sorted(p.name for p in (recovery.recovered_dir / recovery.stamp).iterdir())
    assert kept == ["mid.bin", "new.bin"]
    assert local.used == 0
