"""Streaming promotion: a large file written front to back has its multipart
parts uploaded while it is still being written, so it reaches the lake soon
after close instead of a whole upload after it. Checkpoints were the first
case; any other file (a dataset shard, an export, a log) gains the same.

A file is a candidate when it is written from empty (created, or opened with
O_TRUNC) and the policy lets it stream (``Checkpoints.streams``). Once its
contiguous written prefix reaches ``multipart_threshold`` a multipart upload
starts; each part is read back from the local copy (page cache) when the
writer has gone past its end. A write below what was already handed to an
upload, a hole, a truncate or a write after close breaks the stream: its
upload is aborted and the file is promoted after close as usual, so a
non-sequential writer loses nothing. At most ``MAX_STREAMS`` files stream at
once (each holds a file descriptor and up to ``parts_in_flight`` parts in
memory); another writer starts streaming once one of those ends, if it is
still written front to back, else it is promoted after close. Completion happens only when
the promoter takes the closed file, so the lake never shows a partial object;
a crash leaves an upload the next mount aborts (it is recorded before it is
created, like every multipart upload).

The object's metadata is fixed when the upload is created, so it carries mode
and owner but no ``mtime``: readers take the completion time, which is the
close time to within the promotion delay.

*Spilling*: when the cache disk runs short (``posix.writes``), the bytes of
parts the lake acknowledged leave the local copy (holes punched in it), so a
file larger than the free disk is written at lake speed. Its upload is then
the only place its first bytes are, which sets three rules until it
completes: a spilled stream is never abandoned for a whole upload (a change
that would break it is refused while a writer holds it, and waits for the
completion after the close: ``state``); a part that fails for good loses the
file (``lost``: the writer's next write and close fail, or, after the
close, the file takes the lake's last version again); and the upload's
record says ``spilled``, so the next mount after a crash drops the copy
instead of publishing its holes. Once the upload completes, the promoter
drops the copy and reads come from the lake.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import trio
import xxhash

from aifs.errors import LakeError, lake_error_in
from aifs.lake.base import ObjectInfo, ObjectStore
from aifs.meta.store import MetaStore

log = logging.getLogger(__name__)

MAX_STREAMS = 16
EMPTIED = ("truncated", "a write failed")  # cancels after which a copy has no holes
GONE = ("deleted", "replaced")  # ... after which no name leads to it
AHEAD = 16 << 20  # bytes past a gap a front-to-back writer's write may land (Front)
AHEAD_WRITES = 64  # ... in at most this many writes

#: where a stream's bytes go and come from: lake key, local copy, object metadata
StreamTarget = tuple[str, str, dict[str, str]]


class Front:
    """How far a file is written from offset 0 without a gap. Writes a little
    past it (within :data:`AHEAD`) wait for the gap to fill: the kernel may
    hand one ``write()`` to the daemon as several requests at once, which
    need not be served in order (one that waits for disk room lets the next
    go first)."""

    def __init__(self, end: int = 0) -> None:
        self.end = end
        self.ahead: dict[int, int] = {}  # start -> end of writes past a gap
        self.waited = False  # (a candidate: said once that it waits for a stream slot)

    def wrote(self, offset: int, length: int) -> bool:
        """Count a write; False if it leaves a gap too far ahead to be a
        front-to-back writer's."""
        if offset > self.end:
            if offset - self.end > AHEAD or len(self.ahead) >= AHEAD_WRITES:
                return False
            self.ahead[offset] = max(self.ahead.get(offset, 0), offset + length)
            return True
        self.end = max(self.end, offset + length)
        while self.ahead:
            joined = [start for start in self.ahead if start <= self.end]
            if not joined:
                break
            for start in joined:
                self.end = max(self.end, self.ahead.pop(start))
        return True

    def close(self, size: int) -> None:
        """The file ends at ``size`` (at least :attr:`end`): a gap never
        filled past the front is a hole of the copy, read as zeros."""
        self.end = size
        self.ahead.clear()


