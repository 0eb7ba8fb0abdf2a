"""Files renamed, replaced, deleted or truncated while their pack, upload or
streamed upload is on the way to the lake (core.Filesystem driven directly over
a real local lake, the request held at a gate). Found by the fsx random-operation
test: a file replaced by a rename while its pack was in flight came back, under a
later name, with the replaced bytes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import pytest
import trio
from support.lakes import Lake, lake_tree

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem, SetAttributes
from aifs.lake.local import LocalStore
from aifs.meta.store import ROOT_INO, MetaStore
from aifs.pack.index import JOURNAL_DIR, PACK_DIR

MiB = 1 << 20


class GatedStore(LocalStore):
    """A real local lake whose pack PUTs (or those ``holds`` picks) wait at a
    gate once it is closed:
    ``let_through(n)`` lets n more pass, ``open()`` all."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.holds = lambda key: key.startswith(PACK_DIR)  # which PUTs the gate holds
        self.closed = False
        self.entered = trio.Event()
        self.tickets = 0
        self.changed = trio.Event()
        self.journals = 0

    async def put(self, key, data, metadata=None):
        if self.closed and self.holds(key):
            self.entered.set()
            while self.closed and not self.tickets:
                await self.changed.wait()
            self.tickets = max(0, self.tickets - 1)
        info = await super().put(key, data, metadata)
        if key.startswith(JOURNAL_DIR):
            self.journals += 1
        return info

    completing = 0  # CompleteMultipartUpload calls under way
    overlaps = 0  # aborts sent while one was

    async def complete_multipart(self, key, upload_id, parts):
        self.completing += 1
        try:
            if self.closed and self.holds(key):
                self.entered.set()
                while self.closed:
                    await self.changed.wait()
            return await super().complete_multipart(key, upload_id, parts)
        finally:
            self.completing -= 1

    async def abort_multipart(self, key, upload_id):
        if self.completing:
            self.overlaps += 1
        return await super().abort_multipart(key, upload_id)

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def let_through(self, count: int) -> None:
        self.tickets += count
        self._poke()

    def open(self) -> None:
        self.closed = False
        self._poke()


def _started(tmp_path, nursery, store_class: type[GatedStore] = GatedStore,
             **options: object) -> Filesystem:
    """A Filesystem over a gated local lake (``fs.gate``), promoting at once."""
    (tmp_path / "lake").mkdir()
    config = Config(**{"lake": f"file://{tmp_path}/lake", "block_size": MiB,
                       "cache_size": 64 * MiB, "metadata_ttl": 60, "promote_delay": 0,
                       "pack_wait": 0.05, **options})
    store = store_class(str(tmp_path / "lake"))
    filesystem = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                            BlockCache(tmp_path / "cache", config.cache_size),
                            LocalFiles(tmp_path / "cache"))
    filesystem.start(nursery)
    filesystem.gate = store  # type: ignore[attr-defined] (fs.store wraps it)
    return filesystem


@pytest.fixture
async def fs(tmp_path, nursery):
    return _started(tmp_path, nursery)


async def _write(fs, name: bytes, data: bytes) -> int:
    fh, inode = await fs.create(ROOT_INO, name, 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, data)
    fs.release(fh)
    return inode.ino


async def _sync(fs) -> None:
    with trio.fail_after(30):
        await fs.sync(ROOT_INO)


def _lake_files(tmp_path) -> dict[str, bytes]:
    lake = Lake("local", f"file://{tmp_path}/lake", {}, [], root=tmp_path / "lake")
    return lake_tree(lake)[0]


async def _pack_in_flight(fs, files: dict[bytes, bytes]) -> None:
    fs.gate.closed = True
    for name, data in files.items():
        await _write(fs, name, data)
    with trio.fail_after(30):
        await fs.gate.entered.wait()  # the pack holds these files under their names


async def _journal_landed(fs, count: int) -> None:
    with trio.fail_after(30):
        while fs.gate.journals < count:
            await trio.sleep(0.01)


