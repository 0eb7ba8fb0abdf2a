"""Writing cache files past the kernel's page cache (O_DIRECT).

A block fetched from the lake is already in memory, where readers are served
from; written through the page cache it would be held a second (and, with the
mount's own pages, a third) time, and every GiB cached would cost a GiB of
freshly allocated page-cache pages: on a machine whose memory is handed back to
its hypervisor when free, touching those pages again cost 2-3.5 CPU-seconds per
GiB (measured), more than the rest of a cold read. O_DIRECT moves the bytes
from a reused, page-aligned buffer to the disk without allocating any.

O_DIRECT wants the buffer, offset and length aligned to the device's logical
block size: the bytes are copied into an aligned buffer (a copy between two
warm buffers, without the GIL), the length padded to a whole page and the file
truncated to its size afterwards. Filesystems without O_DIRECT (ramfs, tmpfs
before Linux 6.6, some network and overlay filesystems) get ordinary writes;
the first refusal turns O_DIRECT off for this writer's lifetime.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Iterator

from aifs import buffers

log = logging.getLogger(__name__)

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
COPY_CHUNK = 8 << 20  # bytes per read and write of a copy


class DirectWriter:
    """Writes whole files with O_DIRECT where the filesystem allows it."""

    def __init__(self) -> None:
        self.enabled = hasattr(os, "O_DIRECT")  # off after the filesystem's first refusal
        self._lock = threading.Lock()
        self._free: list[tuple[mmap.mmap, int]] = []  # (buffer, its address), reused

    def write_file(self, path: str | os.PathLike[str], data: buffers.Body) -> None:
        """Create ``path`` (which must not exist) holding ``data``."""
        if self.enabled:
            try:
                self._write_direct(path, data)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.enabled = False
                log.info("%s: the filesystem refuses O_DIRECT; cache files are written "
                         "through the page cache", os.path.dirname(path) or ".")
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        with open(path, "xb") as fp:
            fp.write(data)

    def open(self, path: str | os.PathLike[str], flags: int) -> int:
        """Open ``path`` for :meth:`pwrite`: with O_DIRECT where allowed."""
        if self.enabled:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refused(path)
                if flags & os.O_EXCL:  # the refused open may have created it
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
        return os.open(path, flags, 0o600)

    def pwrite(self, fd: int, data: buffers.Body, offset: int) -> None:
        """Write ``data`` at ``offset`` (aligned) of a file from :meth:`open`;
        with O_DIRECT, padded with zeros to a whole ``ALIGN``."""
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            with self._aligned(data) as view:
                try:
                    _pwrite_all(fd, view, offset)
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            self._refused(f"/proc/self/fd/{fd}")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        _pwrite_all(fd, data, offset)

    def copy(self, src: str, src_offset: int, dst: int, dst_offset: int, length: int) -> bool:
        """Copy ``length`` bytes of file ``src`` from ``src_offset`` into ``dst``
        (a descriptor from :meth:`open`) at ``dst_offset``, through a reused
        aligned buffer: past the page cache on both sides where the filesystem
        allows and the offsets are aligned, so no page-cache page is allocated
        (see above: ``copy_file_range`` allocated two per page copied, 0.5
        CPU-s per GiB here). An unaligned last piece is written padded to a
        whole ``ALIGN``: truncate ``dst`` afterwards. False if ``src`` is short."""
        direct = bool(self.enabled and fcntl.fcntl(dst, fcntl.F_GETFL) & os.O_DIRECT
                      and not (src_offset | dst_offset) % ALIGN)
        try:
            return self._copy(src, src_offset, dst, dst_offset, length, direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
        # refused (a device whose blocks are larger than ALIGN): through the page cache
        fcntl.fcntl(dst, fcntl.F_SETFL, fcntl.fcntl(dst, fcntl.F_GETFL) & ~os.O_DIRECT)
        return self._copy(src, src_offset, dst, dst_offset, length, False)

    def _copy(self, src: str, src_offset: int, dst: int, dst_offset: int, length: int,
              direct: bool) -> bool:
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(src, flags)
        except FileNotFoundError:
            return False
        chunk = min(-(-length // ALIGN) * ALIGN, COPY_CHUNK)
        buffer, address = self._take(chunk)
        try:
            with memoryview(buffer) as view:
                done = 0
                while done < length:
                    want = min(length - done, chunk)
                    padded = -(-want // ALIGN) * ALIGN if direct else want
                    got = os.preadv(fd, [view[:padded]], src_offset + done)
                    if got < want:
                        return False
                    if padded > want:
                        ctypes.memset(address + want, 0, padded - want)
                    _pwrite_all(dst, view[:padded], dst_offset + done)
                    done += want
            return True
        finally:
            os.close(fd)
            self._give_back(buffer, address)

    @contextlib.contextmanager
    def _aligned(self, data: buffers.Body) -> Iterator[memoryview]:
        """``data`` in a reused page-aligned buffer, padded with zeros to a
        whole ``ALIGN`` (a view of the padded length)."""
        if isinstance(data, memoryview):
            whole = buffers.aligned(data)  # a body received aligned: written as it is
            if whole is not None and not len(whole) % ALIGN:
                with whole:
                    yield whole
                return
        size = len(data)
        padded = -(-size // ALIGN) * ALIGN
        buffer, address = self._take(padded)
        try:
            _copy_in(address, buffer, data, size)
            if padded > size:
                ctypes.memset(address + size, 0, padded - size)
            with memoryview(buffer) as view, view[:padded] as part:
                yield part
        finally:
            self._give_back(buffer, address)

    def _refused(self, path: str | os.PathLike[str]) -> None:
        if self.enabled:
            self.enabled = False
            log.info("%s: the filesystem refuses O_DIRECT; cache files are written "
                     "through the page cache", os.path.dirname(path) or ".")

    def _write_direct(self, path: str | os.PathLike[str], data: buffers.Body) -> None:
        with self._aligned(data) as view:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            try:
                _pwrite_all(fd, view, 0)
                if len(view) > len(data):
                    os.ftruncate(fd, len(data))
            finally:
                os.close(fd)

    def _take(self, size: int) -> tuple[mmap.mmap, int]:
        with self._lock:
            for i, (buffer, _) in enumerate(self._free):
                if len(buffer) >= size:
                    return self._free.pop(i)
        buffer = mmap.mmap(-1, max(size, ALIGN))  # page-aligned, zeroed
        return buffer, buffers.address(buffer)

    def _give_back(self, buffer: mmap.mmap, address: int) -> None:
        with self._lock:
            # As many buffers as writes ran at once; a larger one replaces a smaller.
            self._free.append((buffer, address))
            if len(self._free) > 16:
                self._free.sort(key=lambda item: len(item[0]))
                self._free.pop(0)


def _pwrite_all(fd: int, data: buffers.Body, offset: int) -> None:
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)


def _copy_in(address: int, buffer: mmap.mmap, data: buffers.Body, size: int) -> None:
    """Copy ``data`` to the buffer; without the GIL where ctypes can see the bytes."""
    if isinstance(data, bytes):
        ctypes.memmove(address, data, size)  # a ctypes call releases the GIL
        return
    if isinstance(data, bytearray):  # (a body received whole: http1)
        ctypes.memmove(address, (ctypes.c_char * size).from_buffer(data), size)
        return
    with memoryview(buffer) as view:
        view[:size] = data
