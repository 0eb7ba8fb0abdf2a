"""Small cached blocks appended to shared segment files.

A file per cached block costs more than fetching the block when blocks are
small: on this machine's ext4 a directory, an O_DIRECT file and a rename for
a 16 KiB object measured 1.3-1.6 ms of CPU, more than its GET; an O_DIRECT
write of it into a file already open, 30 us (``docs/benchmarks.md``, fresh
node). So blocks of up to ``SMALL`` bytes (small objects, the tails of large
ones) are appended to segment files, many to a file.

Layout, under ``<cache>/segments/``:

- ``<n>.seg``: the blocks, each at an offset aligned for O_DIRECT;
- ``<n>.idx``: one line per event, appended after the block's bytes are
  written: ``+ ident index offset size checksum policy class`` (stored),
  ``- ident index offset`` (evicted: its range punched out of the segment),
  ``c ident class`` (``aifs pin``/``unpin`` moved the object's blocks).

A segment block is read whole and checked against its xxh3 checksum on every
read from the disk: a crash, a range punched out while it was read, a torn
write all read as a miss (fetched again from the lake), never as wrong bytes.
A segment whose blocks are all evicted is deleted.

All methods are blocking disk I/O: call them from a worker thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from aifs.buffers import Body
from aifs.cache.direct import ALIGN, DirectWriter

log = logging.getLogger(__name__)

SMALL = 256 << 10  # blocks up to this size go to segments
SEGMENT_SIZE = 64 << 20  # bytes of blocks per segment file before the next one

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def checksum(data: Body) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Location:
    """Where a cached block's bytes are: a file, from ``offset``."""

    path: str
    offset: int
    size: int
    #: a segment block's checksum (verified on every read); None: a file of its own
    checksum: int | None = None


@dataclass
class _Segment:
    number: int
    path: str
    fd: int = -1  # open for writing while blocks are appended
    index_fd: int = -1
    end: int = 0  # where the next block goes
    live: int = 0  # blocks stored and not evicted
    writers: int = 0  # appends under way