async def test_a_file_replaced_while_its_pack_is_in_flight_stays_replaced(fs, tmp_path):
    await _pack_in_flight(fs, {b"a": b"old a" * 100, b"b": b"new b" * 100})
    await fs.rename(ROOT_INO, b"b", ROOT_INO, b"a", 0)
    fh, _ = await fs.open((await fs.lookup(ROOT_INO, b"a")).ino, os.O_WRONLY, 0)
    await fs.write(fh, 0, b"x" * (2 * MiB))  # past the pack threshold: an object next
    fs.release(fh)
    fs.gate.open()
    await _journal_landed(fs, 1)  # its records name the replaced bytes "a"
    await _sync(fs)
    assert _lake_files(tmp_path) == {"a": b"x" * (2 * MiB)}
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"c", 0)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"c": b"x" * (2 * MiB)}
    await fs.unlink(ROOT_INO, b"c")
    await _sync(fs)
    assert _lake_files(tmp_path) == {}


async def test_a_file_renamed_or_deleted_while_its_pack_is_in_flight(fs, tmp_path):
    await _pack_in_flight(fs, {b"a": b"a" * 300, b"b": b"b" * 200, b"c": b"c" * 100})
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"moved", 0)
    await fs.unlink(ROOT_INO, b"b")
    await _write(fs, b"b", b"another b")  # the name taken again, by a new file
    fs.gate.let_through(1)
    await _journal_landed(fs, 1)
    await fs.rename(ROOT_INO, b"b", ROOT_INO, b"d", 0)
    await fs.rename(ROOT_INO, b"moved", ROOT_INO, b"e", 0)
    fs.gate.open()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"e": b"a" * 300, "d": b"another b", "c": b"c" * 100}


async def test_a_file_replaced_while_its_object_is_in_flight_leaves_no_object(fs, tmp_path):
    """The replaced file's upload lands after the rename (the new file has a
    local copy: it goes to the lake after that upload); the file that took
    the name is packed: the stray object is deleted, never shown or moved."""
    fs.gate.holds = lambda key: key == "a"
    fs.gate.closed = True
    await _write(fs, b"a", b"A" * (2 * MiB))  # an object of its own
    with trio.fail_after(30):
        await fs.gate.entered.wait()
    await _write(fs, b"b", b"small b")
    await fs.rename(ROOT_INO, b"b", ROOT_INO, b"a", 0)
    fs.gate.open()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"a": b"small b"}
    await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    await fs.rename(ROOT_INO, b"a", (await fs.lookup(ROOT_INO, b"d")).ino, b"a", 0)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"d/a": b"small b"}


async def test_a_streamed_file_truncated_while_its_upload_completes(tmp_path, nursery):
    """The completion owns the upload: a truncate then does not send an abort
    beside the CompleteMultipartUpload; the truncated file replaces what landed."""
    fs = _started(tmp_path, nursery, multipart_threshold=5 * MiB, part_size=5 * MiB,
                  stream_large_files="true")
    store = fs.gate
    store.holds = lambda key: key == "big"
    store.closed = True  # completions of "big" wait at the gate
    fh, inode = await fs.create(ROOT_INO, b"big", 0o644, os.O_WRONLY, 0, 0)
    for offset in range(0, 12 * MiB, MiB):
        await fs.write(fh, offset, b"s" * MiB)
    fs.release(fh)
    with trio.fail_after(30):
        await store.entered.wait()  # its completion is under way
    await fs.setattr(inode.ino, SetAttributes(size=1000))
    await trio.sleep(0.2)  # an abort, if one were sent, would be sent now
    store.open()
    with trio.fail_after(60):
        await fs.sync(ROOT_INO)
    assert store.overlaps == 0
    assert _lake_files(tmp_path) == {"big": b"s" * 1000}


