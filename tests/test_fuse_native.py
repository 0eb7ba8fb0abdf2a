"""The kernel session's read loop in C (``aifs/fuse/kernel/_native.c``,
``native.py``): the requests it answers itself get the answers the Python
session gives, and tmpfs's; the files it creates are the files Python would
have made, after a remount and after a killed daemon; every other request
reaches Python."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import trio
from conftest import Mount, _make_lake, open_dir

from aifs.fuse.kernel import protocol as p
from aifs.posix import adopted

native = pytest.importorskip("aifs.fuse.kernel._native")

TTL = 10**9


def core_fs(tmp_path: Path, promote_delay: float = 3600):
    """The core over a local lake in ``tmp_path`` (no mount): what the loop's
    records are applied to."""
    from aifs.cache.blocks import BlockCache
    from aifs.cache.files import LocalFiles
    from aifs.config import Config
    from aifs.core import Filesystem
    from aifs.lake.local import LocalStore
    from aifs.meta.store import MetaStore

    (tmp_path / "lake").mkdir(exist_ok=True)
    config = Config(lake=f"file://{tmp_path}/lake", promote_delay=promote_delay)
    return Filesystem(config, LocalStore(str(tmp_path / "lake")), MetaStore(tmp_path / "meta"),
                      BlockCache(tmp_path / "cache", config.cache_size),
                      LocalFiles(tmp_path / "cache"))


def request(opcode: int, unique: int, body: bytes = b"", nodeid: int = 1, uid: int = 0) -> bytes:
    length = p.IN_HEADER.size + len(body)
    return p.IN_HEADER.pack(length, opcode, unique, nodeid, uid, 0, 0, 0, 0) + body


def getxattr(name: bytes) -> bytes:
    return p.GETXATTR_IN.pack(0, 0) + name + b"\0"


class Loop:
    """A Front over a socket pair that keeps message boundaries, as /dev/fuse does."""

    def __init__(self, tmp: Path) -> None:
        self.kernel, self.daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.daemon.setblocking(False)
        (tmp / "files").mkdir()
        self.journal = os.open(tmp / "journal", os.O_RDWR | os.O_CREAT | os.O_APPEND)
        self.files = os.open(tmp / "files", os.O_RDONLY | os.O_DIRECTORY)
        self.front = native.Front(self.daemon.fileno(), self.journal, self.files, 5, 0, 4096,
                                  1 << 16)

    def served(self, *requests: bytes) -> tuple[list[tuple[int, int, bytes]], int, bytes]:
        """The answers (error, unique, body), serve()'s n and the request it left."""
        for r in requests:
            self.kernel.send(r)
        buf = bytearray(1 << 16)
        n, _, helper = self.front.serve(buf, 0)
        assert not helper
        answers = []
        self.kernel.setblocking(False)
        while True:
            try:
                out = self.kernel.recv(1 << 16)
            except BlockingIOError:
                break
            length, error, unique = p.OUT_HEADER.unpack_from(out)
            assert length == len(out)
            answers.append((-error, unique, out[p.OUT_HEADER.size:]))
        self.kernel.setblocking(True)
        return answers, n, bytes(buf[:max(n, 0)])

    def close(self) -> None:
        self.front.stop()
        for fd in (self.journal, self.files):
            os.close(fd)
        self.kernel.close()
        self.daemon.close()


@pytest.fixture
def loop(tmp_path):
    made = Loop(tmp_path)
    yield made
    made.close()


def test_fixed_answers_are_given_and_the_rest_left_for_python(loop) -> None:
    lookup = request(p.LOOKUP, 5, b"name\0")
    answers, n, left = loop.served(
        request(p.IOCTL, 1, bytes(32)), request(p.GETXATTR, 2, getxattr(b"security.capability")),
        request(p.GETXATTR, 3, getxattr(b"trusted.x")), lookup)
    assert [a[:2] for a in answers] == [(errno.ENOTTY, 1), (errno.ENODATA, 2), (errno.ENODATA, 3)]
    assert (n, left) == (len(lookup), lookup)  # the first one Python answers
    counts = memoryview(loop.front.counts()).cast("Q")
    assert counts[p.IOCTL] == 1 and counts[p.GETXATTR] == 2 and sum(counts) == 3

    user = request(p.GETXATTR, 6, getxattr(b"user.aifs.sync"))  # aifs's own: Python
    assert loop.served(user) == ([], len(user), user)
    unterminated = request(p.GETXATTR, 7, p.GETXATTR_IN.pack(0, 0) + b"security.x")
    assert loop.served(unterminated) == ([], len(unterminated), unterminated)


