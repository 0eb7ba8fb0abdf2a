"""A fresh node (empty cache) sees the lake at LIST speed: the attributes of
what aifs wrote come from its journals (one GET per journal, not one HEAD per
object), objects other tools wrote show the listing's size and mtime with no
HEAD, and their xattrs are read only when asked for."""

from __future__ import annotations

import base64
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from support.mounts import wait_for

from aifs.meta.objattrs import encode_xattrs

KiB = 1 << 10


def lake_requests(path: Path) -> dict[str, int]:
    return json.loads(os.getxattr(path, "user.aifs.metrics"))["lake"]["requests"]


def entries(root: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path relative to ``root``, path, lstat) of every entry below ``root``."""
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            yield os.path.relpath(path, root), path, os.lstat(path)


def attributes(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: type and permission bits, owner, size, mtime,
    a file's atime, symlink target, user xattrs."""
    out = {}
    for rel, path, st in entries(root):
        target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
        xattrs = {} if target is not None else {
            x: os.getxattr(path, x) for x in os.listxattr(path)}
        size = st.st_size if stat.S_ISREG(st.st_mode) else None
        atime = st.st_atime_ns if stat.S_ISREG(st.st_mode) else None
        out[rel] = (st.st_mode, st.st_uid, st.st_gid, size, st.st_mtime_ns, atime, target,
                    xattrs)
    return out


def test_a_fresh_node_knows_what_aifs_wrote_without_a_head_per_object(lake, mounter, aifs_cli):
    """Plain objects (over the pack threshold), packed files, directories and
    a symlink written through one mount, with their own modes, owners, times
    and xattrs: a mount on an empty cache walks them, stats and reads their
    xattrs with lake requests counted by directories and journals, not by
    files; and shows every attribute as the writer did."""
    a = mounter(lake, "--pack-threshold", "64K", "--pack-wait", "0.2", name="a")
    dirs, per_dir = 4, 12
    for d in range(dirs):
        directory = a.path / "t" / f"d{d}"
        directory.mkdir(parents=True)
        for i in range(per_dir):
            path = directory / f"f{i:02d}.bin"
            path.write_bytes(os.urandom((100 if i % 2 else 3) * KiB))  # plain / packed
            os.chmod(path, (0o600, 0o640, 0o755, 0o444)[i % 4])
            os.chown(path, 1000 + i, 2000 + d)
            os.utime(path, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i))
            if i % 3 == 0:
                os.setxattr(path, "user.tag", f"{d}-{i}".encode())
        os.chmod(directory, 0o750)
    os.symlink("d0/f01.bin", a.path / "t" / "link")
    for d in range(dirs):  # (times a directory gets from its entries are this node's)
        os.utime(a.path / "t" / f"d{d}", ns=(1_500_000_000_000_000_000 + d,) * 2)
    result = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    for i in (0, 1, 2):  # atime set on files in the lake (packed: f00, f02; plain: f01)
        path = a.path / "t" / "d0" / f"f{i:02d}.bin"
        os.utime(path, ns=(1_234_567_890_000_000_000 + i, os.stat(path).st_mtime_ns))
    before = attributes(a.path / "t")
    result = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    a.unmount()

    b = mounter(lake, name="b")  # an empty cache of its own; object_attrs as by default
    start = lake_requests(b.path)
    after = attributes(b.path / "t")
    assert after == before
    asked = {op: n - start.get(op, 0) for op, n in lake_requests(b.path).items()
             if n - start.get(op, 0)}
    files = dirs * per_dir
    assert asked.get("HeadObject", 0) <= 1, asked  # the symlink's target: its body, or none
    assert asked.get("ListObjectsV2", 0) <= 2 * (dirs + 2) + 4, asked
    assert asked.get("GetObject", 0) <= 8, asked  # journals (and the symlink's target)
    assert sum(asked.values()) < files // 2, asked


def test_objects_other_tools_wrote_need_no_head_until_their_xattrs_are_asked(lake, mounter):
    """``ls -l`` of a dataset another tool wrote: sizes and mtimes from LIST,
    the default mode, not one HEAD; an xattr asked for reads that object's
    metadata (one HEAD) and shows what the tool stored."""
    count = 200
    lake.put_many({f"w/o{i:04d}": b"x" * (1000 + i) for i in range(count)})
    origin = base64.b64encode(b"camera").decode()
    lake.put("w/tagged", b"t", {"xattr": encode_xattrs({"user.origin": origin})})
    mount = mounter(lake)
    start = lake_requests(mount.path)["HeadObject"]
    with os.scandir(mount.path / "w") as it:
        seen = {entry.name: os.lstat(entry.path) for entry in it}
    assert len(seen) == count + 1
    for i in range(count):
        st = seen[f"o{i:04d}"]
        assert (stat.S_ISREG(st.st_mode), st.st_size) == (True, 1000 + i)
        assert stat.S_IMODE(st.st_mode) == 0o644
    assert lake_requests(mount.path)["HeadObject"] == start
    assert os.getxattr(mount.path / "w" / "tagged", "user.origin") == b"camera"
    assert os.listxattr(mount.path / "w" / "tagged") == ["user.origin"]
    wait_for(lambda: lake_requests(mount.path)["HeadObject"] == start + 1, 10,
             "one HEAD for the xattrs asked for")


