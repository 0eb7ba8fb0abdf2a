"""The write path through a real FUSE mount, on every lake kind: POSIX behaviour,
what reaches the lake after ``aifs sync``, and what survives ``aifs umount`` and a
new mount on an empty cache directory."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import stat
import time
from pathlib import Path

import pytest
import xxhash
from support.lakes import HEAVY_LAKES, lake_keys, lake_tree, lake_upload_parts, lake_uploads
from support.mounts import wait_for
from support.packed import lake_meta, lake_size, mtime_ns_of

MiB = 1 << 20
RENAME_NOREPLACE = 1
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(src: Path, dst: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(src), None, str(dst))


def mount_rw(lake, mounter, *extra: str, **kw):
    return mounter(lake, "--promote-delay", "0.2", *extra, **kw)


def sync(aifs_cli, path: Path) -> None:
    result = aifs_cli("sync", str(path), timeout=300)
    assert result.returncode == 0, f"aifs sync {path} failed: {result.stderr[-2000:]}"


def assert_errno(code: int, fn, *args, **kwargs) -> None:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == code, \
        f"{fn.__name__}{args}: got {info.value!r}, expected {errno.errorcode[code]}"


def names(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def assert_same(got: dict, expected: dict, what: str) -> None:
    diff = {k: (got.get(k, "<missing>"), expected.get(k, "<missing>"))
            for k in got.keys() | expected.keys() if got.get(k) != expected.get(k)}
    assert not diff, f"{what} differs (got, expected): {diff}"


# -- create, write, read ---------------------------------------------------------
def test_create_write_read_back(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    os.makedirs(m / "d" / "e")
    files = {"empty": b"", "one": b"x", "page": os.urandom(4097),
             "big.bin": os.urandom(3 * MiB + 5), "d/e/nested.bin": b"nested"}
    before = time.time_ns()
    for name, data in files.items():
        fd = os.open(m / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            assert os.write(fd, data) == len(data)
        finally:
            os.close(fd)
    after = time.time_ns()
    for name, data in files.items():
        assert (m / name).read_bytes() == data, name
        st = os.stat(m / name)
        assert st.st_size == len(data)
        assert st.st_mode == stat.S_IFREG | 0o640, oct(st.st_mode)
        assert st.st_uid == os.getuid() and st.st_gid == os.getgid()
        assert before - 2_000_000_000 <= st.st_mtime_ns <= after + 2_000_000_000
    assert names(m) == ["big.bin", "d", "empty", "one", "page"]
    assert_errno(errno.EEXIST, os.open, m / "one", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert_errno(errno.ENOENT, os.open, m / "missing", os.O_RDONLY)
    assert_errno(errno.ENOENT, os.open, m / "nodir" / "f", os.O_WRONLY | os.O_CREAT)
    assert_errno(errno.ENOTDIR, os.open, m / "one" / "f", os.O_WRONLY | os.O_CREAT)
    assert_errno(errno.EISDIR, os.open, m / "d", os.O_WRONLY)

    sync(aifs_cli, m)
    got, dirs = lake_tree(lake)
    assert got == files and dirs == {"d", "d/e"}
    # an overwrite of a promoted file replaces the object
    (m / "one").write_bytes(b"second version")
    sync(aifs_cli, m / "one")
    assert lake.get("one") == b"second version"
    assert (m / "one").read_bytes() == b"second version"


def test_writes_at_odd_offsets_and_holes(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    path = mount.path / "sparse.bin"
    model = bytearray()

    def pwrite(fd: int, data: bytes, offset: int) -> None:
        assert os.pwrite(fd, data, offset) == len(data)
        if len(model) < offset:
            model.extend(bytes(offset - len(model)))
        model[offset:offset + len(data)] = data

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        pwrite(fd, b"hello", 0)
        pwrite(fd, b"XYZ", 4095)                     # across a page edge
        pwrite(fd, os.urandom(10_000), 12_345)
        pwrite(fd, b"tail", 3 * MiB + 7)             # leaves a hole of ~3 MiB
        pwrite(fd, b"middle", MiB + 1)               # into the hole
        pwrite(fd, b"ov", 3)                         # over existing bytes
        pwrite(fd, os.urandom(MiB + 3), 2 * MiB - 1)  # a long write across MiB edges
        assert os.fstat(fd).st_size == len(model)
        assert os.pread(fd, len(model) + 10, 0) == model
        assert os.pread(fd, 1000, 1000 * 50) == bytes(1000), "a hole must read as zeros"
        assert os.pread(fd, 10, len(model)) == b""
    finally:
        os.close(fd)
    assert path.read_bytes() == model
    sync(aifs_cli, mount.path)
    assert lake.get("sparse.bin") == model


def test_modify_files_from_the_lake(lake, mounter, aifs_cli):
    """Partial changes to objects that are only in the lake (nothing cached yet)."""
    pre = os.urandom(3 * MiB)
    lake.put("pre.bin", pre)
    lake.put("log.txt", b"line1\n")
    lake.put("cut.bin", b"C" * MiB)
    mount = mount_rw(lake, mounter)
    m = mount.path
    with open(m / "pre.bin", "r+b") as fp:
        fp.seek(MiB + 5)
        fp.write(b"patched")
    expected_pre = pre[:MiB + 5] + b"patched" + pre[MiB + 12:]
    with open(m / "log.txt", "ab") as fp:
        fp.write(b"line2\n")
    os.truncate(m / "cut.bin", 1000)
    os.truncate(m / "cut.bin", 2000)
    expected = {"pre.bin": expected_pre, "log.txt": b"line1\nline2\n",
                "cut.bin": b"C" * 1000 + bytes(1000)}
    for name, data in expected.items():
        assert (m / name).read_bytes() == data, name
    sync(aifs_cli, m)
    assert lake_tree(lake) == (expected, set())


def test_truncate_down_and_up(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    path = m / "t.bin"
    data = os.urandom(10_000)
    path.write_bytes(data)
    os.truncate(path, 5000)
    assert os.stat(path).st_size == 5000 and path.read_bytes() == data[:5000]
    os.truncate(path, 2 * MiB + 3)
    assert path.read_bytes() == data[:5000] + bytes(2 * MiB + 3 - 5000)
    # bytes cut off must not come back when the file grows again
    os.truncate(path, 100)
    os.truncate(path, 10_000)
    assert path.read_bytes() == data[:100] + bytes(9900)
    with open(path, "r+b") as fp:
        os.ftruncate(fp.fileno(), 50)
        assert os.fstat(fp.fileno()).st_size == 50
        fp.seek(0, os.SEEK_END)
        fp.write(b"after")
        fp.flush()
        os.ftruncate(fp.fileno(), 60)
    assert path.read_bytes() == data[:50] + b"after" + bytes(5)
    (m / "o.bin").write_bytes(b"long old contents")
    with open(m / "o.bin", "wb") as fp:  # O_TRUNC
        fp.write(b"new")
    (m / "zero.bin").write_bytes(b"something")
    os.truncate(m / "zero.bin", 0)
    assert (m / "o.bin").read_bytes() == b"new" and (m / "zero.bin").read_bytes() == b""
    os.mkdir(m / "d")
    assert_errno(errno.EISDIR, os.truncate, m / "d", 0)
    assert_errno(errno.ENOENT, os.truncate, m / "missing", 0)
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"t.bin": data[:50] + b"after" + bytes(5), "o.bin": b"new",
                                "zero.bin": b""}, {"d"})


def test_append(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    path = mount.path / "log"
    path.write_bytes(b"start")
    with open(path, "ab") as fp:
        fp.write(b"-one")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"-two")  # O_APPEND writes at the end wherever the offset is
    finally:
        os.close(fd)
    assert path.read_bytes() == b"start-one-two"
    with open(path, "ab", buffering=0) as a, open(path, "ab", buffering=0) as b:
        a.write(b"A")
        b.write(b"B")
        a.write(b"A")
    assert path.read_bytes() == b"start-one-twoABA"
    sync(aifs_cli, mount.path)
    assert lake.get("log") == b"start-one-twoABA"


@pytest.mark.parametrize("direct", ["true", "false"])
def test_readers_see_what_write_only_handles_wrote(lake, mounter, aifs_cli, direct):
    """Write-only handles bypass the kernel's page cache (``direct_writes``): a
    reader that cached the file, by read or by a shared mapping, still sees every
    byte written afterwards; read-write handles can still be mapped writable."""
    import mmap
    mount = mount_rw(lake, mounter, "--direct-writes", direct)
    path = mount.path / "shared.bin"
    original = os.urandom(4 * MiB)
    path.write_bytes(original)
    stack = contextlib.ExitStack()
    reader = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(reader, 4 * MiB, 0) == original  # now in the page cache
        mapped = stack.enter_context(mmap.mmap(reader, 4 * MiB, prot=mmap.PROT_READ))
        assert mapped[MiB:MiB + 8] == original[MiB:MiB + 8]
        patch = os.urandom(64 * 1024 + 3)
        writer = os.open(path, os.O_WRONLY)
        try:
            assert os.pwrite(writer, patch, MiB + 100) == len(patch)
            assert os.pread(reader, len(patch), MiB + 100) == patch  # before close too
        finally:
            os.close(writer)
        expected = original[:MiB + 100] + patch + original[MiB + 100 + len(patch):]
        assert mapped[:] == expected
        with open(path, "ab") as fp:
            fp.write(b"tail")
        assert os.fstat(reader).st_size == 4 * MiB + 4
        assert os.pread(reader, 8, 4 * MiB - 4) == expected[-4:] + b"tail"
    finally:
        stack.close()  # the mapping goes before its descriptor: the mount can go
        os.close(reader)
    expected += b"tail"
    assert path.read_bytes() == expected
    with open(path, "r+b") as fp:  # read-write: mappable for writing as ever
        with mmap.mmap(fp.fileno(), 0) as writable:
            writable[:4] = b"MMAP"
            writable.flush()
    expected = b"MMAP" + expected[4:]
    assert path.read_bytes() == expected
    sync(aifs_cli, mount.path)
    assert lake.get("shared.bin") == expected


# -- metadata --------------------------------------------------------------------
def test_chmod_chown_utime(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    f, d = m / "f", m / "d"
    f.write_bytes(b"data")
    d.mkdir()
    os.chmod(f, 0o640)
    os.chmod(d, 0o711)
    assert os.stat(f).st_mode == stat.S_IFREG | 0o640
    assert os.stat(d).st_mode == stat.S_IFDIR | 0o711
    os.chown(f, 1234, 5678)
    os.chown(d, 1234, 5678)
    assert (os.stat(f).st_uid, os.stat(f).st_gid) == (1234, 5678)
    assert (os.stat(d).st_uid, os.stat(d).st_gid) == (1234, 5678)
    os.chown(f, -1, 42)
    assert (os.stat(f).st_uid, os.stat(f).st_gid) == (1234, 42)
    mtime, atime = 1_600_000_000_123_456_789, 1_500_000_000_987_654_321
    os.utime(f, ns=(atime, mtime))
    os.utime(d, ns=(atime, mtime + 1))
    assert os.stat(f).st_mtime_ns == mtime and os.stat(d).st_mtime_ns == mtime + 1
    assert f.read_bytes() == b"data"
    # a write moves mtime to now
    g = m / "g"
    g.write_bytes(b"1")
    os.utime(g, ns=(atime, mtime))
    before = time.time_ns()
    with open(g, "ab") as fp:
        fp.write(b"2")
    assert os.stat(g).st_mtime_ns >= before - 2_000_000_000

    sync(aifs_cli, m)
    # promotion changes none of it
    st = os.stat(f)
    assert (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns) == \
        (stat.S_IFREG | 0o640, 1234, 42, mtime)
    meta = lake_meta(lake, "f")
    assert int(meta["mode"]) == stat.S_IFREG | 0o640, meta
    assert (meta["uid"], meta["gid"]) == ("1234", "42"), meta
    assert mtime_ns_of(meta["mtime"]) == mtime, meta
    assert lake.get("f") == b"data"


def test_user_xattrs(lake, mounter, aifs_cli):
    lake.put("in-lake", b"x")
    mount = mount_rw(lake, mounter)
    m = mount.path
    f, d = m / "f", m / "d"
    f.write_bytes(b"data")
    d.mkdir()
    binary = bytes(range(256))
    os.setxattr(f, "user.color", b"blue")
    os.setxattr(f, "user.bin", binary)
    os.setxattr(f, "user.empty", b"")
    assert os.getxattr(f, "user.color") == b"blue"
    assert os.getxattr(f, "user.bin") == binary
    assert os.getxattr(f, "user.empty") == b""
    assert {"user.color", "user.bin", "user.empty"} <= set(os.listxattr(f))
    os.setxattr(f, "user.color", b"red")
    assert os.getxattr(f, "user.color") == b"red"
    assert_errno(errno.EEXIST, os.setxattr, f, "user.color", b"x", os.XATTR_CREATE)
    assert_errno(errno.ENODATA, os.setxattr, f, "user.nope", b"x", os.XATTR_REPLACE)
    os.removexattr(f, "user.color")
    assert_errno(errno.ENODATA, os.getxattr, f, "user.color")
    assert "user.color" not in os.listxattr(f)
    assert_errno(errno.ENODATA, os.removexattr, f, "user.color")
    assert_errno(errno.EPERM, os.setxattr, f, "user.aifs.key", b"x")
    with open(f, "ab") as fp:  # a write keeps the xattrs
        fp.write(b"more")
    assert os.getxattr(f, "user.bin") == binary
    os.setxattr(d, "user.tag", b"dir value")
    assert os.getxattr(d, "user.tag") == b"dir value"
    os.setxattr(m / "in-lake", "user.k", b"v")
    assert os.getxattr(m / "in-lake", "user.k") == b"v"
    sync(aifs_cli, m)
    assert os.getxattr(f, "user.bin") == binary
    assert os.getxattr(m / "in-lake", "user.k") == b"v"
    # stored in the lake in s3fs's format (persistence: test_remount_on_empty_cache...)
    assert "xattr" in lake_meta(lake, "f") and "xattr" in lake_meta(lake, "in-lake")
    assert lake.get("f") == b"datamore" and lake.get("in-lake") == b"x"


# -- namespace -------------------------------------------------------------------
def test_mkdir_rmdir(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    os.mkdir(m / "a")
    os.mkdir(m / "a" / "b")
    (m / "file").write_bytes(b"1")
    assert stat.S_ISDIR(os.stat(m / "a" / "b").st_mode)
    assert_errno(errno.EEXIST, os.mkdir, m / "a")
    assert_errno(errno.EEXIST, os.mkdir, m / "file")
    assert_errno(errno.ENOENT, os.mkdir, m / "no" / "x")
    assert_errno(errno.ENOTDIR, os.mkdir, m / "file" / "x")
    assert_errno(errno.ENOTEMPTY, os.rmdir, m / "a")
    assert_errno(errno.ENOTDIR, os.rmdir, m / "file")
    assert_errno(errno.ENOENT, os.rmdir, m / "missing")
    os.rmdir(m / "a" / "b")
    os.rmdir(m / "a")
    assert names(m) == ["file"]
    os.makedirs(m / "keep" / "inner")
    os.mkdir(m / "gone")
    os.mkdir(m / "holder")
    (m / "holder" / "f").write_bytes(b"f")
    os.rmdir(m / "gone")
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"file": b"1", "holder/f": b"f"}, {"keep", "keep/inner", "holder"})
    # changes to directories that are in the lake
    os.rmdir(m / "keep" / "inner")
    os.unlink(m / "holder" / "f")  # holder stays, now empty
    assert names(m) == ["file", "holder", "keep"] and names(m / "holder") == []
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"file": b"1"}, {"keep", "holder"})
    assert names(m) == ["file", "holder", "keep"]


def test_unlink(lake, mounter, aifs_cli):
    lake.put("old.bin", b"in the lake")
    mount = mount_rw(lake, mounter)
    m = mount.path
    (m / "new.bin").write_bytes(b"new")
    sync(aifs_cli, m)
    (m / "fresh.bin").write_bytes(b"maybe never promoted")
    for name in ("old.bin", "new.bin", "fresh.bin"):
        os.unlink(m / name)
        assert_errno(errno.ENOENT, os.stat, m / name)
        assert_errno(errno.ENOENT, os.unlink, m / name)
    assert names(m) == []
    os.mkdir(m / "d")
    assert_errno(errno.EISDIR, os.unlink, m / "d")
    assert_errno(errno.ENOENT, os.unlink, m / "d" / "nothing")
    sync(aifs_cli, m)
    assert lake_keys(lake) == ["d/"]
    # the name again: a new file, nothing of the old one
    (m / "new.bin").write_bytes(b"second")
    assert (m / "new.bin").read_bytes() == b"second"
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"new.bin": b"second"}, {"d"})


def test_open_unlinked_file(lake, mounter, aifs_cli):
    lake.put("in-lake.bin", b"L" * 5000)
    mount = mount_rw(lake, mounter)
    m = mount.path
    path = m / "tmp.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    lake_fd = os.open(m / "in-lake.bin", os.O_RDONLY)
    try:
        os.write(fd, b"before unlink")
        os.unlink(path)
        os.unlink(m / "in-lake.bin")
        assert names(m) == []
        assert_errno(errno.ENOENT, os.open, path, os.O_RDONLY)
        assert os.pwrite(fd, b" and after", 13) == 10
        assert os.pread(fd, 100, 0) == b"before unlink and after"
        assert os.fstat(fd).st_size == 23
        assert os.pread(lake_fd, 6000, 0) == b"L" * 5000
        # the name can be used again meanwhile: another file
        path.write_bytes(b"a new file")
        os.pwrite(fd, b"!", 0)
        assert path.read_bytes() == b"a new file"
        assert os.pread(fd, 100, 0) == b"!efore unlink and after"
        sync(aifs_cli, m)  # the unlinks reach the lake; the open files still read
        assert os.pread(fd, 100, 0) == b"!efore unlink and after"
        assert os.pread(lake_fd, 6000, 0) == b"L" * 5000
    finally:
        os.close(fd)
        os.close(lake_fd)
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"tmp.bin": b"a new file"}, set())
    assert names(m) == ["tmp.bin"]


def test_rename_files(lake, mounter, aifs_cli):
    lake.put("lake.bin", b"from the lake")
    mount = mount_rw(lake, mounter)
    m = mount.path
    os.mkdir(m / "dir")
    (m / "a").write_bytes(b"A")
    (m / "dir" / "x").write_bytes(b"X")
    os.rename(m / "a", m / "b")
    assert (m / "b").read_bytes() == b"A"
    assert_errno(errno.ENOENT, os.stat, m / "a")
    os.rename(m / "lake.bin", m / "dir" / "moved.bin")
    assert (m / "dir" / "moved.bin").read_bytes() == b"from the lake"
    # over an existing file: replaced
    (m / "victim").write_bytes(b"old contents, longer")
    os.rename(m / "b", m / "victim")
    assert (m / "victim").read_bytes() == b"A" and not (m / "b").exists()
    sync(aifs_cli, m)
    (m / "c").write_bytes(b"C")
    os.rename(m / "c", m / "dir" / "x")  # over a file that is in the lake
    assert (m / "dir" / "x").read_bytes() == b"C"
    # RENAME_NOREPLACE
    (m / "p").write_bytes(b"P")
    (m / "q").write_bytes(b"Q")
    assert_errno(errno.EEXIST, renameat2, m / "p", m / "q", RENAME_NOREPLACE)
    assert (m / "p").read_bytes() == b"P" and (m / "q").read_bytes() == b"Q"
    renameat2(m / "p", m / "r", RENAME_NOREPLACE)
    assert (m / "r").read_bytes() == b"P" and not (m / "p").exists()
    os.rename(m / "r", m / "r")  # onto itself: nothing happens
    assert (m / "r").read_bytes() == b"P"
    assert_errno(errno.ENOENT, os.rename, m / "nope", m / "z")
    # a file renamed while open for writing: the later bytes follow it
    fd = os.open(m / "open.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"1")
        os.rename(m / "open.bin", m / "renamed.bin")
        os.write(fd, b"2")
    finally:
        os.close(fd)
    assert (m / "renamed.bin").read_bytes() == b"12"
    expected = {"victim": b"A", "dir/moved.bin": b"from the lake", "dir/x": b"C",
                "q": b"Q", "r": b"P", "renamed.bin": b"12"}
    sync(aifs_cli, m)
    assert lake_tree(lake) == (expected, {"dir"})
    assert names(m) == ["dir", "q", "r", "renamed.bin", "victim"]


def test_rename_or_unlink_while_uploading_leaves_no_stale_object(lake, mounter, aifs_cli):
    """Files written, overwritten at once, then renamed or unlinked, while the first
    version is (often) being uploaded: after ``aifs sync`` the lake holds the renamed
    files under their new names, and nothing else. (Exposes races: a correct
    promoter passes whatever the timing.)"""
    mount = mounter(lake, "--promote-delay", "0")
    m = mount.path
    first = b"first version" * 1000
    expected = {}
    for i in range(30):
        (m / f"f{i}").write_bytes(first)
        second = os.urandom(4 * MiB)
        (m / f"f{i}").write_bytes(second)
        if i % 2:
            os.unlink(m / f"f{i}")
        else:
            os.rename(m / f"f{i}", m / f"g{i}")
            expected[f"g{i}"] = second
    sync(aifs_cli, m)
    stale = {key: "first version" if lake.get(key) == first else "other"
             for key in lake_keys(lake) if key.startswith("f")}
    assert not stale, f"objects left under names renamed away or unlinked: {stale}"
    assert_same(lake_tree(lake)[0], expected, "lake objects")
    assert names(m) == sorted(expected)


# -- streaming: large files uploaded while written -------------------------------------
# streaming on for every lake kind (auto leaves the local-directory lake out)
SMALL_PARTS = ("--part-size", "5M", "--multipart-threshold", "5M",
               "--stream-large-files", "true")


def write_front_to_back(fd: int, data: bytes | bytearray, start: int, end: int) -> None:
    for offset in range(start, end, MiB):
        chunk = data[offset:min(offset + MiB, end)]
        assert os.write(fd, chunk) == len(chunk)


def test_large_file_is_uploaded_while_it_is_written(lake, mounter, aifs_cli):
    """Not a checkpoint: a plain file written front to back has parts in the lake
    while it is open, no object until it is closed, and the whole object soon
    after close although promote_delay is an hour."""
    mount = mounter(lake, "--promote-delay", "3600", *SMALL_PARTS)
    os.makedirs(mount.path / "exports")
    path = mount.path / "exports" / "table.dat"
    data = random.Random(7).randbytes(20 * MiB + 12345)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.getxattr(path, "user.aifs.policy") == b"default"
        write_front_to_back(fd, data, 0, 12 * MiB)
        wait_for(lambda: lake_upload_parts(lake) > 0, 20, "parts in the lake while open")
        assert lake_size(lake, "exports/table.dat") is None, "a partial object is visible"
        write_front_to_back(fd, data, 12 * MiB, len(data))
    finally:
        os.close(fd)
    wait_for(lambda: lake_size(lake, "exports/table.dat") == len(data), 30,
             "exports/table.dat in the lake soon after close")
    assert lake.get("exports/table.dat") == data
    assert lake_uploads(lake) == []
    assert path.read_bytes() == data


def test_attributes_set_through_the_fd_of_a_streamed_file_reach_the_object(
        lake, mounter, aifs_cli):
    """cp -p and tar x of a large file: written front to back (its parts go to
    the lake as it is written), then fchmod and futimens before close. The
    object's metadata has the mode and mtime, after a mount on an empty cache too."""
    mount = mounter(lake, "--promote-delay", "0.2", *SMALL_PARTS)
    path = mount.path / "big.bin"
    data = random.Random(11).randbytes(12 * MiB + 7)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_front_to_back(fd, data, 0, len(data))
        wait_for(lambda: lake_upload_parts(lake) > 0, 20, "parts in the lake while open")
        os.fchmod(fd, 0o640)
        os.utime(fd, ns=(1_500_000_000_000_000_000, 1_600_000_000_123_456_789))
    finally:
        os.close(fd)
    sync(aifs_cli, mount.path)
    meta = lake_meta(lake, "big.bin")
    assert int(meta["mode"]) & 0o7777 == 0o640
    assert mtime_ns_of(meta["mtime"]) == 1_600_000_000_123_456_789
    mount.unmount()
    fresh = mounter(lake, name="fresh")
    st = os.stat(fresh.path / "big.bin")
    assert (st.st_size, st.st_mode & 0o7777, st.st_mtime_ns) == \
        (len(data), 0o640, 1_600_000_000_123_456_789)
    assert (fresh.path / "big.bin").read_bytes() == data


