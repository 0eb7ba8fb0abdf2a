"""At mount: local copies reconciled with the metadata after any exit.

Files written through a handle and neither closed nor fsynced when the node
went down are not published under their names: the lake keeps its last
version of each (a half-written checkpoint shard must not replace it), and
the bytes written go to the recovery directory, for a person to look at
(``aifs status`` says where).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from aifs.cache.files import LocalFiles
from aifs.meta.store import DATA, FILE, MetaStore

log = logging.getLogger(__name__)


RECOVERED_SHARE = 10  # the recovery directory keeps at most 1/this of the cache disk


class Recovery:
    def __init__(self, meta: MetaStore, local: LocalFiles, keep_max: int = 1 << 30) -> None:
        self.meta = meta
        self.local = local
        self.keep_max = keep_max  # bytes the recovery directory holds at most (recovered_max)
        self.recovered_dir = local.root.parent / "recovered"
        self.recovered_files = 0  # files in it (counted at mount, kept since)
        self.stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # this mount's subfolder
        #: the journal of the C read loop an earlier release had (creates it
        #: answered, applied to the metadata at the next mount): where one is
        #: left, copies the metadata does not know may be files it created
        self.legacy_journal = local.root.parent / "native-journal"

    def recover(self) -> None:
        """Reconcile local copies with the metadata after any exit."""
        meta, local = self.meta, self.local
        self._drop_spilled()
        self._recover_unclosed()
        unknown_kept = self._legacy_journal_left()
        kept_all = True
        for ino in meta.purge_orphans():
            local.remove(ino)
        pending = {inode.ino: inode for inode in meta.pending_inodes()}
        for ino, size in local.sizes().items():
            inode = pending.get(ino) or meta.get(ino)
            if inode is None:
                if unknown_kept and size:
                    kept_all &= self._keep_unknown(ino)
                else:
                    local.remove(ino)
            elif not (ino in pending and inode.pending & DATA) and size != inode.size:
                # a clean copy cut short (the node lost power before the disk had
                # it all): the lake has the file, its next read fetches it
                log.warning("the local copy of %s is %d bytes, not %d: dropped", inode.key,
                            size, inode.size)
                local.remove(ino)
            elif ino in pending and inode.pending & DATA:
                if size != inode.size:  # written after the last save: the copy is the truth
                    st = os.stat(local.path(ino))
                    meta.update(ino, size=size, mtime_ns=st.st_mtime_ns)
            else:
                local.mark_clean(ino)
        if kept_all and self.legacy_journal.exists():
            self.legacy_journal.unlink()  # every copy it may name is kept
        for ino, inode in pending.items():
            if inode.pending & DATA and inode.kind == FILE and not inode.size \
                    and not local.has(ino):
                local.create(ino)  # created, the daemon killed before its copy was
                local.mark_dirty(ino)
        if pending:
            log.info("%d inodes have changes not yet in the lake: promoting them",
                     len(pending))

    def _legacy_journal_left(self) -> bool:
        """Whether an earlier release's C loop left a journal this release
        cannot apply: its files' copies are then kept in the recovery directory
        instead of being dropped as unknown (the journal is removed once all
        are kept: until then the next mount keeps them too)."""
        try:
            size = self.legacy_journal.stat().st_size
        except FileNotFoundError:
            return False
        if size:
            log.warning("%s holds creates an earlier release did not apply: files the "
                        "metadata does not know are kept in %s", self.legacy_journal,
                        self.recovered_dir)
        return bool(size)

    def _keep(self, ino: int, names: list[str]) -> Path:
        """The copy of ``ino`` moved into the recovery directory under the
        first of ``names`` it can hold; the last OSError if none (the copy
        is then where it was: nothing is dropped unsaved)."""
        for name in names:
            target = self.recovered_dir / self.stamp / name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(self.local.path(ino), target)
                break
            except OSError:
                if name == names[-1]:
                    raise
        self.recovered_files += 1
        return target

    def set_aside(self, ino: int, key: str, why: str) -> None:
        """The copy of ``ino``, a file not to be published (``why``: a write
        of it failed, or the node went down while it was written), moved into
        the recovery directory, which is then trimmed to its cap. A copy
        larger than the cap is dropped at once, not kept at the cost of
        everything kept before it. Its disk space is the cache's no longer."""
        try:
            size = os.stat(self.local.path(ino)).st_blocks * 512
        except OSError:
            size = 0
        cap = self.cap()
        try:
            if size > cap:
                raise OSError(f"{size} bytes, more than the {cap} it keeps at most "
                              "(recovered_max, and a tenth of the cache disk)")
            # under its key; by inode number where no path here can hold the key
            target = self._keep(ino, list(dict.fromkeys((key or str(ino), str(ino)))))
        except OSError as exc:
            log.error("%s is not published (%s), and cannot be kept in %s (%s): its bytes "
                      "are dropped", key, why, self.recovered_dir, exc)
        else:
            log.warning("%s is not published (%s); the bytes written are in %s", key, why,
                        target)
        self.local.remove(ino)
        self.trim()

    def cap(self) -> int:
        """Bytes the recovery directory may hold: ``keep_max``, and at most
        a tenth of the disk it is on (it must not fill what the cache needs)."""
        size, _ = self.local.disk_space()
        return min(self.keep_max, size // RECOVERED_SHARE) if size else self.keep_max

    def trim(self) -> None:
        """Drop the oldest kept files until the directory fits :meth:`cap`."""
        kept: list[tuple[float, int, str]] = []
        for where, _, names in os.walk(self.recovered_dir):
            for name in names:
                path = os.path.join(where, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                kept.append((st.st_mtime, st.st_blocks * 512, path))
        total, cap = sum(size for _, size, _ in kept), self.cap()
        for _, size, path in sorted(kept):
            if total <= cap:
                break
            try:
                os.unlink(path)
            except OSError as exc:
                log.error("cannot drop %s from the recovery directory: %s", path, exc)
                continue
            total -= size
            self.recovered_files -= 1
            log.warning("dropped %s (%d bytes) from the recovery directory: it keeps at "
                        "most %d bytes (recovered_max, and a tenth of the cache disk), "
                        "oldest first", path, size, cap)

    def _keep_unknown(self, ino: int) -> bool:
        """A copy an earlier release's C loop may have created, kept; False
        if it could not be moved (it stays, for the next mount)."""
        why = "was created by the C read loop of an earlier release and not applied"
        try:
            target = self._keep(ino, [str(ino)])
        except OSError as exc:
            log.error("inode %d %s, and cannot be kept in %s: %s", ino, why,
                      self.recovered_dir, exc)
            return False
        self.local.remove(ino)  # (gone from the cache's books; the file moved)
        log.warning("inode %d %s: its bytes are in %s", ino, why, target)
        return True

    def _drop_spilled(self) -> None:
        """Files whose first bytes had left their local copy for a streamed
        upload that a crash cut short (flush.stream, spilling): the copy has
        holes, the upload is aborted (``abort_leftovers``); the lake keeps
        its last version, as for any file a crash caught being written."""
        for ino in self.meta.spilled_uploads():
            inode = self.meta.get(ino)
            self.local.remove(ino)
            if inode is not None and not inode.orphan and inode.pending:
                log.error("%s was being uploaded as it was written, its first bytes "
                          "already only in that upload, when the node went down: not "
                          "published, and nothing of it is kept", inode.key)
                self.meta.unpublish(ino)

    def _recover_unclosed(self) -> None:
        if self.recovered_dir.is_dir():  # counted once here, not per status request
            self.recovered_files = sum(len(f) for _, _, f in os.walk(self.recovered_dir))
        for ino in self.meta.unclosed():
            inode = self.meta.get(ino)
            if inode is not None and self.local.has(ino) and not inode.orphan:
                self.set_aside(ino, inode.key, "it was open for writing when the node "
                                               "went down")
            self.local.remove(ino)
            self.meta.unpublish(ino)
        self.trim()
