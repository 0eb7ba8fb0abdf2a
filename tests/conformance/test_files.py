"""open/creat flags, read/write at offsets and past EOF, truncate, fallocate,
and files that are open when they are unlinked; each case also on tmpfs."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest
from difftools import both

libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def test_open_flags(sides):
    def case(root: Path):
        out = []
        for flags in (os.O_RDONLY, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                      os.O_WRONLY | os.O_CREAT | os.O_EXCL, os.O_RDWR | os.O_APPEND,
                      os.O_RDONLY | os.O_DIRECTORY, os.O_WRONLY | os.O_TRUNC):
            try:
                fd = os.open(root / "f", flags, 0o644)
                os.write(fd, b"abc") if flags & (os.O_WRONLY | os.O_RDWR) else None
                os.close(fd)
                out.append(("ok", os.stat(root / "f").st_size))
            except OSError as exc:
                out.append(("err", exc.errno))
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_CREAT | os.O_EXCL):
            try:
                os.close(os.open(root, flags))
                out.append("dir ok")
            except OSError as exc:
                out.append(("dir err", exc.errno))
        try:
            os.open(root / "missing" / "x", os.O_CREAT | os.O_WRONLY)
        except OSError as exc:
            out.append(exc.errno)
        return out
    both(sides, case)


def test_terminal_ioctls_on_files_fail_as_on_tmpfs(sides):
    """``isatty()`` (every Python ``open()`` asks) and other ioctls a file
    does not support fail with ENOTTY, open for reading or writing."""
    import fcntl
    import termios

    def case(root: Path):
        (root / "f").write_bytes(b"abc")
        out = []
        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_CREAT):
            fd = os.open(root / "f", flags, 0o644)
            try:
                out.append(os.isatty(fd))
                for request in (termios.TCGETS, termios.TIOCGWINSZ):
                    try:
                        fcntl.ioctl(fd, request, bytes(64))
                        out.append("ok")
                    except OSError as exc:
                        out.append(exc.errno)
            finally:
                os.close(fd)
        out.append((root / "f").read_bytes())
        return out
    both(sides, case)


def test_read_only_open_with_o_trunc_truncates(sides):
    """Linux truncates on O_RDONLY|O_TRUNC (POSIX leaves it open); the handle
    still cannot write. Found by the fsx random-operation test."""
    def case(root: Path):
        (root / "f").write_bytes(b"x" * 5000)
        fd = os.open(root / "f", os.O_RDONLY | os.O_TRUNC)
        try:
            size = os.fstat(fd).st_size
            try:
                os.write(fd, b"y")
                wrote = "wrote"
            except OSError as exc:
                wrote = exc.errno
            read = os.pread(fd, 10, 0)
        finally:
            os.close(fd)
        return size, wrote, read, os.stat(root / "f").st_size
    both(sides, case)


def test_writes_at_offsets_and_past_eof(sides):
    def case(root: Path):
        fd = os.open(root / "f", os.O_RDWR | os.O_CREAT, 0o644)
        os.pwrite(fd, b"hello", 0)
        os.pwrite(fd, b"world", 100_000)  # a hole
        os.pwrite(fd, b"XY", 3)
        st = os.fstat(fd)
        head = os.pread(fd, 10, 0)
        middle = os.pread(fd, 20, 99_990)
        past = os.pread(fd, 10, 200_000)
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, b"end")
        os.close(fd)
        fd = os.open(root / "f", os.O_WRONLY | os.O_APPEND)
        os.pwrite(fd, b"app", 0)  # O_APPEND: the offset is ignored (Linux)
        os.close(fd)
        data = (root / "f").read_bytes()
        return st.st_size, head, middle, past, len(data), data[-6:]
    both(sides, case)


def test_truncate_and_ftruncate(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"0123456789" * 1000)
        os.truncate(root / "f", 5)
        a = (root / "f").read_bytes()
        os.truncate(root / "f", 20)
        b = (root / "f").read_bytes()
        fd = os.open(root / "f", os.O_RDWR)
        os.write(fd, b"abc")
        os.ftruncate(fd, 2)
        os.write(fd, b"Z")  # at offset 3: a hole of one byte
        c = os.pread(fd, 100, 0)
        os.close(fd)
        errors = []
        for bad in (-1,):
            try:
                os.truncate(root / "f", bad)
            except OSError as exc:
                errors.append(exc.errno)
        try:
            os.truncate(root, 0)
        except OSError as exc:
            errors.append(exc.errno)
        return a, b, c, errors
    both(sides, case)


def test_posix_fallocate_works_and_other_modes_are_refused(sides):
    def case(root: Path):
        fd = os.open(root / "f", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 10)
        os.posix_fallocate(fd, 0, 50_000)
        size = os.fstat(fd).st_size
        data = os.pread(fd, 20, 0)
        os.close(fd)
        return size, data
    both(sides, case)
    fd = os.open(sides[0].path / "f", os.O_RDWR)
    try:
        result = libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                ctypes.c_long(0), ctypes.c_long(4096))
        assert result == -1 and ctypes.get_errno() == errno.EOPNOTSUPP
    finally:
        os.close(fd)


def test_open_then_unlinked_file_stays_usable(sides):
    """tmpfile, sqlite and pip rely on it: data readable and writable until
    the last close, st_nlink 0."""
    def case(root: Path):
        fd = os.open(root / "f", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, b"before" * 1000)
        os.unlink(root / "f")
        st = os.fstat(fd)
        os.write(fd, b"after")
        os.fsync(fd)
        data = os.pread(fd, 10_000, 0)
        st2 = os.fstat(fd)
        os.close(fd)
        return st.st_size, st.st_nlink, st2.st_size, st2.st_nlink, data[:12], data[-5:], \
            sorted(os.listdir(root))
    both(sides, case)


def test_file_replaced_by_rename_while_open_stays_usable(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"old content")
        fd = os.open(root / "f", os.O_RDWR)
        (root / "g").write_bytes(b"new")
        os.rename(root / "g", root / "f")
        os.pwrite(fd, b"OLD", 0)
        st = os.fstat(fd)
        data = os.pread(fd, 100, 0)
        os.close(fd)
        return st.st_nlink, data, (root / "f").read_bytes()
    both(sides, case)


def test_open_unlinked_file_of_the_lake_reads_whole(sides, conf_mount):
    """A file already in the lake (no local copy), opened, then unlinked."""
    path = sides[0].path / "f"
    path.write_bytes(b"lake" * 50_000)
    os.getxattr(path, "user.aifs.sync")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 300_000, 0) == b"lake" * 50_000
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20])
def test_read_back_sizes(sides, size):
    def case(root: Path):
        data = os.urandom(size)
        (root / "f").write_bytes(data)
        return (root / "f").read_bytes() == data, os.stat(root / "f").st_size
    both(sides, case)
