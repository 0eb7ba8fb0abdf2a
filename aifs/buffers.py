"""Page-aligned buffers that object bodies are received into, reused.

A block read cold is received from the lake, handed to the kernel as READ
replies and written to the block cache with O_DIRECT, which wants a buffer
aligned to the disk's block. Received into a Python object, every byte was
copied once more into an aligned buffer for the cache write (12% of a cold
read's CPU, ``tests/bench/cpu_per_gib.py``), and into pages the kernel had
to fault in and zero for each new body. A body received here is a view of
the start of an anonymous mapping (page-aligned): the cache writes it as it
is, and the mapping is used again once no view of it is left.

A mapping is free when nothing refers to it but the pool: every view of it
holds a reference to it (through the buffer it exports) until released, so
CPython's reference count says when the last one is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

PAGE = mmap.PAGESIZE
POOL_BYTES = 384 << 20  # mappings kept for reuse, at most
MIN_SIZE = 1 << 20  # smaller bodies are not worth a mapping of their own

_lock = threading.Lock()
_pool: dict[int, list] = {}  # id(mapping) -> [mapping, its address, length taken]
_pooled = 0
#: references to a pooled mapping, seen from :func:`take`'s loop, when nothing
#: else holds it: the pool's list, the loop's name, getrefcount's argument
_IDLE_REFS = 3


def _address(buffer: mmap.mmap | memoryview) -> int:
    probe = ctypes.c_char.from_buffer(buffer)  # (an export of its own: released below)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def take(length: int) -> memoryview:
    """A writable view of ``length`` bytes at the start of a page-aligned
    mapping at least that long (its content is whatever it last held)."""
    global _pooled
    size = -(-length // PAGE) * PAGE
    with _lock:
        for entry in _pool.values():
            buffer = entry[0]
            if len(buffer) >= size and sys.getrefcount(buffer) == _IDLE_REFS:
                entry[2] = length
                return memoryview(buffer)[:length]
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # (shared would be shmem)
        if _pooled + size <= POOL_BYTES:
            _pool[id(buffer)] = [buffer, _address(buffer), length]
            _pooled += size
    return memoryview(buffer)[:length]


def aligned(view: memoryview) -> memoryview | None:
    """If ``view`` is a whole body from :func:`take`: a view of its mapping
    padded to a whole page, the padding zeroed (for an O_DIRECT write of
    it); else None."""
    base = view.obj
    if not isinstance(base, mmap.mmap) or view.readonly:
        return None
    with _lock:
        entry = _pool.get(id(base))
        if entry is None or entry[0] is not base or entry[2] != len(view):
            return None
        address = entry[1]
    if _address(view) != address:
        return None  # a slice, not the body
    padded = -(-len(view) // PAGE) * PAGE
    if padded > len(view):
        ctypes.memset(address + len(view), 0, padded - len(view))
    return memoryview(base)[:padded]
