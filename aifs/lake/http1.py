"""Keep-alive HTTP/1.1 requests over plain sockets, for the per-file calls.

Hand-written, and why: a fresh node reading a dataset of small objects makes
a GET per file from one Python process, on cores it shares with the data
loaders. Measured on this machine against Ceph RGW, 16 KiB GETs signed the
same way: urllib3 0.62 ms of CPU per GET, ``http.client`` 0.38 ms, a socket
and a buffered reader 0.20 ms (``docs/benchmarks.md``, fresh node). A GET,
a HEAD and a LIST page need little of HTTP: one request, a status line,
headers, a body of ``Content-Length`` bytes (or chunks); this is that, with
idle connections kept for the next request. Proxies are left to urllib3
(``s3http.py`` uses this only for direct connections).

Failures are :class:`Broken` with the cause the retry policy counts them
under: ``connection`` (refused, reset, closed before an answer), ``timeout``,
``truncated`` (the answer ended before its length). A request on a reused
connection that the server closed while idle is sent again once on a new one
before anything of the answer came (all requests here are idempotent).
"""

from __future__ import annotations

import errno
import io
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, cast

import trio

from aifs import buffers

LINE = 65536  # longest status or header line taken


class Broken(Exception):
    """The request got no whole answer: ``cause`` is connection, timeout or truncated."""

    def __init__(self, message: str, cause: str, connecting: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        self.connecting = connecting  # the endpoint could not be reached at all


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes | bytearray | memoryview  # (a body received whole: never written to)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # (a BufferedReader: mode "rb", buffering > 0; typeshed says IOBase for any int)
        self.rfile = cast(io.BufferedReader, sock.makefile("rb", buffering=LINE))

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


class Connections:
    """Connections to one ``host:port``, kept open between requests."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None,
                 connect_timeout: float, timeout: float, keep: int) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.keep = keep  # idle connections kept at most
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def request(self, method: str, target: str, headers: dict[str, str],
                pooled: bool = False) -> Response:
        """One request and its answer; ``pooled``: a large successful body is
        received into a reused aligned buffer (:mod:`aifs.buffers`): a view."""
        head = (f"{method} {target} HTTP/1.1\r\n"
                + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                + "\r\n").encode("latin-1")
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                return self._exchange(conn, method, head, pooled)
            except _Stale:
                pass  # closed while idle: once more on a new connection
        try:
            return self._exchange(self._connect(), method, head, pooled)
        except _Stale as exc:
            raise Broken(f"connection closed before an answer ({exc.__cause__ or 'EOF'})",
                         "connection") from None

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        except TimeoutError:
            raise Broken("connect timed out", "timeout", connecting=True) from None
        except OSError as exc:
            raise Broken(type(exc).__name__, "connection", connecting=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise Broken(f"TLS: {exc}", "connection", connecting=True) from None
        return _Connection(sock)

    def _exchange(self, conn: _Connection, method: str, head: bytes,
                  pooled: bool = False) -> Response:
        """Send one request and read its answer; the connection is kept if it may be."""
        started = False  # any byte of the answer read
        try:
            try:
                conn.sock.sendall(head)
                status_line = conn.rfile.readline(LINE)
            except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
                raise _Stale() from exc
            if not status_line:
                raise _Stale()
            started = True
            while True:
                lines = []
                while (line := conn.rfile.readline(LINE)) not in (b"\r\n", b"\n"):
                    if not line:
                        raise Broken("answer cut short in its headers", "truncated")
                    lines.append(line)
                status, headers, keep = _head(status_line, lines)
                if not _interim(status):
                    break
                status_line = conn.rfile.readline(LINE)  # the answer after "100 Continue"
                if not status_line:
                    raise Broken("answer cut short after an interim one", "truncated")
            framing = _framing(method, status, headers)
            body: bytes | memoryview
            if framing == 0:
                body = b""
            elif framing == "chunked":
                body = _chunks(conn)
            elif isinstance(framing, int):
                length = framing
                if pooled and status in (200, 206) and length >= buffers.MIN_SIZE:
                    body = _read_into(conn, buffers.take(length))
                else:
                    body = conn.rfile.read(length)
                if len(body) != length:
                    raise Broken(f"body cut short ({len(body)} of {length} bytes)",
                                 "truncated")
            else:
                body, keep = conn.rfile.read(), False  # to the end of the connection
        except _Stale:
            conn.close()
            raise
        except TimeoutError:
            conn.close()
            raise Broken("timed out", "timeout") from None
        except Broken:
            conn.close()
            raise
        except (OSError, ValueError) as exc:
            conn.close()
            raise Broken(f"connection broken: {type(exc).__name__}",
                         "truncated" if started else "connection") from None
        if keep:
            with self._lock:
                if len(self._idle) < self.keep:
                    self._idle.append(conn)
                    return Response(status, headers, body)
        conn.close()
        return Response(status, headers, body)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Stale(Exception):
    """The connection was closed before any byte of the answer."""


def _read_into(conn: _Connection, view: memoryview) -> memoryview:
    """Fill ``view`` from the connection (a view of what came, if it ended)."""
    got = 0
    while got < len(view):
        n = conn.rfile.readinto(view[got:])
        if not n:
            break
        got += n
    return view[:got]


def _head(status_line: bytes, lines: list[bytes]) -> tuple[int, dict[str, str], bool]:
    """An answer's status, headers (names in lower case) and whether its
    connection may serve another request."""
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise Broken(f"not an HTTP answer: {status_line[:40]!r}", "truncated")
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    keep = parts[0] == b"HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return int(parts[1]), headers, keep


def _interim(status: int) -> bool:
    """An interim answer (``100 Continue``, ``102``, ``103``): the real one follows
    on the same connection (a ``101`` switch of protocols is not one)."""
    return 100 <= status < 200 and status != 101


def _framing(method: str, status: int, headers: dict[str, str]) -> int | str:
    """How an answer's body ends: after that many bytes (0: there is none),
    ``"chunked"``, or ``"close"`` (with the connection)."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return 0
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    if "content-length" in headers:
        return int(headers["content-length"])
    return "close"


def _chunks(conn: _Connection) -> bytes:
    pieces: list[bytes] = []
    while True:
        line = conn.rfile.readline(LINE)
        if not line:
            raise Broken("answer cut short in its chunks", "truncated")
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while conn.rfile.readline(LINE) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(pieces)
        piece = conn.rfile.read(size)
        if len(piece) != size or conn.rfile.readline(LINE) not in (b"\r\n", b"\n"):
            raise Broken("answer cut short in a chunk", "truncated")
        pieces.append(piece)


# -- the same requests from the event loop --------------------------------------
# A request sent from a worker thread costs two wake-ups besides the network's
# (the thread, then the event loop when it answers): on this machine about as
# much CPU as the request itself. Small GETs, a fresh node's request per file,
# are therefore sent from the event loop on non-blocking sockets (plain HTTP;
# TLS and large bodies keep to threads).


class AsyncConnections:
    """Connections to one ``host:port`` used from trio tasks, kept open between
    requests. Same answers and failures as :class:`Connections`."""

    def __init__(self, host: str, port: int, connect_timeout: float, timeout: float,
                 keep: int) -> None:
        self.host, self.port = host, port
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.keep = keep
        self._idle: list[_AsyncConnection] = []
        self._address: tuple[Any, ...] | None = None
        self._family = socket.AF_INET

    async def request(self, method: str, target: str, headers: dict[str, str]) -> Response:
        head = (f"{method} {target} HTTP/1.1\r\n"
                + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
                + "\r\n").encode("latin-1")
        conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                return await self._exchange(conn, method, head)
            except _Stale:
                pass  # closed while idle: once more on a new connection
        try:
            return await self._exchange(await self._connect(), method, head)
        except _Stale as exc:
            raise Broken(f"connection closed before an answer ({exc.__cause__ or 'EOF'})",
                         "connection") from None

    async def _connect(self) -> _AsyncConnection:
        if self._address is None:
            try:
                infos = await trio.socket.getaddrinfo(self.host, self.port,
                                                      type=socket.SOCK_STREAM)
            except OSError as exc:
                raise Broken(type(exc).__name__, "connection", connecting=True) from None
            failed: Broken | None = None
            for family, _, _, _, address in infos:  # the first that answers is kept
                self._family, self._address = family, address
                try:
                    return await self._connect_to()
                except Broken as exc:
                    failed, self._address = exc, None
            raise failed or Broken("no address", "connection", connecting=True)
        return await self._connect_to()

    async def _connect_to(self) -> _AsyncConnection:
        assert self._address is not None
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            with trio.fail_after(self.connect_timeout):
                err = sock.connect_ex(self._address)
                if err in (errno.EINPROGRESS, errno.EAGAIN):
                    await trio.lowlevel.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except trio.TooSlowError:
            _forget(sock)
            raise Broken("connect timed out", "timeout", connecting=True) from None
        except OSError as exc:
            _forget(sock)
            self._address = None  # look the name up again next time
            raise Broken(type(exc).__name__ if not exc.errno else os.strerror(exc.errno),
                         "connection", connecting=True) from None
        except BaseException:
            _forget(sock)
            raise
        return _AsyncConnection(sock)

    async def _exchange(self, conn: _AsyncConnection, method: str, head: bytes) -> Response:
        kept = False
        try:
            with trio.fail_after(self.timeout):
                try:
                    await conn.send(head)
                    end = await conn.until(b"\r\n\r\n")
                except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
                    if conn.buf:
                        raise Broken(f"connection broken: {type(exc).__name__}",
                                     "truncated") from None
                    raise _Stale() from exc
                if end < 0:
                    if not conn.buf:
                        raise _Stale()
                    raise Broken("answer cut short in its headers", "truncated")
                while True:
                    lines = bytes(conn.buf[:end]).split(b"\r\n")
                    del conn.buf[:end + 4]
                    status, headers, keep = _head(lines[0], lines[1:])
                    if not _interim(status):
                        break
                    if (end := await conn.until(b"\r\n\r\n")) < 0:
                        raise Broken("answer cut short after an interim one", "truncated")
                framing = _framing(method, status, headers)
                body: bytes | bytearray
                if framing == 0:
                    body = b""
                elif framing == "chunked":
                    body = await conn.chunks()  # (S3 error answers may come so)
                elif isinstance(framing, int):
                    body = await conn.body(framing)
                else:  # to the end of the connection
                    while await conn.more():
                        pass
                    body, keep = bytes(conn.buf), False
            if keep and not conn.buf and len(self._idle) < self.keep:
                self._idle.append(conn)
                kept = True
            return Response(status, headers, body)
        except trio.TooSlowError:
            raise Broken("timed out", "timeout") from None
        except OSError as exc:
            raise Broken(f"connection broken: {type(exc).__name__}",
                         "truncated" if conn.buf else "connection") from None
        except ValueError as exc:
            raise Broken(f"unreadable answer: {exc}", "truncated") from None
        finally:
            if not kept:
                conn.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _AsyncConnection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.closed = False

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    async def more(self) -> bool:
        """Read what has come into ``buf``; False at the end of the connection."""
        while True:
            try:
                chunk = self.sock.recv(LINE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if not chunk:
                return False
            self.buf += chunk
            return True

    async def until(self, marker: bytes) -> int:
        """Read until ``marker`` is in ``buf``: its index (-1: the connection ended)."""
        start = 0
        while True:
            at = self.buf.find(marker, start)
            if at >= 0:
                return at
            if len(self.buf) > LINE:
                raise ValueError("headers too long")
            start = max(0, len(self.buf) - len(marker) + 1)
            if not await self.more():
                return -1

    async def fill_to(self, length: int) -> bool:
        while len(self.buf) < length:
            if not await self.more():
                return False
        return True

    async def body(self, length: int) -> bytearray:
        """A body of ``length`` bytes, received into one buffer of its own (a
        64 KiB ``recv`` appended to ``buf`` and copied out at the end cost
        three copies of every byte). Returned as the bytearray it was read
        into (no one writes to it afterwards)."""
        body = bytearray(length)
        got = min(len(self.buf), length)
        body[:got] = self.buf[:got]
        del self.buf[:got]
        with memoryview(body) as view:
            while got < length:
                try:
                    n = self.sock.recv_into(view[got:])
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self.sock)
                    continue
                except OSError as exc:  # the server had the request: not a stale connection
                    raise Broken(f"connection broken: {type(exc).__name__}",
                                 "truncated") from None
                if not n:
                    raise Broken(f"body cut short ({got} of {length} bytes)", "truncated")
                got += n
        return body

    async def chunks(self) -> bytes:
        pieces: list[bytes] = []
        while True:
            end = await self.until(b"\r\n")
            if end < 0:
                raise Broken("answer cut short in its chunks", "truncated")
            size = int(bytes(self.buf[:end]).split(b";", 1)[0].strip() or b"0", 16)
            del self.buf[:end + 2]
            if size == 0:
                while (end := await self.until(b"\r\n")) > 0:
                    del self.buf[:end + 2]  # trailers
                if end < 0:
                    raise Broken("answer cut short in its trailers", "truncated")
                del self.buf[:2]
                return b"".join(pieces)
            if not await self.fill_to(size + 2) or self.buf[size:size + 2] != b"\r\n":
                raise Broken("answer cut short in a chunk", "truncated")
            pieces.append(bytes(self.buf[:size]))
            del self.buf[:size + 2]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _forget(self.sock)


def _forget(sock: socket.socket) -> None:
    """Close a socket trio may be watching."""
    try:
        trio.lowlevel.notify_closing(sock)
    except RuntimeError:
        pass  # outside trio
    sock.close()
