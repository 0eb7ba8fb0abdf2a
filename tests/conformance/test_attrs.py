"""chmod, chown, utimensat and their fd forms, also on files open for writing;
modes as given; set-user-ID cleared as Linux does. Each case runs on aifs and
on tmpfs; results and errno must match."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from difftools import both, fresh_stat
from support.mounts import wait_for


def test_futimens_on_a_file_open_for_writing_keeps_its_data(sides):
    """cp -p / tar x: write, then set the times through the descriptor, close."""
    def case(root: Path):
        fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x" * 100_000)
        os.utime(fd, ns=(1_000_000_000_123, 2_000_000_000_456))
        size_open = os.fstat(fd).st_size
        os.close(fd)
        st = os.stat(root / "f")
        return size_open, st.st_size, st.st_mtime_ns, st.st_atime_ns, \
            (root / "f").read_bytes() == b"x" * 100_000
    both(sides, case)


def test_fchmod_and_fchown_on_a_file_open_for_writing_keep_its_data(sides):
    def case(root: Path):
        fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"y" * 5000)
        os.fchmod(fd, 0o600)
        os.fchown(fd, 1234, 5678)
        os.write(fd, b"z" * 10)
        os.close(fd)
        st = os.stat(root / "f")
        return st.st_size, oct(st.st_mode), st.st_uid, st.st_gid, (root / "f").read_bytes()
    both(sides, case)


def test_times_set_while_open_survive_a_remount(sides, conf_mount):
    fd = os.open(sides[0].path / "f", os.O_WRONLY | os.O_CREAT, 0o640)
    os.write(fd, b"data" * 1000)
    os.utime(fd, ns=(1_500_000_000_000_000_001, 1_600_000_000_000_000_002))
    os.fchmod(fd, 0o604)
    os.close(fd)
    st = fresh_stat(conf_mount, sides[0].path / "f")
    assert (st.st_size, st.st_mtime_ns, st.st_atime_ns, oct(st.st_mode & 0o7777)) == \
        (4000, 1_600_000_000_000_000_002, 1_500_000_000_000_000_001, oct(0o604))
    assert (sides[0].path / "f").read_bytes() == b"data" * 1000


def test_atime_is_stored(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"a")
        os.utime(root / "f", ns=(5_000_000_007, 9_000_000_011))
        first = os.stat(root / "f")
        os.utime(root / "f", ns=(7_000_000_000, 9_000_000_011))
        second = os.stat(root / "f")
        os.mkdir(root / "d")
        os.utime(root / "d", ns=(3_000_000_000, 4_000_000_000))
        third = os.stat(root / "d")
        return (first.st_atime_ns, first.st_mtime_ns, second.st_atime_ns,
                third.st_atime_ns, third.st_mtime_ns)
    both(sides, case)


def test_utime_now_and_omit(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"a")
        os.utime(root / "f", ns=(1_000_000_000, 2_000_000_000))
        os.utime(root / "f")  # both to now
        st = os.stat(root / "f")
        import time
        return abs(st.st_mtime - time.time()) < 5, abs(st.st_atime - time.time()) < 5
    both(sides, case)


def test_modes_are_honoured_as_given(sides):
    def case(root: Path):
        old = os.umask(0)
        try:
            fd = os.open(root / "zero", os.O_WRONLY | os.O_CREAT, 0)
            os.close(fd)
            os.mkdir(root / "dzero", 0)
            os.mkdir(root / "sticky", 0o1777)
            fd = os.open(root / "suid", os.O_WRONLY | os.O_CREAT, 0o4755)
            os.close(fd)
            os.chmod(root / "zero", 0)
            modes = [oct(os.lstat(root / n).st_mode) for n in ("zero", "dzero", "sticky", "suid")]
        finally:
            os.umask(old)
        os.chmod(root / "dzero", 0o700)
        return modes
    both(sides, case)


def test_umask_applies(sides):
    def case(root: Path):
        old = os.umask(0o027)
        try:
            fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT, 0o777)
            os.close(fd)
            os.mkdir(root / "d", 0o777)
        finally:
            os.umask(old)
        return oct(os.stat(root / "f").st_mode), oct(os.stat(root / "d").st_mode)
    both(sides, case)


def test_ctime_moves_on_chmod_and_write(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"a")
        os.utime(root / "f", ns=(1_000_000_000, 1_000_000_000))
        before = os.stat(root / "f").st_ctime_ns
        wait_for(lambda: True, 1, "nothing")
        import time
        time.sleep(0.02)  # ctime resolution: a change must read as later
        os.chmod(root / "f", 0o600)
        after = os.stat(root / "f").st_ctime_ns
        return after > before
    both(sides, case)


def test_xattr_create_and_replace_flags(sides):
    def case(root: Path):
        f = root / "xf"
        f.write_bytes(b"")
        out = []
        for name, value, flags in (("user.a", b"1", os.XATTR_CREATE),
                                   ("user.a", b"2", os.XATTR_CREATE),
                                   ("user.a", b"3", os.XATTR_REPLACE),
                                   ("user.b", b"4", os.XATTR_REPLACE),
                                   ("user.b", b"5", 0)):
            try:
                os.setxattr(f, name, value, flags)
                out.append("ok")
            except OSError as exc:
                out.append(errno.errorcode[exc.errno])
        out.append(sorted((n, os.getxattr(f, n)) for n in os.listxattr(f)))
        return out
    both(sides, case)