class Stream:
    """The upload of one file that is still being written."""

    def __init__(self, ino: int, key: str, path: str, metadata: dict[str, str],
                 front: Front) -> None:
        self.ino = ino
        self.key = key
        self.path = path
        self.metadata = metadata
        self.front = front  # how far it is written, from offset 0
        self.handed = 0  # bytes handed to part uploads: no write may go below
        self.sent = 0  # bytes of parts the lake acknowledged
        self.sealed: int | None = None  # final size, once the last writer closed
        self.in_flight = 0  # parts being sent
        self.version = -1  # the file's change count when sealed
        self.broken = ""
        self.completing = False  # finish() owns the upload now: nothing else aborts it
        self.upload_id = ""
        self.parts: list[tuple[int, str]] = []
        #: part number -> (offset, length, xxh3 of what was sent)
        self.sent_hashes: dict[int, tuple[int, int, int]] = {}
        self.finished = trio.Event()
        self._data = trio.Event()
        self.followed = False  # written past the daemon: parts checked before completion
        self.started = 0.0  # wall time the upload was recorded
        self.acked: list[tuple[int, int]] = []  # parts the lake has, still on the disk
        self.spilled = 0  # bytes that left the disk: only in the upload's parts

    @property
    def end(self) -> int:
        """Contiguous bytes written from offset 0."""
        return self.front.end

    def _wake(self) -> None:
        self._data.set()

    def wrote(self, offset: int, length: int) -> None:
        if self.sealed is not None:
            self.break_("written after close")
        elif offset < self.handed or not self.front.wrote(offset, length):
            self.break_("not written front to back")
        else:
            self._wake()


    def seal(self, size: int, version: int) -> None:
        if size < self.end:
            self.break_("size changed")
        else:
            self.front.close(size)
        self.sealed, self.version = size, version
        self._wake()

    def break_(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            if self.spilled:
                log.error("upload of %s failed after %d bytes of it left the cache disk "
                          "for it (%s): the file is lost, the lake keeps its last version",
                          self.key, self.spilled, why)
            else:
                log.debug("streaming upload of %s abandoned: %s", self.key, why)
        self._wake()


class Streams:
    """Streaming uploads by inode; started and fed by the filesystem's writes."""

    def __init__(self, store: ObjectStore, meta: MetaStore, part_plan: Callable[[int], int],
                 threshold: int, parts_in_flight: int, while_writing: int,
                 punch: Callable[[int, int, int], None] = lambda ino, offset, length: None,
                 ) -> None:
        self.store = store
        self.meta = meta
        self.punch = punch  # (ino, offset, length): give those bytes of the copy back
        self.can_punch = True
        #: ino -> end of what left its copy for the lake (until the upload is settled)
        self.spilled: dict[int, int] = {}
        self.lost: dict[int, str] = {}  # spilled files whose upload failed: ino -> why
        self._progress = trio.Event()  # a part reached the lake, or a stream ended
        self.part_plan = part_plan  # part number -> its size
        self.threshold = threshold
        self.parts_in_flight = max(1, parts_in_flight)
        self.while_writing = max(1, min(while_writing, self.parts_in_flight))
        self._nursery: trio.Nursery | None = None
        # ino -> (what settles its target, contiguous bytes written so far)
        self._candidates: dict[int, tuple[Callable[[int], StreamTarget | None], Front]] = {}
        self._streams: dict[int, Stream] = {}
        #: files written past the daemon (passthrough): their growth is all aifs
        #: sees, so every part sent is checked against the copy before completion
        self._followed: set[int] = set()
        self.started = 0
        self.completed = 0
        self.abandoned = 0

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    # -- fed by the filesystem ------------------------------------------------
    def candidate(self, ino: int, target: Callable[[int], StreamTarget | None]) -> None:
        """``ino`` was opened empty for writing; ``target(ino)``, asked once it
        reaches the threshold, says where it streams (None: it does not)."""
        if self._nursery is not None and ino not in self._streams:
            self._candidates[ino] = (target, Front())

    def wrote(self, ino: int, offset: int, length: int) -> None:
        stream = self._streams.get(ino)
        if stream is not None:
            if ino in self._followed and not stream.followed:
                if stream.handed:  # parts went unhashed: they cannot be checked
                    stream.break_("written past the daemon after parts were sent")
                stream.followed = True
            stream.wrote(offset, length)
            return
        candidate = self._candidates.get(ino)
        if candidate is None:
            return
        target, front = candidate
        if not front.wrote(offset, length):
            del self._candidates[ino]  # a hole: not a front-to-back writer
            return
        if front.end < self.threshold:
            return
        if len(self._streams) >= MAX_STREAMS:
            # It starts at a later write, once a stream ends, from the front,
            # as long as it is still written in order.
            if not front.waited:
                front.waited = True
                where = target(ino)
                log.debug("%s waits to stream: %d files stream already",
                          where[0] if where else ino, len(self._streams))
            return
        del self._candidates[ino]
        where = target(ino)
        if where is None:
            return
        key, path, metadata = where
        stream = self._streams[ino] = Stream(ino, key, path, metadata, front)
        stream.followed = ino in self._followed
        self.started += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._run, stream)

    def follow(self, ino: int, on: bool) -> None:
        """``ino`` is (or no longer is) written where aifs sees only its growth."""
        if on:
            self._followed.add(ino)
        else:
            self._followed.discard(ino)

    def closed(self, ino: int, size: int, version: int) -> None:
        """The last writer closed ``ino`` at ``size`` bytes."""
        self._candidates.pop(ino, None)
        stream = self._streams.get(ino)
        if stream is not None:
            stream.seal(size, version)

    def cancel(self, ino: int, why: str) -> None:
        """Truncated, deleted, set aside, renamed or linked: whatever was
        streamed is abandoned. A spilled copy stays marked (its holes must
        not be read as zeros) until it is emptied (truncated to 0, set
        aside); other changes of a spilled file wait for its upload first
        (``posix.writes.before_change``), so one that gets here loses it."""
        self._candidates.pop(ino, None)
        stream = self._streams.get(ino)
        if ino in self.spilled:
            if why in EMPTIED:
                self.settled(ino)
            elif why not in GONE:
                self.lost[ino] = why
            if stream is not None:
                stream.spilled = 0  # (said here, not again as a failed upload)
        if stream is None:
            return
        stream.break_(why)
        if stream.finished.is_set() and not stream.completing:
            # every part was sent and no completion is under way: nobody else
            # aborts it. (A completion under way finishes; the promoter then sees
            # the file changed and deletes or replaces what landed. An abort now
            # would race the CompleteMultipartUpload of the same upload.)
            del self._streams[ino]
            if self._nursery is not None:
                self._nursery.start_soon(self._abort, stream)

    # -- spilling (see the module's docstring) ---------------------------------------
    def spill(self, wanted: int) -> int:
        """Punch the parts the lake has out of the copies of files that
        stream, until ``wanted`` bytes are free; return the bytes freed."""
        freed = 0
        if not self.can_punch:
            return 0
        for stream in list(self._streams.values()):
            if stream.broken or stream.followed or stream.completing:
                continue
            if not stream.acked or freed >= wanted:
                continue
            current = self.meta.get(stream.ino)
            if current is None or current.orphan or current.key != stream.key:
                continue  # moved (a directory above it renamed): its upload cannot complete
            while stream.acked and freed < wanted:
                offset, length = stream.acked.pop()
                if not stream.spilled:  # a crash from now on must not publish the holes
                    self.meta.record_upload(stream.ino, stream.key, stream.upload_id,
                                            stream.started, spilled=True)
                try:
                    self.punch(stream.ino, offset, length)
                except OSError as exc:  # (a disk that cannot punch holes: never again)
                    log.warning("cannot give back parts of %s already in the lake: %s",
                                stream.key, exc)
                    self.can_punch = False
                    return freed
                stream.spilled += length
                self.spilled[stream.ino] = max(self.spilled.get(stream.ino, 0), offset + length)
                freed += length
        if freed:
            log.debug("gave %d bytes of streamed parts back to the cache disk", freed)
        return freed

    def spillable(self) -> bool:
        """Whether waiting may let :meth:`spill` free more: parts are on the way."""
        return self.can_punch and any(s.in_flight or s.acked for s in self._streams.values()
                                      if not (s.broken or s.followed or s.completing))

    def busy(self) -> bool:
        """Whether disk space may come from streams by waiting: parts on the
        way (:meth:`spillable`), or an abandoned stream that still holds its
        copy (a deleted or set-aside file's space returns when it ends)."""
        return self.spillable() or any(s.broken and not s.finished.is_set()
                                       for s in self._streams.values())

    async def wait_progress(self, timeout: float) -> None:
        """Until a part reaches the lake or a stream ends (or ``timeout``)."""
        with trio.move_on_after(timeout):
            await self._progress.wait()

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def state(self, ino: int, offset: int | None = None) -> str:
        """What a change of a spilled file may do: "" (it is not spilled, or
        the change appends), "wait" (closed: its upload completes first),
        "refuse" (a writer holds it: the change would need its spilled
        bytes), or "lost" (its upload failed). ``offset``: a write's start
        (None: a change that is no write, a truncate, rename or link)."""
        if ino in self.lost:
            return "lost"
        if ino not in self.spilled:
            return ""
        stream = self._streams.get(ino)
        if stream is None or stream.sealed is not None or stream.broken:
            return "wait"
        if offset is not None and stream.handed <= offset <= stream.end + AHEAD:
            return ""
        return "refuse"

    def settled(self, ino: int) -> None:
        """``ino``'s copy is whole again or gone: the upload it spilled into
        completed (the promoter drops the copy), or it was emptied or deleted."""
        self.spilled.pop(ino, None)
        self.lost.pop(ino, None)

    def sent(self, ino: int) -> int:
        stream = self._streams.get(ino)
        return stream.sent if stream is not None and not stream.broken else 0

    def wants(self, ino: int) -> bool:
        """Whether ``ino``'s growth is wanted: it streams, or may start to."""
        return ino in self._streams or ino in self._candidates

    def active(self, ino: int) -> bool:
        return ino in self._streams

    # -- taken by the promoter ----------------------------------------------------
    async def finish(self, ino: int, key: str, size: int,
                     version: int) -> ObjectInfo | None:
        """Complete the streamed upload of ``ino`` if it holds exactly this
        version of the file under ``key``; None if there is none (or it broke):
        the caller uploads the file itself."""
        stream = self._streams.get(ino)
        if stream is None:
            return None
        if stream.spilled and stream.sealed is None:
            raise LakeError(f"{key}: still being written, its first bytes only in its "
                            "upload: it goes once its writer closes it")
        if stream.key != key or stream.sealed != size or (
                stream.version != version and not stream.spilled):
            # (A spilled file's bytes cannot have changed, see state(): its
            # attributes did, and are written after the completion.)
            stream.break_("changed after it was written")
        try:
            await stream.finished.wait()
            if not stream.broken and stream.followed:
                await self._verify(stream)
            if stream.broken:
                if stream.spilled and ino in self.spilled:
                    self.lost[ino] = stream.broken
                await self._abort(stream)  # if it broke after its last part
                return None
            parts = sorted(stream.parts)
            stream.completing = True
            info = await self.store.complete_multipart(stream.key, stream.upload_id, parts)
            self.completed += 1
            if not stream.spilled:  # (else once settled: the copy has holes till then)
                self.meta.record_upload(ino, stream.key, None)
            return info
        except BaseException:
            if stream.spilled and not stream.completing:
                raise  # (cancelled while waiting: the upload stays, the next try completes it)
            stream.break_("completion failed")
            with trio.CancelScope(shield=True):
                await self._abort(stream)
            raise
        finally:
            if self._streams.get(ino) is stream:
                del self._streams[ino]

    async def _verify(self, stream: Stream) -> None:
        """Every part sent still holds the copy's bytes (a writer past the
        daemon may have rewritten one after it was sent): else the stream is
        broken and the file is uploaded whole."""
        def check() -> str:
            with open(stream.path, "rb", buffering=0) as fp:
                for number, (offset, length, digest) in sorted(stream.sent_hashes.items()):
                    if xxhash.xxh3_64_intdigest(os.pread(fp.fileno(), length, offset)) != digest:
                        return f"part {number} was rewritten after it was sent"
            return ""
        why = await trio.to_thread.run_sync(check)
        if why:
            stream.break_(why)

    # -- the upload itself ------------------------------------------------------------
    async def _run(self, stream: Stream) -> None:
        try:
            started = stream.started = time.time()
            self.meta.record_upload(stream.ino, stream.key, "", started)
            stream.upload_id = await self.store.create_multipart(stream.key, stream.metadata)
            self.meta.record_upload(stream.ino, stream.key, stream.upload_id, started)
            fd = await trio.to_thread.run_sync(os.open, stream.path, os.O_RDONLY)
            try:
                await self._send_parts(stream, fd)
            finally:
                os.close(fd)
        except Exception as exc:
            error = lake_error_in(exc)
            if error is None and not isinstance(exc, OSError):
                log.exception("streaming upload of %s failed", stream.key)
            stream.break_(f"upload failed: {error or exc}")
        finally:
            if stream.broken:
                if stream.spilled and stream.ino in self.spilled:
                    self.lost[stream.ino] = stream.broken
                with trio.CancelScope(shield=True):
                    await self._abort(stream)
                if self._streams.get(stream.ino) is stream:
                    del self._streams[stream.ino]  # promoted after close as usual
            stream.finished.set()
            self._progressed()

    async def _send_parts(self, stream: Stream, fd: int) -> None:
        in_flight = trio.Semaphore(self.parts_in_flight)
        async with trio.open_nursery() as nursery:
            number = 1
            while not stream.broken:
                offset = stream.handed
                length = self.part_plan(number)
                # Wait for the writer to pass the part's end; while it writes,
                # fewer parts go at once, leaving it the CPU and bandwidth.
                # (A file spilling waits on these parts for disk room: all go.)
                at_once = self.parts_in_flight if stream.spilled else self.while_writing
                while not stream.broken and stream.sealed is None and (
                        stream.end < offset + length or stream.in_flight >= at_once):
                    await stream._data.wait()
                    stream._data = trio.Event()
                if stream.broken:
                    break
                if stream.sealed is not None:
                    length = min(length, stream.sealed - offset)
                    if length <= 0:
                        break
                await in_flight.acquire()
                if stream.broken:
                    in_flight.release()
                    break
                stream.handed = offset + length
                stream.in_flight += 1
                nursery.start_soon(self._send_part, stream, fd, number, offset, length,
                                   in_flight)
                number += 1
                if stream.sealed is not None and stream.handed >= stream.sealed:
                    break

    async def _send_part(self, stream: Stream, fd: int, number: int, offset: int,
                         length: int, in_flight: trio.Semaphore) -> None:
        try:
            data = await trio.to_thread.run_sync(os.pread, fd, length, offset)
            if len(data) != length:
                stream.break_("local copy shrank")
                return
            if stream.followed:
                stream.sent_hashes[number] = (offset, length,
                                              await trio.to_thread.run_sync(
                                                  xxhash.xxh3_64_intdigest, data))
            etag = await self.store.upload_part(stream.key, stream.upload_id, number, data,
                                                offset)
            stream.parts.append((number, etag))
            stream.sent += length
            stream.acked.append((offset, length))
            self._progressed()
        except LakeError as exc:
            stream.break_(f"part {number} failed: {exc}")
        finally:
            stream.in_flight -= 1
            stream._wake()
            in_flight.release()

    async def _abort(self, stream: Stream) -> None:
        """Abort the stream's upload (once) and forget its record."""
        upload_id, stream.upload_id = stream.upload_id, ""
        if not upload_id:
            return
        try:
            await self.store.abort_multipart(stream.key, upload_id)
        except LakeError as exc:
            log.warning("abort of streaming upload of %s failed (%s); the next mount "
                        "aborts it", stream.key, exc)
            return  # kept in the record
        self.abandoned += 1
        self.meta.record_upload(stream.ino, stream.key, None)
