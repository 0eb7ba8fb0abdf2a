"""Deletes from the lake: what tombstones in LMDB ask for, in batches of up
to 1,000 keys, deepest first (a directory's marker goes after what is under
it), and not while an open handle still reads the object or the host keeps
the key (an "unfinished" checkpoint marker outlives what it guards)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from aifs.errors import LakeError
from aifs.flush.host import PromotionHost
from aifs.flush.stats import PromoteStats
from aifs.lake.base import ObjectStore
from aifs.meta.store import DATA, MetaStore

log = logging.getLogger(__name__)

BATCH = 1000  # keys in one DeleteObjects request
RETRY_AFTER = 5.0  # seconds: after a failed round
DEFERRED_AFTER = 1.0  # seconds: a look again at the deletes that had to wait


class Deletes:
    """Runs delete rounds when tombstones change; the promotion loop starts
    them (:meth:`start_if_due`) and wakes for :meth:`wake_at`."""

    def __init__(self, host: PromotionHost, store: ObjectStore, meta: MetaStore,
                 stats: PromoteStats, wake: Callable[[], None],
                 progressed: Callable[[], None],
                 unlisted_deleted: Callable[[list[str]], None]) -> None:
        self.host = host
        self._unlisted_deleted = unlisted_deleted  # (Packer.objects_deleted)
        self.store = store
        self.meta = meta
        self.stats = stats
        self._wake = wake  # the promotion loop looks at its schedule again
        self._progressed = progressed  # something reached the lake (or failed)
        self.due: float | None = 0.0  # when the next round runs; None: not before a change
        self.running = False
        self.failures: tuple[int, str, float] = (0, "", 0.0)  # (count, why, when)
        self.busy_keys: set[str] = set()  # being deleted: an upload of one waits

    def changed(self, delay: float = 0.0) -> None:
        """Tombstones changed: a round runs within ``delay`` seconds."""
        due = trio.current_time() + delay
        self.due = due if self.due is None else min(self.due, due)
        self._wake()

    def start_if_due(self, now: float, nursery: trio.Nursery) -> None:
        if self.due is not None and self.due <= now and not self.running:
            self.due = None
            self.running = True
            nursery.start_soon(self._run)

    def wake_at(self) -> float:
        """When the promotion loop must be up to start the next round."""
        return self.due if self.due is not None and not self.running else math.inf

    def blocked(self, tombs: dict[str, int]) -> set[str]:
        """Deletes that wait for a handle to close (and markers above them)."""
        blocked = {key for key, ino in tombs.items() if ino and self.host.reads_lake(ino)}
        return blocked | {key for key in tombs if key.endswith("/")
                          and any(b.startswith(key) for b in blocked)}

    async def _run(self) -> None:
        try:
            while await self._round():
                pass
        except LakeError as exc:
            log.warning("deleting from the lake failed (%s); retrying in 5s", exc)
            self.stats.failures += 1
            self.failures = (self.failures[0] + 1, str(exc), trio.current_time())
            self.changed(RETRY_AFTER)
        finally:
            self.running = False
            self._wake()
            self._progressed()

    async def _round(self) -> bool:
        """Delete what tombstones ask for; True if another round may delete more."""
        tombs = self.meta.tombstones()
        batch: list[str] = []
        deferred = False
        for key in sorted(tombs, key=lambda k: (-k.count("/"), k)):
            verdict = self._verdict(key, tombs)
            if verdict == "delete":
                batch.append(key)
                if len(batch) >= BATCH:
                    break
            elif verdict == "wait":
                deferred = True
        if batch:
            await self._delete(batch)
            return True
        if deferred:
            self.changed(DEFERRED_AFTER)
        return False

    def _verdict(self, key: str, tombs: dict[str, int]) -> str:
        """What to do with ``key``'s tombstone now: "delete", "wait" or
        "dropped" (a live inode's upload replaces the object)."""
        owner = self.meta.owner_of(key)
        owner_inode = self.meta.get(owner) if owner is not None else None
        if owner is not None and not (owner_inode is not None and owner_inode.packed
                                      and not owner_inode.pending & DATA):
            self.meta.drop_tombstone(key)
            return "dropped"
        if tombs[key] and self.host.reads_lake(tombs[key]):
            return "wait"  # still read through an open handle
        if key.endswith("/") and any(k != key and k.startswith(key) for k in tombs):
            return "wait"  # the marker goes last: the prefix stays hidden
        if not self.host.may_delete(key):
            return "wait"  # an "unfinished" marker outlives what it guards
        return "delete"

    async def _delete(self, batch: list[str]) -> None:
        marks = self.meta.tombstone_marks(batch)
        self.busy_keys.update(batch)
        try:
            await self.store.delete_many(batch)
        finally:
            self.busy_keys.difference_update(batch)
        self.stats.deletes += len(batch)
        # Other nodes list an object of a key longer than the lake takes from
        # its record (lake.longkeys): a deletion record ends it there.
        self._unlisted_deleted([key for key in batch if not self.store.listed(key)])
        self.meta.drop_tombstones(marks)  # not those tombstoned again meanwhile
        self._progressed()

    async def clear_way(self, key: str) -> None:
        """Before something is copied to ``key`` in a lake whose keys are
        paths (``ObjectStore.keys_nest``: an object ``a`` and one under
        ``a/`` exclude each other): delete at once the tombstoned objects in
        its way, at its ancestors (``a`` for ``a/b``), of its name (a file
        ``a`` for a directory ``a/``) or, for a file, below it, where they
        may go now. Else a rename onto a name a file had
        just left failed until the next delete round ran."""
        way = way_of(key)  # (point lookups and one range: not every tombstone)
        while True:  # (a directory's marker may go once what was under it went)
            tombs = self.meta.tombstones_of(way)
            if not key.endswith("/"):
                tombs |= self.meta.tombstones_under(key + "/")
            batch = [k for k in tombs if self._verdict(k, tombs) == "delete"]
            if not batch:
                return
            await self._delete(batch)


def way_of(key: str) -> list[str]:
    """The keys that exclude ``key`` in a lake whose keys are paths: its
    ancestors (``a`` for ``a/b``) and, for a directory ``a/``, the file ``a``
    (those below a file's key are a range, not a list)."""
    parts = key.rstrip("/").split("/")
    return ["/".join(parts[:n]) for n in range(1, len(parts) + key.endswith("/"))]