def test_a_directory_handed_over_is_answered_until_taken_back(loop) -> None:
    attr = p.ATTR.pack(7, 0, 0, 1, 2, 3, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
    loop.front.delegate(7, attr, 1000, 60 * TTL, [b"taken"])
    answers, n, _ = loop.served(request(p.LOOKUP, 1, b"free\0", nodeid=7),
                                request(p.GETATTR, 2, bytes(16), nodeid=7))
    assert n == 0 and [a[:2] for a in answers] == [(0, 1), (0, 2)]
    negative = answers[0][2]
    assert p.ENTRY_HEAD.unpack_from(negative)[:3] == (0, 0, 5)  # no inode, cached 5 s
    assert answers[1][2][p.ATTR_OUT_HEAD.size:] == attr  # the attributes Python gave
    for left in (request(p.LOOKUP, 3, b"taken\0", nodeid=7),  # a name it holds: Python's
                 request(p.LOOKUP, 4, b"free\0", nodeid=8),  # another directory
                 request(p.FLUSH, 5, p.FLUSH_IN.pack(99, 0, 0, 0), nodeid=9)):  # not its handle
        assert loop.served(left) == ([], len(left), left)
    assert loop.front.recall(7) and not loop.front.recall(7)
    again = request(p.LOOKUP, 6, b"free\0", nodeid=7)
    assert loop.served(again) == ([], len(again), again)
    # a listing's TTL over: Python looks again
    loop.front.delegate(7, attr, 1000, 0, [])
    assert loop.served(again) == ([], len(again), again)


def test_a_create_is_left_to_python_where_the_loop_cannot_make_it_direct(loop) -> None:
    """Over a socket no backing file can be registered: the create goes to
    Python, which answers it (and all later ones) as before; nothing is left
    behind and nothing journaled."""
    attr = p.ATTR.pack(7, 0, 0, 1, 2, 3, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 4096, 0)
    loop.front.delegate(7, attr, 1000, 60 * TTL, [])
    loop.front.give([100, 102], 1000, 2000)
    loop.front.set_creates(True)
    create = request(p.CREATE, 1, p.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o644, 0o022, 0)
                     + b"f\0", nodeid=7)
    assert loop.served(create) == ([], len(create), create)
    assert loop.front.state()["creates"] == 0 and loop.front.journaled() == 0
    assert os.listdir(f"/proc/self/fd/{loop.files}") == []


def test_a_file_handed_over_is_answered_until_taken_back(loop, tmp_path) -> None:
    """A closed file handed over: its attributes as Python gave them; an open
    for writing or truncating goes to Python, and so does a read-only one
    whose backing file cannot be registered (a socket here) or whose copy is
    gone, leaving nothing journaled; after take-back or its TTL, all is
    Python's."""
    attr = p.ATTR.pack(9, 5, 1, 1, 2, 3, 0, 0, 0, stat.S_IFREG | 0o640, 1, 0, 0, 0, 4096, 0)
    loop.front.give([], 1000, 2000)
    loop.front.delegate_files(struct.pack("<Qq", 9, time.monotonic_ns() + 60 * TTL) + attr)
    answers, n, _ = loop.served(request(p.GETATTR, 1, bytes(16), nodeid=9))
    assert n == 0 and [a[:2] for a in answers] == [(0, 1)]
    assert answers[0][2][p.ATTR_OUT_HEAD.size:] == attr
    (tmp_path / "files" / "9").write_bytes(b"bytes")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_RDONLY):
        left = request(p.OPEN, 2, p.OPEN_IN.pack(flags, 0), nodeid=9)
        assert loop.served(left) == ([], len(left), left), flags
    os.unlink(tmp_path / "files" / "9")
    assert loop.served(left) == ([], len(left), left)
    assert loop.front.journaled() == 0 and loop.front.state()["open"] == 0
    other = request(p.GETATTR, 3, bytes(16), nodeid=10)
    assert loop.served(other) == ([], len(other), other)
    assert loop.front.recall_file(9) and not loop.front.recall_file(9)
    again = request(p.GETATTR, 4, bytes(16), nodeid=9)
    assert loop.served(again) == ([], len(again), again)
    loop.front.delegate_files(struct.pack("<Qq", 9, time.monotonic_ns()) + attr)  # TTL over
    assert loop.served(again) == ([], len(again), again)