def test_a_walker_finds_the_next_subdirectories_listed_ahead(lake, mounter):
    """A walker opens one subdirectory after another, in readdir order:
    opening one lists the next ``--list-ahead`` of its siblings in the
    background, so the walker finds them listed; each is listed once."""
    subdirs = 6
    files = sorted(f"ds/s{d}/x{i}" for d in range(subdirs) for i in range(3))
    lake.put_many({key: b"x" for key in files})
    mount = mounter(lake, "--list-ahead", "2")

    def lists() -> int:
        return lake_requests(mount.path).get("ListObjectsV2", 0)

    assert sorted(os.listdir(mount.path / "ds")) == [f"s{d}" for d in range(subdirs)]
    start = lists()  # (the root, ds, and the pack journals were listed)
    assert sorted(os.listdir(mount.path / "ds" / "s0")) == ["x0", "x1", "x2"]
    wait_for(lambda: lists() - start == 3, 10, "s1 and s2 listed without being asked")
    walked = sorted(os.path.relpath(os.path.join(d, f), mount.path)
                    for d, _, names in os.walk(mount.path / "ds") for f in names)
    assert walked == files
    assert lists() - start == subdirs


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: type, permission bits, links, size and bytes."""
    return {rel: (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_nlink,
                  st.st_size if stat.S_ISREG(st.st_mode) else None,
                  Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None)
            for rel, path, st in entries(root)}


def test_files_other_tools_wrote_change_through_a_mount_as_on_tmpfs(lake, mounter, tmpfs,
                                                                      aifs_cli):
    """Objects other tools wrote are kept, once listed, as one record per
    directory (meta/batches.py) until one of them or their directory changes.
    Each kind of change to them through the mount (rename in and across
    directories, unlink, chmod, truncate, a write in place, a hard link, a new
    file beside them, a move of their directory) shows as on tmpfs: on this
    mount, and on a mount on an empty cache once synced."""
    items = {f"ds/d{d}/f{i:02d}": bytes([65 + d, 48 + i]) * (40 + i)
             for d in range(3) for i in range(8)}
    lake.put_many(items)
    ref = Path(tempfile.mkdtemp(dir=tmpfs))
    for key, data in items.items():
        (ref / key).parent.mkdir(parents=True, exist_ok=True)
        (ref / key).write_bytes(data)
    a = mounter(lake, name="a")
    assert _tree(a.path / "ds") == _tree(ref / "ds")  # listed: batches of virtual entries

    def changes(root: Path) -> tuple:
        d0, d1, d2 = root / "ds" / "d0", root / "ds" / "d1", root / "ds" / "d2"
        os.rename(d0 / "f00", d1 / "moved")
        os.rename(d1 / "f07", d1 / "renamed")
        os.unlink(d0 / "f01")
        os.chmod(d1 / "f02", 0o600)
        os.truncate(d1 / "f03", 5)
        with open(d2 / "f04", "r+b") as fp:
            fp.seek(3)
            fp.write(b"zz")
        os.link(d2 / "f05", d0 / "hard")
        (d2 / "new").write_bytes(b"a new file beside them")
        os.rename(d2, root / "ds" / "d2b")
        return sorted(os.listdir(d0)), os.stat(d0 / "hard").st_nlink

    assert changes(a.path) == changes(ref)
    expected = _tree(ref / "ds")
    assert _tree(a.path / "ds") == expected
    result = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    a.unmount()
    b = mounter(lake, name="b")
    assert _tree(b.path / "ds") == expected


def test_a_renamed_directory_keeps_its_files_attributes_on_a_fresh_node(lake, mounter,
                                                                           aifs_cli):
    """A directory renamed after its files reached the lake: its files are
    copies there, and a node listing them shows the modes, owners and times
    the writer set (the rename publishes their records, as an upload does),
    not the copies' times and default modes."""
    a = mounter(lake, "--pack-threshold", "64K", "--pack-wait", "0.2", name="a")
    (a.path / "d").mkdir()
    for i in range(3):
        path = a.path / "d" / f"f{i}.bin"
        path.write_bytes(os.urandom(100 * KiB))
        if i:  # (f0 as written: its time is when it was)
            os.chmod(path, (0o600, 0o640, 0o755)[i])
            os.chown(path, 1000 + i, 2000 + i)
            os.utime(path, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i))
    result = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    os.rename(a.path / "d", a.path / "e")
    os.rename(a.path / "e" / "f0.bin", a.path / "e" / "g0.bin")  # and a file of it
    result = aifs_cli("sync", str(a.path), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    before = stats(a.path / "e")
    a.unmount()
    b = mounter(lake, name="b")
    assert stats(b.path / "e") == before  # (no xattr asked for: that reads each object)


def stats(root: Path) -> dict[str, tuple[int, int, int, int, int]]:
    return {rel: (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns)
            for rel, _, st in entries(root)}
