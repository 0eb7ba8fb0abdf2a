"""Hard links: nlink, shared data, unlink of one name keeps the others,
rename of a name; the same after a mount on an empty cache."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from difftools import both


def groups(root: Path) -> list[tuple]:
    """Names sharing an inode, with nlink and content, as a user compares them."""
    by_ino: dict[int, list[str]] = {}
    info: dict[int, tuple] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            st = os.lstat(path)
            by_ino.setdefault(st.st_ino, []).append(str(path.relative_to(root)))
            info[st.st_ino] = (st.st_nlink, st.st_size, oct(st.st_mode),
                               path.read_bytes() if path.is_file() else None)
    return sorted((sorted(names), info[ino]) for ino, names in by_ino.items())


def make_links(root: Path) -> None:
    (root / "a").write_bytes(b"shared bytes")
    os.mkdir(root / "d")
    os.link(root / "a", root / "b")
    os.link(root / "a", root / "d" / "c")
    (root / "solo").write_bytes(b"one name")


def test_hard_links(sides):
    def case(root: Path):
        make_links(root)
        out = [groups(root)]
        with open(root / "b", "ab") as fp:  # written through one name, seen by all
            fp.write(b" + more")
        os.chmod(root / "d" / "c", 0o600)
        out.append(groups(root))
        os.unlink(root / "a")
        out.append(groups(root))
        os.rename(root / "d" / "c", root / "moved")
        os.rename(root / "solo", root / "b")  # over one name of the group
        out.append(groups(root))
        errors = []
        for src, dst in (("d", "dlink"), ("moved", "b"), ("missing", "x"), ("moved", "d/x/y")):
            try:
                os.link(root / src, root / dst)
            except OSError as exc:
                errors.append(exc.errno)
        out.append(errors)
        return out
    both(sides, case)


def test_link_of_an_open_file_and_of_a_file_in_the_lake(sides, conf_mount):
    def case(root: Path):
        fd = os.open(root / "w", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"written while linked")
        os.link(root / "w", root / "w2")
        os.write(fd, b"!")
        os.close(fd)
        return groups(root)
    both(sides, case)
    root = sides[0].path
    (root / "old").write_bytes(b"x" * 1000)
    os.getxattr(root / "old", "user.aifs.sync")  # in the lake (packed, or its own object)
    os.link(root / "old", root / "new")
    assert os.stat(root / "new").st_nlink == 2
    assert (root / "new").read_bytes() == b"x" * 1000


@pytest.mark.parametrize("remove", [False, True])
def test_hard_links_on_a_fresh_node(sides, second_mount, remove):
    """Each name is an object with the same bytes; a fresh node joins them
    into one inode again (same st_ino, nlink 3)."""
    make_links(sides[0].path)
    if remove:
        os.unlink(sides[0].path / "b")
    expected = groups(sides[0].path)
    fresh = second_mount()
    where = fresh.path / sides[0].path.name
    assert groups(where) == expected
    with open(where / "d" / "c", "ab") as fp:
        fp.write(b"!")
    assert (where / "a").read_bytes() == b"shared bytes!"


def test_link_errors(sides):
    def case(root: Path):
        os.mkdir(root / "d")
        (root / "f").write_bytes(b"")
        out = []
        for src, dst in (("d", "x"), ("f", "d"), ("f", "f"), ("f", "n" * 256)):
            try:
                os.link(root / src, root / dst)
                out.append("ok")
            except OSError as exc:
                out.append(exc.errno)
        return out, errno.EPERM
    both(sides, case)