@pytest.mark.parametrize("size", [2 * MiB, 6 * MiB], ids=["put", "multipart"])
@pytest.mark.parametrize("how", ["unlink", "replaced", "dir-renamed-then-unlinked"])
async def test_sync_waits_for_the_upload_of_a_file_deleted_while_it_was_in_flight(
        tmp_path, nursery, size, how):
    """A file deleted (unlinked, or replaced by a rename) while its upload is
    in flight is no longer pending, but what lands under its old key is no
    one's: a sync must not return before that object is deleted (fsx seed 13
    found a deleted file's 5.8 MB multipart object in the lake after a sync)."""
    fs = _started(tmp_path, nursery, multipart_threshold=5 * MiB, part_size=5 * MiB)
    store = fs.gate
    await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    d = (await fs.lookup(ROOT_INO, b"d")).ino
    await _sync(fs)
    store.holds = lambda key: key == "d/a"
    store.closed = True
    fh, _ = await fs.create(d, b"a", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"A" * size)
    fs.release(fh)
    with trio.fail_after(30):
        await store.entered.wait()  # its PUT or its completion waits at the gate

    async def open_later() -> None:
        await trio.sleep(0.5)
        store.open()

    nursery.start_soon(open_later)  # (a rename onto d/a waits for it)
    if how == "unlink":
        await fs.unlink(d, b"a")
    elif how == "replaced":
        fh, _ = await fs.create(d, b"b", 0o644, os.O_WRONLY, 0, 0)
        await fs.write(fh, 0, b"small b")
        fs.release(fh)
        await fs.rename(d, b"b", d, b"a", 0)
    else:
        await fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
        await fs.unlink(d, b"a")
    await _sync(fs)
    assert not store.closed, "the sync returned while the deleted file's upload was in flight"
    expected = {"d/a": b"small b"} if how == "replaced" else {}
    assert _lake_files(tmp_path) == expected


class CopyGatedStore(GatedStore):
    """Also holds server-side copies from keys ``copy_holds`` picks until
    ``copies_go`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.copy_holds = lambda key: False
        self.copy_entered = trio.Event()
        self.copies_go = trio.Event()

    async def copy(self, src, dst, metadata=None):
        if self.copy_holds(src):
            self.copy_entered.set()
            await self.copies_go.wait()
        return await super().copy(src, dst, metadata)


@contextlib.asynccontextmanager
async def _renaming(fs, old: bytes, new: bytes, held_at: str) -> AsyncIterator[None]:
    """The block runs while a rename of ``old`` to ``new`` (in the root) waits
    in its server-side copy of ``held_at``; the copy goes on as it ends."""
    store = fs.gate
    store.copy_holds = lambda key: key == held_at
    async with trio.open_nursery() as inner:
        inner.start_soon(fs.rename, ROOT_INO, old, ROOT_INO, new, 0)
        with trio.fail_after(30):
            await store.copy_entered.wait()
        yield
        store.copies_go.set()


async def test_an_upload_landing_during_a_directory_rename_leaves_no_object(tmp_path, nursery):
    """A file's upload completes while its directory's rename copies the rest
    (after the rename listed the lake), and the file changed meanwhile: the
    promoter records the landed object's ETag and promotes again; the rename
    must then delete the object under the old key, not forget it (fsx seed 13:
    d/a/e stayed in the lake after the directory d was renamed)."""
    fs = _started(tmp_path, nursery, CopyGatedStore, multipart_threshold=5 * MiB,
                  part_size=5 * MiB)
    store = fs.gate
    d = (await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)).ino
    fh, _ = await fs.create(d, b"b", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"B" * (2 * MiB))
    fs.release(fh)
    await _sync(fs)  # d/b is an object of its own: the rename copies it
    store.holds = lambda key: key == "d/a"
    store.closed = True
    fh, inode = await fs.create(d, b"a", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"1" * (6 * MiB))
    fs.release(fh)
    with trio.fail_after(30):
        await store.entered.wait()  # d/a's CompleteMultipartUpload waits at the gate
    fh, _ = await fs.open(inode.ino, os.O_WRONLY, 0)
    await fs.write(fh, 0, b"2" * MiB)  # changed while it completes
    fs.release(fh)
    async with _renaming(fs, b"d", b"e", held_at="d/b"):  # it listed d/ (no d/a yet)
        store.open()  # d/a lands; the promoter records its ETag, d/a pending again
        with trio.fail_after(30):
            while not fs.meta.get(inode.ino).etag:
                await trio.sleep(0.01)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"e/a": b"2" * MiB + b"1" * (5 * MiB),
                                     "e/b": b"B" * (2 * MiB)}


async def test_a_pack_landing_after_the_files_newer_object_is_stale(fs, tmp_path):
    """A file's small version is in a pack on its way; the file grows past the
    pack threshold and its object of its own lands (and settles) first. The
    pack's record of the small version is stale when it lands: it must not
    become the file's lake copy (the object deleted), and it must be deleted in
    the journals, or the key keeps it after the file moves away (fsx seed 15:
    after a directory rename, c/f/c/e stayed in the lake with the bytes of the
    file's earlier, packed version)."""
    d = (await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)).ino
    await _sync(fs)
    fs.gate.closed = True  # pack PUTs wait
    fh, inode = await fs.create(d, b"a", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"small" * 100)
    fs.release(fh)
    with trio.fail_after(30):
        await fs.gate.entered.wait()  # the small version is in a pack on its way
    fh, _ = await fs.open(inode.ino, os.O_WRONLY, 0)
    await fs.write(fh, 0, b"x" * (2 * MiB))  # past the pack threshold: an object next
    fs.release(fh)
    with trio.fail_after(30):  # ... which lands and settles before the pack
        while fs.meta.get(inode.ino).pending:
            await trio.sleep(0.01)
    journals = fs.gate.journals
    fs.gate.open()
    await _journal_landed(fs, journals + 1)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"d/a": b"x" * (2 * MiB)}
    await fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"e/a": b"x" * (2 * MiB)}


