"""POSIX attributes of listed objects, read from their metadata (one HEAD
each, once), ahead of the lookups that need them.

LIST gives a key's size, ETag and mtime, not its mode, owner, times, symlink
target or xattrs: those live in the object's user metadata (s3fs's names,
:mod:`aifs.meta.objattrs`). A walk of a directory another tool wrote would
then wait for one HEAD per ``lstat``, one after the other, since the kernel
looks names up one at a time. So a lookup that needs the attributes of one
entry starts reading those of the entries after it in the listing (the order
a walk, ``ls -l`` or a sorted reader goes in), many at once, and waits only
for its own; the lookups that follow find theirs read or in flight. One
HEAD per key at a time: a lookup of an entry in flight joins it.
"""

from __future__ import annotations

import logging

import trio

from aifs.config import Config
from aifs.errors import LakeError, ObjectNotFound
from aifs.lake.base import ObjectStore
from aifs.meta.objattrs import apply_metadata
from aifs.meta.store import DIR, FILE, Inode, Listed, MetaStore
from aifs.pack.index import Record

log = logging.getLogger(__name__)

#: seconds the lake's clock may run ahead of a node's: an object listed as
#: modified later than its record (by more) was changed since by another tool
CLOCK_SLACK = 2.0
HEADS_AT_ONCE = 32  # attribute reads in flight, per mount
AHEAD = 256  # entries after a looked-up one whose attributes are read ahead
PATH_MAX = 4096  # the longest symlink target (so the largest symlink object)


