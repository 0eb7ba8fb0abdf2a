"""Page-aligned buffers that object bodies are received into, reused.

A block read cold is received from the lake, handed to the kernel as READ
replies and written to the block cache with O_DIRECT, which wants a buffer
aligned to the disk's block. Received into a Python object, every byte was
copied once more into an aligned buffer for the cache write (12% of a cold
read's CPU, ``aifs bench --lake``), and into pages the kernel had
to fault in and zero for each new body. A body received here is a view of
the start of an anonymous mapping (page-aligned): the cache writes it as it
is, and the mapping is used again once no view of it is left.

A mapping is free when nothing refers to it but the pool: every view of it
holds a reference to it (through the buffer it exports) until released, so
CPython's reference count says when the last one is gone. What that count
reads for an idle mapping depends on the interpreter (3.14 passes some
arguments without a reference of their own), so it is measured at import,
the same way :func:`take` reads it, and checked to rise with a live view;
where it does not (or without the GIL, where counts are not exact), no
mapping is reused.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any

PAGE = mmap.PAGESIZE
POOL_BYTES = 384 << 20  # mappings kept for reuse, at most (see limit)
POOL_HEADROOM = 128 << 20  # beyond the memory cache: bodies on their way to it
MIN_SIZE = 1 << 20  # smaller bodies are not worth a mapping of their own

#: bytes as received (a GET's body, a block) and handed on: bytes, or the buffer
#: they were received into (a view of a mapping here, a bytearray), never
#: written to after
Body = bytes | bytearray | memoryview

_lock = threading.Lock()
_pool: dict[int, list] = {}  # id(mapping) -> [mapping, its address, length taken]
_pooled = 0


def address(buffer: mmap.mmap | memoryview) -> int:
    """Where a writable buffer's bytes start."""
    probe = ctypes.c_char.from_buffer(buffer)  # (an export of its own: released below)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def _refs(entry: list) -> int:
    """References to a pool entry's mapping, read the one way it is read."""
    return sys.getrefcount(entry[0])


def _calibrate() -> int | None:
    """What :func:`_refs` reads for an idle pooled mapping, or None where a
    live view does not raise it by one (then nothing is reused)."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    entry: list[Any] = [mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE), 0, 0]
    idle = _refs(entry)
    view = memoryview(entry[0])[:1]
    held = _refs(entry)
    view.release()
    entry[0].close()
    return idle if held == idle + 1 else None


#: what _refs reads when nothing but the pool holds a mapping (None: no reuse)
_IDLE_REFS = _calibrate()


def limit(memory_cache: int) -> None:
    """Keep at most what a memory cache of ``memory_cache`` bytes (which
    holds bodies received here) and the bodies on their way need: a node
    given a small memory cache does not keep 384 MiB of idle mappings.
    Idle mappings past the new limit are unmapped at once."""
    global POOL_BYTES, _pooled
    with _lock:
        POOL_BYTES = memory_cache + POOL_HEADROOM
        for key, entry in list(_pool.items()):
            if _pooled <= POOL_BYTES:
                break
            if _refs(entry) == _IDLE_REFS:
                del _pool[key]
                _pooled -= len(entry[0])
                entry[0].close()


def take(length: int) -> memoryview:
    """A writable view of ``length`` bytes at the start of a page-aligned
    mapping at least that long (its content is whatever it last held)."""
    global _pooled
    size = -(-length // PAGE) * PAGE
    with _lock:
        for entry in _pool.values():
            if len(entry[0]) >= size and _refs(entry) == _IDLE_REFS:
                entry[2] = length
                return memoryview(entry[0])[:length]
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # (shared would be shmem)
        if _IDLE_REFS is not None and _pooled + size <= POOL_BYTES:
            _pool[id(buffer)] = [buffer, address(buffer), length]
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
        start = entry[1]
    if address(view) != start:
        return None  # a slice, not the body
    padded = -(-len(view) // PAGE) * PAGE
    if padded > len(view):
        ctypes.memset(start + len(view), 0, padded - len(view))
    return memoryview(base)[:padded]
