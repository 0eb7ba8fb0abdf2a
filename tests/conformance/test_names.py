"""Long names and long paths: names up to 255 bytes, and paths to PATH_MAX
and past it (reached through descriptors) on every lake, S3's 1,024-byte
keys notwithstanding (lake.longkeys), up to keys of 64 KiB; a longer name
gets ENAMETOOLONG."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from difftools import both, fresh_stat
from support.deep import down


def deep_path(root: Path, total: int) -> Path:
    path = root
    i = 0
    while len(os.fsencode(path)) < total - 250:
        path = path / (f"{i:03d}" + "d" * 196)
        i += 1
    return path


def test_long_names(sides):
    def case(root: Path):
        out = []
        for name in ("n" * 255, "é" * 127 + "x", "n" * 256, "é" * 128):
            try:
                (root / name).write_bytes(name.encode())
                out.append(((root / name).read_bytes() == name.encode(),
                            name in os.listdir(root)))
            except OSError as exc:
                out.append(exc.errno)
        for fn in (os.mkdir, os.rmdir, os.unlink, os.stat):
            try:
                fn(root / ("m" * 256))
            except OSError as exc:
                out.append(exc.errno)
        return out
    both(sides, case)


def test_paths_longer_than_64_kib_are_refused(sides, conf_mount):
    """Keys stop at 64 KiB, a path from the mount's root (what a journal
    record carries; S3 keys past 1,024 bytes are stored under short ones): a
    deeper name gets ENAMETOOLONG at once (a difference from ext4 listed in
    SEMANTICS.md), and what was made stays usable."""
    base = len(os.fsencode(sides[0].path.relative_to(conf_mount.path))) + 1
    names = [f"{i:03d}" + "d" * 196 for i in range(327)]
    key = base + 200 * len(names)  # of the deepest directory, with its "/"
    fd = down(os.open(sides[0].path, os.O_RDONLY | os.O_DIRECTORY), names)
    try:
        fits, too_long = "f" * (65536 - key), "n" * (65537 - key)
        assert 0 < len(fits) < len(too_long) <= 255
        f = os.open(fits, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(f, b"fits")
        os.close(f)
        for make in (lambda name: os.mkdir(name, dir_fd=fd),
                     lambda name: os.open(name, os.O_CREAT | os.O_WRONLY, dir_fd=fd),
                     lambda name: os.symlink("t", name, dir_fd=fd),
                     lambda name: os.rename(fits, name, src_dir_fd=fd, dst_dir_fd=fd)):
            with pytest.raises(OSError) as info:
                make(too_long)
            assert info.value.errno == errno.ENAMETOOLONG
        g = os.open(fits, os.O_RDONLY, dir_fd=fd)
        assert os.read(g, 10) == b"fits"
        os.close(g)
    finally:
        os.close(fd)


def test_path_of_3000_bytes(sides, conf_mount):
    """On S3, past 1,024 bytes, the lake holds the object under a short key
    (lake.longkeys)."""

    def case(root: Path):
        deep = deep_path(root, 3000)
        os.makedirs(deep)
        leaf = deep / ("f" * 200)
        leaf.write_bytes(b"deep" * 100)
        os.rename(leaf, deep / "g")
        os.symlink("g", deep / "link")
        return len(os.fsencode(deep / "g")) > 2800, (deep / "g").read_bytes(), \
            os.readlink(deep / "link"), sorted(os.listdir(deep))
    both(sides, case)
    deep = deep_path(sides[0].path, 3000)
    os.getxattr(deep / "g", "user.aifs.sync")
    assert fresh_stat(conf_mount, deep / "g").st_size == 400


def test_rename_of_a_directory_with_long_keys_below(sides):
    def case(root: Path):
        deep = deep_path(root / "a", 900)
        os.makedirs(deep)
        (deep / "f").write_bytes(b"x")
        os.rename(root / "a", root / "b")
        moved = deep_path(root / "b", 900)
        return (moved / "f").read_bytes(), os.path.exists(root / "a")
    both(sides, case)


#: 30 directories of 200 bytes: 6,000 bytes from the mount's root
PAST_PATH_MAX = [f"{i:03d}" + "d" * 196 for i in range(30)]


def test_paths_past_path_max_below_the_mount(sides, conf_mount):
    """What pjdfstest's ``*/03`` cases ask: a path of PATH_MAX - 1 bytes from
    the working directory works, one byte more gets ENAMETOOLONG (the
    kernel's limit); and a tree goes deeper than PATH_MAX from the mount's
    root, reached through descriptors, as on a local disk."""

    def case(root: Path):
        out: list[object] = []
        fd = down(os.open(root, os.O_RDONLY | os.O_DIRECTORY), PAST_PATH_MAX)
        try:
            f = os.open("f" * 200, os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=fd)
            os.write(f, b"past PATH_MAX")
            os.close(f)
            os.rename("f" * 200, "g", src_dir_fd=fd, dst_dir_fd=fd)
            os.symlink("g", "link", dir_fd=fd)
            os.link("g", "hard", src_dir_fd=fd, dst_dir_fd=fd)
            os.mkdir("sub", dir_fd=fd)
            out.append(sorted(os.listdir(fd)))
            g = os.open("link", os.O_RDONLY, dir_fd=fd)
            out.append(os.read(g, 100))
            os.close(g)
            st = os.stat("hard", dir_fd=fd)
            out.append((st.st_nlink, oct(st.st_mode), st.st_size))
            os.unlink("hard", dir_fd=fd)
            os.rmdir("sub", dir_fd=fd)
            out.append(sorted(os.listdir(fd)))
        finally:
            os.close(fd)
        here = os.getcwd()
        os.chdir(root)
        try:
            parent = "/".join(["p" * 200] * 20)  # 4,019 bytes
            os.makedirs(parent)
            longest = parent + "/" + "n" * (4095 - len(parent) - 1)
            for path in (longest, longest + "x"):
                try:
                    with open(path, "wb") as fp:
                        fp.write(b"x" * 10)
                    out.append((len(path), os.stat(path).st_size))
                    os.rename(path, parent + "/short")
                    os.rename(parent + "/short", path)
                    os.unlink(path)
                    os.mkdir(path)
                    os.rmdir(path)
                except OSError as exc:
                    out.append((len(path), exc.errno))
        finally:
            os.chdir(here)
        return out
    result = both(sides, case)
    assert result[0] == "ok" and result[1][-1] == (4096, errno.ENAMETOOLONG)
    # and the lake holds it: the same bytes through a mount on an empty cache
    os.getxattr(sides[0].path, "user.aifs.sync")
