"""Permission checks and set-ID clearing as a non-root user (``setpriv`` to
nobody), on aifs (mounted with allow_other) and on tmpfs, compared."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from difftools import as_user, both

NOBODY = 65534

# Runs as nobody: each step's result or errno, printed as a Python literal.
STEPS = r"""
import os, sys
root = sys.argv[1]
def step(fn, *args):
    try:
        result = fn(*args)
        return "ok" if result is None else result
    except OSError as exc:
        return exc.errno
def write(path, data, flags=os.O_WRONLY):
    fd = os.open(path, flags, 0o644)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)
out = []
"""


def run_steps(root: Path, steps: str) -> list:
    # nobody must reach the directory, or every step fails alike on both sides
    steps = "os.stat(root)\n" + steps
    result = as_user(NOBODY, NOBODY, STEPS + steps + "\nprint(repr(out))", str(root))
    assert result.returncode == 0, result.stderr
    return eval(result.stdout)  # noqa: S307 (our own literal)


def mode_of(path: Path) -> str:
    return oct(os.lstat(path).st_mode)


def test_write_and_truncate_by_another_user_clear_set_user_id(sides):
    def case(root: Path):
        for name in ("w", "t", "g"):
            (root / name).write_bytes(b"0123456789")
        os.chmod(root / "w", 0o4777)
        os.chmod(root / "t", 0o6777)
        os.chmod(root / "g", 0o2757)  # set-group-ID without group execute: kept
        out = run_steps(root, """
out.append(step(write, f"{root}/w", b"x"))
out.append(step(os.truncate, f"{root}/t", 3))
out.append(step(write, f"{root}/g", b"y"))
""")
        return out, [mode_of(root / n) for n in ("w", "t", "g")]
    both(sides, case)


def test_chown_by_a_non_root_owner_clears_set_ids(sides):
    def case(root: Path):
        (root / "f").write_bytes(b"data")
        os.chown(root / "f", NOBODY, NOBODY)
        os.chmod(root / "f", 0o6755)
        out = run_steps(root, """
out.append(step(os.chown, f"{root}/f", 65534, 65534))
out.append(step(os.chown, f"{root}/f", 0, 0))
""")
        return out, mode_of(root / "f"), os.stat(root / "f").st_uid
    both(sides, case)


def test_access_is_checked(sides):
    def case(root: Path):
        os.mkdir(root / "closed", 0o755)
        (root / "closed" / "f").write_bytes(b"root's")
        os.chmod(root / "closed" / "f", 0o644)
        os.mkdir(root / "open", 0o777)
        os.mkdir(root / "sticky", 0o1777)
        (root / "sticky" / "rootfile").write_bytes(b"")
        (root / "secret").write_bytes(b"s")
        os.chmod(root / "secret", 0o600)
        out = run_steps(root, """
out.append(step(write, f"{root}/closed/f", b"x"))
out.append(step(write, f"{root}/closed/new", b"x", os.O_WRONLY | os.O_CREAT))
out.append(step(os.unlink, f"{root}/closed/f"))
out.append(step(lambda p: open(p, "rb").read(), f"{root}/secret"))
out.append(step(os.chmod, f"{root}/closed/f", 0o777))
out.append(step(os.chown, f"{root}/closed/f", 65534, 65534))
out.append(step(os.utime, f"{root}/closed/f", (1, 1)))
out.append(step(write, f"{root}/open/mine", b"x", os.O_WRONLY | os.O_CREAT))
out.append(step(os.chmod, f"{root}/open/mine", 0o4700))
out.append(step(os.utime, f"{root}/open/mine", (5, 6)))
out.append(step(os.mkdir, f"{root}/open/d", 0o700))
out.append(step(os.rename, f"{root}/open/mine", f"{root}/open/d/mine"))
out.append(step(os.unlink, f"{root}/sticky/rootfile"))
out.append(step(os.rename, f"{root}/sticky/rootfile", f"{root}/open/x"))
out.append(step(os.listdir, f"{root}/open/d"))
out.append(step(os.access, f"{root}/secret", os.R_OK))
""")
        st = os.stat(root / "open" / "d" / "mine")
        return out, oct(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns
    both(sides, case)


def test_set_group_id_directory_is_inherited(sides):
    def case(root: Path):
        os.mkdir(root / "shared")
        os.chown(root / "shared", 0, 4321)
        os.chmod(root / "shared", 0o2777)
        (root / "shared" / "f").write_bytes(b"")
        os.mkdir(root / "shared" / "sub")
        f, sub = os.stat(root / "shared" / "f"), os.stat(root / "shared" / "sub")
        return f.st_gid, sub.st_gid, bool(sub.st_mode & stat.S_ISGID)
    both(sides, case)


def test_write_only_handles_of_another_user_clear_set_ids(sides):
    """The kernel clears set-IDs on writes it caches, not on direct-I/O ones
    (aifs's write-only handles): aifs does it at the first write."""
    def case(root: Path):
        for name, mode in (("u", 0o4777), ("g", 0o2777), ("ug", 0o6777)):
            (root / name).write_bytes(b"")
            os.chmod(root / name, mode)
        out = run_steps(root, """
for name in ("u", "g", "ug"):
    fd = os.open(f"{root}/{name}", os.O_WRONLY)
    os.write(fd, b"x")
    out.append(oct(os.fstat(fd).st_mode))
    os.close(fd)
""")
        return out, [mode_of(root / n) for n in ("u", "g", "ug")]
    both(sides, case)
