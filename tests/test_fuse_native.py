"""The kernel session's read loop in C (``aifs/fuse/kernel/_native.c``): the
requests it answers itself get the answers the Python session gives, and
tmpfs too; every other request reaches Python unchanged."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import termios
from pathlib import Path

import pytest
from conftest import _make_lake

from aifs.fuse.kernel import protocol as p

native = pytest.importorskip("aifs.fuse.kernel._native")


def request(opcode: int, unique: int, body: bytes = b"") -> bytes:
    length = p.IN_HEADER.size + len(body)
    return p.IN_HEADER.pack(length, opcode, unique, 1, 0, 0, 0, 0, 0) + body


def served(ends: tuple[socket.socket, socket.socket], *requests: bytes,
           spin_ns: int = 0) -> tuple[list[tuple[int, int]], int, bytes, list[int]]:
    """Feed ``requests`` to serve() over a socket pair that keeps message
    boundaries, as /dev/fuse does: the answers it wrote (error, unique), what
    it returned, the request it left in the buffer, and its counts."""
    kernel, daemon = ends
    for r in requests:
        kernel.send(r)
    buf, counts = bytearray(1 << 16), bytearray(8 * 64)
    n = native.serve(daemon.fileno(), buf, spin_ns, counts)
    answers = []
    kernel.setblocking(False)
    while True:
        try:
            out = kernel.recv(1 << 16)
        except BlockingIOError:
            break
        length, error, unique = p.OUT_HEADER.unpack_from(out)
        assert length == len(out) == p.OUT_HEADER.size
        answers.append((-error, unique))
    kernel.setblocking(True)
    return answers, n, bytes(buf[:max(n, 0)]), list(memoryview(counts).cast("Q"))


@pytest.fixture
def ends():
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    daemon.setblocking(False)
    yield kernel, daemon
    kernel.close()
    daemon.close()


def test_fixed_answers_are_given_and_the_rest_left_for_python(ends) -> None:
    getxattr = lambda name: p.GETXATTR_IN.pack(0, 0) + name + b"\0"  # noqa: E731
    lookup = request(p.LOOKUP, 5, b"name\0")
    answers, n, left, counts = served(
        ends, request(p.IOCTL, 1, bytes(32)),
        request(p.GETXATTR, 2, getxattr(b"security.capability")),
        request(p.GETXATTR, 3, getxattr(b"trusted.x")), lookup)
    assert answers == [(errno.ENOTTY, 1), (errno.ENODATA, 2), (errno.ENODATA, 3)]
    assert (n, left) == (len(lookup), lookup)  # the first one Python answers
    assert counts[p.IOCTL] == 1 and counts[p.GETXATTR] == 2 and sum(counts) == 3

    user = request(p.GETXATTR, 6, getxattr(b"user.aifs.sync"))  # aifs's own: Python
    assert served(ends, user)[:3] == ([], len(user), user)
    unterminated = request(p.GETXATTR, 7, p.GETXATTR_IN.pack(0, 0) + b"security.x")
    assert served(ends, unterminated)[:3] == ([], len(unterminated), unterminated)


def test_nothing_to_read_returns_after_the_poll_and_an_error_is_told(ends) -> None:
    assert served(ends, spin_ns=200_000)[:2] == ([], 0)
    kernel, daemon = ends
    kernel.close()
    # (a closed socket reads 0 bytes, which /dev/fuse never does)
    assert native.serve(daemon.fileno(), bytearray(64), 0, bytearray(8 * 64)) == -errno.EIO
    with pytest.raises(ValueError):
        native.serve(daemon.fileno(), bytearray(64), 0, bytearray(8))


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
    with open(m.path / "g", "wb") as fp:  # a new file's first write asks security.capability
        fp.write(b"more")
    assert (m.path / "g").read_bytes() == b"more"
    m.unmount()
    summary = m.log_text().split("requests served")[-1]
    assert ("answered by the C loop" in summary) == (c_loop == "true"), summary
