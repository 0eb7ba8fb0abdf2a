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
import ctypes
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import trio

log = logging.getLogger(__name__)

# fallocate(2), which os lacks for holes: give a range of a file back to the disk
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02  # FALLOC_FL_*

ROOM_PLENTY = 4 << 30  # free disk bytes a reading may be used again with ...
ROOM_FRESH = 0.1  # ... for this many seconds
UNLIMITED = 1 << 62  # the free bytes of a disk of no size (ramfs)

EVICT_FIRST = 0
EVICT_LRU = 1
EVICT_LAST = 2
#: Empty files kept made ahead (see LocalFiles.create): at first, and at most.
#: A burst of creates that takes more makes the next ones keep twice its size.
SPARES_MIN = 64
SPARES_MAX = 4096
#: spares are made only once no local copy was created or opened for this long, and
SPARES_QUIET = 0.05
#: only while a CPU has been idle over the last window this long (/proc/stat)
IDLE_WINDOW = 0.1
TICKS = os.sysconf("SC_CLK_TCK")


class LocalFiles:
    def __init__(self, directory: Path, in_use: Callable[[int], bool] = lambda ino: False,
                 max_open: int = 512, idle: Callable[[], bool] | None = None) -> None:
        self.in_use = in_use  # open through the mount: keep the copy and its descriptor
        self.root = directory / "files"
        self.root.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{self.root}/"  # where copies are named, as a str: opens build no Path
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}
        self._punched: dict[int, int] = {}  # ino -> bytes of its size given back (punch)
        self._free: tuple[float, int] = (-ROOM_FRESH, 0)  # (when, free disk bytes) read
        self._clean: OrderedDict[int, None] = OrderedDict()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._rank: dict[int, int] = {}  # ino -> EVICT_FIRST or EVICT_LAST (else LRU)
        self.max_open = max_open
        self.used = 0
        self.evictions = 0
        # Empty files made ahead by a thread: a create renames one into place,
        # which costs the caller a fraction of creating a file (on ext4
        # without a journal, a new inode is found by a scan past every inode
        # freed in the last minutes: a quarter of a create's CPU, measured).
        # They are made only between bursts of creates, never beside one.
        self._spares: list[str] = []
        self._spares_wanted = threading.Condition(self._lock)
        self._burst = 0  # spares taken since the maker last found it quiet
        self._last_use = 0.0  # a copy was last created or opened (monotonic)
        self._idle = idle or IdleCpu().idle  # whether spares may be made now
        self._closed = False
        self._spare_counter = 0
        for entry in os.scandir(self.root):
            if entry.name.isdigit():
                self._account(int(entry.name), entry.stat().st_size)
            elif (entry.name.startswith("spare-") and entry.stat().st_size == 0
                  and len(self._spares) < SPARES_MAX):
                self._spares.append(entry.path)  # kept from the last mount
                number = entry.name[len("spare-"):]
                if number.isdigit():
                    self._spare_counter = max(self._spare_counter, int(number))
            else:
                os.unlink(entry.path)  # a materialization cut short
        self._spares_target = max(SPARES_MIN, len(self._spares))

    # -- accounting ------------------------------------------------------
    def _account(self, ino: int, size: int) -> None:
        with self._lock:
            self.used += size - self._sizes.get(ino, 0)
            self._sizes[ino] = size
            if not size:  # emptied: no holes left
                self.used += self._punched.pop(ino, 0)

    def punch(self, ino: int, offset: int, length: int) -> None:
        """Give ``length`` bytes at ``offset`` of the copy back to the disk (a
        hole; the size stays): they are in the lake (flush.stream, spilling).
        The copy's accounted size is what it holds on the disk from now on."""
        if _fallocate(self.fd(ino), _PUNCH_HOLE | _KEEP_SIZE, offset, length):
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        with self._lock:
            if ino in self._sizes:
                self._punched[ino] = self._punched.get(ino, 0) + length
                self.used -= length

    def disk_free(self) -> int:
        """Free bytes on the cache disk. A reading of plenty (at least
        :data:`ROOM_PLENTY`) is used again for :data:`ROOM_FRESH` seconds: no
        writer fills that much in that time, and a burst of writes or
        creates asks ``statvfs`` once. A disk of no size (ramfs) is unlimited."""
        now = time.monotonic()
        taken, free = self._free
        if now - taken < ROOM_FRESH and free >= ROOM_PLENTY:
            return free
        size, free = self.disk_space()
        self._free = (now, free)
        return free

    def disk_space(self) -> tuple[int, int]:
        """(size, free bytes) of the cache disk, read now."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 0, 0
        if not st.f_blocks:  # (ramfs: no size)
            return UNLIMITED, UNLIMITED
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

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
        self._last_use = time.monotonic()
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
        """Keep empty files made ahead (in a thread of their own), until
        :meth:`stop_spares` or :meth:`close`."""
        threading.Thread(target=self._make_spares, name="aifs-spares", daemon=True).start()

    async def spares_while_running(self) -> None:
        """:meth:`start_spares` for as long as this task runs: the thread
        stops with the nursery (an unmount, or the end of a test that drives
        the core without a mount, whose directory goes next)."""
        self.start_spares()
        try:
            await trio.sleep_forever()
        finally:
            self.stop_spares()

    def stop_spares(self) -> None:
        with self._lock:
            self._closed = True
            self._spares_wanted.notify_all()

    def _make_spares(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    if len(self._spares) >= self._spares_target:
                        self._spares_wanted.wait()
                        continue
                    # Not beside a burst of creates or opens: on a small node it
                    # takes the CPU (and Python's lock) their requests wait on
                    # (the opens after a burst: 0.36 -> 0.39 s in aifs bench).
                    quiet = self._last_use + SPARES_QUIET - time.monotonic()
                    if quiet <= 0:
                        break
                    self._spares_wanted.wait(quiet)
                if self._closed:
                    return
                self._spares_target = min(SPARES_MAX, max(self._spares_target,
                                                          2 * self._burst))
                self._burst = 0
            if not self._idle():
                with self._lock:
                    self._spares_wanted.wait(IDLE_WINDOW)
                continue
            with self._lock:
                self._spare_counter += 1
                name = f"{self._prefix}spare-{self._spare_counter}"
            try:
                os.mknod(name, 0o600 | stat.S_IFREG)
            except FileExistsError:
                continue
            except OSError as exc:  # a full disk: try again later, it may empty
                log.warning("cannot make spare local files: %s", exc)
                with self._lock:
                    self._spares_wanted.wait(5.0)
                continue
            with self._lock:
                self._spares.append(name)

    def _take_spare(self) -> str | None:
        with self._lock:
            if len(self._spares) >= self._spares_target:
                self._spares_wanted.notify()  # the maker sleeps while there are enough
            self._last_use = time.monotonic()
            self._burst += 1
            return self._spares.pop() if self._spares else None

    def _empty_file(self, fallback: str) -> tuple[str, int]:
        """An empty file and its read-write descriptor: a spare, else
        ``fallback`` made now."""
        spare = self._take_spare()
        if spare is not None:
            with contextlib.suppress(OSError):
                # No O_TRUNC on a spare: ext4 then writes a file's delayed blocks
                # out when it is closed, which made the close of a 1 GiB write
                # wait for the disk (auto_da_alloc; 0.2 -> 0.65 s in aifs bench).
                return spare, os.open(spare, os.O_RDWR)
        return fallback, os.open(fallback, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def create(self, ino: int) -> int:
        """A new, empty copy (it replaces an old one at once); returns its descriptor."""
        made, fd = self._empty_file(self._name(ino))
        try:
            self.adopt(ino, made, fd, 0)
        except BaseException:
            self.discard(made, fd)
            raise
        return fd

    def adopt(self, ino: int, tmp: Path | str, fd: int = -1, size: int = -1) -> None:
        """Install a fully written temporary file as the copy of ``ino`` (if
        the rename fails nothing changed); ``fd``, an open descriptor of it, is
        kept as the copy's, and ``size`` spares a stat."""
        self._drop_fd(ino)
        name = self._name(ino)
        os.rename(tmp, name)
        self._account(ino, size if size >= 0 else os.stat(name).st_size)
        if fd >= 0:
            self._fds[ino] = fd
            self._close_extra()

    def filled(self, ino: int, data: bytes) -> tuple[str, int]:
        """A file holding ``data``, to become the copy of ``ino`` by
        :meth:`adopt` (whole or not at all): a spare, else a new file.
        Blocking; safe in a worker thread."""
        name, fd = self.blank(ino)
        try:
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, len(data) - len(view)):]
        except BaseException:
            self.discard(name, fd)
            raise
        return name, fd

    def blank(self, ino: int) -> tuple[str, int]:
        """An empty file to fill and make the copy of ``ino`` by :meth:`adopt`
        (or :meth:`discard`). Blocking; safe in a worker thread."""
        # (not tmp_path: a materialization may be using it)
        return self._empty_file(f"{self._prefix}admit-{ino}")

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
                self.used -= size - self._punched.pop(ino, 0)
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
        self.stop_spares()  # (the spares stay, for the next mount)


class IdleCpu:
    """Whether this machine had a CPU to spare lately: background work that
    can wait (the spares) runs on CPU time nothing else wanted. On a small
    node, spares made beside a 1 GiB write slowed it from 0.96x to 0.28-0.67x
    local speed (``aifs bench``)."""

    def __init__(self) -> None:
        self._at, self._idle = self._read()
        self._ok = True

    @staticmethod
    def _read() -> tuple[float, int]:
        try:
            with open("/proc/stat", "rb") as fp:
                fields = fp.readline().split()
            return time.monotonic(), int(fields[4]) + int(fields[5])  # idle + iowait
        except (OSError, ValueError, IndexError):
            return time.monotonic(), -1

    def idle(self) -> bool:
        """At least 0.8 of a CPU was idle over the last :data:`IDLE_WINDOW`."""
        if time.monotonic() - self._at >= IDLE_WINDOW:
            at, idle = self._read()
            if idle < 0 or self._idle < 0:
                self._ok = True  # nothing to tell by: as if idle
            else:
                self._ok = (idle - self._idle) / TICKS >= 0.8 * (at - self._at)
            self._at, self._idle = at, idle
        return self._ok
