"""A do-nothing pyfuse3 filesystem that keeps files in memory: the floor cost of
one FUSE request through the kernel, pyfuse3 and trio on this machine. The
benchmarks run the same create and read loops through it beside aifs, so a
per-file figure can be read against what any pyfuse3 daemon could reach.

    python tests/bench/fuse_floor.py MOUNTPOINT [--discard | --store DIR]
                                                  (serves until unmounted)

With ``--discard`` written bytes are counted, not kept (reads give zeros): the
floor of a write, with no copy into memory that a real daemon would not make.
With ``--store DIR`` each write request is one ``pwrite`` into a file in DIR:
the floor of a daemon that keeps written data in a local file, as a
write-back cache must.
"""

from __future__ import annotations

import argparse
import os
import stat

import pyfuse3
import trio

TIMEOUT = 300.0  # like a long aifs metadata TTL: a warm stat never reaches Python


def _write_only(flags: int) -> bool:
    """Write-only handles skip the page cache, as aifs's do (the faster way)."""
    return flags & os.O_ACCMODE == os.O_WRONLY


class FloorFS(pyfuse3.Operations):
    """Files and directories in dicts; no checks beyond what the loops need."""

    def __init__(self, discard: bool = False, store: str | None = None) -> None:
        super().__init__()
        self.in_memory = not discard and store is None  # else only sizes are kept here
        self.store = store
        self.fds: dict[int, int] = {}  # with store: each file's local file, open for good
        self.sizes: dict[int, int] = {}  # unless in memory: the size each file reached
        self.children: dict[tuple[int, bytes], int] = {}
        self.modes: dict[int, int] = {pyfuse3.ROOT_INODE: stat.S_IFDIR | 0o755}
        self.data: dict[int, bytearray] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.st_mode = self.modes[ino]
        entry.st_nlink = 1
        entry.st_size = len(self.data.get(ino, b"")) if self.in_memory else self.sizes.get(ino, 0)
        entry.st_blksize = 1 << 20
        entry.entry_timeout = entry.attr_timeout = TIMEOUT
        return entry

    def _new(self, parent: int, name: bytes, mode: int) -> int:
        ino = self.next_ino
        self.next_ino += 1
        self.children[(parent, name)] = ino
        self.modes[ino] = mode
        return ino

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self._entry(inode)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        ino = self.children.get((parent_inode, name))
        if ino is None:
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = TIMEOUT
            return negative
        return self._entry(ino)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self._new(parent_inode, name, stat.S_IFDIR | 0o755))

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        ino = self._new(parent_inode, name, stat.S_IFREG | 0o644)
        self.data[ino] = bytearray()
        return pyfuse3.FileInfo(fh=ino, direct_io=_write_only(flags)), self._entry(ino)

    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode, direct_io=_write_only(flags))

    def _local(self, ino: int) -> int:
        fd = self.fds.get(ino)
        if fd is None:
            fd = self.fds[ino] = os.open(os.path.join(str(self.store), str(ino)),
                                         os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if self.store is not None:
            written = os.pwrite(self._local(fh), buf, off)
            self.sizes[fh] = max(self.sizes.get(fh, 0), off + written)
            return written
        if not self.in_memory:  # discarded
            self.sizes[fh] = max(self.sizes.get(fh, 0), off + len(buf))
            return len(buf)
        data = self.data[fh]
        data[off:off + len(buf)] = buf
        return len(buf)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        if self.store is not None:
            return os.pread(self._local(fh), size, off)
        if not self.in_memory:  # discarded
            return bytes(max(0, min(size, self.sizes.get(fh, 0) - off)))
        return memoryview(self.data[fh])[off:off + size]

    async def flush(self, fh: int) -> None:
        return None

    async def release(self, fh: int) -> None:
        fd = self.fds.pop(fh, None)
        if fd is not None:  # the benchmark may delete the local file now
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mountpoint")
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument("--discard", action="store_true", help="keep no written bytes")
    keep.add_argument("--store", metavar="DIR", help="keep written bytes in files in DIR")
    args = parser.parse_args()
    options = set(pyfuse3.default_options)
    options.add("fsname=fuse-floor")
    pyfuse3.init(FloorFS(args.discard, args.store), args.mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


if __name__ == "__main__":
    main()
