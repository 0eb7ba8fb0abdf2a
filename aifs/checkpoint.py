"""Checkpoint awareness: which policy a file has, when a commit marker or a
staging file may go to the lake, and which checkpoints stay on the local tier.

The publication rule: a commit marker (``.metadata``, ``latest``, ...; see
:mod:`aifs.policy`) is promoted only when no file under the marker's
directory that became pending before the marker was last closed is still
pending (files still open for writing, and files under staging names, are
not waited for). Any file counts, whatever its policy: a framework's data
files need not have checkpoint-like names (torchsnapshot, Orbax). The order
is LMDB's pending sequence (:meth:`MetaStore.pending_order`), so the rule
holds across a crash and a remount: whoever trusts the marker in the lake
finds every shard written before it there, complete. The files a marker
waits for are promoted at once, whatever their delay.

NeMo's inverse marker works the other way round: ``X-unfinished`` exists while
checkpoint ``X`` is being written. It is promoted at once, the files of ``X``
wait until it is in the lake, and its deletion from the lake waits until
every file of ``X`` is there. (If it is created and deleted before it could
reach the lake, ``X`` is published without it.)

Files under a staging name (``tmp-checkpoint-N/``, ``x.tmp``) wait up to
``staging_hold`` seconds for the rename that commits them, so they reach the
lake once, under their final name, with no copy in the lake.
"""

from __future__ import annotations

import base64
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from aifs.cache.files import EVICT_FIRST, EVICT_LAST, LocalFiles
from aifs.config import Config
from aifs.meta.store import DATA, ROOT_INO, Inode, MetaStore
from aifs.policy import CHECKPOINT, POLICIES, POLICY_XATTR, Policies

log = logging.getLogger(__name__)
T = TypeVar("T")
_UNKNOWN = object()

#: Markers up to this size are kept, version by version, so that while saves
#: come faster than the lake takes them, the lake's marker still advances to
#: each checkpoint that is complete there (``latest`` rewritten every save).
MAX_MARKER_VERSION = 64 << 10
UNFINISHED_SUFFIX = "-unfinished"


def path_of(inode: Inode) -> str:
    """The inode's path relative to the mount root (its key without the '/')."""
    return inode.key.rstrip("/")


def _parent_path(path: str) -> str:
    return path.rpartition("/")[0]