async def test_a_file_whose_pack_lands_while_a_rename_replaces_it(tmp_path, nursery):
    """A rename over a small file copies the source in the lake first; the
    target's pack lands during that copy. What the rename knew of the target
    from before the copy (no packed copy yet) must not decide: the target's
    record in the pack index is deleted with it, or the name keeps the
    replaced bytes in the lake (fsx seed 15: a stale record for e/b/f/c/f/a
    travelled through eleven directory renames and showed up as c/a/f/a)."""
    fs = _started(tmp_path, nursery, CopyGatedStore)
    store = fs.gate
    await _write(fs, b"y", b"Y" * (2 * MiB))  # an object of its own: the rename copies it
    await _sync(fs)
    await _pack_in_flight(fs, {b"x": b"small x" * 100})
    async with _renaming(fs, b"y", b"x", held_at="y"):  # it looked at x, then began the copy
        x = (await fs.lookup(ROOT_INO, b"x")).ino
        store.open()  # x's pack lands: x is packed now
        with trio.fail_after(30):
            while not fs.meta.get(x).packed:
                await trio.sleep(0.01)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"x": b"Y" * (2 * MiB)}
    fh, _ = await fs.open((await fs.lookup(ROOT_INO, b"x")).ino, os.O_WRONLY, 0)
    await fs.write(fh, 0, b"changed")  # pending again: no upload before the unlink
    fs.release(fh)
    await fs.unlink(ROOT_INO, b"x")
    await _sync(fs)
    assert _lake_files(tmp_path) == {}


