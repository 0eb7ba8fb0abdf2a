"""aifs's own HTTP/1.1 connections (lake/http1.py), threaded and from the
event loop, against a scripted server on 127.0.0.1: a connection the server
closed while idle, a body cut short, no answer at all, chunks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import trio

from aifs.lake.http1 import AsyncConnections, Broken, Connections

Answer = Callable[[socket.socket, bytes], bool]  # False: close the connection after it


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@pytest.fixture
def server() -> Iterator[tuple[int, list[Answer], list[int]]]:
    """A server that answers each request with the next scripted answer;
    ``accepted[0]`` counts the connections it took."""
    listener = socket.create_server(("127.0.0.1", 0))
    script: list[Answer] = []
    accepted = [0]
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            buf = b""
            while not stop.is_set():
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                if not script or not script.pop(0)(conn, head):
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1], script, accepted
    stop.set()
    listener.close()


def reply(data: bytes, keep: bool = True) -> Answer:
    def answer(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(data)
        return keep
    return answer


def silent(conn: socket.socket, head: bytes) -> bool:
    threading.Event().wait(2)
    return False


def clients(port: int) -> list[Callable[[], bytes]]:
    sync = Connections("127.0.0.1", port, None, 2.0, 0.5, 4)
    loop = AsyncConnections("127.0.0.1", port, 2.0, 0.5, 4)

    async def in_trio() -> bytes:
        return (await loop.request("GET", "/k", {"host": "x"})).body
    return [lambda: sync.request("GET", "/k", {"host": "x"}).body,
            lambda: trio.run(in_trio)]


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_a_connection_closed_while_idle_is_replaced_once(server, which):
    port, script, accepted = server
    get = clients(port)[which]
    script += [reply(ok(b"first"), keep=False), reply(ok(b"second"))]
    assert get() == b"first"  # kept: the answer did not say close
    assert get() == b"second"  # the server had closed it: sent again, new connection
    assert accepted[0] == 2


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_a_body_cut_short_is_an_error_never_data(server, which):
    port, script, _ = server
    get = clients(port)[which]
    script.append(reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", keep=False))
    with pytest.raises(Broken) as info:
        get()
    assert info.value.cause == "truncated"


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_no_answer_times_out(server, which):
    port, script, _ = server
    get = clients(port)[which]
    script.append(silent)
    with pytest.raises(Broken) as info:
        get()
    assert info.value.cause == "timeout"


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_nothing_listening_is_a_connection_error(which):
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(Broken) as info:
        clients(port)[which]()
    assert info.value.cause == "connection" and info.value.connecting


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_chunked_and_unsized_answers_are_read_whole(server, which):
    """S3 servers may send an error's body in chunks, or to the connection's end."""
    port, script, accepted = server
    get = clients(port)[which]
    script += [reply(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n4;x=1\r\ndefg\r\n0\r\nX-T: 1\r\n\r\n"),
               reply(ok(b"next")),  # the same connection, kept
               reply(b"HTTP/1.1 200 OK\r\n\r\nto the end", keep=False),
               reply(ok(b"after"))]
    assert get() == b"abcdefg"
    assert get() == b"next"
    assert get() == b"to the end"
    assert get() == b"after"
    assert accepted[0] == 2


@pytest.mark.parametrize("which", [0, 1], ids=["thread", "event-loop"])
def test_an_interim_answer_is_skipped_for_the_real_one(server, which):
    """A ``100 Continue`` (or ``103 Early Hints``) before the answer is not the
    answer: its empty body must not be taken for the object's bytes, nor the
    real answer left on the connection for the next request to read."""
    port, script, accepted = server
    get = clients(port)[which]
    script += [reply(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
                     + ok(b"the body")),
               reply(ok(b"next"))]
    assert get() == b"the body"
    assert get() == b"next"
    assert accepted[0] == 1