def test_nothing_to_read_returns_after_the_poll_and_an_error_is_told(loop) -> None:
    buf = bytearray(64)
    assert loop.front.serve(buf, 200_000) == (0, 0, False)
    loop.kernel.close()
    # (a closed socket reads 0 bytes, which /dev/fuse never does)
    assert loop.front.serve(buf, 0) == (-errno.EIO, 0, False)


@pytest.mark.parametrize("c_loop", ["true", "false"])
def test_a_mount_answers_as_tmpfs_with_and_without_the_c_loop(tmp_path, mounter, tmpfs,
                                                               c_loop) -> None:
    lake = _make_lake("local", None, tmp_path)
    m = mounter(lake, "--fuse-binding", "kernel", "--fuse-native", c_loop)
    reference = tmpfs / f"native-{c_loop}"
    reference.mkdir()
    for root in (m.path, reference):
        (root / "f").write_bytes(b"data")
        os.setxattr(root / "f", "user.kept", b"value")

    def outcome(path: Path, name: str) -> object:
        try:
            return os.getxattr(path, name)
        except OSError as exc:
            return errno.errorcode[exc.errno]

    def ioctl(path: Path) -> object:
        with open(path, "rb") as fp:
            try:
                return fcntl.ioctl(fp.fileno(), termios.TCGETS, bytes(64))
            except OSError as exc:
                return errno.errorcode[exc.errno]

    for name in ("security.capability", "trusted.x", "user.kept", "user.missing"):
        assert outcome(m.path / "f", name) == outcome(reference / "f", name), name
    assert ioctl(m.path / "f") == ioctl(reference / "f") == "ENOTTY"
    m.unmount()
    summary = m.log_text().split("requests served")[-1]
    assert ("answered by the C loop" in summary) == (c_loop == "true"), summary


# A program's files in a new directory, and what the names and attributes are
# after: run on tmpfs and on the mount, compared.
PROGRAM = r"""
import json, os, sys, stat
root = sys.argv[1]
os.umask(0o027)
d = os.path.join(root, "made")
os.mkdir(d)
for i in range(200):
    mode = (0o644, 0o600, 0o755, 0o4755)[i % 4]
    fd = os.open(os.path.join(d, f"f{i:03d}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, bytes([i % 251]) * (i * 37))
    os.close(fd)
try:
    os.open(os.path.join(d, "f000"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
except OSError as exc:
    excl = exc.errno
os.rename(os.path.join(d, "f001"), os.path.join(d, "moved"))
os.unlink(os.path.join(d, "f002"))
os.mkdir(os.path.join(d, "sub"))
with open(os.path.join(d, "f001"), "wb") as fp:  # the name moved away, made again
    fp.write(b"again")
with open(os.path.join(d, "sub", "g"), "wb") as fp:
    fp.write(b"below")
def seen(path):
    st = os.stat(path)
    size = None if stat.S_ISDIR(st.st_mode) else st.st_size  # (tmpfs counts entries)
    return [oct(st.st_mode), size, st.st_nlink, st.st_uid, st.st_gid]
out = {"excl": excl, "names": sorted(os.listdir(d)), "dir": seen(d)[::2],
       "files": {n: seen(os.path.join(d, n)) for n in sorted(os.listdir(d))},
       "newest": os.stat(d).st_mtime_ns >= os.stat(os.path.join(d, "f199")).st_mtime_ns}
print(json.dumps(out))
"""


