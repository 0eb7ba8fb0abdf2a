"""Blocks of lake objects kept on the local disk.

A block is identified by the object's key *and ETag* plus its index, so a
changed object can never be answered from blocks of its old version: the old
blocks simply stop being asked for and age out. A large block is one file,
written to a temporary name and renamed, so a crash never leaves a torn
block; small ones are appended to shared segment files (``segments.py``:
a file each cost more than their GET), checked by checksum when read.
Capacity is accounted in memory (rebuilt by a scan at start, oldest
access first).

Blocks live in one of three classes, each in its own LRU order:

- *regular* blocks (default, weights and checkpoint policies) are evicted
  first, oldest first;
- *dataset* blocks are admitted while there is room or regular blocks to
  evict, and are never evicted to admit other dataset blocks: a training
  job that reads a dataset larger than the cache in a fresh random order each
  epoch keeps a stable subset cached (hit ratio about cache ÷ dataset) where
  LRU would evict each sample just before its next use;
- *pinned* blocks (``aifs pin``) are never evicted.

An object's class and policy are kept as xattrs on its block directory, so a
remount finds the same classes (the warm cache and its admission state).

All methods are blocking disk I/O: call them from a worker thread.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from aifs import xattrs
from aifs.buffers import Body
from aifs.cache.direct import DirectWriter
from aifs.cache.segments import SMALL, Location, Segments
from aifs.policy import DATASET, POLICY_XATTR

log = logging.getLogger(__name__)

PINNED_XATTR = xattrs.CACHE_CLASS
REGULAR, DATASET_CLASS, PINNED = "regular", "dataset", "pinned"
CLASSES = (REGULAR, DATASET_CLASS, PINNED)


@dataclass(frozen=True)
class ObjectVersion:
    """One version of a lake object: what cached blocks belong to."""

    key: str
    etag: str
    size: int
    #: the file's policy when its blocks are cached (admission, figures per policy)
    policy: str = field(default="default", compare=False)
    #: kept whatever the pressure (``aifs pin``)
    pinned: bool = field(default=False, compare=False)
    #: a packed file: its bytes are [base, base + size) of the pack object
    #: ``source``, and ``etag`` is their checksum (verified on every fetch)
    source: str = field(default="", compare=False)
    base: int = field(default=0, compare=False)

    @functools.cached_property
    def ident(self) -> str:
        return xxhash.xxh3_128_hexdigest(f"{self.key}\0{self.etag}".encode(
            "utf-8", "surrogateescape"))

    @property
    def block_class(self) -> str:
        if self.pinned:
            return PINNED
        return DATASET_CLASS if self.policy == DATASET else REGULAR


class BlockCache:
    def __init__(self, directory: Path, capacity: int,
                 others: Callable[[], int] = lambda: 0) -> None:
        self.root = directory / "blocks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.others = others  # bytes of the same capacity used outside blocks
        #: free bytes on the disk (LocalFiles.disk_free, set by the core)
        self.disk_free: Callable[[], int] = lambda: 1 << 62
        self._lock = threading.Lock()
        # relative path -> bytes, per class, least recently used first
        self._lru: dict[str, OrderedDict[str, int]] = {c: OrderedDict() for c in CLASSES}
        self._class: dict[str, str] = {}  # ident -> its class
        self._policy: dict[str, str] = {}  # ident -> policy of its blocks
        self._blocks: dict[str, dict[str, int]] = {}  # ident -> its blocks (rel -> bytes)
        self.by_policy: Counter[str] = Counter()  # bytes cached per policy
        self.by_class: Counter[str] = Counter()  # bytes cached per class
        self.used = 0
        self._landing = 0  # bytes admitted whose write has not ended (not on the disk yet)
        self.evictions = 0
        self.refused = 0  # blocks not admitted (a full dataset share, or all pinned)
        self.writer = DirectWriter()  # blocks skip the page cache: they are in memory
        self.segments = Segments(directory / "segments")
        self._where: dict[str, Location] = {}  # rel -> where a segment block is
        self._scan()

    def _scan(self) -> None:
        in_segments: dict[str, tuple[float, int]] = {}
        for ident, index, where, policy, cls, order in self.segments.scan():
            rel = f"{ident[:2]}/{ident}/{index}"
            stale = self._where.get(rel)
            if stale is not None:  # in two segments (an eviction's note lost): the newer
                self.segments.punch(ident, index, stale)
            self._where[rel] = where
            self._policy[ident] = policy
            self._class[ident] = cls if cls in CLASSES else REGULAR  # the last record's
            in_segments[rel] = (order, where.size)
        found = [(order, rel, size) for rel, (order, size) in in_segments.items()]
        for shard in os.scandir(self.root):
            if not shard.is_dir():
                continue
            for obj in os.scandir(shard.path):
                for name, into, default in ((POLICY_XATTR, self._policy, "default"),
                                            (PINNED_XATTR, self._class, "")):
                    try:
                        into[obj.name] = os.getxattr(obj.path, name).decode()
                    except OSError:
                        if default:
                            into[obj.name] = default
                if not self._class.get(obj.name):
                    self._class[obj.name] = (DATASET_CLASS if self._policy[obj.name] == DATASET
                                             else REGULAR)
                for block in os.scandir(obj.path):
                    if block.name.startswith("tmp-"):
                        os.unlink(block.path)
                        continue
                    st = block.stat()
                    found.append((st.st_atime, f"{shard.name}/{obj.name}/{block.name}",
                                  st.st_size))
        for _, rel, size in sorted(found):
            self._account(rel, size)
        if found:
            log.info("block cache: %d blocks, %.1f MiB kept from before (%s)", len(found),
                     self.used / 2**20, ", ".join(f"{c} {n / 2**20:.1f} MiB"
                                                  for c, n in self.by_class.items() if n))

    def _account(self, rel: str, size: int, reserved: bool = False,
                 cls: str = REGULAR) -> None:
        ident = rel.split("/")[1]
        cls = self._class.setdefault(ident, cls)
        self._lru[cls][rel] = size
        self._blocks.setdefault(ident, {})[rel] = size
        self.by_policy[self._policy.get(ident, "default")] += size
        self.by_class[cls] += size
        if not reserved:
            self.used += size

    @staticmethod
    def _rel(version: ObjectVersion, index: int) -> str:
        ident = version.ident
        return f"{ident[:2]}/{ident}/{index}"

    def locate(self, version: ObjectVersion, index: int) -> Location | None:
        """Where the block is if it is cached (counts as a use); cheap, no I/O.
        A segment block's bytes are checked against ``checksum`` when read
        (:meth:`drop` it if they differ)."""
        rel = self._rel(version, index)
        with self._lock:
            lru = self._lru[self._class.get(version.ident, REGULAR)]
            size = lru.get(rel)
            if size is None:
                return None
            lru.move_to_end(rel)
            where = self._where.get(rel)
        return where or Location(str(self.root / rel), 0, size)

    def drop(self, version: ObjectVersion, index: int, where: Location) -> None:
        """Forget a block whose bytes read back wrong at ``where`` (a crash tore
        them), unless it was stored again elsewhere meanwhile."""
        rel = self._rel(version, index)
        with self._lock:
            if self._where.get(rel) != where:
                return
        log.warning("cached block %d of %s read back damaged: fetched again",
                    index, version.key)
        self._forget(rel)

    def store(self, version: ObjectVersion, index: int, data: Body) -> bool:
        """Cache a block; False if it was not admitted (or could not be written)."""
        rel = self._rel(version, index)
        path = self.root / rel
        with self._lock:
            if rel in self._blocks.get(version.ident, {}):
                return True
            cls = self._class.get(version.ident) or version.block_class
        if not self._reserve(len(data), cls):
            with self._lock:
                self.refused += 1
            return False
        try:
            return self._write(version, index, data, rel, path, cls)
        finally:
            with self._lock:
                self._landing -= len(data)

    def _write(self, version: ObjectVersion, index: int, data: Body, rel: str, path: Path,
               cls: str) -> bool:
        """Write an admitted block (``store``)."""
        where = tmp = None
        for attempt in (1, 2):
            try:
                if len(data) <= SMALL:
                    where = self.segments.append(version.ident, index, data, version.policy,
                                                 cls)
                else:
                    if not path.parent.is_dir():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        self._label(path.parent, version)
                    tmp = path.parent / f"tmp-{uuid.uuid4().hex}"
                    self.writer.write_file(tmp, data)
                    os.rename(tmp, path)
                break
            except OSError as exc:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
                if attempt == 1 and exc.errno == errno.ENOSPC and self.evict(len(data)):
                    continue  # a disk smaller than cache_size: older blocks make room
                # A full or failing cache disk costs speed, not correctness.
                log.warning("cannot cache block %s: %s", rel, exc.strerror)
                with self._lock:
                    self.used -= len(data)
                return False
        with self._lock:
            if rel in self._blocks.get(version.ident, {}):  # stored twice at once
                self.used -= len(data)
                stale = where
            else:
                stale = None
                if where is not None:
                    self._where[rel] = where
                self._policy.setdefault(version.ident, version.policy)
                self._account(rel, len(data), reserved=True, cls=cls)
        if stale is not None:
            self.segments.punch(version.ident, index, stale)
        return True

    def _label(self, directory: Path, version: ObjectVersion) -> None:
        """Remember the policy and class of an object's blocks across restarts."""
        try:
            if version.policy != "default":
                os.setxattr(directory, POLICY_XATTR, version.policy.encode())
            if version.pinned:
                os.setxattr(directory, PINNED_XATTR, PINNED.encode())
        except OSError:
            pass  # no user xattrs on the cache disk: default and unpinned after a restart

    def reclass(self, version: ObjectVersion) -> None:
        """Move the cached blocks of ``version`` to the class its policy and pin
        say now (after ``aifs pin``/``unpin`` or a policy change)."""
        ident, cls = version.ident, version.block_class
        with self._lock:
            old = self._class.get(ident)
            if old is None or old == cls:
                return
            self._class[ident] = cls
            for rel, size in self._blocks.get(ident, {}).items():
                self._lru[old].pop(rel, None)
                self._lru[cls][rel] = size
                self.by_class[old] -= size
                self.by_class[cls] += size
            where = [self._where[rel] for rel in self._blocks.get(ident, {})
                     if rel in self._where]
        if where:
            self.segments.reclass(ident, cls, where)
        directory = self.root / ident[:2] / ident
        if not directory.is_dir():
            return
        try:
            if cls == PINNED:
                os.setxattr(directory, PINNED_XATTR, PINNED.encode())
            else:
                os.removexattr(directory, PINNED_XATTR)
        except OSError:
            pass

    def _victim(self, cls: str) -> str | None:
        """The block to evict to admit one of class ``cls``: regular blocks
        first; dataset blocks only for others; pinned ones never."""
        order = (REGULAR,) if cls == DATASET_CLASS else (REGULAR, DATASET_CLASS)
        for victim_class in order:
            if self._lru[victim_class]:
                return next(iter(self._lru[victim_class]))
        return None

    def _reserve(self, incoming: int, cls: str) -> bool:
        """Evict until ``incoming`` bytes fit and count them as used at once (so
        blocks stored by several threads together cannot overshoot); False if
        they cannot fit without evicting what ``cls`` may not evict."""
        while True:
            short = incoming + self._landing - self.disk_free()
            with self._lock:
                # (the disk may be smaller than the capacity: both must hold it)
                if self.used + incoming + self.others() <= self.capacity and (
                        short <= 0 or not self._lru[REGULAR] and not self._lru[DATASET_CLASS]):
                    self.used += incoming
                    self._landing += incoming
                    return True
                rel = self._victim(cls)
                if rel is None:
                    if cls == REGULAR and not self.used:
                        self.used += incoming  # the rest is held outside blocks
                        return True
                    return False
            self._forget(rel)
            self.evictions += 1

    def evict(self, wanted: int) -> int:
        """Drop blocks until ``wanted`` bytes are freed: regular ones (least
        recently used first), then dataset ones; never pinned ones."""
        freed = 0
        while freed < wanted:
            with self._lock:
                rel = self._victim(REGULAR)
                if rel is None:
                    break
                size = self._blocks[rel.split("/")[1]][rel]
            self._forget(rel)
            self.evictions += 1
            freed += size
        return freed

    def _forget(self, rel: str) -> None:
        ident = rel.split("/")[1]
        with self._lock:
            blocks = self._blocks.get(ident, {})
            size = blocks.pop(rel, None)
            if size is None:
                return
            cls = self._class.get(ident, REGULAR)
            self._lru[cls].pop(rel, None)
            self.used -= size
            self.by_policy[self._policy.get(ident, "default")] -= size
            self.by_class[cls] -= size
            if not blocks:
                del self._blocks[ident]
                self._policy.pop(ident, None)
                self._class.pop(ident, None)
            where = self._where.pop(rel, None)
        if where is not None:
            self.segments.punch(ident, int(rel.rsplit("/", 1)[1]), where)
            return
        try:
            os.unlink(self.root / rel)
            os.rmdir((self.root / rel).parent)
        except OSError:
            pass

    def forget(self, version: ObjectVersion) -> list[str]:
        """Drop every block of ``version`` (a local copy holds its bytes now);
        the paths of the block files that were (:meth:`locate`'s)."""
        with self._lock:
            rels = list(self._blocks.get(version.ident, {}))
            files = [str(self.root / rel) for rel in rels if rel not in self._where]
        for rel in rels:
            self._forget(rel)
        return files

    def close(self) -> None:
        self.segments.close()

    def cached_bytes(self, version: ObjectVersion) -> int:
        with self._lock:
            return sum(self._blocks.get(version.ident, {}).values())
