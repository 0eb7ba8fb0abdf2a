"""core.Filesystem driven directly (no mount) over a real local lake."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem, SetAttributes
from aifs.errors import FsError
from aifs.lake.base import ObjectStore as ObjectStoreBase
from aifs.lake.local import LocalStore
from aifs.lake.s3 import S3Store
from aifs.meta.store import ROOT_INO, MetaStore

MiB = 1 << 20


class CountingStore(LocalStore):
    """A real local lake that counts range GETs."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gets: list[tuple[str, int]] = []

    async def get_range(self, key, start, length, if_match=None):
        self.gets.append((key, start))
        await trio.sleep(0.01)  # let concurrent readers pile up
        return await super().get_range(key, start, length, if_match)


@pytest.fixture
async def fs(tmp_path, nursery):
    (tmp_path / "lake" / "d").mkdir(parents=True)
    data = os.urandom(8 * MiB + 3)
    (tmp_path / "lake" / "d" / "big").write_bytes(data)
    (tmp_path / "lake" / "small").write_bytes(b"small")
    # Plain objects are what these tests look at in the lake (packing: test_packing).
    config = Config(lake=f"file://{tmp_path}/lake", block_size=MiB, cache_size=64 * MiB,
                    readahead_max=4 * MiB, metadata_ttl=60, pack_threshold=0)
    store = CountingStore(str(tmp_path / "lake"))
    filesystem = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                            BlockCache(tmp_path / "cache", config.cache_size),
                            LocalFiles(tmp_path / "cache"))
    filesystem.start(nursery)
    filesystem.data = data  # type: ignore[attr-defined]
    return filesystem


