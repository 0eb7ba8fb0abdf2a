"""Reading the lake's journals into the local pack index (replay).

A node learns what other nodes packed (and the attributes of the plain
objects they wrote) by replaying the journals under ``.aifs/journals/``:
listed, fetched many at once, applied in order; folds (compacted journals)
replace what they cover. A refresh runs at most once per ``metadata_ttl``,
the same freshness as directory listings, however many listings ask.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from aifs.errors import LakeError, ObjectNotFound
from aifs.lake.base import ObjectStore
from aifs.pack.folds import directory_of, read_shard, shard_key, shard_of
from aifs.pack.index import FOLD_SUFFIX, JOURNAL_DIR, PackIndex, decode_journal, read_fold

log = logging.getLogger(__name__)

JOURNALS_AT_ONCE = 16
REPLAY_ROUNDS = 3  # listings in one refresh while journals vanish under it (folds)


@dataclass
class PackStats:
    packs: int = 0
    packed_files: int = 0
    packed_bytes: int = 0
    journals: int = 0
    journals_read: int = 0
    shards_read: int = 0  # shards of sharded folds (read by directory)
    corrupt: int = 0



class _ReplayFromScratch(Exception):
    pass


class Journals:
    """Replays the lake's journals into the local pack index."""

    def __init__(self, store: ObjectStore, index: PackIndex, ttl: float,
                 stats: PackStats) -> None:
        self.store = store
        self.index = index
        self.ttl = ttl
        self.stats = stats
        self._refreshed = -float("inf")
        self._running: trio.Event | None = None
        self._ahead = False  # the refresh running is :meth:`read_ahead`'s
        self._replayed: set[str] = set()
        self._from_scratch = False  # the index was reset in this refresh
        self._shards_lock = trio.Lock()  # one task reads shards at a time: none twice
        #: changes when the index is reset or a sharded fold's head applied
        #: (entries it held, or their live bytes, may be unknown until read)
        self.generation = 0
        self._warned: set[tuple[str, int]] = set()  # shards reported unreadable
        #: journals and folds in the lake at the last refresh that could not be read
        self.unreadable: list[str] = []

    @property
    def replayed(self) -> set[str]:
        """The journals and folds in the lake at the last refresh (read here)."""
        return self._replayed

    async def refresh_if_stale(self) -> None:
        if trio.current_time() - self._refreshed >= self.ttl:
            await self.refresh()

    async def read_ahead(self) -> None:
        """At mount: replay the lake's journals before a listing asks (a
        fresh node's first listing then waits for a LIST of the journals, not
        for their GETs and replay). It counts as no refresh: the first listing
        still lists the journals (what was published since is read then), and
        one that comes while this runs refreshes after it. A lake that fails
        here is no error: the listing tries again."""
        if self._running is not None:
            return
        self._ahead = True
        refreshed = self._refreshed
        try:
            await self.refresh()
        except LakeError as exc:
            log.debug("journals not read ahead: %s", exc)
        finally:
            self._refreshed = refreshed

    async def refresh(self, fresh: bool = False) -> set[str]:
        """Read the journals and folds this node has not replayed yet (one
        LIST, and a GET per new object); concurrent callers share one refresh
        (``fresh``: one whose LIST comes after this call). Returns the names
        listed that this node has replayed and could read."""
        early: tuple[int, float, dict[str, int]] | None = None
        while self._running is not None:
            if self._ahead and early is None:
                # A read-ahead runs: list now, beside it, and replay after it
                # what it did not (not its whole time, then a LIST).
                early = (time.time_ns(), trio.current_time(), await self._list())
                continue
            await self._running.wait()
            if not fresh and early is None:  # (a read-ahead's waiters listed: early)
                return self._replayed
        self._running = trio.Event()
        started = trio.current_time() if early is None else early[1]
        try:
            for _ in range(REPLAY_ROUNDS):
                if early is not None:
                    listed_at, _, listed = early
                    early = None
                else:
                    listed_at = time.time_ns()
                    listed = await self._list()
                seen = self.index.seen(listed)
                try:
                    vanished = await self._replay(sorted(set(listed) - seen), listed)
                except _ReplayFromScratch as why:
                    log.warning("%s: this node replays the pack index from scratch", why)
                    self.generation += 1
                    await trio.to_thread.run_sync(self.index.reset)
                    self._from_scratch = True
                    continue
                self._replayed = self.index.seen(listed, readable_only=True)
                self.unreadable = sorted(self.index.seen(listed) - self._replayed)
                if not vanished:
                    self.index.set_replayed_at(listed_at)
                    break
                # Folded by another node while we read: its fold holds them.
                log.debug("journals vanished while replayed; listing again")
            self._refreshed = started
            return self._replayed
        finally:
            self._from_scratch = False
            self._ahead = False
            self._running.set()
            self._running = None

    async def _list(self) -> dict[str, int]:
        """The journals and folds in the lake: name -> size."""
        listed: dict[str, int] = {}
        async for page in self.store.iter_list(JOURNAL_DIR, None):
            # (a "directory" marker is no journal: an empty journal directory
            # of the local lake lists as one, and so does a folder made in a
            # cloud console)
            listed.update({obj.key: obj.size for obj in page.objects
                           if not obj.key.endswith("/")})
        return listed

    async def _replay(self, names: list[str], sizes: dict[str, int]) -> bool:
        """Apply these journals and folds, folds first (the journals they
        cover then need no GET); True if one vanished before it was read."""
        folds = [name for name in names if name.endswith(FOLD_SUFFIX)]
        vanished = await self._apply_batch(folds, sizes)
        journals = sorted(set(names) - set(folds) - self.index.seen(names))
        return await self._apply_batch(journals, sizes) or vanished

    def _apply_one(self, name: str, raw: bytes) -> None:
        """Apply a journal, or a fold batch by batch (the fold is marked read
        with the last; a sharded fold's shards are read as directories are
        listed: :meth:`ensure_dir`); ValueError if it cannot be read."""
        if not name.endswith(FOLD_SUFFIX):
            self.index.apply(decode_journal(raw), name)
            return
        header, batches = read_fold(raw)
        covers = header.covers
        pending = self.index.pending()
        applied = self.index.seen(covers) - pending.keys()
        if len(applied) < len(covers):  # else all read here already
            if (header.dels_after > self.index.replayed_at() and not self._from_scratch
                    and not self.index.is_empty()):
                # The fold left out deletions this node may not have read: an
                # entry it knows could be one of them.
                raise _ReplayFromScratch(f"{name} leaves out deletions older than "
                                         "this node's last replay")
            for records, lines in batches:
                self.index.apply(records, raws=lines)
            if header.shards:
                self.generation += 1
                self.index.apply([], name, covers, shards=header.shard_sizes)
                return
        self.index.apply([], name, covers)

    # -- sharded folds: read by directory ----------------------------------------
    async def ensure_dir(self, prefix: str) -> None:
        """Read the shard of each pending sharded fold that holds the records
        of the keys in directory ``prefix`` (none if read already). One that
        cannot be read is logged: the listing shows what is known."""
        await self._read_shards(lambda shards: [shard_of(prefix, shards)], strict=False)

    async def ensure_complete(self) -> None:
        """Read every shard not read yet: for what needs the whole index
        (compaction, collection, a fold, the rename of a directory).
        LakeError if one cannot be read: nothing may be decided without it."""
        await self._read_shards(lambda shards: list(range(shards)), strict=True)

    def _todo(self, wanted: Callable[[int], list[int]]) -> list[tuple[str, int, int, int]]:
        """(fold, shard, shards, size) of the wanted shards not read yet."""
        return [(fold, shard, len(state["sizes"]), state["sizes"][shard])
                for fold, state in self.index.pending().items()
                for shard in sorted(set(wanted(len(state["sizes"]))))
                if shard not in state["done"]]

    async def _read_shards(self, wanted: Callable[[int], list[int]], strict: bool) -> None:
        if not self._todo(wanted):  # (the common case: no lock, no task switch)
            return
        async with self._shards_lock:
            for _ in range(3):
                todo = self._todo(wanted)
                if not todo:
                    return
                missing, unreadable = await self._fetch_shards(todo)
                if unreadable:
                    break
                if missing:
                    # Folded again by another node since: its fold holds them all.
                    await self.refresh(fresh=True)
            left = self._todo(wanted)
            if not left:
                return
            fold, shard = left[0][:2]
            message = (f"{len(left)} shard(s) of the pack index could not be read "
                       f"({shard_key(fold, shard)}, ...): the packed files they hold "
                       "stay hidden")
            if strict:
                raise LakeError(message + "; nothing is compacted, collected or folded")
            if (fold, shard) not in self._warned:
                self._warned.add((fold, shard))
                log.error("%s", message)

    async def _shards_for_moves(self, name: str, raw: bytes) -> bool:
        """Before a journal with compaction's ``move`` records is applied, read
        the shards of the moved keys' directories: a move applies only where
        the file still is, so the file's own record must be known first.
        False if one is gone (a newer fold covers its fold: list again)."""
        if b'"move"' not in raw or name.endswith(FOLD_SUFFIX) or not self.index.pending():
            return True
        try:
            directories = {directory_of(record["key"]) for record in decode_journal(raw)
                           if isinstance(record, dict) and record.get("op") == "move"}
        except (ValueError, KeyError, TypeError):
            return True  # unreadable: reported when it is applied
        missing, _ = await self._fetch_shards(
            self._todo(lambda shards: [shard_of(d, shards) for d in directories]))
        return not missing  # (an unreadable one: those files stay hidden anyway)

    async def _fetch_shards(self, todo: list[tuple[str, int, int, int]]
                            ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Fetch and apply these shards, a few at a time; return those gone
        from the lake and those that could not be read."""
        missing: list[tuple[str, int]] = []
        unreadable: list[tuple[str, int]] = []
        slots = trio.Semaphore(JOURNALS_AT_ONCE)

        async def one(fold: str, shard: int, shards: int, size: int) -> None:
            async with slots:
                try:
                    raw = await self.store.get_range(shard_key(fold, shard), 0, size)
                except ObjectNotFound:
                    missing.append((fold, shard))
                    return
            if not await trio.to_thread.run_sync(self._apply_shard, fold, shard, shards, raw):
                unreadable.append((fold, shard))

        async with trio.open_nursery() as nursery:
            for item in todo:
                nursery.start_soon(one, *item)
        return missing, unreadable

    def _apply_shard(self, fold: str, shard: int, shards: int, raw: bytes) -> bool:
        """Apply a shard; False if it cannot be read (its fold is then never
        folded by this node, so never deleted: its records are not lost)."""
        records: list = []
        lines: list[bytes] = []
        try:
            for batch, batch_lines in read_shard(raw, shard, shards):
                records += batch
                lines += batch_lines
        except ValueError as exc:
            log.error("shard %d of %s is unreadable (%s)", shard, fold, exc)
            self.index.unreadable(fold)
            return False
        if self.index.apply_shard(records, lines, fold, shard):
            self.stats.shards_read += 1
        return True

    async def _apply_batch(self, names: list[str], sizes: dict[str, int]) -> bool:
        """Fetch and apply, a few at a time (a new node may find thousands of
        journals); True if one vanished before it was read."""
        vanished = False
        for start in range(0, len(names), 4 * JOURNALS_AT_ONCE):
            chunk = names[start:start + 4 * JOURNALS_AT_ONCE]
            contents = await self._fetch(chunk, sizes)
            vanished |= len(contents) < len(chunk)
            for name in chunk:  # in name (time) order, though any order gives the same
                if name not in contents:
                    continue
                if not await self._shards_for_moves(name, contents[name]):
                    vanished = True  # a fold it needs was folded again: list again
                    continue
                try:
                    await trio.to_thread.run_sync(self._apply_one, name, contents.pop(name))
                except ValueError as exc:
                    log.error("journal %s is unreadable (%s); its packed files stay hidden",
                              name, exc)
                    await trio.to_thread.run_sync(self.index.unreadable, name)
                    continue
                self.stats.journals_read += 1
        log.debug("replayed %d journals", len(names))
        return vanished

    async def _fetch(self, names: list[str], sizes: dict[str, int]) -> dict[str, bytes]:
        contents: dict[str, bytes] = {}
        slots = trio.Semaphore(JOURNALS_AT_ONCE)

        async def fetch(name: str) -> None:
            async with slots:
                try:
                    contents[name] = await self.store.get_range(name, 0, sizes[name])
                except ObjectNotFound:
                    pass  # folded or collected meanwhile

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(fetch, name)
        return contents