class ObjectAttributes:
    def __init__(self, meta: MetaStore, store: ObjectStore, config: Config) -> None:
        self.meta = meta
        self.store = store
        self.config = config
        self._limiter = trio.CapacityLimiter(HEADS_AT_ONCE)
        self._in_flight: dict[int, trio.Event] = {}
        self._frontier: dict[int, int] = {}  # directory -> last cookie read ahead
        self._nursery: trio.Nursery | None = None
        self.read_ahead = 0  # attribute reads started ahead of a lookup (stats)

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def unknown(self, inode: Inode, asked: bool = False) -> bool:
        """Whether ``inode``'s attributes are still to be read from the lake:
        with ``object_attrs`` on, those of every object no record described;
        with it off, only a hard link's (its names are joined) and what is
        ``asked`` for (xattrs)."""
        return (not inode.attrs_known and not inode.pending and not inode.orphan
                and bool(inode.key)
                and (self.config.object_attrs or bool(inode.link_id) or asked))

    @staticmethod
    def from_record(plain: Listed, record: Record) -> Listed | None:
        """``plain`` (a listed object) with the attributes the record aifs
        wrote when it put the object gives, if the record describes this
        version of it (same ETag, not modified since); None if it does not.

        A hard link's names are joined by a lookup that reads its metadata
        (rare: the record says so and the lookup does the rest)."""
        if plain.fields or plain.kind not in (FILE, DIR) \
                or (plain.kind == DIR) != record["key"].endswith("/"):
            return None
        if plain.kind == FILE and (record.get("etag") != plain.etag
                                   or plain.mtime > record["t"] / 1e9 + CLOCK_SLACK):
            return None  # (a directory's marker is not listed with its parent)
        scratch = Inode(0, plain.kind, plain.key, 0, mtime_ns=int(plain.mtime * 1e9))
        apply_metadata(scratch, record.get("meta") or {})
        fields: dict[str, object] = {
            "mode": scratch.mode, "uid": scratch.uid, "gid": scratch.gid,
            "mtime_ns": scratch.mtime_ns, "atime_ns": scratch.atime_ns, "rdev": scratch.rdev,
            "xattrs": scratch.xattrs, "attrs_known": not scratch.link_id}
        if scratch.link_id:
            fields.update(link_id=scratch.link_id, nlink_hint=scratch.nlink_hint)
        return Listed(plain.name, scratch.kind, plain.key, plain.size, plain.etag,
                      scratch.mtime_ns / 1e9, fields)

    def type_unknown(self, inode: Inode) -> bool:
        """Whether a listed object may be other than a regular file (symlinks,
        FIFOs, sockets and devices are small objects: at most PATH_MAX bytes)."""
        return (inode.kind == FILE and self.unknown(inode) and not inode.packed
                and inode.in_lake and inode.size <= PATH_MAX)

    async def of_entry(self, parent: int, name: bytes, child: Inode) -> Inode:
        """``child`` (entry ``name`` of ``parent``) with its attributes read,
        those of the entries after it started too."""
        if not self.unknown(child):
            return child
        self._read_ahead(parent, name)
        await self.load(child, may_change_kind=True)
        return self.meta.lookup(parent, name) or child  # renumbered if a symlink

    async def load(self, inode: Inode, may_change_kind: bool, ahead: bool = False,
                   asked: bool = False) -> Inode:
        """``inode`` with its attributes read (joining a read in flight).
        ``ahead``: for no lookup yet, so what only a lookup may do (give a
        symlink its own number, join a hard link's names) is left to it.
        ``asked``: read even with ``object_attrs`` off (its xattrs are wanted)."""
        if not self.unknown(inode, asked):
            return inode
        flight = self._in_flight.get(inode.ino)
        if flight is not None:
            await flight.wait()
            current = self.meta.get(inode.ino)
            if current is None or not self.unknown(current, asked):
                return current or inode
            inode = current  # that read failed: this one tries again, and says why
        ino = inode.ino  # a symlink found gets a new number (reincarnate)
        done = self._in_flight[ino] = trio.Event()
        try:
            async with self._limiter:
                return await self._read(inode, may_change_kind, ahead)
        finally:
            del self._in_flight[ino]
            done.set()

    async def _read(self, inode: Inode, may_change_kind: bool, ahead: bool) -> Inode:
        key, etag = inode.key, inode.etag
        try:
            info = await self.store.head(key)
        except ObjectNotFound:
            info = None  # an implicit directory, or an object gone meanwhile
        # The answer goes onto the record as it is now, not the one read before
        # the HEAD: a rename or chmod made (and promoted) meanwhile stays.
        current = self.meta.get(inode.ino)
        if (current is None or current.pending or current.etag != etag
                or current.key != key or current.attrs_known):
            return current or inode  # changed while we asked: keep the newer state
        inode = current
        kind = inode.kind
        if info is not None:
            apply_metadata(inode, info.metadata)
        if ahead and (inode.kind != kind or inode.link_id):
            return self.meta.get(inode.ino) or inode  # the lookup renumbers or joins it
        inode.attrs_known = True
        if inode.kind != kind:
            if not may_change_kind:
                inode.kind = kind  # known to the kernel as it was; a lookup fixes it
                inode.attrs_known = False
                return inode
            return self.meta.reincarnate(inode)
        if inode.link_id and may_change_kind:  # a name of a hard-linked file
            return self.meta.join_link_group(inode)
        self.meta.put(inode)
        return inode

    def _read_ahead(self, parent: int, name: bytes) -> None:
        """Start reading the attributes of up to AHEAD entries from ``name`` on,
        unless they were started already (a walk extends its window as it
        goes; a lookup elsewhere in the directory starts a new one)."""
        if self._nursery is None:
            return
        cookie = self.meta.cookie_of(parent, name)
        if cookie is None:
            return
        frontier = self._frontier.get(parent, -1)
        if cookie > frontier:
            start = cookie - 1  # a new window, from this entry on
        elif cookie > frontier - AHEAD // 2:
            start = frontier  # near the end of the window: extend it
        else:
            return  # inside the window read ahead already
        batch = self.meta.readdir(parent, start, AHEAD)
        if not batch:
            return
        if len(self._frontier) > 10_000:
            self._frontier.clear()
        self._frontier[parent] = batch[-1][0]
        for _, _, inode in batch:
            if self.unknown(inode) and inode.ino not in self._in_flight:
                self.read_ahead += 1
                self._nursery.start_soon(self._ahead_one, inode)

    async def _ahead_one(self, inode: Inode) -> None:
        try:
            await self.load(inode, may_change_kind=False, ahead=True)
        except LakeError as exc:  # the lookup that needs it tries again, and says why
            log.debug("attributes of %s, read ahead: %s", inode.key, exc)
