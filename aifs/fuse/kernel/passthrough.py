"""FUSE passthrough: opens whose reads and writes the kernel sends straight
to the file's local copy (docs/kernel-binding.md).

The core decides which handles may go direct (:mod:`aifs.posix.direct`);
this registers the copy with the kernel (``FUSE_DEV_IOC_BACKING_OPEN``), one
backing id per inode shared by all its direct handles, and drops the id when
the last of them is released (not earlier: the kernel looks the id up after
it reads the open reply). Where the kernel refuses the ioctl (not root on
the host, no CONFIG_FUSE_PASSTHROUGH) every open is served by the daemon.
"""

from __future__ import annotations

import fcntl
import logging
import struct

from aifs.core import Filesystem
from aifs.fuse.kernel import protocol as p

log = logging.getLogger(__name__)


class Passthrough:
    def __init__(self, fs: Filesystem) -> None:
        self.fs = fs
        self.devfd = -1
        self.enabled = False  # set once INIT settled passthrough
        self.ids: dict[int, list[int]] = {}  # ino -> [backing id, direct handles]
        self.handles: dict[int, int] = {}  # direct fh -> ino

    async def backing_for(self, ino: int, fh: int, pid: int) -> int:
        """The backing id an open of ``ino`` as ``fh`` (by thread ``pid``)
        replies with, or 0."""
        if not self.enabled:
            return 0
        entry = self.ids.get(ino)
        fd = await self.fs.direct_backing(fh, entry is not None, pid)
        if fd is None:
            if entry is not None:
                log.error("inode %d is open in passthrough, but handle %d cannot be", ino, fh)
            return 0
        if entry is None:
            try:
                backing = fcntl.ioctl(self.devfd, p.DEV_IOC_BACKING_OPEN,
                                      bytearray(p.BACKING_MAP.pack(fd, 0, 0)), True)
            except OSError as exc:
                log.warning("passthrough off: the kernel refused a backing file (%s)",
                            exc.strerror)
                self.enabled = False
                self.fs.direct_released(fh)
                return 0
            entry = self.ids[ino] = [backing, 0]
        entry[1] += 1
        self.handles[fh] = ino
        return entry[0]

    def closed(self, ino: int) -> None:
        """One handle of ``ino`` on its backing id is released."""
        entry = self.ids[ino]
        entry[1] -= 1
        if entry[1] == 0:
            del self.ids[ino]
            self.drop(entry[0])

    def drop(self, backing: int) -> None:
        """Close a backing id no handle of this session holds any more."""
        try:
            fcntl.ioctl(self.devfd, p.DEV_IOC_BACKING_CLOSE,
                        bytearray(struct.pack("<I", backing)), True)
        except OSError as exc:
            log.warning("closing backing id %d: %s", backing, exc.strerror)

    def direct(self, fh: int) -> bool | None:
        """Whether handle ``fh`` is direct (for :meth:`Filesystem.release`);
        None where there is no passthrough."""
        if fh in self.handles:
            return True
        return False if self.enabled else None

    def released(self, fh: int) -> None:
        """Handle ``fh`` is released: its backing id let go if it was direct."""
        ino = self.handles.pop(fh, None)
        if ino is not None:
            self.closed(ino)
