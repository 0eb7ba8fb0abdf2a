"""Blocks of lake objects kept on the local disk.

A block is identified by the object's key *and ETag* plus its index, so a
changed object can never be answered from blocks of its old version: the old
blocks simply stop being asked for and age out. Each block is one file,
written to a temporary name and renamed, so a crash never leaves a torn
block. Capacity is accounted in memory (rebuilt by a scan at start, oldest
access first) and enforced by LRU eviction.

All methods are blocking disk I/O: call them from a worker thread.
"""

from __future__ import annotations

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

from aifs.policy import POLICY_XATTR

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectVersion:
    """One version of a lake object: what cached blocks belong to."""

    key: str
    etag: str
    size: int
    #: the file's policy when its blocks were cached (for figures per policy)
    policy: str = field(default="default", compare=False)

    @functools.cached_property
    def ident(self) -> str:
        return xxhash.xxh3_128_hexdigest(f"{self.key}\0{self.etag}".encode(
            "utf-8", "surrogateescape"))


class BlockCache:
    def __init__(self, directory: Path, capacity: int,
                 others: Callable[[], int] = lambda: 0) -> None:
        self.root = directory / "blocks"
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.others = others  # bytes of the same capacity used outside blocks
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # relative path -> bytes
        self._per_object: dict[str, int] = {}  # ident -> bytes cached
        self._policy: dict[str, str] = {}  # ident -> policy of its blocks
        self.by_policy: Counter[str] = Counter()  # bytes cached per policy
        self.used = 0
        self.evictions = 0
        self._scan()

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for shard in os.scandir(self.root):
            if not shard.is_dir():
                continue
            for obj in os.scandir(shard.path):
                try:
                    self._policy[obj.name] = os.getxattr(obj.path, POLICY_XATTR).decode()
                except OSError:
                    pass
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
            log.info("block cache: %d blocks, %.1f MiB kept from before", len(found),
                     self.used / 2**20)

    def _account(self, rel: str, size: int, reserved: bool = False) -> None:
        self._lru[rel] = size
        ident = rel.split("/")[1]
        self._per_object[ident] = self._per_object.get(ident, 0) + size
        self.by_policy[self._policy.get(ident, "default")] += size
        if not reserved:
            self.used += size

    @staticmethod
    def _rel(version: ObjectVersion, index: int) -> str:
        ident = version.ident
        return f"{ident[:2]}/{ident}/{index}"

    def locate(self, version: ObjectVersion, index: int) -> Path | None:
        """The block's file if it is cached (counts as a use); cheap, no I/O."""
        rel = self._rel(version, index)
        with self._lock:
            if rel not in self._lru:
                return None
            self._lru.move_to_end(rel)
        return self.root / rel

    def store(self, version: ObjectVersion, index: int, data: bytes) -> None:
        rel = self._rel(version, index)
        path = self.root / rel
        with self._lock:
            if rel in self._lru:
                return
        self._reserve(len(data))
        tmp = path.parent / f"tmp-{uuid.uuid4().hex}"
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                self._label(path.parent, version)
            with open(tmp, "wb") as fp:
                fp.write(data)
            os.rename(tmp, path)
        except OSError as exc:
            # A full or failing cache disk costs speed, not correctness.
            log.warning("cannot cache block %s: %s", rel, exc.strerror)
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used -= len(data)
            return
        with self._lock:
            if rel in self._lru:  # stored twice at once: the space was reserved twice
                self.used -= len(data)
            else:
                self._account(rel, len(data), reserved=True)

    def _label(self, directory: Path, version: ObjectVersion) -> None:
        """Remember the policy of an object's blocks, across restarts too."""
        with self._lock:
            self._policy[version.ident] = version.policy
        if version.policy != "default":
            try:
                os.setxattr(directory, POLICY_XATTR, version.policy.encode())
            except OSError:
                pass  # no user xattrs on the cache disk: counted as default after a restart

    def _reserve(self, incoming: int) -> None:
        """Evict until ``incoming`` bytes fit, and count them as used at once, so
        that blocks stored by several threads together cannot overshoot."""
        while True:
            with self._lock:
                if self.used + incoming + self.others() <= self.capacity or not self._lru:
                    self.used += incoming
                    return
                rel, _ = next(iter(self._lru.items()))
            self._forget(rel)
            self.evictions += 1

    def evict(self, wanted: int) -> int:
        """Drop least recently used blocks until ``wanted`` bytes are freed."""
        freed = 0
        while freed < wanted:
            with self._lock:
                if not self._lru:
                    break
                rel, size = next(iter(self._lru.items()))
            self._forget(rel)
            self.evictions += 1
            freed += size
        return freed

    def _forget(self, rel: str) -> None:
        with self._lock:
            size = self._lru.pop(rel, None)
            if size is None:
                return
            ident = rel.split("/")[1]
            self.used -= size
            self.by_policy[self._policy.get(ident, "default")] -= size
            left = self._per_object.get(ident, 0) - size
            if left > 0:
                self._per_object[ident] = left
            else:
                self._per_object.pop(ident, None)
                self._policy.pop(ident, None)
        try:
            os.unlink(self.root / rel)
            os.rmdir((self.root / rel).parent)
        except OSError:
            pass

    def cached_bytes(self, version: ObjectVersion) -> int:
        with self._lock:
            return self._per_object.get(version.ident, 0)