async def test_lookup_counts_and_forget(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    assert d.is_dir and fs.lookups[d.ino] == 1
    await fs.lookup(ROOT_INO, b"d")
    assert fs.lookups[d.ino] == 2
    fs.forget([(d.ino, 2)])
    assert d.ino not in fs.lookups
    assert await fs.lookup(ROOT_INO, b"missing") is None
    with pytest.raises(FsError) as info:
        await fs.lookup((await fs.lookup(ROOT_INO, b"small")).ino, b"x")
    assert info.value.errno == errno.ENOTDIR


async def test_concurrent_readers_cause_one_get_per_block(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    big = await fs.lookup(d.ino, b"big")
    handles = [(await fs.open(big.ino, os.O_RDONLY))[0] for _ in range(8)]
    results: dict[int, bytes] = {}

    async def read(fh: int) -> None:
        results[fh] = await fs.read(fh, MiB - 10, 20)
    async with trio.open_nursery() as nursery:
        for fh in handles:
            nursery.start_soon(read, fh)
    assert set(results.values()) == {fs.data[MiB - 10:MiB + 10]}
    assert len(fs.store.inner.gets) == len(set(fs.store.inner.gets))  # never two GETs of one block
    assert {("d/big", 0), ("d/big", MiB)} <= set(fs.store.inner.gets)


async def test_sequential_reads_grow_readahead(fs):
    d = await fs.lookup(ROOT_INO, b"d")
    big = await fs.lookup(d.ino, b"big")
    fh, _ = await fs.open(big.ino, os.O_RDONLY)
    out = bytearray()
    for offset in range(0, len(fs.data), 128 * 1024):
        out += await fs.read(fh, offset, 128 * 1024)
    assert bytes(out) == fs.data
    starts = sorted(s for _, s in fs.store.inner.gets)
    assert starts == [i * MiB for i in range(9)]  # every block exactly once
    assert fs.files[fh].readahead.window == 4 * MiB  # grew to the maximum


async def _sync_all(fs) -> None:
    with trio.fail_after(30):
        await fs.sync(ROOT_INO)


async def test_write_then_promote_to_the_lake(fs, tmp_path):
    fh, inode = await fs.create(ROOT_INO, b"new.bin", 0o640, os.O_WRONLY, 0, 0)
    assert await fs.write(fh, 0, b"hello ") == 6
    assert await fs.write(fh, 10, b"world") == 5  # a hole of 4 bytes
    assert bytes(await fs.read(fh, 0, 100)) == b"hello \0\0\0\0world"
    fs.release(fh)
    assert fs.meta.get(inode.ino).pending  # not in the lake before its delay
    await _sync_all(fs)
    assert (tmp_path / "lake" / "new.bin").read_bytes() == b"hello \0\0\0\0world"
    stored = fs.meta.get(inode.ino)
    assert not stored.pending and stored.etag and stored.size == 15
    meta = {n: os.getxattr(tmp_path / "lake" / "new.bin", n).decode()
            for n in os.listxattr(tmp_path / "lake" / "new.bin")}
    assert meta["user.aifs.meta.mode"] == str(0o100640)


async def test_overwrite_of_a_lake_file_materializes_it(fs, tmp_path):
    small = await fs.lookup(ROOT_INO, b"small")
    fh, _ = await fs.open(small.ino, os.O_RDWR)
    await fs.write(fh, 2, b"X")
    assert bytes(await fs.read(fh, 0, 10)) == b"smXll"
    fs.release(fh)
    await _sync_all(fs)
    assert (tmp_path / "lake" / "small").read_bytes() == b"smXll"


async def test_rename_of_a_promoted_directory_copies_in_the_lake(fs, tmp_path):
    d = await fs.lookup(ROOT_INO, b"d")
    fh, _ = await fs.create(d.ino, b"local", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"not yet promoted")
    fs.release(fh)
    await fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
    await _sync_all(fs)
    lake = tmp_path / "lake"
    assert not (lake / "d").exists()
    assert (lake / "e" / "big").read_bytes() == fs.data
    assert (lake / "e" / "local").read_bytes() == b"not yet promoted"
    e = await fs.lookup(ROOT_INO, b"e")
    big = await fs.lookup(e.ino, b"big")
    fh, _ = await fs.open(big.ino, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 64)) == fs.data[:64]  # the copy's ETag is known


async def test_unlink_deletes_in_the_lake_and_rmdir_needs_empty(fs, tmp_path):
    d = await fs.lookup(ROOT_INO, b"d")
    with pytest.raises(FsError) as info:
        await fs.rmdir(ROOT_INO, b"d")
    assert info.value.errno == errno.ENOTEMPTY
    await fs.unlink(d.ino, b"big")
    await fs.rmdir(ROOT_INO, b"d")
    await fs.unlink(ROOT_INO, b"small")
    await _sync_all(fs)
    assert sorted(os.listdir(tmp_path / "lake")) == []
    assert await fs.lookup(ROOT_INO, b"small") is None


async def test_changes_survive_a_crash(tmp_path):
    """A new Filesystem on the same cache promotes what the old one left."""
    lake = tmp_path / "lake"
    lake.mkdir()
    config = Config(lake=f"file://{lake}", block_size=MiB, cache_size=64 * MiB,
                    promote_delay=3600, pack_threshold=0)

    def build():
        return Filesystem(config, LocalStore(str(lake)), MetaStore(tmp_path / "meta"),
                          BlockCache(tmp_path / "cache", config.cache_size),
                          LocalFiles(tmp_path / "cache"))

    first = build()
    async with trio.open_nursery() as nursery:
        first.start(nursery)
        fh, _ = await first.create(ROOT_INO, b"kept", 0o644, os.O_WRONLY, 0, 0)
        await first.write(fh, 0, b"closed before the crash")
        first.release(fh)
        nursery.cancel_scope.cancel()  # the daemon dies: nothing promoted
    first.meta.env.close()
    assert not (lake / "kept").exists()
    second = build()
    second.recover()
    async with trio.open_nursery() as nursery:
        second.start(nursery)
        with trio.fail_after(30):
            await second.sync(ROOT_INO)
        nursery.cancel_scope.cancel()
    assert (lake / "kept").read_bytes() == b"closed before the crash"


@pytest.mark.parametrize("journal", [b"records", None])
def test_files_an_earlier_c_loop_created_are_kept_at_mount(tmp_path, journal):
    """An earlier release answered some creates in C and journaled them for
    the metadata (``native-journal`` in the cache directory); this one cannot
    apply that journal. A local copy the metadata does not know is then kept
    in the recovery directory, where it would otherwise be dropped as a
    leftover (as it still is where no such journal is left)."""
    config = Config(lake=f"file://{tmp_path}/lake", cache_size=64 * MiB)
    (tmp_path / "lake").mkdir()
    unknown = 1_000_001  # a number no create here took
    (tmp_path / "cache" / "files").mkdir(parents=True)  # as the earlier daemon left it
    (tmp_path / "cache" / "files" / str(unknown)).write_bytes(b"closed under the C loop")
    if journal is not None:
        (tmp_path / "cache" / "native-journal").write_bytes(journal)
    fs = Filesystem(config, LocalStore(str(tmp_path / "lake")), MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", config.cache_size),
                    LocalFiles(tmp_path / "cache"))
    fs.recover()
    kept = list((tmp_path / "cache" / "recovered").glob(f"*/{unknown}"))
    if journal is None:
        assert kept == []
    else:
        assert [p.read_bytes() for p in kept] == [b"closed under the C loop"]
        assert not (tmp_path / "cache" / "native-journal").exists()
    assert not fs.local.path(unknown).exists()
    assert not fs.local.has(unknown) and fs.local.used == 0
    fs.meta.env.close()


def test_a_copy_an_earlier_c_loop_created_that_cannot_be_kept_stays(tmp_path):
    """Where the recovery directory cannot be made, the copy stays where it
    is and so does the journal: the next mount keeps it, nothing is dropped."""
    config = Config(lake=f"file://{tmp_path}/lake", cache_size=64 * MiB)
    (tmp_path / "lake").mkdir()
    (tmp_path / "cache" / "files").mkdir(parents=True)
    (tmp_path / "cache" / "files" / "1000001").write_bytes(b"closed under the C loop")
    (tmp_path / "cache" / "native-journal").write_bytes(b"records")
    (tmp_path / "cache" / "recovered").write_bytes(b"")  # a file: no directory here
    fs = Filesystem(config, LocalStore(str(tmp_path / "lake")), MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", config.cache_size),
                    LocalFiles(tmp_path / "cache"))
    fs.recover()
    assert fs.local.path(1_000_001).read_bytes() == b"closed under the C loop"
    assert (tmp_path / "cache" / "native-journal").exists()
    fs.meta.env.close()


async def test_keep_cache_only_for_unchanged_objects(fs, tmp_path):
    small = await fs.lookup(ROOT_INO, b"small")
    fh1, keep1 = await fs.open(small.ino, os.O_RDONLY)
    fh2, keep2 = await fs.open(small.ino, os.O_RDONLY)
    assert (keep1, keep2) == (False, True)
    (tmp_path / "lake" / "small").write_bytes(b"changed")
    fs.clock = lambda: 1e12  # the TTL has passed
    fresh = await fs.getattr(small.ino)
    assert fresh.size == 7
    fh3, keep3 = await fs.open(small.ino, os.O_RDONLY)
    assert keep3 is False
    assert await fs.read(fh3, 0, 100) == b"changed"


async def test_sync_of_one_file(fs, tmp_path):
    fh, inode = await fs.create(ROOT_INO, b"one", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(fh, 0, b"1")
    fs.release(fh)
    with trio.fail_after(30):
        await fs.sync(inode.ino)
    assert (tmp_path / "lake" / "one").read_bytes() == b"1"


async def test_a_name_deleted_while_open_for_writing_is_free_in_the_lake_at_once(fs, tmp_path):
    """The open handle has all the bytes locally, so the deleted name's object
    goes now, not at the last close: on a local-directory lake a directory of
    that name could not be made while it stood (fsx found this)."""
    fh, inode = await fs.create(ROOT_INO, b"x", 0o644, os.O_RDWR, 0, 0)
    await fs.write(fh, 0, b"first")
    fs.release(fh)
    await _sync_all(fs)
    fh, _ = await fs.open(inode.ino, os.O_RDWR, 0)
    await fs.write(fh, 5, b" second")
    await fs.unlink(ROOT_INO, b"x")
    directory = await fs.mkdir(ROOT_INO, b"x", 0o755, 0, 0)
    child, _ = await fs.create(directory.ino, b"y", 0o644, os.O_WRONLY, 0, 0)
    await fs.write(child, 0, b"inside")
    fs.release(child)
    await _sync_all(fs)  # while the deleted file is still open
    assert (tmp_path / "lake" / "x" / "y").read_bytes() == b"inside"
    assert bytes(await fs.read(fh, 0, 100)) == b"first second"
    fs.release(fh)


async def test_a_zero_metadata_ttl_lists_once_per_lookup_and_sees_new_objects(tmp_path):
    """``--metadata-ttl 0`` (always ask the lake) used to list a directory
    for ever: a listing was stale the moment it ended."""
    lake = tmp_path / "lake"
    (lake / "d").mkdir(parents=True)
    config = Config(lake=f"file://{lake}", block_size=MiB, cache_size=64 * MiB,
                    metadata_ttl=0, pack_threshold=0)
    store = CountingStore(str(lake))
    filesystem = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                            BlockCache(tmp_path / "cache", config.cache_size),
                            LocalFiles(tmp_path / "cache"))
    async with trio.open_nursery() as nursery:
        filesystem.start(nursery)
        with trio.fail_after(10):
            d = await filesystem.lookup(ROOT_INO, b"d")
            assert d is not None and await filesystem.lookup(d.ino, b"new") is None
            (lake / "d" / "new").write_bytes(b"from another node")
            assert (await filesystem.lookup(d.ino, b"new")).size == 17
        nursery.cancel_scope.cancel()


async def test_an_empty_journal_directory_is_no_journal(tmp_path):
    """The local lake lists an empty directory as a marker object: one under
    .aifs/journal/ (the moment before the first journal lands, or a folder
    made by hand) was fetched as a journal and failed every listing."""
    lake = tmp_path / "lake"
    (lake / ".aifs" / "journal").mkdir(parents=True)
    (lake / "a").write_bytes(b"x")
    config = Config(lake=f"file://{lake}", block_size=MiB, cache_size=64 * MiB)
    filesystem = Filesystem(config, LocalStore(str(lake)), MetaStore(tmp_path / "meta"),
                            BlockCache(tmp_path / "cache", config.cache_size),
                            LocalFiles(tmp_path / "cache"))
    async with trio.open_nursery() as nursery:
        filesystem.start(nursery)
        with trio.fail_after(10):
            assert (await filesystem.lookup(ROOT_INO, b"a")).size == 1
        nursery.cancel_scope.cancel()


class HeldHeadS3(S3Store):
    """A real S3 lake (moto) whose HEADs of ``held`` keys answer only once
    ``release`` is set (what they answer is what the lake held when asked)."""

    def __init__(self, bucket: str, endpoint: str, held: set[str]) -> None:
        super().__init__(bucket, "", endpoint_url=endpoint)
        self.held = held
        self.release = trio.Event()
        self.waiting = 0

    async def head(self, key):
        info = await super().head(key)
        if key in self.held:
            self.waiting += 1
            await self.release.wait()
        return info


async def test_attributes_read_across_a_rename_keep_the_new_name(tmp_path, nursery,
                                                                 moto_server, monkeypatch):
    """The HEADs a lookup starts ahead of a walk may answer after the file was
    renamed and the rename reached the lake (an S3 copy keeps the ETag): what
    they bring must not put the old key back, where a later change would be
    promoted, nor undo a chmod made meanwhile."""
    for name, value in moto_server.env.items():
        monkeypatch.setenv(name, value)
    bucket = f"held-{os.getpid()}-{id(tmp_path) % 10_000}"
    moto_server.client.create_bucket(Bucket=bucket)
    for i in range(5):
        moto_server.client.put_object(Bucket=bucket, Key=f"w/a{i}", Body=b"object %d" % i)
    config = Config(lake=f"s3://{bucket}", endpoint_url=moto_server.endpoint, metadata_ttl=60,
                    pack_threshold=0, object_attrs=True)
    store = HeldHeadS3(bucket, moto_server.endpoint, {f"w/a{i}" for i in range(1, 5)})
    fs = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", 64 * MiB), LocalFiles(tmp_path / "cache"))
    fs.start(nursery)
    w = await fs.lookup(ROOT_INO, b"w")
    await fs.lookup(w.ino, b"a0")  # starts the HEADs of a1..a4, held
    with trio.fail_after(10):
        while store.waiting < 4:
            await trio.sleep(0.01)
    await fs.rename(w.ino, b"a1", w.ino, b"b1", 0)
    a2 = fs.meta.lookup(w.ino, b"a2")
    await fs.setattr(a2.ino, SetAttributes(mode=0o600))
    await _sync_all(fs)
    store.release.set()
    with trio.fail_after(10):
        while fs.object_attrs._in_flight:
            await trio.sleep(0.01)
    b1 = await fs.lookup(w.ino, b"b1")
    assert b1.key == "w/b1"
    assert (await fs.getattr(a2.ino)).mode == 0o600
    await fs.setattr(b1.ino, SetAttributes(mode=0o640))
    await _sync_all(fs)
    keys = [o["Key"] for o in moto_server.client.list_objects_v2(Bucket=bucket)["Contents"]
            if not o["Key"].startswith(".aifs/")]  # (journals: the objects' records)
    assert sorted(keys) == ["w/a0", "w/a2", "w/a3", "w/a4", "w/b1"]
    await store.aclose()


class HeldListStore(LocalStore):
    """A real local lake whose LISTs answer only once ``release`` is set while
    ``hold`` is on."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.hold = False
        self.release = trio.Event()
        self.lists = 0

    async def list_page(self, prefix, delimiter="/", token=None, max_keys=1000):
        self.lists += 1
        if self.hold:
            await self.release.wait()
        return await super().list_page(prefix, delimiter, token, max_keys)

    async def iter_list(self, prefix, delimiter="/"):
        async for page in ObjectStoreBase.iter_list(self, prefix, delimiter):
            yield page


async def test_a_stat_past_the_ttl_is_answered_while_the_listing_refreshes_behind(
        tmp_path, nursery):
    """Past the TTL (and within twice it) a stat or lookup of a known entry is
    answered from the listing at once, one LIST refreshing it in the
    background; the lake's change shows once that LIST is in. A name not
    known, or a listing older than twice the TTL, waits for the LIST."""
    lake = tmp_path / "lake"
    (lake / "d").mkdir(parents=True)
    (lake / "d" / "f").write_bytes(b"one")
    now = [1000.0]
    config = Config(lake=f"file://{lake}", metadata_ttl=60, pack_threshold=0)
    store = HeldListStore(str(lake))
    fs = Filesystem(config, store, MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", 64 * MiB), LocalFiles(tmp_path / "cache"),
                    clock=lambda: now[0])
    fs.start(nursery)
    d = await fs.lookup(ROOT_INO, b"d")
    f = await fs.lookup(d.ino, b"f")
    (lake / "d" / "f").write_bytes(b"two!")
    (lake / "d" / "g").write_bytes(b"new")
    store.hold = True
    now[0] += 61
    lists = store.lists
    with trio.fail_after(5):
        assert (await fs.getattr(f.ino)).size == 3  # the LIST is held: not waited for
        assert (await fs.lookup(d.ino, b"f")).size == 3
        while store.lists == lists:
            await trio.sleep(0.01)
    assert store.lists == lists + 1  # one background LIST for both
    async with trio.open_nursery() as waiting:
        found = []

        async def look_up_new() -> None:
            found.append(await fs.lookup(d.ino, b"g"))  # unknown: waits for the LIST

        waiting.start_soon(look_up_new)
        await trio.sleep(0.1)
        assert not found
        store.release.set()
    assert found[0] is not None and found[0].size == 3
    assert (await fs.getattr(f.ino)).size == 4
    store.hold, store.release = True, trio.Event()
    now[0] += 121  # twice the TTL past the last listing: a stat waits
    with trio.move_on_after(0.3) as timed:
        await fs.getattr(f.ino)
    assert timed.cancelled_caught
    store.release.set()
    assert (await fs.getattr(f.ino)).size == 4


async def test_a_marker_renamed_into_place_is_published_only_as_of_the_rename(tmp_path):
    """The HF Trainer writes ``tmp-checkpoint-N/``: the model, then
    ``trainer_state.json`` (the commit marker), then ``rng_state.pth``, and
    renames the directory to ``checkpoint-N/``. The rename is the commit: the
    marker's version from its close, before the rename, must never be
    published on its own once the model is in the lake, or the lake shows
    ``checkpoint-N/trainer_state.json`` while ``rng_state.pth`` is not there
    (found by test_checkpoint_survives_a_kill_during_promotion[local-hf])."""
    lake = tmp_path / "lake"
    lake.mkdir()
    config = Config(lake=f"file://{lake}", promote_delay=3600)
    fs = Filesystem(config, LocalStore(str(lake)), MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", 64 * MiB), LocalFiles(tmp_path / "cache"))
    async with trio.open_nursery() as nursery:
        fs.start(nursery)
        staging = await fs.mkdir(ROOT_INO, b"tmp-checkpoint-3", 0o40755, 0, 0)

        async def write(name: bytes, data: bytes) -> int:
            fh, inode = await fs.create(staging.ino, name, 0o644, os.O_WRONLY, 0, 0)
            await fs.write(fh, 0, data)
            await fs.flush(fh)
            fs.release(fh)
            return inode.ino

        model = await write(b"pytorch_model.bin", b"m" * 4096)
        marker = await write(b"trainer_state.json", b'{"global_step": 3}')
        await write(b"rng_state.pth", b"r" * 100)
        await fs.rename(ROOT_INO, b"tmp-checkpoint-3", ROOT_INO, b"checkpoint-3", 0)
        fs.meta.update(model, pending=0)  # the model reached the lake; rng_state.pth not yet
        assert fs.hosting.older_marker_version(fs.meta.get(marker)) is None
        nursery.cancel_scope.cancel()


async def test_a_listing_that_failed_for_another_caller_is_tried_again_not_served_empty(
        tmp_path, nursery):
    """Two callers want a directory never listed (a walker and the listing
    ahead of it, or two programs): the LIST of the first fails. The first gets
    the error; the second lists it again itself: never an empty directory."""
    import trio.testing

    from aifs.errors import LakeError, LakeUnavailable

    (tmp_path / "lake" / "d").mkdir(parents=True)
    for name in ("a", "b"):
        (tmp_path / "lake" / "d" / name).write_bytes(b"x")
    release = trio.Event()

    class FailsOnce(LocalStore):
        failed = False

        async def iter_list(self, prefix, delimiter="/"):
            if prefix == "d/" and not self.failed:
                self.failed = True
                await release.wait()
                raise LakeUnavailable("the connection was reset", "connection")
            async for page in super().iter_list(prefix, delimiter):
                yield page

    config = Config(lake=f"file://{tmp_path}/lake", metadata_ttl=60)
    fs = Filesystem(config, FailsOnce(str(tmp_path / "lake")), MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", 1 << 26), LocalFiles(tmp_path / "cache"))
    fs.start(nursery)
    d = await fs.lookup(ROOT_INO, b"d")
    seen: dict[int, object] = {}

    async def reader(i: int) -> None:
        try:
            fh = await fs.opendir(d.ino)
        except LakeError as exc:
            seen[i] = exc
            return
        seen[i] = sorted(name for _, name, _ in await fs.readdir(fh, 2))

    async with trio.open_nursery() as readers:
        readers.start_soon(reader, 0)
        await trio.testing.wait_all_tasks_blocked()
        readers.start_soon(reader, 1)  # waits for the first one's listing
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert isinstance(seen[0], LakeUnavailable)
    assert seen[1] == [b"a", b"b"]
