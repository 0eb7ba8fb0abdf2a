"""A TCP proxy in front of a real S3 server that breaks connections, seeded.

Each request/response exchange on a connection (the proxy sees bytes, not HTTP:
a response begins when the server sends after the client did) may meet one
fault, drawn with probability ``rate``:

- ``before``: the connection is reset when the request starts, before the server
  saw anything of it;
- ``after``: the request reaches the server, which answers, and the reply is
  lost: the client's connection is reset (the lost reply of a PUT, a
  CreateMultipartUpload, a CompleteMultipartUpload, a DELETE);
- ``truncate``: the reply is cut short (headers and part of the body arrive,
  then a reset): a truncated GET body.
- ``cut_body`` (not among the default kinds): a GET's reply is cut inside its
  body, always (at a seeded point after its headers, before its
  ``Content-Length`` is reached); other replies pass whole.

Counts of each fault are kept in ``faults``. Only 127.0.0.1.

``replies`` (an Event, set) lets the server's replies through; cleared, they
are held (``held`` counts those waiting) until it is set again: a lake that
does not answer yet.
"""

from __future__ import annotations

import collections
import random
import selectors
import socket
import struct
import threading

KINDS = ("before", "after", "truncate")


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    def __init__(self, upstream_port: int, rate: float, seed: int,
                 kinds: tuple[str, ...] = KINDS) -> None:
        self.upstream_port = upstream_port
        self.rate = rate
        self.kinds = kinds
        self.seed = seed
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.faults: collections.Counter[str] = collections.Counter()
        self.exchanges = 0
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.enabled = True
        self.replies = threading.Event()
        self.replies.set()
        self.held = 0
        self.held_lines: list[bytes] = []  # the request line of each reply held
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _draw(self) -> str | None:
        with self.lock:
            self.exchanges += 1
            if not self.enabled or self.random.random() >= self.rate:
                return None
            kind = self.random.choice(self.kinds)
            self.faults[kind] += 1
            return kind

    def _cut(self) -> int:
        """Where a truncated reply ends: in or just after its headers, or
        anywhere in the first MiB (a reply shorter than that arrives whole)."""
        with self.lock:
            if self.random.random() < 0.5:
                return self.random.randint(0, 2048)
            return self.random.randint(0, 1 << 20)

    def _body_cut(self, data: bytes, line: bytes) -> int | None:
        """Where a ``cut_body`` reply starting with ``data`` ends: -1 while its
        headers are not whole; None (the fault not counted) for a reply with
        no body or not to a GET."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return -1
        length = 0
        for header in data[:end].split(b"\r\n")[1:]:
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        with self.lock:
            if not line.startswith(b"GET ") or length <= 0:
                self.faults["cut_body"] -= 1
                return None
            return end + 4 + self.random.randint(0, length - 1)

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        # selectors, not select.select: a test process may hold fds past
        # FD_SETSIZE (1,024), which select() cannot watch
        watch = selectors.DefaultSelector()
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            fault: str | None = None
            phase = "idle"  # then "request" (client sending), "reply" (server sending)
            sent = cut = 0  # reply bytes passed on; where a truncated reply ends
            held = b""  # (cut_body) the reply's start, until its headers are whole
            watch.register(client, selectors.EVENT_READ)
            watch.register(upstream, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in watch.select(60)]
                if not ready:
                    return
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    if phase != "request":  # a new exchange
                        phase, sent, held = "request", 0, b""
                        line = data.split(b"\r\n", 1)[0]  # "GET /bucket/key?... HTTP/1.1"
                        fault, cut = self._draw(), self._cut()
                        if fault == "before":
                            _reset(client)
                            return
                    upstream.sendall(data)
                if upstream in ready:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    phase = "reply"
                    if not self.replies.is_set():
                        with self.lock:
                            self.held += 1
                            self.held_lines.append(line)
                        self.replies.wait(60)
                    if fault == "after":
                        _reset(client)
                        return
                    if fault == "cut_body" and not sent:  # (the cut is chosen with the headers)
                        data, held = held + data, b""
                        chosen = self._body_cut(data, line)
                        if chosen == -1:  # headers not whole yet
                            held = data
                            continue
                        fault, cut = (None, 0) if chosen is None else (fault, chosen)
                    if fault in ("truncate", "cut_body"):
                        if sent + len(data) > cut:
                            client.sendall(data[:max(0, cut - sent)])
                            _reset(client)
                            return
                    client.sendall(data)
                    sent += len(data)
        except OSError:
            pass
        finally:
            watch.close()
            if upstream is not None:
                upstream.close()
            try:
                client.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self.listener.close()
