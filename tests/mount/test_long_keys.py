"""Paths longer than the lake's keys take (S3: 1,024 bytes, the mount's
prefix included): the object goes under ``.aifs/long/<hash>`` and the journal
record carries the whole path, so a fresh node lists, stats and reads it;
renames (of a file, of a directory whose files' keys grow past the limit, of
a directory already past it), a hard link and deletes round-trip (docs/SEMANTICS.md,
"Lake key length"). On the local lake the same paths are plain files."""

from __future__ import annotations

import os
from pathlib import Path

from support.lakes import lake_objects

from aifs.lake.longkeys import LONG_KEYS

KiB = 1 << 10
#: six directories of 200 bytes: 1,206 bytes below t/, past S3's 1,024
DEEP = Path(*[f"{i}" + "d" * 199 for i in range(6)])


def tree(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: type and permission bits, owner, links,
    size, mtime, symlink target, bytes."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            link = os.readlink(path) if os.path.islink(path) else None
            data = open(path, "rb").read() if os.path.isfile(path) and not link else None
            links = st.st_nlink if data is not None else None  # (a directory's: not yet listed)
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_uid, st.st_gid, links,
                                               st.st_size if data is not None else None,
                                               st.st_mtime_ns if data is not None else None,
                                               link, data)
    return out


def test_paths_longer_than_the_lake_takes_round_trip_through_a_fresh_node(
        lake, mounter, aifs_cli):
    a = mounter(lake, "--pack-threshold", "64K", "--pack-wait", "0.2", name="a")
    deep = a.path / "t" / DEEP
    (deep / "sub").mkdir(parents=True)
    (deep / "big.bin").write_bytes(os.urandom(300 * KiB))  # an object of its own
    os.chmod(deep / "big.bin", 0o640)
    os.chown(deep / "big.bin", 1234, 2345)
    (deep / "small.bin").write_bytes(os.urandom(3 * KiB))  # packed
    os.symlink("big.bin", deep / "link")
    (deep / "empty").mkdir()
    (deep / "before.bin").write_bytes(os.urandom(100 * KiB))
    (deep / "gone.bin").write_bytes(os.urandom(100 * KiB))
    (deep / "sub" / "x.bin").write_bytes(os.urandom(100 * KiB))
    (a.path / "t" / "short").mkdir()
    (a.path / "t" / "short" / "f.bin").write_bytes(os.urandom(100 * KiB))
    sync = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert sync.returncode == 0, sync.stderr
    # in the lake now: changed by copies, records and deletes
    os.rename(deep / "before.bin", deep / "after.bin")
    os.rename(a.path / "t" / "short", deep / "moved")  # its file's key grows past the limit
    os.rename(deep / "sub", deep / "sub2")  # a directory already past it
    os.unlink(deep / "gone.bin")
    os.link(deep / "after.bin", deep / "hard")
    sync = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert sync.returncode == 0, sync.stderr
    before = tree(a.path / "t")
    assert len(before) == 16 and before[str(DEEP / "moved" / "f.bin")][4] == 100 * KiB
    a.unmount()

    keys = list(lake_objects(lake))  # (objects only: packed files are in packs)
    if lake.kind != "local":
        assert [key for key in keys if len((lake.prefix + key).encode()) > 1024] == []
        assert any(key.startswith(LONG_KEYS) for key in keys), keys
    b = mounter(lake, name="b")  # an empty cache of its own
    assert tree(b.path / "t") == before


def test_a_long_file_packed_after_it_was_an_object_stays_on_a_fresh_node(lake, mounter,
                                                                         aifs_cli):
    """A file past the limit rewritten small: its new bytes are packed and its
    old object deleted; what the delete publishes for other nodes (the end of
    the object's record) must not end the packed file too."""
    a = mounter(lake, "--pack-threshold", "64K", "--pack-wait", "0.2", name="a")
    deep = a.path / "t" / DEEP
    deep.mkdir(parents=True)
    (deep / "f.bin").write_bytes(os.urandom(100 * KiB))  # an object of its own
    sync = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert sync.returncode == 0, sync.stderr
    small = os.urandom(3 * KiB)
    (deep / "f.bin").write_bytes(small)  # packed now; the object goes
    sync = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert sync.returncode == 0, sync.stderr
    a.unmount()
    b = mounter(lake, name="b")
    assert (b.path / "t" / DEEP / "f.bin").read_bytes() == small