class DeleteGatedStore(GatedStore):
    """Also holds deletes until ``deletes_go`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.deletes_go = trio.Event()

    async def delete_many(self, keys):
        await self.deletes_go.wait()
        return await super().delete_many(keys)


async def test_a_file_shrunk_into_a_pack_is_no_other_writers_change(tmp_path, nursery,
                                                                    caplog):
    """A file whose object this node wrote shrinks into a pack: until the
    object's delete is done, the lake still has it. That is this node's own
    old copy, not another writer's change: the check before the next upload
    must not say the lake changed; an object another tool put there does."""
    fs = _started(tmp_path, nursery, DeleteGatedStore)
    ino = await _write(fs, b"a", b"A" * (2 * MiB))
    await _sync(fs)  # an object of its own
    await fs.setattr(ino, SetAttributes(size=1000))
    with trio.fail_after(30):  # packed; the old object's delete waits at the gate
        while fs.meta.get(ino).pending or not fs.meta.get(ino).packed:
            await trio.sleep(0.01)
    assert (tmp_path / "lake" / "a").exists()
    await fs.promoter.uploads.warn_if_replaced(fs.meta.get(ino))
    assert "changed in the lake" not in caplog.text
    fs.gate.deletes_go.set()
    await _sync(fs)
    assert not (tmp_path / "lake" / "a").exists()
    (tmp_path / "lake" / "a").write_bytes(b"another tool's")
    await fs.promoter.uploads.warn_if_replaced(fs.meta.get(ino))
    assert "a changed in the lake since this node read it" in caplog.text


async def _directory_with_an_object(fs) -> int:
    """Directory d holding d/kept, an object of its own, all in the lake."""
    d = (await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)).ino
    await _write(fs, b"kept", b"K" * (2 * MiB))
    await fs.rename(ROOT_INO, b"kept", d, b"kept", 0)
    await _sync(fs)
    return d


class LandsFirstStore(GatedStore):
    """Its held PUTs land in the lake first; only the reply waits at the gate
    (the server has the object; the promoter does not know yet)."""

    async def put(self, key, data, metadata=None):
        info = await LocalStore.put(self, key, data, metadata)
        if self.closed and self.holds(key):
            self.entered.set()
            while self.closed:
                await self.changed.wait()
        return info


@pytest.mark.parametrize("kind", ["directory", "file"])
async def test_a_stale_upload_landed_unanswered_is_not_copied_by_a_rename(
        tmp_path, nursery, kind):
    """A directory is removed (or a file unlinked) while its PUT is on the
    way; the PUT lands, its reply not yet handled, when the parent is renamed.
    The rename's listing shows the object with no owner and no tombstone: it
    must be deleted, not copied to a key no entry has (fsx seed 2: d/a/b/b/
    and d/a/b/b/a/ stayed in the lake after d/e was renamed to d/a/b; seed 13
    the same with a file below new directories)."""
    fs = _started(tmp_path, nursery, LandsFirstStore)
    store = fs.gate
    d = await _directory_with_an_object(fs)
    store.closed = True
    if kind == "directory":
        store.holds = lambda key: key == "d/x/"
        await fs.mkdir(d, b"x", 0o755, 0, 0)
    else:
        store.holds = lambda key: key == "d/x"
        fh, _ = await fs.create(d, b"x", 0o644, os.O_WRONLY, 0, 0)
        await fs.write(fh, 0, b"X" * (2 * MiB))  # an object of its own
        fs.release(fh)
    with trio.fail_after(30):
        await store.entered.wait()  # d/x is in the lake; its reply is held
    if kind == "directory":
        await fs.rmdir(d, b"x")
    else:
        await fs.unlink(d, b"x")
    await fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
    store.open()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"e/kept": b"K" * (2 * MiB)}
    lake = tmp_path / "lake"
    assert not (lake / "e" / "x").exists()


@pytest.mark.parametrize("kind", ["directory", "file"])
async def test_an_upload_settled_during_a_directory_rename_moves_with_it(
        tmp_path, nursery, kind):
    """A new entry's upload is on the way when its directory is renamed; it
    lands and settles under the old key after the rename listed the lake,
    before the rename is recorded. The old key must be deleted and the entry
    written under its new one (an empty directory's marker included, or it is
    gone on the next mount)."""
    fs = _started(tmp_path, nursery, CopyGatedStore)
    store = fs.gate
    d = await _directory_with_an_object(fs)
    store.closed = True
    if kind == "directory":
        store.holds = lambda key: key == "d/y/"
        y = (await fs.mkdir(d, b"y", 0o755, 0, 0)).ino
    else:
        store.holds = lambda key: key == "d/y"
        fh, inode = await fs.create(d, b"y", 0o644, os.O_WRONLY, 0, 0)
        await fs.write(fh, 0, b"Y" * (2 * MiB))
        fs.release(fh)
        y = inode.ino
    with trio.fail_after(30):
        await store.entered.wait()  # d/y's PUT waits at the gate
    async with _renaming(fs, b"d", b"e", held_at="d/kept"):  # it listed d/ (no d/y yet)
        store.open()  # d/y lands and settles under d/y
        with trio.fail_after(30):
            while fs.meta.get(y).pending:
                await trio.sleep(0.01)
    await _sync(fs)
    expected = {"e/kept": b"K" * (2 * MiB)}
    if kind == "file":
        expected["e/y"] = b"Y" * (2 * MiB)
    assert _lake_files(tmp_path) == expected
    lake = tmp_path / "lake"
    assert not (lake / "d").exists()
    assert (lake / "e" / "y").is_dir() == (kind == "directory")


async def test_a_file_a_writer_past_the_daemon_opens_while_its_pack_waits(tmp_path, nursery):
    """A small file waits for its pack; a writer past the daemon (passthrough:
    the kernel writes its copy, the daemon learns of it at the next attribute
    request or close) opens it and makes it 2 MiB before the pack is put
    together. The pack must not take those bytes for the small version (fsx
    seed 13 on io_uring: a 5 MB file went into a pack, under the attributes
    of its 200 KB version, and its record outlived the file's rename)."""
    fs = _started(tmp_path, nursery, pack_wait=30,  # the pack goes when told
                  cache_size=2 << 30)  # room for a direct writer
    small, big = b"small" * 100, b"B" * (2 * MiB)
    ino = await _write(fs, b"a", small)
    with trio.fail_after(30):
        while not fs.promoter.packer.queued(ino):
            await trio.sleep(0.01)
    fh, _ = await fs.open(ino, os.O_WRONLY, 0)
    fd = await fs.direct_backing(fh, False)
    assert fd is not None, "the handle should go direct"
    os.pwrite(fd, big, 0)  # as the kernel does, past the daemon
    fs.promoter.packer.hurry()
    with trio.fail_after(30):
        while fs.promoter.packer.queued(ino):
            await trio.sleep(0.01)
    entry = fs.promoter.packer.index.entry("a")
    assert entry is None or entry.length == len(small), entry
    fs.release(fh, direct=True)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"a": big}
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)
    await _sync(fs)
    assert _lake_files(tmp_path) == {"b": big}


