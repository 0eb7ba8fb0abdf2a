"""Telling the kernel what another node changed (NOTIFY_INVAL_ENTRY and
NOTIFY_INVAL_INODE).

The kernel keeps names, attributes and pages for the listing TTL. When a
listing refresh finds that another writer added, removed or replaced a file,
the kernel is told at once, so the next ``stat``, ``open`` or read asks aifs
instead of showing what its caches hold until they expire.

The notices are written by a thread of their own, never by a request's
handler or the trio loop: an entry's notice takes the directory's lock in
the kernel, which a LOOKUP waiting on this very listing may hold (a write
from the loop would then wait for an answer only the loop can give).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading

from aifs.fuse.kernel import protocol as p

log = logging.getLogger(__name__)

NOTICES_QUEUED = 100_000  # at most; beyond, the kernel's timeouts do it
STOP_WAIT = 5.0  # seconds a notice being written may take once the session stops


class Notifier:
    def __init__(self, fd: int) -> None:
        # A descriptor of its own: a notice written after the session closed
        # its fd cannot reach whatever file reuses that number.
        self.fd = os.dup(fd)
        self.sent = 0
        self._stopped = False
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="aifs-notify", daemon=True)
        self._thread.start()

    def changed(self, parent: int, names: list[bytes], inodes: list[int]) -> None:
        """Names of ``parent`` added or removed, and inodes whose content was
        replaced, by another writer."""
        for name in names:
            body = p.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
            if not self._put(p.OUT_HEADER.pack(p.OUT_HEADER.size + len(body),
                                               p.NOTIFY_INVAL_ENTRY, 0) + body):
                return
        for ino in inodes:  # attributes and every cached page
            body = p.NOTIFY_INVAL_INODE_OUT.pack(ino, 0, 0)
            if not self._put(p.OUT_HEADER.pack(p.OUT_HEADER.size + len(body),
                                               p.NOTIFY_INVAL_INODE, 0) + body):
                return

    def _put(self, message: bytes) -> bool:
        if self._stopped or self._queue.qsize() >= NOTICES_QUEUED:
            return False  # (the kernel's timeouts do it)
        self._queue.put(message)
        return True

    def stop(self) -> None:
        """No more notices, and none of those waiting: once the session stops
        reading, an entry's notice may wait for the directory's lock behind a
        request no one will answer."""
        self._stopped = True
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._queue.put(None)

    def close(self) -> bool:
        """Stop; False if a notice being written did not return in time (the
        caller ends the connection, which frees it)."""
        self.stop()
        self._thread.join(STOP_WAIT)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while (message := self._queue.get()) is not None and not self._stopped:
                try:
                    os.write(self.fd, message)
                    self.sent += 1
                except OSError as exc:
                    if exc.errno in (errno.ENODEV, errno.EBADF, errno.ECONNABORTED):
                        return  # unmounted
                    if exc.errno != errno.ENOENT:  # ENOENT: the kernel holds none of it
                        log.debug("kernel cache notice: %s", exc.strerror)
        finally:
            os.close(self.fd)