def test_large_file_rewritten_after_close_is_promoted_whole(lake, mounter, aifs_cli):
    """Streams broken every way a writer can: a write after close (racing the
    completion of the upload), a truncate while open, a write behind what was
    uploaded. Whatever the timing, the lake ends with the last bytes written and
    no upload left open."""
    mount = mounter(lake, "--promote-delay", "0.2", *SMALL_PARTS)
    m = mount.path
    rng = random.Random(8)
    expected: dict[str, bytes] = {}

    # written after close: reopened at once, a patch near the front
    after = bytearray(rng.randbytes(14 * MiB))
    fd = os.open(m / "after-close.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    write_front_to_back(fd, after, 0, len(after))
    os.close(fd)
    patch = rng.randbytes(MiB + 5)
    fd = os.open(m / "after-close.bin", os.O_WRONLY)
    os.pwrite(fd, patch, 3)
    os.close(fd)
    after[3:3 + len(patch)] = patch
    expected["after-close.bin"] = bytes(after)
    sync(aifs_cli, m)  # so the uploads awaited below are the next file's
    assert lake.get("after-close.bin") == after
    wait_for(lambda: not lake_uploads(lake), 20, "no upload left after sync")

    def stream_then(name: str, size: int, change) -> bytes:
        """Write the first 12 MiB of ``name`` front to back, wait for parts in
        the lake, let ``change(fd, data)`` break the stream, close; the bytes
        the file holds."""
        data = bytearray(rng.randbytes(size))
        fd = os.open(m / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            write_front_to_back(fd, data, 0, 12 * MiB)
            wait_for(lambda: lake_upload_parts(lake) > 0, 20, f"parts of {name} in the lake")
            change(fd, data)
        finally:
            os.close(fd)
        return bytes(data)

    def truncate_and_write_on(fd: int, data: bytearray) -> None:
        os.ftruncate(fd, 7 * MiB)
        del data[7 * MiB:]
        tail = rng.randbytes(3 * MiB)
        os.pwrite(fd, tail, 7 * MiB)
        data += tail

    def write_behind_the_upload(fd: int, data: bytearray) -> None:
        patch = rng.randbytes(2 * MiB)
        os.pwrite(fd, patch, MiB)
        data[MiB:3 * MiB] = patch
        write_front_to_back(fd, data, 12 * MiB, len(data))

    expected["truncated.bin"] = stream_then("truncated.bin", 16 * MiB, truncate_and_write_on)
    sync(aifs_cli, m)
    wait_for(lambda: not lake_uploads(lake), 20, "no upload left after sync")
    expected["behind.bin"] = stream_then("behind.bin", 15 * MiB, write_behind_the_upload)

    sync(aifs_cli, m)
    for name, data in expected.items():
        assert lake_size(lake, name) == len(data), name
        assert lake.get(name) == data, f"{name}: other bytes in the lake"
        assert (m / name).read_bytes() == data, f"{name} through the mount"
    wait_for(lambda: not lake_uploads(lake), 20, "the abandoned uploads aborted")
    log = mount.log_text()
    assert "streaming upload of truncated.bin abandoned: truncated" in log
    # seen at the write (through the daemon) or, for a direct writer, when the
    # parts are checked against the copy before completion
    assert ("streaming upload of behind.bin abandoned: not written front to back" in log
            or "streaming upload of behind.bin abandoned: part 1 was rewritten" in log)


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_at_most_16_files_stream_at_once(lake, mounter, aifs_cli):
    """17 large files written at the same time: 16 stream, the 17th waits for
    a slot, which none frees before all close: it is promoted after close;
    all 17 reach the lake exact."""
    from aifs.flush.stream import MAX_STREAMS
    mount = mounter(lake, "--promote-delay", "0.2", *SMALL_PARTS)
    m = mount.path
    rng = random.Random(9)
    files = {f"wide/f{i:02d}.dat": rng.randbytes(6 * MiB + i) for i in range(MAX_STREAMS + 1)}
    os.makedirs(m / "wide")
    fds = {name: os.open(m / name, os.O_WRONLY | os.O_CREAT, 0o644) for name in files}
    try:
        for name, data in files.items():
            write_front_to_back(fds[name], data, 0, len(data))
    finally:
        for fd in fds.values():
            os.close(fd)
    sync(aifs_cli, m)
    for name, data in files.items():
        assert lake.get(name) == data, name
    assert lake_uploads(lake) == []
    log = mount.log_text()
    assert f"wide/f16.dat waits to stream: {MAX_STREAMS} files stream already" in log


def test_rename_error_cases_and_directories(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    for d in ("full", "empty", "empty2", "d"):
        os.mkdir(m / d)
    (m / "full" / "f").write_bytes(b"full/f")
    (m / "d" / "inner").write_bytes(b"d/inner")
    (m / "file").write_bytes(b"file")
    assert_errno(errno.EISDIR, os.rename, m / "file", m / "empty")
    assert_errno(errno.ENOTDIR, os.rename, m / "d", m / "file")
    assert_errno(errno.ENOTEMPTY, os.rename, m / "d", m / "full")
    assert_errno(errno.EINVAL, os.rename, m / "d", m / "d" / "sub")
    assert_errno(errno.ENOTDIR, os.rename, m / "file" / "x", m / "y")
    assert_errno(errno.EEXIST, renameat2, m / "d", m / "empty2", RENAME_NOREPLACE)
    assert names(m) == ["d", "empty", "empty2", "file", "full"]
    sync(aifs_cli, m)
    os.rename(m / "d", m / "empty")  # a directory over an empty one replaces it
    assert names(m / "empty") == ["inner"] and not (m / "d").exists()
    assert (m / "empty" / "inner").read_bytes() == b"d/inner"
    os.rename(m / "full", m / "renamed")
    assert (m / "renamed" / "f").read_bytes() == b"full/f" and not (m / "full").exists()
    assert names(m) == ["empty", "empty2", "file", "renamed"]
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"file": b"file", "empty/inner": b"d/inner",
                                "renamed/f": b"full/f"}, {"empty", "empty2", "renamed"})


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_rename_directory_of_1000_files(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "5")
    m = mount.path
    size = 4096 if lake.kind == "local" else 16
    expected = {f"f{i:04d}": random.Random(i).randbytes(size) for i in range(1000)}
    os.mkdir(m / "src")
    for name, data in expected.items():
        (m / "src" / name).write_bytes(data)
    os.mkdir(m / "src" / "sub")
    (m / "src" / "sub" / "deep").write_bytes(b"deep")
    expected["sub/deep"] = b"deep"
    sync(aifs_cli, m)
    assert lake_tree(lake, "src/")[0] == expected
    # some changes not yet promoted when the directory moves
    (m / "src" / "f0000").write_bytes(b"changed")
    (m / "src" / "new").write_bytes(b"new file")
    expected.update({"f0000": b"changed", "new": b"new file"})
    os.rename(m / "src", m / "dst")
    assert not (m / "src").exists()
    assert names(m) == ["dst"]
    assert names(m / "dst") == sorted([n for n in expected if "/" not in n] + ["sub"])
    for name, data in expected.items():
        assert (m / "dst" / name).read_bytes() == data, name
    sync(aifs_cli, m)
    files, dirs = lake_tree(lake)
    assert not [k for k in lake_keys(lake) if k.startswith("src")]
    assert_same(files, {f"dst/{k}": v for k, v in expected.items()}, "lake contents")
    assert dirs == {"dst", "dst/sub"}


def test_symlinks(lake, mounter, aifs_cli):
    mount = mount_rw(lake, mounter)
    m = mount.path
    (m / "target.txt").write_bytes(b"pointed at")
    os.mkdir(m / "d")
    os.symlink("target.txt", m / "rel")
    os.symlink("/nowhere/at/all", m / "dangling")
    os.symlink("../target.txt", m / "d" / "up")
    assert os.readlink(m / "rel") == "target.txt"
    assert os.readlink(m / "dangling") == "/nowhere/at/all"
    assert os.readlink(m / "d" / "up") == "../target.txt"
    assert stat.S_ISLNK(os.lstat(m / "rel").st_mode)
    assert (m / "rel").read_bytes() == b"pointed at"
    assert (m / "d" / "up").read_bytes() == b"pointed at"
    assert os.path.lexists(m / "dangling") and not os.path.exists(m / "dangling")
    assert_errno(errno.EEXIST, os.symlink, "x", m / "rel")
    assert_errno(errno.EINVAL, os.readlink, m / "target.txt")
    sync(aifs_cli, m)
    assert lake.get("rel") == b"target.txt" and lake.get("d/up") == b"../target.txt"
    assert stat.S_ISLNK(int(lake_meta(lake, "rel")["mode"]))
    assert stat.S_ISLNK(int(lake_meta(lake, "dangling")["mode"]))
    os.unlink(m / "rel")
    assert (m / "target.txt").read_bytes() == b"pointed at"
    sync(aifs_cli, m)
    assert lake_tree(lake) == ({"target.txt": b"pointed at", "d/up": b"../target.txt",
                                "dangling": b"/nowhere/at/all"}, {"d"})


def test_hard_links_in_the_lake_are_objects_other_tools_can_read(lake, mounter, aifs_cli):
    """Each name of a hard-linked file is an object with the file's bytes and
    the group's id and name count in its metadata; an unlinked name's object
    goes, the others stay."""
    mount = mount_rw(lake, mounter)
    m = mount.path
    os.makedirs(m / "d")
    (m / "f").write_bytes(b"linked bytes" * 100_000)  # an object of its own (1.2 MB)
    (m / "small").write_bytes(b"tiny")  # packed, then linked: objects too
    sync(aifs_cli, m)
    os.link(m / "f", m / "d" / "g")
    os.link(m / "f", m / "h")
    os.link(m / "small", m / "d" / "small2")
    sync(aifs_cli, m)
    files, _ = lake_tree(lake)
    assert {k: v for k, v in files.items() if not k.startswith(".aifs/")} == {
        "f": b"linked bytes" * 100_000, "d/g": b"linked bytes" * 100_000,
        "h": b"linked bytes" * 100_000, "small": b"tiny", "d/small2": b"tiny"}
    metas = [lake_meta(lake, key) for key in ("f", "d/g", "h")]
    assert {m["aifs-link"] for m in metas} == {metas[0]["aifs-link"]}
    assert [m["aifs-nlink"] for m in metas] == ["3", "3", "3"]
    os.unlink(m / "f")
    sync(aifs_cli, m)
    files, _ = lake_tree(lake)
    assert "f" not in files and files["h"] == b"linked bytes" * 100_000
    assert lake_meta(lake, "d/g")["aifs-nlink"] == "2"


def test_fsync_keeps_data_across_a_daemon_crash(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "3600", name="first")
    data = os.urandom(MiB + 1)
    fd = os.open(mount.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.fdatasync(fd)
    dir_fd = os.open(mount.path, os.O_RDONLY)
    os.fsync(dir_fd)
    os.close(dir_fd)
    assert "f" not in lake_keys(lake)  # fsync=local: durable in the cache, not uploaded
    mount.proc.kill()
    mount.kill()
    with contextlib.suppress(OSError):
        os.close(fd)
    again = mount_rw(lake, mounter, name="second", cache="first")
    assert (again.path / "f").read_bytes() == data
    sync(aifs_cli, again.path)
    assert lake.get("f") == data


def test_fsync_lake_waits_for_the_lake(lake, mounter):
    mount = mounter(lake, "--promote-delay", "3600", "--fsync", "lake")
    data = os.urandom(MiB + 1)
    with open(mount.path / "f", "wb") as fp:
        fp.write(data)
        fp.flush()
        os.fsync(fp.fileno())
        assert lake.get("f") == data
        fp.write(b"more")
        fp.flush()
        os.fsync(fp.fileno())
        assert lake.get("f") == data + b"more"


# -- what survives umount and a new mount on an empty cache ---------------------------
def snapshot(root: Path) -> dict[str, dict]:
    """Everything a user sees of each entry below root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            entry = {"mode": oct(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                     "mtime_ns": st.st_mtime_ns}
            if stat.S_ISLNK(st.st_mode):
                entry["link"] = os.readlink(path)
            else:
                entry["xattrs"] = {n: os.getxattr(path, n) for n in os.listxattr(path)
                                   if not n.startswith("user.aifs.")}
                if stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as fp:
                        entry["xxh3"] = xxhash.xxh3_128_hexdigest(fp.read())
                    entry["size"] = st.st_size
            out[os.path.relpath(path, root)] = entry
    return out


def test_remount_on_empty_cache_keeps_everything(lake, mounter, aifs_cli):
    lake.put("from-lake.bin", b"lake object")
    first = mount_rw(lake, mounter, name="first")
    m = first.path
    files = {"plain.txt": b"hello", "empty": b"", "big.bin": os.urandom(2 * MiB + 3),
             "dir/owned.bin": b"owned", "dir/sub/deep.bin": b"deep",
             "shared/x": b"x"}
    for d in ("dir", "dir/sub", "shared", "emptydir", "a", "a/b", "a/b/c"):
        os.mkdir(m / d)
    for name, data in files.items():
        (m / name).write_bytes(data)
    os.symlink("plain.txt", m / "link")
    os.symlink("../nowhere/x", m / "dir" / "dangling")
    modes = {"plain.txt": 0o600, "empty": 0o644, "big.bin": 0o755, "dir/owned.bin": 0o640,
             "dir/sub/deep.bin": 0o444, "from-lake.bin": 0o600, "shared": 0o1777,
             "dir": 0o750, "emptydir": 0o700, "a/b/c": 0o555}
    for name, mode in modes.items():
        os.chmod(m / name, mode)
    for name in ("dir/owned.bin", "dir", "from-lake.bin", "emptydir"):
        os.chown(m / name, 1234, 5678)
    xattrs = {"plain.txt": {"user.a": b"1", "user.bin": bytes(range(256))},
              "dir": {"user.d": b"dir"}, "emptydir": {"user.e": b"empty dir"},
              "from-lake.bin": {"user.l": b"lake"}}
    for name, values in xattrs.items():
        for key, value in values.items():
            os.setxattr(m / name, key, value)
    # mtimes last: entries added to a directory change its mtime
    stamped = ["plain.txt", "empty", "big.bin", "dir/owned.bin", "dir/sub/deep.bin",
               "shared/x", "from-lake.bin", "dir/sub", "dir", "shared", "emptydir",
               "a/b/c", "a/b", "a"]
    for i, name in enumerate(stamped):
        stamp = 1_600_000_000_000_000_001 + i * 1_000_003_007
        os.utime(m / name, ns=(stamp, stamp))
    before = snapshot(m)
    # what was set is what is seen
    assert before["dir/owned.bin"]["uid"] == 1234 and before["dir/owned.bin"]["gid"] == 5678
    assert before["shared"]["mode"] == oct(stat.S_IFDIR | 0o1777)
    assert before["plain.txt"]["xattrs"] == xattrs["plain.txt"]
    assert before["a/b"]["mtime_ns"] == 1_600_000_000_000_000_001 + 12 * 1_000_003_007
    assert before["link"]["link"] == "plain.txt"

    sync(aifs_cli, m)
    got_files, got_dirs = lake_tree(lake)
    assert_same(got_files, dict(files, **{"from-lake.bin": b"lake object",
                                          "link": b"plain.txt",
                                          "dir/dangling": b"../nowhere/x"}), "lake objects")
    assert got_dirs == {"dir", "dir/sub", "shared", "emptydir", "a", "a/b", "a/b/c"}
    keys = lake_keys(lake)
    assert "emptydir/" in keys and "a/b/c/" in keys
    meta = lake_meta(lake, "dir/owned.bin")
    assert int(meta["mode"]) == stat.S_IFREG | 0o640
    assert (meta["uid"], meta["gid"]) == ("1234", "5678")
    assert mtime_ns_of(meta["mtime"]) == before["dir/owned.bin"]["mtime_ns"]
    assert stat.S_ISLNK(int(lake_meta(lake, "link")["mode"]))

    first.unmount()
    second = mount_rw(lake, mounter, name="second")  # a new, empty cache directory
    after = snapshot(second.path)
    assert_same(after, before, "the tree after a remount on an empty cache")


# -- the CLI around the write path -------------------------------------------------
def test_sync_outside_a_mount_is_one_clear_line(aifs_cli, tmp_path):
    result = aifs_cli("sync", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, \
        result.stderr


def test_umount_no_flush_leaves_changes_for_the_next_mount(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "3600", name="first")
    data = os.urandom(MiB + 3)
    (mount.path / "kept.bin").write_bytes(data)
    os.mkdir(mount.path / "d")
    (mount.path / "d" / "small").write_bytes(b"small")
    result = aifs_cli("umount", "--no-flush", str(mount.path))
    assert result.returncode == 0, result.stderr
    assert mount.proc.wait(60) == 0 and not os.path.ismount(mount.path)
    assert not {"kept.bin", "d/small"} & set(lake_keys(lake))
    again = mount_rw(lake, mounter, name="second", cache="first")
    assert (again.path / "kept.bin").read_bytes() == data
    sync(aifs_cli, again.path)
    assert lake_tree(lake) == ({"kept.bin": data, "d/small": b"small"}, {"d"})


def test_a_file_the_lake_refuses_does_not_keep_the_others_out_at_unmount(tmp_path, mounter):
    """One file whose upload keeps failing (here: its lake directory is
    immutable) must not make the unmount give up on every other pending file."""
    import subprocess

    from support.lakes import Lake
    root = tmp_path / "lake"
    (root / "blocked").mkdir(parents=True)
    lake = Lake("local", f"file://{root}", {}, [], root=root)
    mount = mounter(lake, "--promote-delay", "3600", "--pack-threshold", "0",
                    "--promote-workers", "1")
    (mount.path / "blocked" / "f").write_bytes(b"refused")
    os.makedirs(mount.path / "ok")
    files = 100  # one at a time: they take longer than the failing file's retries
    for i in range(files):
        (mount.path / "ok" / f"{i}").write_bytes(b"%d" % i * MiB)
    subprocess.run(["chattr", "+i", str(root / "blocked")], check=True)
    try:
        mount.unmount()
    finally:
        subprocess.run(["chattr", "-i", str(root / "blocked")], check=True)
    assert {p.name: p.read_bytes() for p in (root / "ok").iterdir()} == \
        {f"{i}": b"%d" % i * MiB for i in range(files)}
    assert not (root / "blocked" / "f").exists()
    assert "blocked/f" in mount.log_text()
    again = mounter(lake, "--pack-threshold", "0", name="again", cache="m")  # promotes it now
    wait_for(lambda: (root / "blocked" / "f").exists(), 30, "blocked/f in the lake")
    assert (again.path / "blocked" / "f").read_bytes() == b"refused"
