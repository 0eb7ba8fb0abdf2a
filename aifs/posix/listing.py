"""Directory listings, lookups, getattr and readdir.

A directory is listed from the lake (LIST with a delimiter) merged with the
pack index, and the result kept in LMDB for ``metadata_ttl`` seconds. Past
the TTL a known entry is still answered at once while one LIST refreshes the
directory behind it (up to ``STALE_SERVED`` TTLs); an unknown name waits.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import trio

from aifs.config import Config
from aifs.errors import FsError, LakeError, ObjectNotFound
from aifs.lake.base import ObjectStore
from aifs.meta.objattrs import default_mode, type_bits
from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore, valid_name
from aifs.pack.packer import Packer, entry_fields
from aifs.posix.inodes import Inodes
from aifs.read.attrs import ObjectAttributes

log = logging.getLogger(__name__)

#: (directory, names that came or went, inodes replaced): what a refresh found
Changes = Callable[[int, list[bytes], list[int]], None]

RESERVED_PREFIX = ".aifs"
READDIR_BATCH = 1000
STALE_SERVED = 2  # known entries are answered up to this many TTLs, refreshed behind
LIST_AHEAD = 4  # directories listed ahead of walkers at once, in the background
SIBLINGS_LOOKED_AT = 8  # entries after an opened directory looked at per list_ahead
PLAIN_MODE = type_bits(FILE) | default_mode(FILE)  # a file as LIST gave it


class PlainEntries(NamedTuple):
    """Directory entries that are files as LIST gave them: the first's cookie
    and inode number (the others' follow one by one), then per entry its name,
    size and mtime (LIST's float); mode, owner and group are those of all."""

    cookie: int
    ino: int
    names: list[bytes]
    sizes: list[int]
    mtimes: list[float]
    mode: int
    uid: int
    gid: int


class Listings:
    def __init__(self, inodes: Inodes, config: Config, store: ObjectStore, meta: MetaStore,
                 packer: Packer, object_attrs: ObjectAttributes) -> None:
        self.inodes = inodes
        self.config = config
        self.store = store
        self.meta = meta
        self.packer = packer
        self.packs = packer.index
        self.object_attrs = object_attrs
        self._listing: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._warned: set[str] = set()
        self._ahead = trio.CapacityLimiter(LIST_AHEAD)
        #: told what a refresh found another writer changed: (directory, names
        #: that came or went, inodes replaced); the kernel binding drops its caches
        self.on_changes: Changes | None = None

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    # -- lookups ------------------------------------------------------------
    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        """The child, with one more kernel reference; None if there is none."""
        self.inodes.counters.lookup_requests += 1
        directory = self.inodes.directory(parent)
        if name == b".":
            child: Inode | None = directory
        elif name == b"..":
            child = self.inodes.get(directory.parent)
        else:
            if len(name) > 255:
                raise FsError(errno.ENAMETOOLONG)
            child = self.meta.lookup(parent, name)
            if child is None or not self.refresh_behind(directory):
                await self.ensure_listed(directory)
                child = self.meta.lookup(parent, name)
            if child is not None:
                child = await self.object_attrs.of_entry(parent, name, child)
                child = self.inodes.get(child.ino)
        if child is not None:
            self.inodes.remember(child.ino)
        return child

    async def getattr(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if not inode.is_dir and not inode.orphan and not inode.pending:
            parent = self.meta.get(inode.parent)
            if parent is not None and not self.refresh_behind(parent):
                await self.ensure_listed(parent)
                inode = self.inodes.get(ino)
        if not inode.attrs_known and not inode.orphan:
            await self.object_attrs.load(inode, may_change_kind=False)
            inode = self.inodes.get(ino)
        return inode

    async def child(self, parent: int, name: bytes) -> Inode:
        """An existing child of a listed directory."""
        await self.ensure_listed(self.inodes.directory(parent))
        child = self.meta.lookup(parent, name)
        if child is None:
            raise FsError(errno.ENOENT)
        return child

    # -- directories ----------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        directory = self.inodes.directory(ino)
        self._list_ahead(directory)
        await self.ensure_listed(directory)
        fh = next(self.inodes.handles)
        self.inodes.dirs[fh] = ino
        return fh

    def _list_ahead(self, directory: Inode) -> None:
        """A walker (``find``, ``du``, ``os.walk``, a DataLoader indexing its
        dataset) opens one subdirectory after another, in readdir order: when
        it opens one, the next ``list_ahead`` subdirectories after it in its
        parent (cookie order, the order readdir gives; among the next
        SIBLINGS_LOOKED_AT entries) are listed in the background (LIST_AHEAD at
        a time), so that it finds them listed while it reads this one."""
        wanted = self.config.list_ahead
        if not wanted or directory.ino == ROOT_INO or self._nursery is None \
                or not self.config.metadata_ttl:
            return  # (with no TTL a listing is never kept: the reader lists again)
        name = directory.key[:-1].rpartition("/")[2].encode("utf-8", "surrogateescape")
        cookie = self.meta.cookie_of(directory.parent, name)
        if cookie is None:  # (a name that is not its key's)
            return
        for _, _, child in self.meta.readdir(directory.parent, cookie,
                                             SIBLINGS_LOOKED_AT * wanted):
            if child.is_dir:
                if not self.fresh(child) and child.ino not in self._listing:
                    self._nursery.start_soon(self._ahead_of_reader, child.ino)
                wanted -= 1
                if not wanted:
                    break

    async def _ahead_of_reader(self, ino: int) -> None:
        async with self._ahead:
            directory = self.meta.get(ino)  # the reader may have listed it meanwhile
            if directory is None or self.fresh(directory) or ino in self._listing:
                return
            await self._refresh(directory)

    async def readdir(self, fh: int, after_cookie: int,
                      limit: int = READDIR_BATCH) -> list[tuple[int, bytes, Inode]]:
        """The next (cookie, name, inode) after ``after_cookie``: ``.`` and
        ``..`` first (cookies 1 and 2), then up to ``limit`` entries, whose
        stored cookies are shifted by 2.

        readdir reports each entry's type (d_type): an object LIST showed
        that may be a symlink, FIFO, socket or device (their objects are
        small: at most PATH_MAX bytes) has its attributes read first, those
        of one batch in parallel. Larger objects are regular files."""
        ino = self.inodes.dirs.get(fh)
        if ino is None:
            raise FsError(errno.EBADF)
        batch = self.meta.readdir(ino, max(0, after_cookie - 2), limit)
        for _ in range(3):  # entries that move up into the batch are looked at too
            unknown = [inode for _, _, inode in batch if self.object_attrs.type_unknown(inode)]
            if not unknown:
                break

            async def load(inode: Inode) -> None:
                try:
                    await self.object_attrs.load(inode, may_change_kind=True)
                except LakeError as exc:  # listed as a file; a lookup tries again
                    log.warning("attributes of %s: %s", inode.key, exc)

            async with trio.open_nursery() as nursery:
                for inode in unknown:
                    nursery.start_soon(load, inode)
            # A symlink found gets a new inode number (and cookie: it comes later)
            batch = self.meta.readdir(ino, max(0, after_cookie - 2), limit)
        with_written = self.inodes.with_written
        out: list[tuple[int, bytes, Inode]] = []
        if after_cookie < 2:
            directory = self.inodes.get(ino)
            if after_cookie < 1:
                out.append((1, b".", directory))
            parent = directory if ino == ROOT_INO else self.meta.get(directory.parent)
            out.append((2, b"..", with_written(parent or directory)))
        out += [(cookie + 2, name, with_written(inode)) for cookie, name, inode in batch]
        return out

    def plain_entries(self, fh: int, after_cookie: int) -> PlainEntries | None:
        """The entries after ``after_cookie`` that are files of the directory's
        first listing as LIST gave them (a batch: no inode of their own yet,
        the default mode and owner), up to the first that is open or being
        written; None where the next entry is no such file (then ``readdir``).
        What ``readdir`` would give for them, without an inode each."""
        ino = self.inodes.dirs.get(fh)
        if ino is None:
            raise FsError(errno.EBADF)
        if after_cookie < 2 or self.config.object_attrs:  # (. and ..; a HEAD each first)
            return None
        found = self.meta.batch_after(ino, after_cookie - 2)
        if found is None:
            return None
        batch, start = found
        end = min(len(batch), start + READDIR_BATCH)
        first, opens, written = batch.first_ino, self.inodes.opens, self.inodes.written
        end = next((i for i in range(start, end)
                    if first + i in opens or first + i in written), end)
        if end == start:
            return None
        return PlainEntries(batch.first_cookie + start + 2, first + start,
                            batch.names[start:end], batch.sizes[start:end],
                            batch.mtimes[start:end], PLAIN_MODE, self.inodes.uid,
                            self.inodes.gid)

    def releasedir(self, fh: int) -> None:
        self.inodes.dirs.pop(fh, None)

    # -- listings -------------------------------------------------------------
    def fresh(self, directory: Inode) -> bool:
        return self.inodes.clock() - directory.listed_at < self.config.metadata_ttl

    def refresh_behind(self, directory: Inode) -> bool:
        """Whether an entry already known in ``directory`` may be answered now,
        the listing past its TTL refreshed in the background meanwhile: while
        it is younger than twice the TTL (stale-while-revalidate, so a ``stat``
        after the TTL does not wait for a LIST). True if the listing is fresh."""
        age = self.inodes.clock() - directory.listed_at
        ttl = self.config.metadata_ttl
        if age < ttl:
            return True
        if age >= STALE_SERVED * ttl or self._nursery is None:
            return False
        if directory.ino not in self._listing:
            self._nursery.start_soon(self._refresh, directory)
        return True

    async def _refresh(self, directory: Inode) -> None:
        try:
            await self.ensure_listed(directory)
        except (LakeError, FsError) as exc:  # the next lookup past the window lists again
            log.debug("background listing of %r: %s", directory.key, exc)

    async def ensure_listed(self, directory: Inode) -> Inode:
        """Refresh ``directory`` from LIST if its listing is older than the TTL.

        A listing that started after this call did is fresh enough for it,
        whatever the TTL (with ``metadata_ttl`` 0 every call lists once)."""
        called = self.inodes.clock()
        retried = False
        while not self.fresh(directory):
            pending = self._listing.get(directory.ino)
            if pending is not None:
                await pending.wait()
            else:
                done = self._listing[directory.ino] = trio.Event()
                try:
                    await self._list(directory)
                finally:
                    del self._listing[directory.ino]
                    done.set()
            refreshed = self.meta.get(directory.ino)
            if refreshed is None:
                raise FsError(errno.ENOENT)
            if refreshed.listed_at == directory.listed_at:
                if not (directory.listed_at or retried
                        or self.meta.readdir(directory.ino, 0, 1)):
                    retried = True
                    continue  # failed for another caller, and nothing known: try it here
                return refreshed  # the listing failed for another waiter: serve what we have
            directory = refreshed
            if directory.listed_at >= called:
                break
        return directory

    async def _list(self, directory: Inode) -> None:
        self.inodes.save_dir_times()  # a listing keeps what changed here since it started
        prefix = directory.key
        started = self.inodes.clock()
        entries: dict[str, Listed] = {}
        # The pack index is brought up to date (a journal LIST and GETs, a
        # shard of a sharded fold) while the directory is listed, not after.
        failed: list[Exception] = []
        async with trio.open_nursery() as nursery:

            async def part(work: Callable[..., Awaitable[None]], *args: object) -> None:
                try:
                    await work(*args)
                except Exception as exc:  # raised below as itself, not in a group
                    failed.append(exc)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(part, self._packs_ready, prefix)
            nursery.start_soon(part, self._list_pages, directory, prefix, started, entries)
        if failed:
            raise failed[0]
        await self._unlisted_objects(directory, entries, started)
        await trio.to_thread.run_sync(self._merge_packed, directory, entries, started)
        # A file listed before the directory of the same name loses too.
        names: list[bytes] | None = [] if self.on_changes and directory.listed_at else None
        removed, replaced = await trio.to_thread.run_sync(
            self.meta.apply_listing, directory.ino, list(entries.values()), started, started,
            names)
        if self.on_changes is not None and (names or replaced):  # a refresh found changes
            self.on_changes(directory.ino, names or [], replaced)
        for ino in removed:
            self.inodes.free_if_unused(ino)
        local = self.inodes.local
        for ino in replaced:  # another writer's version: our clean copy is stale
            if local.has(ino):
                if self.inodes.is_open(ino):
                    self.inodes.stale_local.add(ino)
                else:
                    local.remove(ino)
        self.inodes.subdir_counts.pop(directory.ino, None)
        log.debug("listed %r: %d entries, %d removed", prefix, len(entries), len(removed))

    async def _list_pages(self, directory: Inode, prefix: str, started: float,
                          entries: dict[str, Listed]) -> None:
        """The directory's LIST, into ``entries``."""
        async for page in self.store.iter_list(prefix, "/"):
            for sub in page.prefixes:
                name = sub[len(prefix):-1]
                if self._acceptable(directory, name, sub):
                    entries[name] = Listed(name, DIR, sub, 0, "", started)
            for obj in page.objects:
                if obj.key == prefix:
                    continue  # this directory's own marker object
                name = obj.key[len(prefix):]
                if not self._acceptable(directory, name, obj.key):
                    continue
                if name in entries:
                    self._warn_once(obj.key, "a directory of the same name exists; "
                                    "the object is hidden")
                    continue
                entries[name] = Listed(name, FILE, obj.key, obj.size, obj.etag, obj.mtime)

    async def _unlisted_objects(self, directory: Inode, entries: dict[str, Listed],
                                started: float) -> None:
        """The children no LIST finds: objects the lake holds under another
        key, theirs being longer than it takes (:mod:`aifs.lake.longkeys`).
        The records aifs published when it put them name them; a HEAD each
        says whether they are still there."""
        prefix = directory.key
        if self.store.listed(prefix + "n" * 256 + "/"):
            return  # no child's key can be that long (a directory's key with a name)
        wanted = {name: record for name, record in self.packs.objects(prefix).items()
                  if not self.store.listed(record["key"]) and name.rstrip("/") not in entries
                  and self._acceptable(directory, name.rstrip("/"), record["key"])}
        limiter = trio.CapacityLimiter(16)
        files: dict[str, Listed] = {}
        dirs: dict[str, Listed] = {}
        failed: list[LakeError] = []

        async def head(name: str, key: str) -> None:
            async with limiter:
                try:
                    info = await self.store.head(key)
                except ObjectNotFound:
                    return  # deleted since
                except LakeError as exc:  # raised below as itself, not in a group
                    failed.append(exc)
                    return
            if name.endswith("/"):
                dirs[name[:-1]] = Listed(name[:-1], DIR, key, 0, "", started)
            else:
                files[name] = Listed(name, FILE, key, info.size, info.etag, info.mtime)

        async with trio.open_nursery() as nursery:
            for name, record in wanted.items():
                nursery.start_soon(head, name, record["key"])
        if failed:
            raise failed[0]
        entries.update(files)
        entries.update(dirs)  # a directory wins over a file of its name, as in a LIST

    async def _packs_ready(self, prefix: str) -> None:
        """The pack index knows the packed files of directory ``prefix``.

        A plain object of the same name wins if it is not older than the
        packed file's record (to the second); a packed copy made by ``aifs
        pack`` shows only while its original is unchanged (the original is the
        truth for other tools): see :meth:`_merge_packed`, run in a worker
        thread (a directory may hold 100,000 packed files)."""
        journals = self.packer.journals
        await journals.refresh_if_stale()
        await journals.ensure_dir(prefix)  # (a sharded fold: this directory's part)

    def _merge_packed(self, directory: Inode, entries: dict[str, Listed],
                      started: float) -> None:
        prefix = directory.key
        for name, record in self.packs.objects(prefix).items():
            name = name.rstrip("/")  # a directory's marker
            plain = entries.get(name)
            described = plain and self.object_attrs.from_record(plain, record)
            if described:
                entries[name] = described
        for name, entry in self.packs.children(prefix):
            if not self._acceptable(directory, name, prefix + name):
                continue
            plain = entries.get(name)
            if entry is None:
                if plain is None:
                    entries[name] = Listed(name, DIR, prefix + name + "/", 0, "", started)
                continue
            if entry.origin:
                if plain is None or plain.kind != FILE or plain.etag != entry.origin:
                    continue
            elif plain is not None and (plain.kind == DIR or math.floor(plain.mtime)
                                        >= math.floor(entry.stamp / 1e9)):
                continue  # the lake's times are whole seconds: a tie goes to the object
            entries[name] = Listed(name, FILE, entry.key, entry.length, entry.etag,
                                   entry.mtime_ns / 1e9, entry_fields(entry))

    def _acceptable(self, directory: Inode, name: str, key: str) -> bool:
        if directory.ino == ROOT_INO and name == RESERVED_PREFIX:
            return False
        if not valid_name(name) or "/" in name:
            self._warn_once(key, "not a valid POSIX name; skipped")
            return False
        return True

    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("lake key %r: %s", key, why)
