"""Long names and long paths: names up to 255 bytes and paths up to PATH_MAX
work (whatever the lake key's length), a longer name gets ENAMETOOLONG."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from difftools import both, fresh_stat


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


def test_paths_longer_than_the_lake_keys_are_refused(sides, conf_mount):
    """S3 keys hold at most 1,024 bytes: a deeper name gets ENAMETOOLONG at
    once (a difference from ext4 listed in SEMANTICS.md), and what was made
    stays usable. The local-directory lake takes paths up to PATH_MAX."""
    if conf_mount.lake.kind == "local":
        pytest.skip("the local-directory lake holds PATH_MAX paths (see the 3,000-byte case)")
    deep = deep_path(sides[0].path, 1000)
    deep.mkdir(parents=True)
    (deep / "ok").write_bytes(b"fits")
    key = len(os.fsencode(deep.relative_to(conf_mount.path))) + len(conf_mount.lake.prefix)
    too_long = "n" * (1024 - key)  # with the "/" before it: 1,025 bytes
    assert len(too_long) <= 255
    for fn in (os.mkdir, lambda p: p.write_bytes(b"x"), lambda p: os.symlink("t", p)):
        with pytest.raises(OSError) as info:
            fn(Path(deep / too_long))
        assert info.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as info:
        os.rename(deep / "ok", deep / too_long)
    assert info.value.errno == errno.ENAMETOOLONG
    assert (deep / "ok").read_bytes() == b"fits"


def test_path_of_3000_bytes(sides, conf_mount):
    if conf_mount.lake.kind != "local":
        pytest.skip("S3 keys hold at most 1,024 bytes")

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