def _rename_soon(fs, nursery, old: bytes, new: bytes) -> trio.Event:
    """Start renaming ``old`` to ``new`` (in the root); the event is set once
    the rename returned."""
    done = trio.Event()

    async def rename() -> None:
        await fs.rename(ROOT_INO, old, ROOT_INO, new, 0)
        done.set()
    nursery.start_soon(rename)
    return done


class FirstPutHeldStore(GatedStore):
    """Holds the first PUT of key ``"a"`` until ``first_go`` is set; tells
    when a later one arrives (``second_came``)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.puts_of_a = 0
        self.first_go = trio.Event()
        self.second_came = trio.Event()

    async def put(self, key, data, metadata=None):
        if key == "a":
            self.puts_of_a += 1
            if self.puts_of_a == 1:
                self.entered.set()
                await self.first_go.wait()
            else:
                self.second_came.set()
        return await super().put(key, data, metadata)


async def test_a_new_files_upload_waits_for_a_stale_one_to_the_same_key(tmp_path, nursery):
    """A file's PUT is on the way when it is renamed away; a new file takes
    the name and is uploaded. The stale PUT must not land after the new one:
    the lake would hold the old bytes under the new file's name, and the
    tombstone of the stale landing would be dropped for the new file's sake."""
    fs = _started(tmp_path, nursery, FirstPutHeldStore)
    store = fs.gate
    old, new = b"O" * (2 * MiB), b"N" * (2 * MiB)  # objects of their own
    await _write(fs, b"a", old)
    with trio.fail_after(30):
        await store.entered.wait()  # the old file's PUT of "a" is held
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"moved", 0)
    await _write(fs, b"a", new)
    # A second PUT of "a" while the first is held is the race; it comes at
    # once (promote_delay 0) if nothing holds it back. Either way the first
    # then goes on.
    with trio.move_on_after(2):
        await store.second_came.wait()
    if store.second_came.is_set():
        with trio.fail_after(30):  # (the race: let the new file settle first)
            while fs.meta.get((await fs.lookup(ROOT_INO, b"a")).ino).pending:
                await trio.sleep(0.01)
    store.first_go.set()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"a": new, "moved": old}


