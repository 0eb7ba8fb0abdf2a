"""What promotion asks of the filesystem it serves.

The promoter (:class:`~aifs.flush.promoter.Promoter`) decides when and how a
change reaches the lake; whether a file may go now, which version of it that
is, and what follows once it is in belong to the filesystem. This protocol is
the whole of that conversation: a class with these methods hosts a promoter.
"""

from __future__ import annotations

from typing import Protocol

from aifs.meta.store import Inode


class PromotionHost(Protocol):
    """The filesystem as the promoter sees it."""

    def promotable(self, ino: int, force: bool) -> Inode | None:
        """The inode as it should reach the lake now, or None if it must wait
        (open for writing: promoted after close, unless ``force``)."""
        ...

    def held(self, ino: int) -> str | None:
        """Why ``ino`` must not reach the lake now (a failed write it waits
        for its writer to repair), or None if it may."""
        ...

    def lost(self, ino: int, why: str) -> None:
        """``ino``'s bytes left its local copy for an upload that failed
        (``flush.stream``, spilling): it cannot be published; it takes the
        lake's last version again (or goes), as a file whose write failed."""
        ...

    def change_count(self, ino: int) -> int:
        """How many times ``ino`` changed: an upload whose count moved while it
        ran holds an older version."""
        ...

    def packable(self, inode: Inode) -> bool:
        """Whether ``inode`` goes to the lake in a pack rather than as an
        object of its own."""
        ...

    def wait_before_promoting(self, inode: Inode, force: bool) -> float:
        """Seconds ``inode`` must wait before it may be promoted; 0 for now,
        ``math.inf`` for a commit marker whose checkpoint is not all in yet."""
        ...

    def may_delete(self, key: str) -> bool:
        """Whether the tombstoned ``key`` may be deleted from the lake now."""
        ...

    def older_marker_version(self, inode: Inode) -> tuple[int, bytes] | None:
        """An earlier version (sequence, content) of a waiting commit marker
        whose checkpoint is complete, to publish meanwhile; None if none."""
        ...

    def marker_version_published(self, ino: int, seq: int) -> None:
        """The version ``seq`` of marker ``ino`` is in the lake."""
        ...

    def promoted(self, ino: int, inode: Inode) -> None:
        """``inode`` (as settled) reached the lake."""
        ...

    def reads_lake(self, ino: int) -> bool:
        """Whether an open handle may still read ``ino``'s bytes from its lake
        object (its deleted name's object then stays until the last close)."""
        ...