def run_program(root: Path, program: str = PROGRAM) -> dict:
    """What ``program`` printed (JSON) run on ``root``; its errors, if it failed."""
    out = subprocess.run([sys.executable, "-c", program, str(root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def test_files_the_loop_creates_are_as_on_tmpfs_and_after_a_remount(tmp_path, mounter, tmpfs,
                                                                     aifs_cli) -> None:
    lake = _make_lake("local", None, tmp_path)
    m = mounter(lake, "--fuse-binding", "kernel")
    reference = tmpfs / "native-files"
    reference.mkdir()
    expected = run_program(reference)
    assert run_program(m.path) == expected
    made = m.path / "made"
    assert (made / "f100").read_bytes() == bytes([100]) * 3700
    assert (made / "f001").read_bytes() == b"again"
    assert aifs_cli("sync", str(m.path)).returncode == 0
    m.unmount()
    summary = m.log_text().split("requests served")[-1]
    assert " creates" in summary, summary  # the loop made them
    fresh = mounter(lake, "--fuse-binding", "kernel", name="fresh")  # an empty cache
    names = sorted(os.listdir(fresh.path / "made"))
    assert names == expected["names"]
    for i in (0, 3, 100, 199):
        assert (fresh.path / "made" / f"f{i:03d}").read_bytes() == bytes([i % 251]) * (i * 37)
    assert oct(os.stat(fresh.path / "made" / "f003").st_mode) == expected["files"]["f003"][0]


# Files a program wrote, read back (the loop opens them), then changed one way
# each and looked at again: each change reaches the next stat and read, as on
# tmpfs (the loop gave the file back first).
READ_BACK = r"""
import ctypes, hashlib, json, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def statx(path):  # AT_STATX_FORCE_SYNC: the daemon is asked, not the kernel's cache
    buf = ctypes.create_string_buffer(256)
    if libc.statx(-100, path.encode(), 0x2000, 0xFFF, buf) != 0:
        raise OSError(ctypes.get_errno(), path)
    nlink, uid, gid, mode = struct.unpack_from("<IIIH", buf, 16)
    size = struct.unpack_from("<Q", buf, 40)[0]
    mtime = struct.unpack_from("<qI", buf, 112)
    return [oct(mode), size, nlink, uid, gid, mtime[0] * 10**9 + mtime[1]]
root = sys.argv[1]
d = os.path.join(root, "made")
os.mkdir(d)
for i in range(40):
    with open(os.path.join(d, f"f{i:02d}"), "wb") as fp:
        fp.write(bytes([i]) * (1000 + i))
def looked(name):
    path = os.path.join(d, name)
    st = os.stat(path)
    with open(path, "rb") as fp:
        data = fp.read()
        same = os.fstat(fp.fileno()).st_size == len(data)
    forced = statx(path)
    return [oct(st.st_mode), st.st_size, st.st_nlink, same, hashlib.sha1(data).hexdigest(),
            forced[:5], forced[5] == st.st_mtime_ns]
os.mkdir(os.path.join(root, "other"))
with open(os.path.join(d, "twice"), "wb") as fp:  # a second name while open, then gone
    fp.write(b"two names")
    os.link(os.path.join(d, "twice"), os.path.join(root, "other", "alias"))
os.unlink(os.path.join(root, "other", "alias"))
first = {n: looked(n) for n in sorted(os.listdir(d))}
held = [open(os.path.join(d, "f30"), "rb"), open(os.path.join(d, "f30"), "rb")]
p = lambda i: os.path.join(d, f"f{i:02d}")
os.chmod(p(0), 0o600)
os.utime(p(1), ns=(1_000_000_000, 2_000_000_123))
os.truncate(p(2), 5)
with open(p(3), "ab") as fp:
    fp.write(b"more")
os.rename(p(4), os.path.join(d, "moved"))
os.link(p(5), os.path.join(d, "linked"))
os.unlink(p(6))
with open(p(7), "r+b") as fp:
    fp.write(b"XY")
with open(p(8), "wb") as fp:
    fp.write(b"new")
os.setxattr(p(9), "user.k", b"v")
os.rename(p(10), p(11))
os.unlink(p(30))
held_data = [fp.read() == bytes([30]) * 1030 for fp in held]
for fp in held:
    fp.close()
after = {n: looked(n) for n in sorted(os.listdir(d))}
print(json.dumps({"first": first, "after": after, "held": held_data,
                  "utime": os.stat(p(1)).st_mtime_ns, "xattr": os.getxattr(p(9), "user.k").hex()}))
"""


def test_files_the_loop_opens_are_as_on_tmpfs_after_each_change(tmp_path, mounter, tmpfs,
                                                                aifs_cli) -> None:
    lake = _make_lake("local", None, tmp_path)
    m = mounter(lake, "--fuse-binding", "kernel")
    reference = tmpfs / "native-read-back"
    reference.mkdir()
    assert run_program(m.path, READ_BACK) == run_program(reference, READ_BACK)
    assert aifs_cli("sync", str(m.path)).returncode == 0
    m.unmount()
    summary = m.log_text().split("requests served")[-1]
    assert " opens)" in summary, summary  # the loop opened them
    assert "Traceback" not in m.log_text()
    fresh = mounter(lake, "--fuse-binding", "kernel", name="fresh")  # an empty cache
    for name in ("f02", "f03", "f05", "linked", "f07", "f08", "f11", "moved", "f39"):
        assert (fresh.path / "made" / name).read_bytes() == (reference / "made" / name).read_bytes()


def test_files_closed_before_the_daemon_is_killed_are_kept(tmp_path, mounter, aifs_cli) -> None:
    """Creates the loop answered may not be applied when the daemon dies: the
    next mount applies them from the journal, so every closed file is there."""
    lake = _make_lake("local", None, tmp_path)
    m = mounter(lake, "--fuse-binding", "kernel", "--promote-delay", "3600", name="first")
    writer = subprocess.run([sys.executable, "-c", (
        "import os, sys\n"
        "d = os.path.join(sys.argv[1], 'burst'); os.mkdir(d)\n"
        "for i in range(1500):\n"
        "    with open(os.path.join(d, f'{i}'), 'wb') as fp: fp.write(str(i).encode() * 9)\n"),
        str(m.path)], timeout=120)
    assert writer.returncode == 0
    m.proc.send_signal(signal.SIGKILL)
    m.kill()
    again = mounter(lake, "--fuse-binding", "kernel", name="second", cache="first")
    got = {name: (again.path / "burst" / name).read_bytes()
           for name in os.listdir(again.path / "burst")}
    assert got == {str(i): str(i).encode() * 9 for i in range(1500)}
    assert aifs_cli("sync", str(again.path)).returncode == 0
    again.unmount()
    assert "Traceback" not in m.log_text() + again.log_text()


async def test_the_journal_a_killed_daemon_left_is_applied_at_mount(tmp_path) -> None:
    """Records written as the C loop writes them: a file closed (CREATE, FLUSH)
    comes back with its size and closed; one never closed is a crashed
    writer's (kept aside by recovery); a record cut short by the crash is left
    out."""
    from aifs.meta.store import ROOT_INO

    fs = core_fs(tmp_path)
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        directory = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        inos, _ = fs.adopted.reserve(3, 0)
        nursery.cancel_scope.cancel()
    fs.meta.close()
    fs.local.close()

    def create(ino: int, name: bytes) -> bytes:
        head = adopted.CREATE.pack(0, adopted.CREATED, directory.ino, ino, 1000 + ino,
                                   1_700_000_000_123_456_789, 0o640, 0, 0, 1, os.O_WRONLY,
                                   len(name), 5, 99)
        record = head + name + bytes((8 - (len(head) + len(name)) % 8) % 8)
        return struct.pack("<I", len(record)) + record[4:]

    def closed(ino: int) -> bytes:
        return adopted.HANDLE.pack(adopted.HANDLE.size, adopted.FLUSHED, ino, 1000 + ino, 1, 0)

    for ino, data in zip(inos, (b"closed bytes", b"open bytes"), strict=False):
        (tmp_path / "cache" / "files" / str(ino)).write_bytes(data)
    journal = (create(inos[0], b"closed") + closed(inos[0]) + create(inos[1], b"open")
               + create(inos[2], b"cut")[:30])
    (tmp_path / "cache" / adopted.JOURNAL).write_bytes(journal)
    fs = core_fs(tmp_path)
    try:
        fs.recover()
        kept = fs.meta.lookup(directory.ino, b"closed")
        assert kept is not None and kept.ino == inos[0] and kept.size == len(b"closed bytes")
        assert kept.mode == 0o640 and kept.mtime_ns == os.stat(
            tmp_path / "cache" / "files" / str(inos[0])).st_mtime_ns
        assert inos[0] not in fs.meta.unclosed()
        # never closed: a crashed writer's, kept aside as recovery keeps those
        assert fs.meta.lookup(directory.ino, b"open") is None
        assert [p.read_bytes() for p in (tmp_path / "cache" / "recovered").glob("*/d/open")] \
            == [b"open bytes"]
        assert fs.meta.lookup(directory.ino, b"cut") is None
        assert (tmp_path / "cache" / adopted.JOURNAL).stat().st_size == 0
        fs.recover()  # (applied once: a second mount finds the journal empty)
    finally:
        fs.meta.close()
        fs.local.close()



async def test_a_closed_create_applied_at_once_leaves_what_three_steps_leave(tmp_path) -> None:
    """The loop's create, flush and release of one file, applied together
    (``Adopted.create_closed``), leave the metadata, the local copy and the
    promotion queue as the core's own create, direct write, flush and release
    do."""
    from aifs.meta.store import ROOT_INO

    fs = core_fs(tmp_path)
    data = b"sixteen bytes.." * 99
    try:
        async with trio.open_nursery() as nursery:
            fs.start(nursery)
            d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
            counted = [dataclasses.asdict(fs.inodes.counters)]
            fh, three = await fs.create(d.ino, b"three", 0o640, os.O_WRONLY | os.O_CREAT, 0, 0)
            await fs.direct_backing(fh, False, os.getpid())
            os.pwrite(fs.local.fd(three.ino), data, 0)
            fs.absorb(three.ino)
            await fs.flush(fh)
            fs.direct_released(fh)
            fs.release(fh)
            counted.append(dataclasses.asdict(fs.inodes.counters))

            (ino,), first_fh = fs.adopted.reserve(1, 1)
            fd = os.open(fs.local.path(ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.pwrite(fd, data, 0)
            fs.adopted.create_closed(adopted.Created(d.ino, ino, first_fh, 1_800_000_000 * 10**9,
                                                     0o640, 0, 0, os.getpid(), 7, fd, b"once"))
            counted.append(dataclasses.asdict(fs.inodes.counters))
            # (status and metrics count the same: bytes written, direct opens)
            assert {k: counted[1][k] - counted[0][k] for k in counted[0]} \
                == {k: counted[2][k] - counted[1][k] for k in counted[0]}
            once = fs.meta.lookup(d.ino, b"once")
            three = fs.meta.lookup(d.ino, b"three")
            assert once is not None and three is not None

            def kept(inode) -> dict:
                fields = dataclasses.asdict(inode)
                for k in ("ino", "key", "mtime_ns", "ctime", "atime_ns"):
                    fields.pop(k)
                return fields

            assert kept(once) == kept(three)
            assert once.size == len(data) and once.mtime_ns == os.fstat(fd).st_mtime_ns
            assert once.ctime * 1e9 >= once.mtime_ns - 1000
            inodes = fs.inodes

            def state(ino_: int) -> tuple:
                return (ino_ in fs.meta.unclosed(), ino_ in inodes.unclosed,
                        ino_ in inodes.marked_dirty, ino_ in inodes.written,
                        ino_ in inodes.unsaved, inodes.opens.get(ino_),
                        inodes.writers.get(ino_), ino_ in fs.direct.writers,
                        fs.local.sizes()[ino_], ino_ in fs.promoter._due,
                        inodes.kernel_etag.get(ino_), ino_ in inodes.lookups)

            assert state(once.ino) == state(three.ino), repr((state(once.ino), state(three.ino)))
            assert state(once.ino)[8:10] == (len(data), True)  # promotion waits its delay
            nursery.cancel_scope.cancel()
    finally:
        fs.meta.close()
        fs.local.close()


async def test_a_read_only_open_applied_with_its_release_leaves_what_both_leave(
        tmp_path) -> None:
    """A read-only open the loop answered, applied alone (``Adopted.open``) or
    with its release (``Adopted.open_closed``), leaves the counters and the
    core's tables as the core's own open and release do."""
    from aifs.meta.store import ROOT_INO

    fs = core_fs(tmp_path)
    try:
        async with trio.open_nursery() as nursery:
            fs.start(nursery)
            fh, inode = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
            await fs.write(fh, 0, b"x" * 5000)
            await fs.flush(fh)
            fs.release(fh)
            ino = inode.ino
            inodes = fs.inodes

            def state() -> tuple:
                return (dataclasses.asdict(inodes.counters), inodes.opens.get(ino),
                        inodes.kernel_etag.get(ino), len(inodes.files), ino in fs.direct.writers)

            before = state()
            fh, _ = await fs.open(ino, os.O_RDONLY)
            assert await fs.direct_backing(fh, False, os.getpid()) is not None
            opened = state()
            fs.direct_released(fh)
            fs.release(fh)
            own = state()
            (_,), first = fs.adopted.reserve(1, 2)
            record = adopted.Handled(adopted.OPENED, ino, first, os.getpid(), 7)
            fs.adopted.open(record)
            fs.direct.went_direct(first, os.getpid())
            assert state()[1:] == opened[1:]
            fs.direct_released(first)
            fs.release(first)
            alone = state()
            assert fs.adopted.open_closed(dataclasses.replace(record, fh=first + 1))
            together = state()
            counted = [{k: b[0][k] - a[0][k] for k in a[0]}
                       for a, b in ((before, own), (own, alone), (alone, together))]
            assert counted[0] == counted[1] == counted[2] and counted[0]["direct_opens"] == 1
            assert own[1:] == alone[1:] == together[1:]
            nursery.cancel_scope.cancel()
    finally:
        fs.meta.close()
        fs.local.close()


async def test_a_copy_the_loop_may_hold_open_is_not_evicted(tmp_path) -> None:
    """Opens the C loop answered may not be applied yet when the cache makes
    room: a copy it may hold (``Inodes.held_outside``) stays, as an open one
    does; the others go. Its descriptor in the daemon may go."""
    from aifs.meta.store import ROOT_INO

    fs = core_fs(tmp_path, 0)
    try:
        async with trio.open_nursery() as nursery:
            fs.start(nursery)
            inos = []
            for name in (b"held", b"free"):
                fh, inode = await fs.create(ROOT_INO, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
                await fs.write(fh, 0, b"x" * 5000)
                await fs.flush(fh)
                fs.release(fh)
                inos.append(inode.ino)
            with trio.fail_after(30):
                await fs.sync(ROOT_INO)  # in the lake: the copies are clean
            held, free = inos
            fs.inodes.held_outside = lambda ino: ino == held
            fs.local.evict(1 << 30)
            assert fs.local.has(held) and not fs.local.has(free)
            # Its descriptor is not kept for it (the kernel holds its own): the
            # daemon's stay within max_open (they did not, and each new copy
            # scanned them all).
            fs.inodes.held_outside = lambda ino: True
            fs.local.max_open = 2
            for i in range(6):
                fh, _ = await fs.create(ROOT_INO, b"more%d" % i, 0o644, os.O_WRONLY, 0, 0)
                fs.release(fh)
            root = str(fs.local.root) + "/"

            def target(fd: str) -> str:
                try:
                    return os.readlink(f"/proc/self/fd/{fd}")
                except FileNotFoundError:  # (the listing's own, closed since)
                    return ""

            kept = [fd for fd in os.listdir("/proc/self/fd") if target(fd).startswith(root)]
            assert len(kept) <= 2, kept
            nursery.cancel_scope.cancel()
    finally:
        fs.meta.close()
        fs.local.close()


AS_NOBODY = r"""
import os, sys
os.setgid(65534); os.setuid(65534)
with open(sys.argv[1], "wb") as fp:
    fp.write(b"nobody's")
"""


def test_another_users_create_keeps_the_directory_right(tmp_path, tmpfs) -> None:
    """A create the loop leaves to Python (not root's) is told to the loop: a
    lookup of that name, once the kernel forgot it, is not answered absent,
    and the directory's times are Python's."""
    lake = _make_lake("local", None, tmp_path)
    where = open_dir()  # (pytest's tmp_path is root's alone)
    m = Mount(lake, where / "mnt", tmp_path / "cache", tmp_path / "aifs.log",
              ["--fuse-binding", "kernel", "--allow-other"])
    try:
        check_another_users_create(m, tmpfs)
    finally:
        m.unmount()
        shutil.rmtree(where, ignore_errors=True)
    assert " creates" in m.log_text().split("requests served")[-1]


def check_another_users_create(m: Mount, tmpfs: Path) -> None:
    os.chmod(m.path, 0o777)
    reference = tmpfs / "native-nobody"
    reference.mkdir()
    seen = {}
    for side, root in (("aifs", m.path), ("tmpfs", reference)):
        d = root / "shared"
        old_umask = os.umask(0)  # (no chmod: it would take the directory back)
        try:
            d.mkdir(mode=0o777)
        finally:
            os.umask(old_umask)
        (d / "first").write_bytes(b"root's")
        subprocess.run([sys.executable, "-c", AS_NOBODY, str(d / "theirs")], check=True,
                       timeout=60)
        (d / "after").write_bytes(b"root's again")
        before = os.stat(d).st_mtime_ns
        Path("/proc/sys/vm/drop_caches").write_text("2")  # the kernel forgets the names
        got = {name: ((d / name).read_bytes(), os.stat(d / name).st_uid)
               for name in ("first", "theirs", "after")}
        seen[side] = (got, sorted(os.listdir(d)), os.stat(d).st_mtime_ns == before)
    assert seen["aifs"] == seen["tmpfs"]
