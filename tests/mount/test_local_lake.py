"""The local-directory lake wherever it lives: keys as long as a path inside
the mount can be, however deep the lake directory itself lies (issue 50:
the limit was PATH_MAX minus the length of the lake's own path)."""

from __future__ import annotations

import os
from pathlib import Path

from support.deep import down
from support.lakes import Lake
from support.mounts import Mount


def deep(root: Path, total: int, stem: str) -> Path:
    """A directory path below ``root`` about ``total`` bytes long."""
    path, i = root, 0
    while len(os.fsencode(path)) < total - 250:
        path = path / (f"{i:03d}{stem}" + "d" * 190)
        i += 1
    return path


def test_a_local_lake_deep_down_holds_paths_as_long_as_the_mount_takes(tmp_path):
    lake_root = deep(tmp_path / "lakes", 2500, "L")
    lake_root.mkdir(parents=True)
    lake = Lake("local", f"file://{lake_root}", {}, [], root=lake_root)
    mount = Mount(lake, tmp_path / "m", tmp_path / "cache", tmp_path / "m.log", [])
    try:
        inside = deep(mount.path, 3500, "m")
        inside.mkdir(parents=True)
        (inside / "f").write_bytes(b"deep bytes")
        os.rename(inside / "f", inside / "g")
        os.symlink("g", inside / "link")
        (inside / "gone").write_bytes(b"x")
        os.unlink(inside / "gone")
        key = os.fsencode(inside.relative_to(mount.path) / "g")
        assert len(os.fsencode(lake_root)) + len(key) > 4096  # past PATH_MAX from /
        os.getxattr(mount.path, "user.aifs.sync")
        rel = inside.relative_to(mount.path)
    finally:
        mount.unmount()
    fresh = Mount(lake, tmp_path / "f", tmp_path / "fresh-cache", tmp_path / "f.log", [])
    try:
        again = fresh.path / rel
        assert (again / "g").read_bytes() == b"deep bytes"
        assert os.readlink(again / "link") == "g"
        assert sorted(os.listdir(again)) == ["g", "link"]
    finally:
        fresh.unmount()


def test_a_tree_deeper_than_path_max_round_trips_through_a_fresh_node(tmp_path):
    """Keys past PATH_MAX (6,000 bytes from the mount's root, reached through
    descriptors as a program on a local disk may; a file past pack_threshold, so an
    object of its own): written, renamed, linked
    and removed on one mount, and read back by a mount on an empty cache."""
    names = [f"{i:03d}" + "d" * 196 for i in range(30)]
    lake_root = tmp_path / "lake"
    lake_root.mkdir()
    lake = Lake("local", f"file://{lake_root}", {}, [], root=lake_root)
    mount = Mount(lake, tmp_path / "m", tmp_path / "cache", tmp_path / "m.log", [])
    try:
        fd = down(os.open(mount.path, os.O_RDONLY | os.O_DIRECTORY), names)
        try:
            f = os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
            os.write(f, b"past PATH_MAX" * 200_000)
            os.close(f)
            os.rename("f", "g", src_dir_fd=fd, dst_dir_fd=fd)
            os.symlink("g", "link", dir_fd=fd)
            os.mkdir("empty", dir_fd=fd)
            os.mkdir("gone", dir_fd=fd)
            os.rmdir("gone", dir_fd=fd)
        finally:
            os.close(fd)
        os.getxattr(mount.path, "user.aifs.sync")
    finally:
        mount.unmount()
    fresh = Mount(lake, tmp_path / "f", tmp_path / "fresh-cache", tmp_path / "f.log", [])
    try:
        fd = down(os.open(fresh.path, os.O_RDONLY | os.O_DIRECTORY), names)
        try:
            assert sorted(os.listdir(fd)) == ["empty", "g", "link"]
            g = os.open("g", os.O_RDONLY, dir_fd=fd)
            assert os.read(g, 4 << 20) == b"past PATH_MAX" * 200_000
            os.close(g)
            assert os.stat("g", dir_fd=fd).st_mode & 0o777 == 0o600
            assert os.readlink("link", dir_fd=fd) == "g"
        finally:
            os.close(fd)
    finally:
        fresh.unmount()
