"""Fixtures of the conformance suite: one aifs mount per lake kind and module
(mounting costs seconds; each test works in a directory of its own), and the
tmpfs (support/mounts.py) as the reference (Linux, not our opinion)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.lakes import LAKE_KINDS, _make_lake
from support.mounts import Mount, open_dir


class Side:
    """Where a case runs: ``path`` is a fresh directory on one filesystem."""

    def __init__(self, name: str, path: Path, mount: Mount | None = None) -> None:
        self.name = name
        self.path = path
        self.mount = mount


@pytest.fixture(scope="module", params=LAKE_KINDS)
def conf_mount(request, tmp_path_factory) -> Iterator[Mount]:
    """aifs on one lake kind, with allow_other (permission cases switch users)."""
    base = tmp_path_factory.mktemp(f"conf-{request.param}")
    lake = _make_lake(request.param, request, base)
    where = open_dir()
    mount = Mount(lake, where / "mnt", base / "cache", base / "aifs.log",
                  ["--allow-other"])
    os.chmod(mount.path, 0o777)
    yield mount
    if mount.proc.poll() is None or os.path.ismount(mount.path):
        mount.unmount()
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def sides(conf_mount, tmpfs) -> tuple[Side, Side]:
    """(aifs, tmpfs): an empty directory of this test's own on each."""
    name = uuid.uuid4().hex[:8]
    fuse_dir, ref_dir = conf_mount.path / name, tmpfs / name
    fuse_dir.mkdir()
    ref_dir.mkdir()
    os.chmod(fuse_dir, 0o777)
    os.chmod(ref_dir, 0o777)
    return Side("aifs", fuse_dir, conf_mount), Side("tmpfs", ref_dir)


@pytest.fixture
def second_mount(conf_mount, tmp_path) -> Iterator[Callable[[], Mount]]:
    """``second_mount()``: after everything of ``conf_mount`` reached the lake,
    the same lake mounted again on an empty cache (a fresh node)."""
    mounts: list[Mount] = []

    def make() -> Mount:
        os.getxattr(conf_mount.path, "user.aifs.sync")
        n = len(mounts)
        mount = Mount(conf_mount.lake, tmp_path / f"fresh{n}", tmp_path / f"fresh-cache{n}",
                      tmp_path / f"fresh{n}.log", ["--allow-other"])
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        mount.unmount()
