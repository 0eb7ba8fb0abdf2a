"""The C read loop's Python side (``_native.c``): which directories it may
create files in, and what it answered, applied to the core before anything
else runs.

The loop answers the seven requests of a create (GETATTR of the directory,
LOOKUP of the new name, CREATE, IOCTL, GETXATTR, FLUSH, RELEASE) without
Python in a directory handed over to it, and journals what it did
(:mod:`aifs.posix.adopted`). It runs inside :meth:`Native.serve`, in the
trio thread, until creates come; then a helper thread of its own reads and
answers while the trio thread applies the journal beside it
(:meth:`Native.from_helper`), until the helper reads a request for Python
and hands it back. Python applies everything journaled before it answers any
request, so every handler finds the core as if Python had answered those
requests itself; other tasks (promotion, listings) may run while records
wait, and meanwhile see those files as not created yet, or still open.

A directory is handed over at its MKDIR, where the core knows every name in
it (none) and its listing is fresh: only until that listing's TTL ends (a
later listing may bring names from the lake), and not where its files would
take its group (set-group-ID). It is taken back, for good, before Python
answers a request that adds or removes a name in it, changes its
attributes, or moves a directory (the lake keys below change length, which
the loop checks names against); a create the loop leaves to Python keeps it
(the loop is told the name). Those past their TTL are dropped.

A file the loop created is handed over once it is closed, while its
directory is: the loop answers its GETATTR, its opens for reading
(passthrough to the local copy, journaled) and their releases, the three
requests a program reading what it just wrote sends. No other node's
version can reach the core before the directory's listing TTL ends (a
refresh that finds one takes it back anyway). It is taken back before
Python answers any request that names it, or links it, and with its
directory.

The loop leaves to Python what Python would answer otherwise than it can: a
create by a user other than root (whose writes must clear set-user-ID, so
not direct), for reading, of a name it holds, with no passthrough or no room
for a direct writer; an open for writing or truncating.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import sys
import time

import trio

from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel.operations import Operations
from aifs.fuse.kernel.passthrough import Passthrough
from aifs.meta.store import Inode
from aifs.posix.adopted import FLUSHED, JOURNAL, OPENED, RELEASED, Created, Handled, records

log = logging.getLogger(__name__)

#: requests that change the directory they name (a name in it, its attributes)
CHANGES_DIR = frozenset({p.SETATTR, p.MKNOD, p.MKDIR, p.UNLINK, p.RMDIR, p.SYMLINK,
                         p.RENAME, p.RENAME2, p.LINK, p.CREATE, p.SETXATTR, p.REMOVEXATTR})
HANDED = struct.Struct("<Qq")  # a file handed over: ino, until (monotonic ns), its fuse_attr
POOL_LOW = 256  # inode numbers or handles left to the loop before more are reserved
POOL_INOS = 1024
POOL_HANDLES = 4096


class Native:
    def __init__(self, front_type: type, devfd: int, ops: Operations,
                 passthrough: Passthrough, buffer: int) -> None:
        self.fs = fs = ops.fs
        self.ops = ops
        self.passthrough = passthrough
        cache_dir = fs.local.root.parent
        self.journal_fd = os.open(cache_dir / JOURNAL,
                                  os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.journal_fd, 0)  # (applied at mount by recovery)
        self.files_fd = os.open(fs.local.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        seconds, nanos = ops.ttl
        self.front = front_type(devfd, self.journal_fd, self.files_fd, seconds, nanos,
                                ops.blksize, buffer)
        self.efd = self.front.eventfd()
        self.helper_reads = False  # the C helper thread holds the reader's role
        #: directories handed over -> when their listing's TTL ends (monotonic,
        #: so in order): those past it are dropped on both sides as more come
        self.delegated: dict[int, float] = {}
        #: files handed over -> their directory, and each directory's files
        self.files: dict[int, int] = {}
        self.dir_files: dict[int, set[int]] = {}
        self.handing: list[tuple[int, bytes]] = []  # files handed over in this apply
        self.creating: set[int] = set()  # handles of the loop's creates, applied, still open
        #: inodes (and directories) a request Python answers names, while it runs
        self.busy: dict[int, int] = {}
        #: files taken back while the journal held records not applied yet (the
        #: loop's opens of them, maybe) -> the journal's length then
        self.recent: dict[int, int] = {}
        fs.inodes.held_outside = self.holds
        self.applied = 0  # journal bytes applied
        self.ttl_ns = int(fs.config.metadata_ttl * 1e9)
        self.broken = False
        self.turns = sys.modules[front_type.__module__].TURNS  # answered in a row, at most
        ops.made_dir = self.hand_over

    def counts(self) -> memoryview:
        return memoryview(self.front.counts()).cast("Q")

    def started(self) -> None:
        """INIT is answered: passthrough is settled."""
        self._refill()

    async def serve(self, buf: bytearray, spin_ns: int) -> tuple[int, int]:
        """Read and answer requests (``Front.serve``): (n, answered) as it
        returns them; what was journaled is applied before this returns.
        Where creates came, the helper thread reads from then on
        (:attr:`helper_reads`: call :meth:`from_helper` instead)."""
        n, answered, self.helper_reads = self.front.serve(buf, spin_ns)
        if self.front.journaled() != self.applied:
            await self.apply()
        return n, answered

    async def from_helper(self, buf: bytearray) -> int:
        """While the helper reads: wait until it journals or hands a request
        over, and apply what it journaled. The request's length (in ``buf``;
        the role is Python's again), 0 if the helper still reads, or -errno."""
        await trio.lowlevel.wait_readable(self.efd)
        n = self.front.take(buf)
        if n:
            self.helper_reads = False
        if self.front.journaled() != self.applied:
            await self.apply()
        return n

    async def finish(self) -> None:
        """The session ends: the helper stops, and what it journaled is applied
        (before the drain at unmount promotes it)."""
        self.front.stop()
        self.helper_reads = False
        if self.front.journaled() != self.applied:
            await self.apply()

    async def apply(self) -> None:
        """Apply what the loop journaled since the last call."""
        end = self.front.journaled()
        data = os.pread(self.journal_fd, end - self.applied, self.applied)
        done, used = records(data)
        state = self.front.state()
        if used < len(data) or state["broken"]:
            self._broken()
        fs = self.fs
        # A file created, written and closed before any of it was applied (the
        # common case: small files come and go between two applies) is applied
        # as its close leaves it, at a fraction of the cost of three steps.
        # So is a read-only open released before it was applied.
        released = {r.fh for r in done if isinstance(r, Handled) and r.kind == RELEASED}
        closed = {r.fh for r in done if isinstance(r, Created) and r.fh in released}
        passthrough = self.passthrough
        reads_closed: set[int] = set()  # (read-only opens applied with their release)
        for record in done:
            try:
                if record.fh in closed:
                    if isinstance(record, Created):
                        inode = fs.adopted.create_closed(record)
                        passthrough.drop(record.backing)
                        self._hand_over_file(inode)
                elif record.fh in reads_closed:
                    if record.kind == RELEASED:  # (the open's: its backing id's count)
                        passthrough.closed(record.ino)
                elif isinstance(record, Created):
                    self.passthrough.adopt(record.ino, record.fh, record.backing)
                    fs.adopted.create(record)
                    self.creating.add(record.fh)
                    # (what it wrote since is taken at its flush: seen as made)
                    fs.direct.went_direct(record.fh, record.pid, (0, record.time_ns))
                elif record.kind == OPENED:
                    if record.fh in released and fs.adopted.open_closed(record):
                        reads_closed.add(record.fh)
                        passthrough.adopt(record.ino, 0, record.backing)
                        continue
                    passthrough.adopt(record.ino, record.fh, record.backing)
                    fs.adopted.open(record)
                    fs.direct.went_direct(record.fh, record.pid)
                elif record.kind == FLUSHED:
                    fs.absorb(record.ino)
                    await fs.flush(record.fh)
                else:
                    passthrough.released(record.fh)
                    fs.release(record.fh)
                    if record.fh in self.creating:  # a create's file, closed now
                        self.creating.discard(record.fh)
                        inode = fs.meta.get(record.ino)
                        if inode is not None and record.ino not in fs.inodes.opens:
                            self._hand_over_file(inode)
            except Exception:  # the program was answered: keep going with the rest
                log.exception("applying %s of inode %d answered by the C loop", record,
                              record.ino)
        if self.handing:  # (those still held: an await above let other tasks run)
            try:
                self.front.delegate_files(b"".join(r for ino, r in self.handing
                                                   if ino in self.files))
            except Exception:  # (out of memory: the loop answers them not)
                log.exception("handing %d files over to the C loop", len(self.handing))
                for ino, _ in self.handing:
                    self.take_back_file(ino)
            self.handing.clear()
        self.applied += used
        if self.recent:
            for ino, upto in list(self.recent.items()):
                if upto <= self.applied:
                    del self.recent[ino]
        if self.front.journal_applied(self.applied):  # all of it, and no more came
            self.applied = 0
            self.recent.clear()
        self._refill(state)

    def _broken(self) -> None:
        """A record cut short (a full disk the journal could not be cut back
        on): the loop creates no more, Python answers all from now on."""
        log.error("the C loop's journal holds a record cut short: creates go through "
                  "Python from now on")
        self.broken = True
        self.front.set_creates(False)
        self.take_back_all()

    def _refill(self, state: dict[str, int] | None = None) -> None:
        """Fill the loop's pools where low (``state``: its state, if just read;
        what the loop took since only makes them lower)."""
        state = state or self.front.state()
        inos = POOL_INOS if state["inos"] < POOL_LOW else 0
        handles = POOL_HANDLES if state["fhs"] < POOL_LOW else 0
        if inos or handles:
            numbers, first = self.fs.adopted.reserve(inos, handles)
            self.front.give(numbers, first, first + handles if handles else 0)
        self.front.set_creates(not self.broken and self.passthrough.enabled
                               and self.fs.direct.may_write_direct())

    # -- directories ------------------------------------------------------------------
    def hand_over(self, directory: Inode) -> None:
        """A directory just made: the loop may create files in it."""
        now = time.monotonic()
        while self.delegated:  # (past their TTL: the loop answers nothing there)
            first, until = next(iter(self.delegated.items()))
            if until > now:
                break
            self.take_back(first)
        if (not self.passthrough.enabled or self.ttl_ns <= 0 or self.broken
                or directory.mode >= 0 and directory.mode & stat.S_ISGID):
            return
        room = self.fs.store.max_key_bytes - len(directory.key.encode("utf-8", "surrogateescape"))
        attr = self.ops.attr(self.ops.attributes(directory))
        self.front.delegate(directory.ino, attr, max(room, 0), self.ttl_ns, [])
        self.delegated[directory.ino] = now + self.ttl_ns / 1e9

    # -- files ------------------------------------------------------------------------
    def _hand_over_file(self, inode: Inode) -> None:
        """A file the loop created was closed: the loop may answer its GETATTR,
        its opens for reading and their releases, while its directory is
        handed over (the same listing: no other node's version can come
        before that TTL ends). Not one that streams (its upload may set
        its mtime), nor one with other names (an unlink of another changes
        its link count), nor one whose copy is gone."""
        parent = inode.parent
        until = self.delegated.get(parent)
        if (until is None or inode.orphan or inode.nlink != 1
                or inode.size >= self.fs.config.multipart_threshold
                or inode.ino in self.busy or parent in self.busy
                or not self.fs.local.has(inode.ino)):
            return  # (a request Python answers may be changing it: it waits on)
        # (told to the loop at the end of the apply, all at once: each call
        # waits for the lock the helper answers under)
        self.handing.append((inode.ino, HANDED.pack(inode.ino, int(until * 1e9))
                             + self.ops.attr(self.ops.attributes(inode))))
        self.files[inode.ino] = parent
        self.dir_files.setdefault(parent, set()).add(inode.ino)

    def take_back_file(self, ino: int) -> None:
        parent = self.files.pop(ino, None)
        if parent is not None:
            self._recall_files([ino])
            files = self.dir_files.get(parent)
            if files is not None:
                files.discard(ino)

    def _recall_files(self, inos: list[int] | set[int]) -> None:
        """The loop answers nothing of these files from now; those it may hold
        open unknown to the core stay held until the journal is applied."""
        for ino in inos:
            self.front.recall_file(ino)
        journaled = self.front.journaled()  # (after the recalls: no more opens of them)
        if journaled != self.applied:
            self.recent.update(dict.fromkeys(inos, journaled))

    def holds(self, ino: int) -> bool:
        """Whether the loop may hold ``ino`` open without the core knowing yet
        (its copy is in use: not evicted, and a newer version marks it stale)."""
        return ino in self.files or ino in self.recent

    def lake_changed(self, parent: int, names: list[bytes], replaced: list[int]) -> None:
        """A listing refresh found another node's changes (before it tells the
        kernel): what the loop holds there goes back."""
        self.take_back(parent)
        for ino in replaced:
            self.take_back_file(ino)

    def before(self, opcode: int, nodeid: int, body: memoryview) -> tuple[int, ...]:
        """Python answers this request: take back the files it names and the
        directories it changes (a create the loop left to Python keeps its
        directory: :meth:`created`). The inodes it names, for :meth:`after`:
        none is handed over while it runs."""
        marked = (nodeid, p.LINK_IN.unpack_from(body)[0]) if opcode == p.LINK else (nodeid,)
        busy = self.busy
        for ino in marked:
            busy[ino] = busy.get(ino, 0) + 1
        if self.files:
            for ino in marked:
                self.take_back_file(ino)
        if opcode in CHANGES_DIR and self.delegated and opcode != p.CREATE:
            self._changes_dir(opcode, nodeid, body)
        return marked

    def after(self, marked: tuple[int, ...]) -> None:
        """The request :meth:`before` marked these for is answered."""
        busy = self.busy
        for ino in marked:
            left = busy.pop(ino) - 1
            if left:
                busy[ino] = left

    def _changes_dir(self, opcode: int, nodeid: int, body: memoryview) -> None:
        if opcode in (p.RENAME, p.RENAME2):
            (newdir,) = p.RENAME_IN.unpack_from(body)
            old, end = p.cstring(body, p.RENAME_IN.size if opcode == p.RENAME
                                 else p.RENAME2_IN.size)
            new, _ = p.cstring(body, end)
            meta = self.fs.meta
            moved, replaced = meta.lookup(nodeid, old), meta.lookup(newdir, new)
            if moved is None or moved.is_dir or replaced is not None and replaced.is_dir:
                self.take_back_all()  # (a directory moved: the keys below change length)
                return
            self.take_back(newdir)
        elif opcode == p.RMDIR:  # (the one removed, too: its table goes)
            removed = self.fs.meta.lookup(nodeid, p.cstring(body)[0])
            if removed is not None:
                self.take_back(removed.ino)
        self.take_back(nodeid)

    def created(self, nodeid: int, body: memoryview) -> None:
        """Python made the file a CREATE in ``nodeid`` named (one the loop left
        to it: another user's, say): the loop knows the name and the times."""
        if nodeid in self.delegated:
            name, _ = p.cstring(body, p.CREATE_IN.size)
            mtime_ns, ctime = self.fs.inodes.dir_times.get(nodeid, (0, 0.0))
            if not mtime_ns or not self.front.add_name(nodeid, name, mtime_ns,
                                                       int(ctime * 1e9)):
                self.take_back(nodeid)

    def take_back(self, ino: int) -> None:
        """Directory ``ino``, and the files in it."""
        if self.delegated.pop(ino, None) is not None:
            self.front.recall(ino)
        files = [file for file in self.dir_files.pop(ino, ())
                 if self.files.pop(file, None) is not None]
        if files:
            self._recall_files(files)

    def take_back_all(self) -> None:
        for ino in list(self.delegated):
            self.take_back(ino)

    def close(self) -> None:
        self.front.stop()
        for fd in (self.journal_fd, self.files_fd):
            os.close(fd)
