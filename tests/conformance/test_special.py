"""FIFOs, sockets, character and block devices, symlinks: made, listed with
the right d_type, and the same on a fresh node (a mount on an empty cache)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from difftools import both


def make_specials(root: Path) -> None:
    os.mkfifo(root / "fifo", 0o640)
    os.mknod(root / "chr", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(root / "blk", 0o660 | stat.S_IFBLK, os.makedev(7, 200))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "sock"))
    (root / "file").write_bytes(b"content")
    os.symlink("file", root / "link")
    os.symlink("/no/such/target" + "x" * 300, root / "dangling")
    os.mkdir(root / "dir")


def describe(root: Path) -> list[tuple]:
    out = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        st = os.lstat(entry.path)
        out.append((entry.name, entry.is_symlink(), entry.is_dir(follow_symlinks=False),
                    entry.is_file(follow_symlinks=False), oct(st.st_mode),
                    os.major(st.st_rdev) if not stat.S_ISREG(st.st_mode) else 0,
                    os.minor(st.st_rdev) if not stat.S_ISREG(st.st_mode) else 0,
                    os.readlink(entry.path) if entry.is_symlink() else None))
    return out


def test_fifo_socket_and_devices(sides):
    def case(root: Path):
        make_specials(root)
        out = describe(root)
        # A FIFO works through the mount: the kernel serves it.
        reader = os.open(root / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(root / "fifo", os.O_WRONLY)
        os.write(writer, b"through the pipe")
        got = os.read(reader, 100)
        os.close(writer)
        os.close(reader)
        os.rename(root / "fifo", root / "dir" / "fifo2")
        os.unlink(root / "chr")
        return out, got, describe(root / "dir")
    both(sides, case)


def test_specials_and_symlinks_on_a_fresh_node(sides, second_mount):
    """d_type and modes of symlinks and special files after a mount on an
    empty cache: no DT_REG for a symlink, each entry once."""
    def case(root: Path):
        make_specials(root)
        return describe(root)
    expected = both(sides, case)
    fresh = second_mount()
    where = fresh.path / sides[0].path.name
    listed = os.listdir(where)
    assert len(listed) == len(set(listed)), f"an entry listed twice: {sorted(listed)}"
    assert ("ok", describe(where)) == expected
    # ls -l before any lookup: readdir's own d_type
    names = {e.name: (e.is_symlink(), e.is_dir(follow_symlinks=False)) for e in os.scandir(where)}
    assert names["link"] == (True, False) and names["dir"] == (False, True)