@pytest.mark.parametrize("local", [True, False], ids=["local-copy", "lake-only"])
async def test_a_rename_onto_a_key_waits_for_a_stale_upload_to_it(tmp_path, nursery, local):
    """As above, the name taken by a rename: its server-side copy must not
    land before the stale PUT of the name does. A file with a local copy is
    uploaded again after it (the rename does not wait); one without waits."""
    fs = _started(tmp_path, nursery, FirstPutHeldStore)
    store = fs.gate
    old, other = b"O" * (2 * MiB), b"C" * (2 * MiB)
    c = await _write(fs, b"c", other)
    await _sync(fs)  # "c" is an object: a rename copies it
    if not local:
        fs.local.remove(c)
    await _write(fs, b"a", old)
    with trio.fail_after(30):
        await store.entered.wait()  # the PUT of "a" is held
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"moved", 0)
    async with trio.open_nursery() as inner:
        renamed = _rename_soon(fs, inner, b"c", b"a")
        with trio.move_on_after(2):  # done at once if nothing holds it back (the race)
            await renamed.wait()
        assert renamed.is_set() == local
        store.first_go.set()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"a": other, "moved": old}


class PartGatedStore(GatedStore):
    """Holds the second part of a multipart upload until ``part_go`` is set;
    counts the parts sent."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.parts = 0
        self.part_held = trio.Event()
        self.part_go = trio.Event()

    async def upload_part(self, key, upload_id, number, data, offset=None):
        self.parts += 1
        if number == 2:
            self.part_held.set()
            await self.part_go.wait()
        return await super().upload_part(key, upload_id, number, data, offset)


async def test_a_rename_over_a_file_being_uploaded_stops_that_upload(tmp_path, nursery):
    """Saving to a temporary name and renaming it over the last checkpoint
    while that one is still being uploaded: the rename waits for the part on
    its way, not for the whole upload, which stops (it is no one's now)."""
    fs = _started(tmp_path, nursery, PartGatedStore, multipart_threshold=5 * MiB,
                  part_size=5 * MiB, parts_in_flight=1)
    store = fs.gate
    await _write(fs, b"ckpt", b"1" * (20 * MiB))  # four parts
    with trio.fail_after(30):
        await store.part_held.wait()
    await _write(fs, b"tmp", b"2" * (1 << 10))
    async with trio.open_nursery() as inner:
        renamed = _rename_soon(fs, inner, b"tmp", b"ckpt")
        store.part_go.set()
        with trio.fail_after(30):
            await renamed.wait()
    assert store.parts <= 2, f"{store.parts} parts sent for a file replaced at the second"
    await _sync(fs)
    assert _lake_files(tmp_path) == {"ckpt": b"2" * (1 << 10)}


async def _read_through_the_daemon(fs, name: bytes) -> bytes:
    """Open, read whole and close ``name`` as the kernel binding does for a
    file that is not direct (its close may queue a local copy)."""
    inode = await fs.lookup(ROOT_INO, name)
    fh, _ = await fs.open(inode.ino, os.O_RDONLY)
    assert await fs.direct_backing(fh, False) is None
    data = b""
    while chunk := await fs.read(fh, len(data), MiB):
        data += bytes(chunk)
    fs.release(fh, direct=False)
    return data


async def test_a_large_copy_under_way_does_not_hold_back_small_ones(tmp_path, nursery,
                                                                    monkeypatch):
    """A large object read whole is copied to a local file at the promotion's
    pace (minutes for a big one); a small file read again meanwhile gets its
    copy at once, not after it."""
    big, small = os.urandom(4 * MiB + 5), os.urandom(10_000)
    fs = _started(tmp_path, nursery)
    (tmp_path / "lake" / "big.bin").write_bytes(big)  # written by another tool
    (tmp_path / "lake" / "small.bin").write_bytes(small)
    admissions = fs.direct.admissions
    copying, go = trio.Event(), trio.Event()
    admit_large = admissions._admit_large

    async def held(ino, version):
        copying.set()
        await go.wait()
        await admit_large(ino, version)

    monkeypatch.setattr(admissions, "_admit_large", held)
    assert await _read_through_the_daemon(fs, b"big.bin") == big
    with trio.fail_after(10):
        await copying.wait()
    for _ in range(2):  # read before: its second close queues its copy
        assert await _read_through_the_daemon(fs, b"small.bin") == small
    local = fs.inodes.local
    small_ino = (await fs.lookup(ROOT_INO, b"small.bin")).ino
    big_ino = (await fs.lookup(ROOT_INO, b"big.bin")).ino
    with trio.fail_after(10):
        while not local.has(small_ino):
            await trio.sleep(0.01)
    assert not local.has(big_ino)
    go.set()
    with trio.fail_after(10):
        while not local.has(big_ino):
            await trio.sleep(0.01)


@pytest.mark.parametrize("what", ["directory", "file"])
async def test_a_rename_onto_a_name_whose_old_object_is_still_in_the_lake(tmp_path, nursery,
                                                                          monkeypatch, what):
    """In a local lake a path is a file or a directory: a rename onto a name
    whose old object is not deleted yet (the delete round had not run: here
    held) must not fail (it did, with EIO, in a CI run of fsx): the old
    object in its way goes first, and every file is in the lake under its
    new name."""
    fs = _started(tmp_path, nursery, pack_threshold=0)
    old, inner = os.urandom(2 * MiB), os.urandom(2 * MiB)
    if what == "directory":  # a file "x" leaves, a directory takes its name
        await _write(fs, b"x", old)
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        fh, _ = await fs.create(d.ino, b"a", 0o644, os.O_WRONLY, 0, 0)
    else:  # a directory "x" leaves, a file takes its name
        x = await fs.mkdir(ROOT_INO, b"x", 0o755, 0, 0)
        fh, _ = await fs.create(x.ino, b"a", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, inner)
    fs.release(fh)
    if what == "file":
        await _write(fs, b"f", old)
    await _sync(fs)
    deletes = fs.promoter.deletes
    monkeypatch.setattr(deletes, "changed", lambda delay=0.0: None)  # no round runs
    with trio.fail_after(30):
        if what == "directory":
            await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)
            await fs.rename(ROOT_INO, b"d", ROOT_INO, b"x", 0)
        else:
            await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)
            await fs.rename(ROOT_INO, b"f", ROOT_INO, b"x", 0)
    monkeypatch.undo()
    deletes.changed()
    await _sync(fs)
    expected = {"y": old, "x/a": inner} if what == "directory" else {"y/a": inner, "x": old}
    assert _lake_files(tmp_path) == expected