class Checkpoints:
    def __init__(self, config: Config, meta: MetaStore, local: LocalFiles,
                 is_writing: Callable[[int], bool],
                 hurry: Callable[[int], None] = lambda ino: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.meta = meta
        self.local = local
        self.is_writing = is_writing
        self.hurry = hurry  # promote this inode now, whatever its delay
        self.clock = clock
        self._waiting_since: dict[int, float] = {}  # marker ino -> first refusal
        self.policies: Policies = config.policies()
        self._streams_large_files = config.streams_large_files()
        self._streams_checkpoints = config.streams_checkpoints()
        self._policy_cache: dict[int, str] = {}
        self._pin_cache: dict[int, bool] = {}
        self._directory_values: dict[tuple[int, int], object] = {}  # (kind, dir) -> value
        self.generation = 0  # bumped whenever policies may have changed
        # retention: checkpoint root -> its units, oldest first -> inos cached
        self._units: dict[str, OrderedDict[str, set[int]]] = {}

    # -- policies ----------------------------------------------------------
    def policy_of(self, inode: Inode) -> str:
        """The xattr ``user.aifs.policy`` of the inode or its nearest directory
        that has one, else the first matching rule."""
        return self._inherited(inode, self._policy_cache, _own_policy,
                               lambda: self.policies.by_rules(path_of(inode)))

    def is_pinned(self, inode: Inode) -> bool:
        """Whether the inode or a directory above it is pinned (``aifs pin``)."""
        return self._inherited(inode, self._pin_cache, lambda i: True if i.pinned else None,
                               lambda: False)

    def _inherited(self, inode: Inode, cache: dict[int, T], own: Callable[[Inode], T | None],
                   otherwise: Callable[[], T]) -> T:
        """The value set on ``inode`` or its nearest directory (``own``), else
        ``otherwise()``; remembered per inode until :meth:`forget_policies`."""
        cached = cache.get(inode.ino)
        if cached is not None:
            return cached
        value = own(inode)
        if value is None and inode.ino != ROOT_INO:
            value = self._from_directories(inode.parent, id(cache), own)
        if value is None:
            value = otherwise()
        if len(cache) > 100_000:
            cache.clear()
        cache[inode.ino] = value
        return value

    def _from_directories(self, ino: int, kind: int,
                          own: Callable[[Inode], T | None]) -> T | None:
        """The value set on directory ``ino`` or the nearest one above it (None:
        none is); every directory walked is remembered, so the files of one
        directory cost one walk, not one each."""
        walked: list[int] = []
        value: T | None = None
        current: int | None = ino
        for _ in range(4096):
            if current is None:
                break
            hit = self._directory_values.get((kind, current), _UNKNOWN)
            if hit is not _UNKNOWN:
                value = hit  # type: ignore[assignment]
                break
            walked.append(current)
            inode = self.meta.get(current)
            value = own(inode) if inode is not None else None
            if value is not None or inode is None or current == ROOT_INO:
                break
            current = inode.parent
        if len(self._directory_values) > 100_000:
            self._directory_values.clear()
        for directory in walked:
            self._directory_values[(kind, directory)] = value
        return value

    def forget_policies(self) -> None:
        """A rename, a policy xattr or a pin changed: they are looked up again."""
        self._policy_cache.clear()
        self._pin_cache.clear()
        self._directory_values.clear()
        self.generation += 1  # tells others who remember policies (the metrics)

    def is_checkpoint(self, inode: Inode) -> bool:
        return self.policy_of(inode) == CHECKPOINT

    def streams(self, inode: Inode) -> bool:
        """Whether ``inode``, written from empty, is uploaded while written: a
        checkpoint (``stream_checkpoints``) or any other file
        (``stream_large_files``), but never a file under a staging name (its
        rename would abandon the upload) nor a commit marker (it waits for
        what it commits)."""
        enabled = (self._streams_checkpoints if self.is_checkpoint(inode)
                   else self._streams_large_files)
        if not enabled:
            return False
        path = path_of(inode)
        return not self.policies.is_staging(path) and not self.policies.is_marker(path)

    def is_marker(self, inode: Inode) -> bool:
        return self.policies.is_marker(path_of(inode)) and self.is_checkpoint(inode)

    def is_shard(self, inode: Inode) -> bool:
        """Whether ``inode`` is part of a checkpoint laid out as several files:
        under a checkpoint directory (``global_step*/``, ...), a DCP ``*.distcp``
        file, or under a directory (or itself) given the checkpoint policy by
        xattr. A lone ``*.pt`` elsewhere is a file like any other (it may be a
        dataset's sample), whatever its name."""
        if not self.is_checkpoint(inode):
            return False
        path = path_of(inode)
        if self.policies.unit_of(path) != path:
            return True
        explicit = _own_policy(inode)
        if explicit is None and inode.ino != ROOT_INO:
            explicit = self._from_directories(inode.parent, id(self._policy_cache), _own_policy)
        return explicit == CHECKPOINT

    # -- publication order ------------------------------------------------------
    def wait_before_promoting(self, inode: Inode, force: bool) -> float:
        """0 if ``inode`` may go to the lake now, else seconds to wait
        (``math.inf``: a marker waiting for its checkpoint)."""
        path = path_of(inode)
        if not force and self._staging(inode):
            left = self.config.staging_hold - (self.clock() - inode.ctime)
            if left > 0:
                return min(left, 30.0)  # and look again (a rename may have come)
        if inode.is_dir:
            return 0.0
        if self._unfinished_guard(inode) is not None:
            return math.inf
        if not self.is_marker(inode):
            return 0.0
        blockers = self.blockers(inode)
        if not blockers:
            self._waiting_since.pop(inode.ino, None)
            return 0.0
        log.debug("commit marker %s waits for %d files", path, len(blockers))
        for blocker in blockers:
            self.hurry(blocker.ino)
        since = self._waiting_since.setdefault(inode.ino, self.clock())
        if self.clock() - since > 60.0:
            self._waiting_since[inode.ino] = math.inf  # warned once
            log.warning("commit marker %s still waits for %d files (%s, ...) to reach "
                        "the lake", path, len(blockers), blockers[0].key)
        return math.inf

    def _staging(self, inode: Inode) -> bool:
        path = path_of(inode)
        return self.policies.is_staging(path + "/-" if inode.is_dir else path)

    def closed(self, ino: int, stored: Inode | None = None) -> None:
        """A writer of ``ino`` closed it (flush, before close() returns): a marker
        counts as written now, so it also waits for what was written since it
        was first made dirty; its content as of now is kept as one version.
        ``stored``: the inode as just stored, if the caller has it."""
        inode = stored if stored is not None else self.meta.get(ino)
        if inode is not None and inode.pending & DATA and self.is_marker(inode):
            self.meta.renew_order(ino, self._content(inode))

    def _content(self, inode: Inode) -> bytes | None:
        if not self.local.has(inode.ino):
            return None
        try:
            with open(self.local.path(inode.ino), "rb") as fp:
                data = fp.read(MAX_MARKER_VERSION + 1)
        except OSError:
            return None
        return data if len(data) <= MAX_MARKER_VERSION else None

    def older_version(self, marker: Inode) -> tuple[int, bytes] | None:
        """The newest kept version of a waiting marker older than its current
        one whose checkpoint is all in the lake: it may be published now."""
        current = self.meta.pending_order().get(marker.ino)
        if current is None:
            return None
        for seq, content in reversed(self.meta.marker_versions(marker.ino)):
            if seq < current and not self.blockers(marker, seq):
                return seq, content
        return None

    def version_published(self, ino: int, seq: int) -> None:
        self.meta.drop_marker_versions(ino, up_to=seq)

    def blockers(self, marker: Inode, seq: int | None = None) -> list[Inode]:
        """Files under the marker's directory, closed and pending since before
        the marker (its version ``seq``; default the current one), that the
        lake does not have yet."""
        order = self.meta.pending_order()
        mine = order.get(marker.ino) if seq is None else seq
        if mine is None:
            return []
        root = _parent_path(path_of(marker))
        prefix = root + "/" if root else ""
        out = []
        for ino, seq in order.items():
            if seq >= mine or ino == marker.ino or self.is_writing(ino):
                continue
            inode = self.meta.get(ino)
            if (inode is None or inode.is_dir or not inode.pending & DATA
                    or not inode.key.startswith(prefix)):
                continue
            if self.policies.is_staging(path_of(inode)[len(prefix):]):
                continue
            out.append(inode)
        return out

    def is_unfinished_marker(self, inode: Inode) -> bool:
        return inode.key.endswith(UNFINISHED_SUFFIX) and self.is_checkpoint(inode)

    def _unfinished_guard(self, inode: Inode) -> Inode | None:
        """A pending ``X-unfinished`` beside the file or one of its directories
        ``X``: the file waits until that marker is in the lake."""
        if not self.is_checkpoint(inode) or inode.key.endswith(UNFINISHED_SUFFIX):
            return None
        node = inode
        for _ in range(4096):
            if node.ino == ROOT_INO:
                return None
            name = path_of(node).rpartition("/")[2] + UNFINISHED_SUFFIX
            guard = self.meta.lookup(node.parent, name.encode("utf-8", "surrogateescape"))
            if guard is not None and guard.pending and not guard.orphan:
                return guard
            parent = self.meta.get(node.parent)
            if parent is None:
                return None
            node = parent
        return None

    def may_delete(self, key: str) -> bool:
        """An ``X-unfinished`` marker leaves the lake only after all of ``X``."""
        if not key.endswith(UNFINISHED_SUFFIX):
            return True
        guarded = key[:-len(UNFINISHED_SUFFIX)]
        return not any(i.pending & DATA and (i.key == guarded or i.key.startswith(guarded + "/"))
                       for i in self.meta.pending_inodes())

    def committed_by_rename(self, moved: Inode) -> None:
        """A rename may commit a checkpoint (``.metadata.tmp`` -> ``.metadata``,
        ``tmp-checkpoint-N`` -> ``checkpoint-N``): markers it moved count as
        written now, after everything the rename committed. Their versions kept
        from before the rename go: they were written under another name, and
        published now they would commit less than the rename did (HF's
        ``trainer_state.json`` is written before ``rng_state.pth``)."""
        self.forget_policies()
        if not moved.is_dir:
            if moved.pending & DATA and self.is_marker(moved):
                self._renamed_marker(moved)
            return
        prefix = moved.key
        for inode in self.meta.pending_inodes():
            if (inode.key.startswith(prefix) and inode.pending & DATA
                    and self.is_marker(inode)):
                self._renamed_marker(inode)

    def _renamed_marker(self, marker: Inode) -> None:
        self.meta.drop_marker_versions(marker.ino)
        self.meta.renew_order(marker.ino, self._content(marker))

    # -- local retention ------------------------------------------------------------
    def promoted(self, inode: Inode) -> None:
        """A checkpoint file reached the lake: keep the newest ``checkpoint_keep``
        checkpoints of its directory on the local tier, let older ones go first."""
        if inode.is_dir:
            return
        if self.is_marker(inode):
            self.meta.drop_marker_versions(inode.ino)  # the current version is in
        if not self.is_checkpoint(inode):
            return
        unit = self.policies.unit_of(path_of(inode))
        if unit is None:
            return
        units = self._units.setdefault(_parent_path(unit), OrderedDict())
        keep = self.config.checkpoint_keep
        if unit in units:  # one more file of a known checkpoint: ranks stand
            units[unit].add(inode.ino)
            newest = list(units)[-keep:] if keep else []
            self.local.rank(inode.ino, EVICT_LAST if unit in newest else EVICT_FIRST)
            return
        # A new checkpoint: forget those gone from the local tier, rank again.
        for name in [n for n, inos in units.items() if not any(map(self.local.has, inos))]:
            del units[name]
        units[unit] = {inode.ino}
        names = list(units)
        for index, name in enumerate(names):
            rank = EVICT_LAST if index >= len(names) - keep else EVICT_FIRST
            for ino in units[name]:
                self.local.rank(ino, rank)

    # -- visibility ----------------------------------------------------------------
    def state(self, inode: Inode, progress: Callable[[int], int],
              current: Callable[[Inode], Inode] = lambda inode: inode) -> str:
        """``lake``, ``local``, or ``promoting DONE/TOTAL`` (bytes) for a file or
        everything under a directory (``current`` adds sizes not yet stored)."""
        if inode.is_dir:
            prefix = inode.key
            pending = [current(i) for i in self.meta.pending_inodes()
                       if i.key.startswith(prefix) and i.ino != inode.ino]
            tombs = self.meta.tombstones_under(prefix) if prefix else self.meta.tombstones()
            if not pending and not tombs:
                return "local" if inode.pending else "lake"
        else:
            if not inode.pending:
                return "lake"
            pending = [inode]
        total = sum(i.size for i in pending if i.pending & DATA)
        done = sum(min(progress(i.ino), i.size) for i in pending if i.pending & DATA)
        if done:
            return f"promoting {done}/{total}"
        return "local"


def _own_policy(inode: Inode) -> str | None:
    """The policy the xattr on ``inode`` itself sets (None: none, or not valid)."""
    value = inode.xattrs.get(POLICY_XATTR)
    return _decode_policy(value) if value is not None else None


def _decode_policy(value: str) -> str | None:
    try:
        policy = base64.b64decode(value).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return None
    if policy not in POLICIES:
        return None
    return policy
