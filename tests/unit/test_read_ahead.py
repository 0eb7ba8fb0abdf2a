"""Read-ahead of local copies and cached blocks into the kernel's page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest

from aifs.read.fetcher import read_ahead

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def resident_pages(fd: int, size: int) -> int:
    """Pages of the file in the page cache (mincore; it reads nothing in)."""
    return sum(byte & 1 for byte in resident_map(fd, size))


def resident_map(fd: int, size: int) -> bytes:
    """mincore's vector for the file: one byte per page, bit 0 set if resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        # The temporary ctypes view goes at once: the mapping can then close.
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if libc.mincore(address, size, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return vector.raw


def test_a_range_larger_than_one_advice_is_read_ahead_whole(tmp_path):
    """One WILLNEED reads no more than the device's readahead window (16 MiB
    here, 128 KiB on many NVMe defaults): a 64 MiB range asked for at once
    must still all reach the page cache."""
    size = 64 * MiB
    path = tmp_path / "copy"
    with open(path, "wb") as fp:
        fp.write(os.urandom(size))
        fp.flush()
        os.fsync(fp.fileno())
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if resident_pages(fd, size) > size // PAGE // 4:
            pytest.skip(f"{tmp_path} keeps file pages whatever is advised (tmpfs?)")
        read_ahead([(fd, 0, size)])
        # Every page must reach the page cache; under memory pressure the
        # kernel may drop some again before the last arrive, so pages seen at
        # any poll count.
        seen = bytearray(size // PAGE)
        deadline = time.monotonic() + 30
        while (resident := sum(seen)) < size // PAGE:
            assert time.monotonic() < deadline, (
                f"only {resident * PAGE // MiB} of {size // MiB} MiB were read ahead")
            for page, byte in enumerate(resident_map(fd, size)):
                seen[page] |= byte & 1
            time.sleep(0.05)
    finally:
        os.close(fd)