class Segments:
    def __init__(self, root: Path, segment_size: int = SEGMENT_SIZE) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_size = segment_size
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._current: _Segment | None = None
        self._next = 1  # the next segment's number (scan sets it past those on disk)
        self._closed = False
        self._writer = DirectWriter()

    # -- start: what the segments hold ------------------------------------

    def scan(self) -> Iterator[tuple[str, int, Location, str, str, float]]:
        """Every block kept from before: ``(ident, index, location, policy,
        class, order)``, ``order`` growing with the time it was stored."""
        found = {int(name[:-4]) for name in os.listdir(self.root)
                 if name[-4:] in (".idx", ".seg") and name[:-4].isdigit()}
        self._next = max(found, default=0) + 1  # numbers are never reused
        for number in sorted(found):
            segment = _Segment(number, str(self.root / f"{number}.seg"))
            try:
                size = os.stat(segment.path).st_size
                mtime = os.stat(segment.path).st_mtime
                lines = self._read_index(number)
            except OSError:  # one of the two files is missing: nothing indexed
                self._remove(number)
                continue
            blocks: dict[tuple[str, int], tuple[Location, str]] = {}
            classes: dict[str, str] = {}  # ident -> its class, the last line's
            for line in lines:
                parts = line.split()
                try:
                    if len(parts) == 8 and parts[0] == "+":
                        ident, index, offset, length = parts[1], int(parts[2]), \
                            int(parts[3]), int(parts[4])
                        where = Location(segment.path, offset, length, int(parts[5], 16))
                        if offset + length <= size:  # else its bytes never made it
                            blocks[ident, index] = (where, parts[6])
                            classes[ident] = parts[7]
                    elif len(parts) == 4 and parts[0] == "-":
                        old = blocks.get((parts[1], int(parts[2])))
                        if old is not None and old[0].offset == int(parts[3]):
                            del blocks[parts[1], int(parts[2])]
                    elif len(parts) == 3 and parts[0] == "c":
                        classes[parts[1]] = parts[2]
                except ValueError:  # a line a power loss cut short: skipped
                    continue
            if not blocks:
                self._remove(number)
                continue
            segment.live = len(blocks)
            segment.end = _aligned(size)
            self._segments[number] = segment
            for i, ((ident, index), (where, policy)) in enumerate(blocks.items()):
                yield ident, index, where, policy, classes[ident], mtime + i * 1e-6

    def _read_index(self, number: int) -> list[str]:
        """A segment's index lines; a last line a power loss cut short is cut
        off the file too (what is appended next must start a line of its own)."""
        path = self.root / f"{number}.idx"
        raw = path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            raw = raw[:raw.rfind(b"\n") + 1]
            os.truncate(path, len(raw))
        return raw.decode(errors="replace").splitlines()

    # -- storing ------------------------------------------------------------

    def append(self, ident: str, index: int, data: Body, policy: str,
               cls: str) -> Location:
        """Write a block; raises OSError if the disk refuses it."""
        size = len(data)
        with self._lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the block cache is closed")
            segment = self._current
            if segment is None or segment.end >= self.segment_size:
                segment = self._open_next()
            offset = segment.end
            segment.end = _aligned(offset + size)
            segment.writers += 1
        done = False
        try:
            self._writer.pwrite(segment.fd, data, offset)
            where = Location(segment.path, offset, size, checksum(data))
            os.write(segment.index_fd, (f"+ {ident} {index} {offset} {size} "
                                        f"{where.checksum:x} {policy} {cls}\n").encode())
            done = True
        finally:
            with self._lock:
                segment.writers -= 1
                if done:
                    segment.live += 1
                self._close_if_done(segment)
        return where

    def _open_next(self) -> _Segment:
        """A new segment to append to (under the lock); its index is made
        first, so a segment file is never left without one."""
        number = self._next
        self._next += 1
        segment = _Segment(number, str(self.root / f"{number}.seg"))
        index_path = self.root / f"{number}.idx"
        segment.index_fd = os.open(index_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            segment.fd = self._writer.open(segment.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError:
            os.close(segment.index_fd)
            self._remove(number)
            raise
        old, self._current = self._current, segment
        self._segments[number] = segment
        if old is not None:
            self._close_if_done(old)
        return segment

    def _close_if_done(self, segment: _Segment) -> None:
        """Close a full segment's descriptors once no append is under way
        (under the lock); delete it if its blocks are all gone meanwhile."""
        if (segment is self._current and not self._closed) or segment.writers \
                or segment.fd < 0:
            return
        os.close(segment.fd)
        os.close(segment.index_fd)
        segment.fd = segment.index_fd = -1
        if segment.live <= 0 and self._segments.get(segment.number) is segment:
            del self._segments[segment.number]
            self._remove(segment.number)

    # -- evicting, reclassing ------------------------------------------------

    def punch(self, ident: str, index: int, where: Location) -> None:
        """Give a block's disk space back; delete its segment once empty."""
        number = int(os.path.basename(where.path)[:-4])
        with self._lock:
            segment = self._segments.get(number)
            if segment is None:
                return
            segment.live -= 1
            empty = segment.live <= 0 and segment is not self._current and not segment.writers
            if empty:
                del self._segments[number]
        if empty:
            self._remove(number)
            return
        try:
            self._note(number, f"- {ident} {index} {where.offset}\n")
        except OSError as exc:  # the block's checksum still tells it is gone
            log.debug("cannot note the eviction of %s/%d: %s", ident, index, exc.strerror)
        try:
            fd = os.open(where.path, os.O_WRONLY)
            try:
                if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                                   where.offset, _aligned(where.size)) != 0:
                    err = ctypes.get_errno()
                    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot free cached block %s/%d: %s", ident, index, exc.strerror)

    def reclass(self, ident: str, cls: str, where: Iterable[Location]) -> None:
        """Remember that an object's blocks (``where``) moved to class ``cls``."""
        for number in {int(os.path.basename(w.path)[:-4]) for w in where}:
            try:
                self._note(number, f"c {ident} {cls}\n")
            except OSError:
                pass

    def _note(self, number: int, line: str) -> None:
        fd = os.open(self.root / f"{number}.idx", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _remove(self, number: int) -> None:
        for suffix in (".seg", ".idx"):
            try:
                os.unlink(self.root / f"{number}{suffix}")
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """No more appends; descriptors close now, or as their last append ends."""
        with self._lock:
            self._closed = True
            for segment in list(self._segments.values()):
                self._close_if_done(segment)
            self._current = None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
