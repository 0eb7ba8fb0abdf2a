"""A cache disk that fills up: the cache directory on a small tmpfs of its own.

What must hold: reads keep working; a writer waits while promotion makes room,
and gets ENOSPC (never EIO) only when what is not in the lake yet fills the
disk; creates and deletes keep working (the metadata has its reserve); the
mount works again by itself once space returns; nothing closed is lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from conftest import lake_tree

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "small-disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(path)],
                   check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def _write(path: Path, size: int, seed: int) -> bytes:
    data = (bytes([seed]) * 4096) * (size // 4096)
    with open(path, "wb") as fp:
        for start in range(0, len(data), MiB):
            fp.write(data[start:start + MiB])
    return data


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_a_full_cache_disk_refuses_only_what_cannot_fit_and_recovers(lake, mounter,
                                                                     small_disk):
    mount = mounter(lake, "--promote-delay", "0", "--cache-size", "10G",
                    "--cache-dir", str(small_disk / "cache"))  # (the last --cache-dir wins)
    root = mount.path
    kept = _write(root / "kept.bin", 5 * MiB, 1)
    # Written and closed one after the other: each fits once the one before is
    # in the lake and its copy evicted, though together they exceed the disk.
    firsts = {f"closed{i}.bin": _write(root / f"closed{i}.bin", 40 * MiB, 10 + i)
              for i in range(3)}
    # One open file larger than the free disk: refused with ENOSPC, not EIO.
    with pytest.raises(OSError) as refused:
        _write(root / "too-big.bin", 200 * MiB, 2)
    assert refused.value.errno == errno.ENOSPC
    # Creates, small writes, reads and deletes go on.
    (root / "small.txt").write_bytes(b"still works")
    assert (root / "kept.bin").read_bytes() == kept
    os.unlink(root / "too-big.bin")  # space returns
    again = _write(root / "after.bin", 30 * MiB, 3)  # no restart needed
    assert (root / "after.bin").read_bytes() == again
    mount.unmount()
    files, _ = lake_tree(lake)
    assert files["kept.bin"] == kept and files["after.bin"] == again
    assert files["small.txt"] == b"still works"
    for name, data in firsts.items():
        assert files[name] == data, name