class LandedPutHeldStore(FirstPutHeldStore):
    """The first PUT of ``"a"`` is in the lake, its reply held until
    ``first_go`` is set (``before=True``: held before it reaches the lake)."""

    before = False

    async def put(self, key, data, metadata=None):
        if key != "a" or self.puts_of_a or self.before:
            return await super().put(key, data, metadata)
        self.puts_of_a += 1
        info = await LocalStore.put(self, key, data, metadata)
        self.entered.set()
        await self.first_go.wait()
        return info


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "on-the-way"])
async def test_a_directory_renamed_onto_a_name_whose_upload_is_landing(tmp_path, nursery,
                                                                       landed):
    """In a local lake: a file's PUT is on the way (or in the lake, its reply
    not yet handled) when the file is renamed away, and a directory is renamed
    onto its old name. The rename must not fail (it did, with EIO "File
    exists", in a CI run of fsx: the stale object had no tombstone yet, so
    nothing cleared the way): it waits for the stale PUT, whose object then
    goes, and every file is in the lake under its new name."""
    fs = _started(tmp_path, nursery, LandedPutHeldStore, pack_threshold=0)
    store = fs.gate
    store.before = not landed
    old, inner = os.urandom(2 * MiB), os.urandom(2 * MiB)
    d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    fh, _ = await fs.create(d.ino, b"x", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, inner)
    fs.release(fh)
    await _sync(fs)
    await _write(fs, b"a", old)
    with trio.fail_after(30):
        await store.entered.wait()  # the PUT of "a" is held
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"moved", 0)
    async with trio.open_nursery() as inner_nursery:
        renamed = _rename_soon(fs, inner_nursery, b"d", b"a")
        with trio.move_on_after(1):
            await renamed.wait()
        store.first_go.set()
        with trio.fail_after(30):
            await renamed.wait()
    await _sync(fs)
    assert _lake_files(tmp_path) == {"moved": old, "a/x": inner}
