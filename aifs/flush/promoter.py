"""Promotion: local changes reach the lake in the background.

What is pending is recorded in LMDB (``Inode.pending`` and tombstones), so
this module keeps only a schedule in memory and rebuilds it at start: after a
crash every dirty inode is promoted again from its local copy, and multipart
uploads the crash left open are aborted. An object appears under a file's key
only by a complete PUT or a completed multipart upload, so the lake never
shows a partial file. A file changed while its upload ran is uploaded again;
the stale upload is abandoned before completion (multipart) or replaced.

This module schedules promotions and settles what landed; the upload itself
is :mod:`aifs.flush.uploads`, deletes are :mod:`aifs.flush.deletes`, small
files go through :mod:`aifs.pack.packer`, and what the promoter asks of the
filesystem is :class:`aifs.flush.host.PromotionHost`.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import trio

from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.errors import Failure, LakeError, lake_error_in
from aifs.flush.deletes import Deletes, way_of
from aifs.flush.host import PromotionHost
from aifs.flush.pacing import Pacer
from aifs.flush.stats import PromoteStats
from aifs.flush.stream import Streams
from aifs.flush.uploads import (
    MAX_PART,
    MAX_PARTS,
    MIN_PART,
    PARTS_PER_STEP,
    Uploads,
    part_size,
    plan_parts,
)
from aifs.lake.base import ObjectStore
from aifs.lake.retry import PROMOTION_BACKOFF
from aifs.meta.objattrs import to_metadata
from aifs.meta.store import DATA, FILE, MAYBE_IN_LAKE, META, Inode, MetaStore
from aifs.pack.index import PackedEntry, deletion, is_packed_at, object_record
from aifs.pack.packer import Packer

__all__ = ["MAX_PART", "MAX_PARTS", "MIN_PART", "PARTS_PER_STEP", "PromoteStats", "Promoter",
           "PromotionHost", "part_size", "plan_parts"]

log = logging.getLogger(__name__)

WAKE_TICK = 0.02  # seconds: the promotion loop's timer granularity


class Promoter:
    def __init__(self, host: PromotionHost, store: ObjectStore, meta: MetaStore,
                 files: LocalFiles, config: Config, uid: int, gid: int) -> None:
        self.host = host
        self.store = store
        self.meta = meta
        self.files = files
        self.config = config
        self.uid, self.gid = uid, gid
        self._due: dict[int, float] = {}  # ino -> when; _heap orders them (lazily)
        self._heap: list[tuple[float, int]] = []
        self._forced: set[int] = set()
        self._active: set[int] = set()
        self._deciding: set[int] = set()  # active, not yet handed to the packer or uploading
        # ino -> (count, why, when); why: a Failure (its errno is sync's answer) or a reason
        self._failures: dict[int, tuple[int, str, float]] = {}
        self._wake = trio.Event()
        self._sleeps_until = -math.inf  # when the loop wakes by itself
        self._progress = trio.Event()
        self._slots = trio.Semaphore(max(1, config.promote_workers))
        self._parked: dict[int, bool] = {}  # commit markers waiting: ino -> forced
        self._landing: Counter[str] = Counter()  # keys of uploads whose reply is not handled
        self._reserved: Counter[str] = Counter()  # keys renames are copying to
        self.sync_error = ""  # why the last sync that gave up did
        self.stats = PromoteStats()
        self.pacer = Pacer(config.promote_busy_rate)
        self.streams = Streams(store, meta, lambda number: part_size(number, config.part_size),
                               config.multipart_threshold, config.parts_in_flight,
                               config.stream_parts_in_flight, files.punch)
        self.packer = Packer(self, store, meta, files, config, uid, gid)
        self.uploads = Uploads(host, store, meta, files, config, uid, gid, self.stats,
                               self.streams, self.packer, self.pacer)
        self.deletes = Deletes(host, store, meta, self.stats, self._poke, self._changed,
                               self.packer.objects_deleted)

    # -- schedule -----------------------------------------------------------
    def schedule(self, ino: int, delay: float | None = None, force: bool = False,
                 sooner: bool = False) -> None:
        """Promote ``ino`` after ``delay`` seconds (default: promote_delay)."""
        delay = self.config.promote_delay if delay is None else delay
        due = trio.current_time() + delay
        if ino in self._due and sooner:
            due = min(due, self._due[ino])
        elif ino in self._due and not force:
            due = max(due, self._due[ino])  # a newer change restarts the delay
        if self._due.get(ino) != due:
            self._due[ino] = due
            heapq.heappush(self._heap, (due, ino))
        if force:
            self._forced.add(ino)
        if due < self._sleeps_until:  # else the loop is up by then anyway
            self._wake.set()

    def tombstones_changed(self, delay: float = 0.0) -> None:
        self.deletes.changed(delay)

    def _poke(self) -> None:
        self._wake.set()

    def _changed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def run(self) -> None:
        """The promotion loop (runs until cancelled)."""
        await self.uploads.abort_leftovers()
        try:
            await self.uploads.abort_stale()
        except LakeError as exc:
            log.warning("cannot look for stale multipart uploads: %s", exc)
        for inode in self.meta.pending_inodes():
            self.schedule(inode.ino, 0.0)
        async with trio.open_nursery() as nursery:
            self.streams.start(nursery)
            nursery.start_soon(self.packer.run)
            while True:
                now = trio.current_time()
                while self._heap and self._slots.value > 0:
                    due, ino = self._heap[0]
                    if due > now:
                        break
                    heapq.heappop(self._heap)
                    if self._due.get(ino) != due:
                        continue  # rescheduled since: a later entry stands for it
                    if ino in self._active:
                        heapq.heappush(self._heap, (now + 0.05, ino))
                        self._due[ino] = now + 0.05
                        continue
                    del self._due[ino]
                    force = ino in self._forced
                    self._forced.discard(ino)
                    self._active.add(ino)
                    # Deciding from now, not from when the task first runs:
                    # the packer must not take the pause in between for the
                    # end of a handover and send a pack without this file.
                    self._deciding.add(ino)
                    self._slots.acquire_nowait()
                    nursery.start_soon(self._promote_task, ino, force)
                self.deletes.start_if_due(now, nursery)
                wake_at = self._heap[0][0] if self._heap and self._slots.value else math.inf
                wake_at = min(wake_at, self.deletes.wake_at())
                # Files closed a few ms apart fall due together: one wake-up for all.
                if wake_at < math.inf:
                    wake_at = math.ceil(wake_at / WAKE_TICK) * WAKE_TICK
                self._sleeps_until = wake_at
                with trio.move_on_at(wake_at):
                    await self._wake.wait()
                self._sleeps_until = -math.inf
                self._wake = trio.Event()

    # -- one inode ------------------------------------------------------------
    async def _promote_task(self, ino: int, force: bool) -> None:
        landed = False
        try:
            held = self.host.held(ino)
            if held is not None:  # it waits for its writer, not the lake: no retry
                count = self._failures.get(ino, (0, "", 0.0))[0] + 1
                self._failures[ino] = (max(2, count), held, trio.current_time())
                return
            try:
                landed = await self._promote(ino, force)
            except Exception as exc:
                raise lake_error_in(exc) or exc from None
            self._failures.pop(ino, None)
        except LakeError as exc:
            count = self._failures.get(ino, (0, "", 0.0))[0] + 1
            self._failures[ino] = (count, Failure(exc), trio.current_time())
            self.stats.failures += 1
            pause = PROMOTION_BACKOFF.delay(count)
            log.warning("promotion of inode %d failed (%s); next try in %.1fs", ino, exc, pause)
            self.schedule(ino, pause)
        except FileNotFoundError as exc:
            current = self.meta.get(ino)
            if current is not None and not current.orphan:
                log.error("promotion of inode %d failed: %s", ino, exc)
                self._failures[ino] = (1, Failure(exc), trio.current_time())
                self.schedule(ino, 30.0)
            # else: deleted while it uploaded; its local copy went with it
        except Exception as exc:  # a bug must not end the promotion loop
            log.exception("promotion of inode %d failed", ino)
            # counted like a lake error, so that a sync (and an unmount) gives up
            # on it instead of waiting for ever
            count = self._failures.get(ino, (0, "", 0.0))[0] + 1
            self._failures[ino] = (count, repr(exc), trio.current_time())
            self.schedule(ino, PROMOTION_BACKOFF.delay(count))
        finally:
            self._active.discard(ino)
            self._deciding.discard(ino)
            self.uploads.sent.pop(ino, None)
            self._slots.release()
            if landed:
                self._unpark()
            self._wake.set()
            self._changed()

    def handing_over(self) -> bool:
        """Whether files due now may still reach the packer: promotions that
        have not decided between pack and upload, or due ones not started."""
        if self._deciding:
            return True
        heap = self._heap
        while heap and self._due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale: the loop would skip it anyway
        return bool(heap) and heap[0][0] <= trio.current_time()

    def _unpark(self) -> None:
        """Something reached the lake: the commit markers waiting look again."""
        parked, self._parked = self._parked, {}
        for ino, force in parked.items():
            self.schedule(ino, 0.05, force=force, sooner=True)

    async def paced(self, size: int) -> None:  # (Owner, for the packer)
        await self.pacer.take(size)

    def published(self) -> None:  # (Owner: a journal of records alone wakes a sync too)
        self._changed()

    def promote_soon(self, ino: int) -> None:
        """Promote ``ino`` now, whatever its delay (unless it keeps failing)."""
        if ino not in self._failures:
            self.schedule(ino, 0.0, sooner=True)

    def forget(self, ino: int) -> None:
        """``ino`` owes the lake nothing any more (its changes were dropped):
        its failures are no one's concern."""
        self._failures.pop(ino, None)
        self._changed()

    def progress(self, ino: int) -> int:
        """Bytes of the upload of ``ino`` under way that the lake has."""
        return self.uploads.sent.get(ino, 0) + self.streams.sent(ino)

    async def _promote(self, ino: int, force: bool) -> bool:
        """Promote ``ino`` if it may go now; True if something landed."""
        inode = self.host.promotable(ino, force)
        if inode is None or not inode.pending:
            return False
        if inode.key in self.deletes.busy_keys:
            self.schedule(ino, 0.1)
            return False
        wait = self.host.wait_before_promoting(inode, force)
        if wait == math.inf:  # a commit marker whose checkpoint is not all in yet
            self._parked[ino] = force
            self.schedule(ino, 1.0, force=force)  # and look again after a deletion
            older = self.host.older_marker_version(inode)
            return older is not None and await self._publish_version(inode, *older)
        if wait > 0:
            self.schedule(ino, wait, force=force)
            return False
        version = self.host.change_count(ino)
        key = inode.key
        if inode.pending & DATA and inode.kind == FILE and not self.files.has(ino):
            log.error("%s: local copy of inode %d is missing; it cannot be promoted",
                      inode.key, ino)
            self.meta.update(ino, pending=inode.pending & ~DATA)
            return False
        if inode.pending & DATA and self.host.packable(inode):
            if inode.etag and inode.etag != MAYBE_IN_LAKE:
                await self.uploads.warn_if_replaced(inode)
            self._deciding.discard(ino)
            self.packer.submit(inode, version, force)  # it settles once its journal is in
            return False
        self._deciding.discard(ino)
        if any(name in self._landing or name in self._reserved for name in inode.keys()):
            # Another file's upload to this key is on the way (a file renamed
            # or deleted while it uploaded), or a rename's copy: this one goes
            # after it, or the stale bytes could land last, under its name.
            self.schedule(ino, 0.05)
            return False
        with self._landing_under(inode.keys()):
            if inode.pending & DATA:
                info = await self.uploads.upload(inode, version)
            else:
                info = await self.uploads.write_metadata(inode)
            if info is None:
                self.schedule(ino)  # changed before anything landed: promote it later
                return False
            etags = {key: info.etag}
            if inode.links:
                etags.update(await self.uploads.copy_to_links(inode))
            current = self.meta.get(ino)
            if current is None or current.orphan or current.key != key:
                # Renamed, deleted or replaced while it uploaded: what landed
                # under the old key is no one's. Its tombstone goes at once if
                # no file has the name; a file that took the name either
                # overwrites it with an upload of its own (the tombstone is
                # dropped) or is packed, and then deletes it (its etag says an
                # object may be there).
                self._landed_stale(key)
                if current is not None and not current.orphan:
                    self.schedule(ino, 0.0)
                return False
        spilled = ino in self.streams.spilled  # its copy has holes: its data is done
        if self.host.change_count(ino) != version and not spilled:
            # Changed meanwhile: promote the newer state later. The lake holds
            # this version now: remember it, so a rename or unlink deletes it.
            self.meta.update(ino, etag=info.etag)
            self.schedule(ino)
            return False
        done = inode.pending
        streamed = ino in self.uploads.streamed
        if streamed and inode.pending & META:
            # A streamed object got the attributes of when its upload began
            # (and the lake's mtime): a chmod or utime since is written next.
            done &= ~META
        self.uploads.streamed.discard(ino)
        fields: dict[str, object] = {"etag": info.etag}
        if not info.etag.startswith("pack:"):  # an object of its own now
            fields.update(pack="", pack_offset=0, checksum="")
            if inode.packed or inode.kind == FILE and self.packer.index.entry(key) is not None:
                # its packed copy, or one of a file this one replaced
                self.packer.queue_records([deletion(key)])
            if inode.key and not (streamed and inode.pending & META):
                # What the object's metadata says, for nodes that list it
                # (attributes without a HEAD each): a record per name.
                metadata = to_metadata(inode, self.uid, self.gid)
                if streamed:
                    metadata.pop("mtime", None)  # the lake's time serves (see _stream_target)
                self.packer.queue_records(
                    [object_record(name, etags.get(name, info.etag), metadata)
                     for name in inode.keys()], lazy=True)
        settled = self.meta.settle(ino, key, done, **fields)
        if spilled:
            # The copy is not the file (flush.stream): gone, reads come from the lake.
            self.files.remove(ino)
            self.streams.settled(ino)
            self.meta.record_upload(ino, key, None)
        if settled is None:
            return True
        if done & DATA and not settled.pending:
            self.files.mark_clean(ino)
        self.host.promoted(ino, settled)
        if settled.pending:
            self.schedule(ino, 0.0)
        return True

    def packed(self, ino: int, key: str, version: int, entry: PackedEntry) -> None:
        """A packed file's journal is in the lake: settle it (as ``_promote``
        settles an upload)."""
        current = self.meta.get(ino)
        if current is None or current.orphan or current.key != key:
            # Renamed, deleted or replaced while its pack was on the way: the
            # record names bytes that are no one's now. Its deletion is stamped
            # just after it, so that the record of a file that took the name
            # since (packed later, so stamped later) still wins.
            owner = self.meta.owner_of(key)
            holder = self.meta.get(owner) if owner is not None else None
            if holder is None or not is_packed_at(holder, entry):
                self.packer.queue_records([deletion(key, entry.stamp + 1)])
            if current is not None and not current.orphan:
                self.schedule(ino, 0.0)
            return
        if self.host.change_count(ino) != version and not current.pending & DATA:
            # Changed since, and the newer version already landed as an object
            # of its own (its upload settled while this pack was on the way):
            # the record names stale bytes. The object stays the file's copy,
            # and the record is deleted, stamped just after it (the object's
            # settling found no packed entry to delete: it had not landed yet;
            # a later "obj" record hides it here, but not from the journals).
            self.packer.queue_records([deletion(key, entry.stamp + 1)])
            return
        # (Any: inode fields of several types, which update's ``closed`` never gets)
        fields: dict[str, Any] = {"etag": entry.etag, "pack": entry.pack,
                                  "pack_offset": entry.offset, "checksum": entry.xxh3}
        if current.etag and current.etag != entry.etag:
            # An object of the file's own may be in the lake: deleted now.
            self.meta.add_tombstone(key)
            self.tombstones_changed()
        if self.host.change_count(ino) != version:
            self.meta.update(ino, **fields)  # this version is in the lake; a newer follows
            self.schedule(ino)
            return
        settled = self.meta.settle(ino, key, DATA | META, **fields)
        self.stats.uploads += 1
        self.stats.upload_bytes += entry.length
        if settled is not None:
            if not settled.pending:
                self.files.mark_clean(ino)
            self.host.promoted(ino, settled)
        self._unpark()
        self._changed()

    def _landed_stale(self, key: str) -> None:
        """An object landed under ``key`` for a file that no longer has it."""
        self.meta.add_tombstone(key)
        owner = self.meta.owner_of(key)
        if owner is not None:
            holder = self.meta.get(owner)
            if holder is not None and not holder.etag:
                self.meta.update(owner, etag=MAYBE_IN_LAKE)
        self.tombstones_changed()

    def _landing_under(self, keys: list[str]) -> contextlib.AbstractContextManager[None]:
        """While an upload to ``keys`` runs and until its reply is handled."""
        return _counted(self._landing, keys)

    def reserving(self, keys: list[str]) -> contextlib.AbstractContextManager[None]:
        """While a rename copies to ``keys``: no upload to them starts."""
        return _counted(self._reserved, keys)

    def landing_at(self, key: str, below: bool = False) -> bool:
        """Whether an upload to ``key`` (``below``: or under it) is on the way.
        A file renamed or deleted while its PUT ran leaves that PUT to land
        under its old key; whatever else goes there first would be replaced
        by the stale bytes."""
        return any(name == key or below and name.startswith(key) for name in self._landing)

    async def wait_landed(self, key: str, below: bool = False) -> None:
        """Until no upload to ``key`` (``below``: or under it) is on the way."""
        while self.landing_at(key, below):
            await self.wait_progress()

    async def clear_way(self, key: str) -> None:
        """Before a rename copies to ``key`` in a lake whose keys are paths:
        the stale uploads in its way land first (a file renamed away while
        its PUT ran: its object gets its tombstone only with the reply), then
        the tombstoned objects there go (:meth:`Deletes.clear_way`)."""
        for name in way_of(key):
            await self.wait_landed(name)
        if not key.endswith("/"):
            await self.wait_landed(key + "/", below=True)
        await self.deletes.clear_way(key)

    def landing(self, key: str) -> bool:
        """Whether an upload to ``key`` may be in the lake already, its reply
        not yet handled: if the key has no owner now, the object is stale (its
        tombstone comes with the reply) and a rename must not copy it."""
        return key in self._landing

    def change_count(self, ino: int) -> int:
        return self.host.change_count(ino)

    async def _publish_version(self, inode: Inode, seq: int, content: bytes) -> bool:
        """Put an older version of a waiting marker whose checkpoint is complete
        in the lake (so ``latest`` advances while saves outpace the lake)."""
        with self._landing_under([inode.key]):
            info = await self.uploads.put(inode.key, content,
                                          to_metadata(inode, self.uid, self.gid))
            current = self.meta.get(inode.ino)
            if current is None or current.orphan or current.key != inode.key:
                self._landed_stale(inode.key)
                return True
        self.meta.update(inode.ino, etag=info.etag)  # a delete now removes it too
        self.host.marker_version_published(inode.ino, seq)
        log.debug("%s: published an earlier version whose checkpoint is complete", inode.key)
        return True

    async def abort_stale_uploads(self) -> int:
        """Abort the lake's stale multipart uploads (see :meth:`Uploads.abort_stale`)."""
        return await self.uploads.abort_stale()

    # -- waiting for the lake ----------------------------------------------------
    def hurry(self) -> bool:
        """The cache needs room: promote what waits for its delay now. False if
        nothing promotable is left (or all of it keeps failing)."""
        now = trio.current_time()
        self.pacer.hurry()
        hopeful = False
        for ino, due in list(self._due.items()):
            if ino not in self._failures:
                if due > now:
                    self._due[ino] = now
                    heapq.heappush(self._heap, (now, ino))
                hopeful = True
        self._wake.set()
        return hopeful or any(ino not in self._failures for ino in self._active)

    async def wait_progress(self, timeout: float = 1.0) -> None:
        with trio.move_on_after(timeout):
            await self._progress.wait()

    def summary(self) -> dict[str, Any]:
        """The promotion queue: files and bytes not yet in the lake, deletes to
        make, uploads running, the age in seconds of the oldest change, and
        why the last sync gave up (for ``aifs sync`` to say)."""
        pending = self.meta.pending_inodes()
        oldest = min((i.ctime for i in pending if i.ctime), default=None)
        return {"files": len(pending),
                "bytes": sum(i.size for i in pending if i.pending & DATA),
                "deletes": len(self.meta.tombstones()),
                "uploading": len(self._active),
                "oldest_age": round(max(0.0, time.time() - oldest), 3) if oldest else 0.0,
                "error": self.sync_error}

    async def sync(self, selects: Callable[[Inode], bool], key_prefix: str | None) -> None:
        """Return once every pending change selected (and every tombstone under
        ``key_prefix``) is in the lake; raise LakeError if one keeps failing.

        Deletes of files still open (unlinked while open) are not waited for:
        they happen when the last handle closes. Someone waits: nothing is
        paced meanwhile (flush.pacing).
        """
        with self.pacer.urgent():
            await self._sync(selects, key_prefix)

    async def _sync(self, selects: Callable[[Inode], bool], key_prefix: str | None) -> None:
        started = trio.current_time()
        self.deletes.failures = (0, "", 0.0)
        kicked = False
        # What is pending now (changes made later are not waited for).
        waiting = {i.ino for i in self.meta.pending_inodes() if selects(i)}
        while True:
            waiting &= self.meta.pending_set()  # an orphan is pending no more
            tombs: dict[str, int] = {}
            if key_prefix is not None:
                tombs = self.meta.tombstones_under(key_prefix)
                for key in self.deletes.blocked(self.meta.tombstones()):
                    tombs.pop(key, None)
            packing = self.packer.waiting()
            # A file deleted (unlinked, or replaced by a rename) while its upload
            # was in flight is pending no more, but what its upload lands under
            # the old key is tombstoned only when it lands: wait for that too.
            landing = key_prefix is not None and any(
                (record := self.meta.get(ino)) is None or record.orphan for ino in self._active)
            if not waiting and not tombs and not packing and not landing:
                return
            # What keeps failing does not stop the rest: sync gives up only
            # once all that is left keeps failing (one file the lake refuses
            # must not leave every other one out of the lake at unmount).
            stuck: list[str] = []
            errnos: list[int] = []  # of what is stuck, where an error says it
            if packing:
                count, why, when = self.packer.failure
                if count >= 2 and when >= started:
                    stuck.append(f"packing small files: {why}")
                    errnos.append(getattr(why, "errno", errno.EIO))
                self.packer.hurry()
            failing = 0
            for ino in waiting:
                failure = self._failures.get(ino)
                if failure and failure[2] >= started and failure[0] >= 2:
                    inode = self.meta.get(ino)
                    stuck.append(f"{inode.key if inode else ino}: {failure[1]}")
                    errnos.append(getattr(failure[1], "errno", errno.EIO))
                    failing += 1
                    continue
                if ino not in self._active and not self.packer.queued(ino) and (
                        ino not in self._forced or ino not in self._due):
                    self.schedule(ino, 0.0, force=True)
            deletes_stuck = False
            if tombs:
                count, why, when = self.deletes.failures
                if count >= 2 and when >= started:
                    stuck.append(f"deleting from the lake: {why}")
                    deletes_stuck = True
                if not kicked:
                    self.tombstones_changed()
                    kicked = True
            if stuck and failing == len(waiting) and (not tombs or deletes_stuck) \
                    and (not packing or stuck[0].startswith("packing")):
                more = f" (and {len(stuck) - 1} more)" if len(stuck) > 1 else ""
                self.sync_error = stuck[0] + more
                error = LakeError(self.sync_error)
                # a full lake says so (ENOSPC, EDQUOT); anything else is EIO
                error.errno = next((e for e in errnos if e != errno.EIO), errno.EIO)
                raise error
            progress = self._progress
            with trio.move_on_after(1.0):
                await progress.wait()
            await trio.sleep(0.05)  # let more complete before scanning again


@contextlib.contextmanager
def _counted(counter: Counter[str], keys: list[str]) -> Iterator[None]:
    """Count ``keys`` in ``counter`` while the block runs."""
    for key in keys:
        counter[key] += 1
    try:
        yield
    finally:
        for key in keys:
            counter[key] -= 1
            if not counter[key]:
                del counter[key]
