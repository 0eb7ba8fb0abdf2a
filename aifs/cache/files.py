"""Whole local copies of files on the NVMe tier: the write-back data.

A file written through the mount lives here, as ``files/<ino>``, until it is
promoted to the lake and after that as clean cached data that reads are
served from, until eviction. The file's own size is the truth for its size
(after a crash too). Dirty copies are never evicted; clean ones are, least
recently used first, when the cache needs room; copies ranked ``EVICT_FIRST``
(checkpoints older than the newest few) go before all others and copies
ranked ``EVICT_LAST`` (the newest checkpoints) after all others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

EVICT_FIRST = 0
EVICT_LRU = 1
EVICT_LAST = 2
SPARES = 64


class LocalFiles:
    def __init__(self, directory: Path, in_use: Callable[[int], bool] = lambda ino: False,
                 max_open: int = 512) -> None:
        self.in_use = in_use  # open through the mount: keep the copy and its descriptor
        self.root = directory / "files"
        self.root.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{self.root}/"  # where copies are named, as a str: opens build no Path
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        self._clean: OrderedDict[int, None] = OrderedDict()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._rank: dict[int, int] = {}  # ino -> EVICT_FIRST or EVICT_LAST (else LRU)
        self.max_open = max_open
        self.used = 0
        self.evictions = 0
        # Empty files made ahead by a thread: a create renames one into place,
        # which costs the caller a fraction of creating a file on a busy disk.
        self._spares: list[tuple[str, int]] = []
        self._spares_wanted = threading.Condition(self._lock)
        self._closed = False
        self._spare_counter = 0
        for entry in os.scandir(self.root):
            if entry.name.isdigit():
                self._account(int(entry.name), entry.stat().st_size)
            else:
                os.unlink(entry.path)  # a materialization cut short

    # -- accounting ------------------------------------------------------
    def _account(self, ino: int, size: int) -> None:
        with self._lock:
            self.used += size - self._sizes.get(ino, 0)
            self._sizes[ino] = size

    def resized(self, ino: int, size: int) -> None:
        if self._sizes.get(ino) != size:
            self._account(ino, size)

    @property
    def dirty_bytes(self) -> int:
        with self._lock:
            return sum(size for ino, size in self._sizes.items() if ino not in self._clean)

    def has(self, ino: int) -> bool:
        return ino in self._sizes

    def inos(self) -> list[int]:
        return list(self._sizes)

    def sizes(self) -> dict[int, int]:
        """ino -> bytes of its local copy (a snapshot)."""
        with self._lock:
            return dict(self._sizes)

    def path(self, ino: int) -> Path:
        return Path(self._name(ino))

    def _name(self, ino: int) -> str:
        return f"{self._prefix}{ino}"

    def mark_clean(self, ino: int) -> None:
        """The lake has this copy's content: it may be evicted."""
        with self._lock:
            if ino in self._sizes:
                self._clean[ino] = None
                self._clean.move_to_end(ino)

    def mark_dirty(self, ino: int) -> None:
        with self._lock:
            self._clean.pop(ino, None)

    def rank(self, ino: int, rank: int) -> None:
        """Set when ``ino`` is evicted relative to plain LRU (retention)."""
        with self._lock:
            if rank == EVICT_LRU:
                self._rank.pop(ino, None)
            elif ino in self._sizes:
                self._rank[ino] = rank

    def touch(self, ino: int) -> None:
        with self._lock:
            if ino in self._clean:
                self._clean.move_to_end(ino)

    # -- descriptors -------------------------------------------------------
    def fd(self, ino: int) -> int:
        """An open read-write descriptor of the copy (which must exist)."""
        fd = self._fds.get(ino)
        if fd is not None:
            self._fds.move_to_end(ino)
            return fd
        fd = os.open(self._name(ino), os.O_RDWR)
        self._fds[ino] = fd
        self._close_extra()
        return fd

    def _close_extra(self) -> None:
        """Close the least recently used descriptors over ``max_open`` (those of
        files open through the mount stay)."""
        while len(self._fds) > self.max_open:
            for ino in self._fds:  # oldest first; no copy of the whole table
                if not self.in_use(ino):
                    break
            else:
                return
            os.close(self._fds.pop(ino))

    def start_spares(self) -> None:
        """Keep a few empty files made ahead (in a thread of their own)."""
        threading.Thread(target=self._make_spares, name="aifs-spares", daemon=True).start()

    def _make_spares(self) -> None:
        while True:
            with self._lock:
                while len(self._spares) >= SPARES and not self._closed:
                    self._spares_wanted.wait()
                if self._closed:
                    return
                self._spare_counter += 1
                name = str(self.root / f"spare-{self._spare_counter}")
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as exc:  # a full disk: try again later, it may empty
                log.warning("cannot make spare local files: %s", exc)
                with self._lock:
                    self._spares_wanted.wait(5.0)
                continue
            with self._lock:
                self._spares.append((name, fd))

    def _take_spare(self) -> tuple[str, int] | None:
        with self._lock:
            spare = self._spares.pop() if self._spares else None
            self._spares_wanted.notify()
        return spare

    def create(self, ino: int) -> int:
        """A new, empty copy; returns its descriptor."""
        self._drop_fd(ino)
        spare = self._take_spare()
        if spare is not None:
            try:
                os.rename(spare[0], self.path(ino))  # replaces an old copy at once
                fd = spare[1]
            except OSError:
                os.close(spare[1])
                spare = None
        if spare is None:
            fd = os.open(self.path(ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fds[ino] = fd
        self._account(ino, 0)
        self._close_extra()
        return fd

    def adopt(self, ino: int, tmp: Path | str, fd: int = -1, size: int = -1) -> None:
        """Install a fully written temporary file as the copy of ``ino`` (if
        the rename fails nothing changed); ``fd``, an open descriptor of it, is
        kept as the copy's, and ``size`` spares a stat."""
        self._drop_fd(ino)
        os.rename(tmp, self.path(ino))
        self._account(ino, size if size >= 0 else os.stat(self.path(ino)).st_size)
        if fd >= 0:
            self._fds[ino] = fd
            self._close_extra()

    def filled(self, ino: int, data: bytes) -> tuple[str, int]:
        """A file holding ``data``, to become the copy of ``ino`` by
        :meth:`adopt` (whole or not at all): a spare, else a new file.
        Blocking; safe in a worker thread."""
        spare = self._take_spare()  # (not tmp_path: a materialization may be using it)
        name, fd = spare if spare is not None else (f"{self._prefix}admit-{ino}", -1)
        try:
            if fd < 0:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, len(data) - len(view)):]
        except BaseException:
            self.discard(name, fd)
            raise
        return name, fd

    @staticmethod
    def discard(name: str, fd: int) -> None:
        """Drop a file from :meth:`filled` that was not installed."""
        with contextlib.suppress(OSError):
            os.unlink(name)
        if fd >= 0:
            os.close(fd)

    def tmp_path(self, ino: int) -> Path:
        return self.root / f"tmp-{ino}"

    def _drop_fd(self, ino: int) -> None:
        fd = self._fds.pop(ino, None)
        if fd is not None:
            os.close(fd)

    def remove(self, ino: int) -> None:
        self._drop_fd(ino)
        with self._lock:
            size = self._sizes.pop(ino, None)
            self._clean.pop(ino, None)
            self._rank.pop(ino, None)
            if size is not None:
                self.used -= size
        try:
            os.unlink(self.path(ino))
        except FileNotFoundError:
            pass

    def evict(self, wanted: int, up_to_rank: int = EVICT_LAST) -> int:
        """Drop clean copies not in use, oldest first (by rank, then LRU; ranks
        above ``up_to_rank`` stay), until ``wanted`` bytes are free."""
        freed = 0
        with self._lock:
            order = sorted((i for i in self._clean
                            if self._rank.get(i, EVICT_LRU) <= up_to_rank),
                           key=lambda i: self._rank.get(i, EVICT_LRU))
        for ino in order:
            if freed >= wanted:
                break
            if self.in_use(ino):
                continue
            freed += self._sizes.get(ino, 0)
            self.remove(ino)
            self.evictions += 1
        return freed

    def sync(self, ino: int) -> None:
        if ino in self._sizes:
            os.fsync(self.fd(ino))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        with self._lock:
            self._closed = True
            self._spares_wanted.notify_all()
            spares, self._spares = self._spares, []
        for name, fd in spares:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
