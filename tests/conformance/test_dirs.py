"""mkdir/rmdir, st_nlink, readdir with . and .., d_type, rename and its flags;
each case also on tmpfs."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from difftools import both

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4


def renameat2(old: Path, new: Path, flags: int) -> None:
    if libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def listing(path: Path) -> list[tuple[str, bool, bool, bool]]:
    return sorted((e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False),
                   e.is_symlink()) for e in os.scandir(path))


def dot_entries(path: Path) -> dict[str, int]:
    """. and .. as readdir(3) returns them (os.scandir hides them), by inode."""
    import subprocess
    out = subprocess.run(["ls", "-ai", str(path)], capture_output=True, text=True,
                         check=True).stdout.split()
    pairs = dict(zip(out[1::2], out[0::2], strict=False))
    return {name: int(pairs[name]) for name in (".", "..") if name in pairs}


def test_readdir_returns_dot_and_dotdot(sides):
    def case(root: Path):
        os.mkdir(root / "sub")
        (root / "sub" / "f").write_bytes(b"")
        dots = dot_entries(root / "sub")
        return sorted(dots), dots.get(".") == os.stat(root / "sub").st_ino, \
            dots.get("..") == os.stat(root).st_ino
    both(sides, case)


def test_directory_nlink(sides):
    def case(root: Path):
        out = []
        os.mkdir(root / "a")
        os.mkdir(root / "b")
        out.append(os.stat(root).st_nlink)
        os.mkdir(root / "a" / "x")
        os.mkdir(root / "a" / "y")
        (root / "a" / "f").write_bytes(b"")
        out.append(os.stat(root / "a").st_nlink)
        os.rename(root / "a" / "x", root / "b" / "x")
        out += [os.stat(root / "a").st_nlink, os.stat(root / "b").st_nlink]
        os.rmdir(root / "a" / "y")
        out.append(os.stat(root / "a").st_nlink)
        out.append(os.stat(root / "a" / "f").st_nlink)
        # each change after a stat: a count kept from before must follow it
        for change in (lambda: (root / "a" / "g").write_bytes(b""),
                       lambda: os.mkdir(root / "a" / "z"),
                       lambda: os.rename(root / "a" / "g", root / "a" / "h"),
                       lambda: os.link(root / "a" / "h", root / "a" / "i"),
                       lambda: os.unlink(root / "a" / "h"),
                       lambda: os.rename(root / "a" / "z", root / "b" / "z"),
                       lambda: os.rename(root / "b" / "x", root / "a" / "x"),
                       lambda: os.rmdir(root / "a" / "x")):
            change()
            out += [os.stat(root / "a").st_nlink, os.stat(root / "b").st_nlink]
        return out
    both(sides, case)


def test_mkdir_rmdir_errors(sides):
    def case(root: Path):
        out = []
        os.mkdir(root / "d")
        (root / "d" / "f").write_bytes(b"")
        (root / "file").write_bytes(b"")
        for fn, arg in ((os.mkdir, "d"), (os.rmdir, "d"), (os.rmdir, "file"),
                        (os.rmdir, "missing"), (os.mkdir, "file/x"), (os.unlink, "d"),
                        (os.rmdir, "d/."), (os.mkdir, "missing/x")):
            try:
                fn(root / arg)
                out.append("ok")
            except OSError as exc:
                out.append(exc.errno)
        return out
    both(sides, case)


def test_rename_cases(sides):
    def case(root: Path):
        out = []
        (root / "a").write_bytes(b"A")
        (root / "b").write_bytes(b"B")
        os.mkdir(root / "d")
        os.mkdir(root / "e")
        (root / "e" / "x").write_bytes(b"")
        os.mkdir(root / "empty")
        for old, new in (("a", "b"), ("b", "d"), ("d", "b"), ("d", "e"), ("d", "empty"),
                         ("empty", "empty/sub"), ("missing", "x"), ("e", "e2")):
            try:
                os.rename(root / old, root / new)
                out.append("ok")
            except OSError as exc:
                out.append(exc.errno)
        out.append(listing(root))
        return out
    both(sides, case)


def test_rename_exchange_is_refused_cleanly(sides):
    """aifs does not exchange two names (a difference listed in SEMANTICS.md):
    EINVAL, and both entries stay as they were."""
    root = sides[0].path
    (root / "a").write_bytes(b"A")
    os.mkdir(root / "d")
    try:
        renameat2(root / "a", root / "d", RENAME_EXCHANGE)
        raise AssertionError("RENAME_EXCHANGE succeeded")
    except OSError as exc:
        assert exc.errno == errno.EINVAL
    assert listing(root) == [("a", False, True, False), ("d", True, False, False)]
    assert (root / "a").read_bytes() == b"A"


def test_rename_noreplace(sides):
    def case(root: Path):
        out = []
        (root / "a").write_bytes(b"A")
        (root / "b").write_bytes(b"B")
        os.mkdir(root / "d")
        for old, new, flags in (("a", "b", RENAME_NOREPLACE), ("a", "c", RENAME_NOREPLACE),
                                ("c", "d", RENAME_NOREPLACE), ("d", "e", RENAME_NOREPLACE),
                                ("missing", "x", RENAME_NOREPLACE),
                                ("b", "e", RENAME_NOREPLACE | RENAME_EXCHANGE),
                                ("b", "e", RENAME_WHITEOUT | RENAME_EXCHANGE)):
            try:
                renameat2(root / old, root / new, flags)
                out.append("ok")
            except OSError as exc:
                out.append(exc.errno)
        out.append(listing(root))
        out.append({p.name: p.read_bytes() for p in root.iterdir() if p.is_file()})
        return out
    both(sides, case)


def test_d_type_of_every_kind(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"")
        os.mkdir(root / "d")
        os.symlink("f", root / "l")
        os.mkfifo(root / "p")
        return listing(root), [(e.name, e.inode() == os.lstat(e.path).st_ino)
                               for e in sorted(os.scandir(root), key=lambda e: e.name)]
    both(sides, case)
