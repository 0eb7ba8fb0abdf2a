"""The pack index without a mount: journal records applied in any order give
the same packed files (last writer wins per key), directory children come
from a skip scan, moves apply only where the entry still is, and live bytes
per pack follow every change."""

from __future__ import annotations

import gzip
import itertools
import json
import time

import pytest
import trio

from aifs.errors import LakeError
from aifs.lake.counting import CountingStore
from aifs.lake.local import LocalStore
from aifs.meta.store import MetaStore
from aifs.pack.folds import encode_sharded_fold, read_shard, shard_key, shard_of
from aifs.pack.index import (
    FOLD_SUFFIX,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    PackedEntry,
    PackIndex,
    checksum,
    deletion,
    encode_fold,
    object_record,
    read_fold,
)
from aifs.pack.journals import Journals, PackStats


def put(key: str, pack: str, offset: int, length: int, stamp: int) -> dict:
    return PackedEntry(key, pack, offset, length, checksum(b"x" * length), stamp).record()


def index(tmp_path, name: str = "meta") -> PackIndex:
    return PackIndex(MetaStore(tmp_path / name))


def test_records_in_any_order_give_the_same_files(tmp_path):
    records = [
        {"op": "pack", "pack": "p1", "size": 300, "t": 1},
        put("a/x", "p1", 0, 100, 10),
        put("a/y", "p1", 100, 100, 11),
        put("a/x", "p1", 200, 100, 20),       # x rewritten later
        deletion("a/y", 30),                  # y deleted after it was written
        put("a/y", "p1", 100, 100, 25),       # an older record of y, read late
    ]
    results = []
    for n, order in enumerate(itertools.permutations(records)):
        if n % 89:  # a spread of the 720 orders
            continue
        idx = index(tmp_path, f"meta{n}")
        for record in order:
            idx.apply([record])
        x = idx.entry("a/x")
        results.append((x.offset if x else None, idx.entry("a/y"),
                        idx.pack_info("p1")["live"]))
    assert set(results) == {(200, None, 100)}


def test_children_skip_subdirectories_and_deleted_entries(tmp_path):
    idx = index(tmp_path)
    idx.apply([put("d/a.dat", "p", 0, 1, 1), put("d/sub/b.dat", "p", 1, 1, 1),
               put("d/sub/c.dat", "p", 2, 1, 1), put("d/gone/e.dat", "p", 3, 1, 1),
               put("d0/f.dat", "p", 4, 1, 1), put("d/z.dat", "p", 5, 1, 1),
               deletion("d/gone/e.dat", 2)])
    children = [(name, entry.key if entry else None) for name, entry in idx.children("d/")]
    assert children == [("a.dat", "d/a.dat"), ("sub", None), ("z.dat", "d/z.dat")]
    assert [e.key for e in idx.under("d/sub/")] == ["d/sub/b.dat", "d/sub/c.dat"]


def test_a_move_applies_only_where_the_entry_still_is(tmp_path):
    idx = index(tmp_path)
    idx.apply([{"op": "pack", "pack": "old", "size": 200, "t": 1},
               {"op": "pack", "pack": "new", "size": 100, "t": 5},
               put("k", "old", 0, 100, 1), put("moved-away", "old", 100, 100, 1)])
    idx.apply([put("k", "other", 0, 100, 9)])  # rewritten meanwhile by another node
    idx.apply([{"op": "move", "key": "k", "from": ["old", 0], "pack": "new", "off": 0},
               {"op": "move", "key": "moved-away", "from": ["old", 100], "pack": "new",
                "off": 0}])
    assert idx.entry("k").pack == "other"
    moved = idx.entry("moved-away")
    assert (moved.pack, moved.offset, moved.stamp) == ("new", 0, 1)
    assert idx.pack_info("old")["live"] == 0 and idx.pack_info("old")["dead_since"] > 0
    assert idx.pack_info("new")["live"] == 100
    assert [e.key for e in idx.members_of("new")] == ["moved-away"]


def test_queued_changes_wait_in_the_outbox(tmp_path):
    idx = index(tmp_path)
    idx.apply([put("k", "p", 0, 10, 1)])
    idx.queue([deletion("k", 5)])
    assert idx.entry("k") is None  # applied here at once
    records, last = idx.outbox_records()
    assert records == [deletion("k", 5)] and idx.outbox_size() == 1
    idx.queue([put("k2", "p", 10, 10, 6)])
    idx.drop_outbox(last)  # the first was published; the second was queued since
    assert idx.outbox_records()[0] == [put("k2", "p", 10, 10, 6)]


def test_pack_size_is_known_once_its_record_is_applied(tmp_path):
    idx = index(tmp_path)
    assert idx.pack_size("p") is None  # not known yet: not remembered either
    idx.apply([{"op": "pack", "pack": "p", "size": 300, "t": 1}, put("k", "p", 0, 300, 1)])
    assert idx.pack_size("p") == 300
    idx.apply([deletion("k", 2)])  # a pack's size stays what was put, live or not
    assert idx.pack_size("p") == 300
    assert idx.pack_size("other") is None


def test_a_snapshot_rebuilds_the_index_on_a_node_that_has_none(tmp_path):
    idx = index(tmp_path)
    idx.apply([{"op": "pack", "pack": "p1", "size": 200, "t": 1},
               {"op": "pack", "pack": "dead", "size": 100, "t": 1},
               put("a", "p1", 0, 100, 10), put("b", "p1", 100, 100, 10),
               put("c", "dead", 0, 100, 10), deletion("c", 20), deletion("old", 3)])
    idx.apply([{"op": "move", "key": "b", "from": ["p1", 100], "pack": "p2", "off": 0},
               {"op": "pack", "pack": "p2", "size": 100, "t": 12}])
    snapshot = [json.loads(raw) for raw in idx.snapshot(keep_deletions_after=5)]
    assert deletion("old", 3) not in snapshot  # too old to matter any more
    assert deletion("c", 20) in snapshot  # must still beat a late put of c
    assert {r["pack"] for r in snapshot if r["op"] == "pack"} == {"p1", "p2"}
    fresh = index(tmp_path, "fresh")
    fresh.apply(snapshot)
    for key in ("a", "b", "c"):
        assert fresh.entry(key) == idx.entry(key)
    assert fresh.pack_info("p1")["live"] == 100 and fresh.pack_info("p2")["live"] == 100
    fresh.apply([put("c", "dead", 0, 100, 10)])  # the put of c, read late
    assert fresh.entry("c") is None


def test_a_fold_made_before_a_move_does_not_undo_it(tmp_path):
    """Node A folds its index; node B compacts meanwhile. A node that reads the
    move first and the (newer) fold second keeps the moved place."""
    before_move = [{"op": "pack", "pack": "old", "size": 100, "t": 1}, put("k", "old", 0, 100, 5)]
    move = [{"op": "pack", "pack": "new", "size": 100, "t": 6},
            {"op": "move", "key": "k", "from": ["old", 0], "pack": "new", "off": 0}]
    folder = index(tmp_path, "folder")
    folder.apply(before_move)
    fold = [json.loads(raw) for raw in folder.snapshot(keep_deletions_after=0)]
    for order in (before_move + move + fold, before_move + fold + move,
                  fold + move, fold + move + before_move):
        idx = index(tmp_path, f"reader{len(order)}{order.index(move[1])}")
        idx.apply(order)
        assert (idx.entry("k").pack, idx.entry("k").offset) == ("new", 0), order
        assert idx.pack_info("old")["live"] == 0 and idx.pack_info("new")["live"] == 100


async def test_journals_folded_while_a_node_reads_them_are_found_in_the_fold(tmp_path):
    """Another node folds (puts the fold, deletes the journals) between this
    node's LIST and its GETs: the refresh lists again and reads the fold."""
    store = LocalStore(str(tmp_path / "lake"))
    writer = index(tmp_path, "writer")
    journals = []
    for n in range(3):
        records = [{"op": "pack", "pack": f"p{n}", "size": 10, "t": n},
                   put(f"d/f{n}", f"p{n}", 0, 10, 10 + n)]
        name = f"{JOURNAL_DIR}{n:020d}-w-{n}{JOURNAL_SUFFIX}"
        await store.put(name, json.dumps({"v": 1, "node": "w", "records": records}).encode())
        writer.apply(records, name)
        journals.append(name)

    class FoldsUnderTheReader(LocalStore):
        folded = False

        async def iter_list(self, prefix, delimiter):
            async for page in super().iter_list(prefix, delimiter):
                yield page
            if not self.folded:  # right after the reader's first LIST
                self.folded = True
                fold = encode_fold("w", journals, writer.snapshot(0), 0)
                await store.put(f"{JOURNAL_DIR}{9:020d}-w-9{FOLD_SUFFIX}", fold)
                await store.delete_many(journals)

    reader = index(tmp_path, "reader")
    replay = Journals(FoldsUnderTheReader(str(tmp_path / "lake")), reader, 60.0, PackStats())
    replayed = await replay.refresh()
    assert [e.key for e in reader.under("d/")] == ["d/f0", "d/f1", "d/f2"]
    assert replayed == {f"{JOURNAL_DIR}{9:020d}-w-9{FOLD_SUFFIX}"}
    assert replay.stats.journals_read == 1  # the fold; the journals it covers need no GET


def test_a_fold_reads_back_in_batches_and_a_damaged_one_is_refused():
    lines = [json.dumps(put(f"k{i}", "p", i, 1, i)).encode() for i in range(120_000)]
    body = encode_fold("node", ["j1", "j2"], iter(lines), 0)
    header, batches = read_fold(body, batch=50_000)
    got = [records for records, _ in batches]
    assert header.covers == ["j1", "j2"]
    assert [len(b) for b in got] == [50_000, 50_000, 20_000]
    assert got[2][-1] == put("k119999", "p", 119_999, 1, 119_999)
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 0xFF
    for damaged in (body[:len(body) // 2], bytes(flipped), b"not a fold"):
        with pytest.raises(ValueError):
            _, batches = read_fold(damaged)
            list(batches)


async def test_a_node_behind_a_fold_that_left_out_deletions_replays_from_scratch(tmp_path):
    """A fold leaves out deletions older than pack_gc_grace. A node whose last
    replay is older than that may still hold an entry one of them deleted: it
    replays from scratch (keeping its unpublished changes) instead."""
    store = LocalStore(str(tmp_path / "lake"))

    async def journal(n: int, records: list[dict]) -> str:
        name = f"{JOURNAL_DIR}{n:020d}-w-{n}{JOURNAL_SUFFIX}"
        await store.put(name, json.dumps({"v": 1, "node": "w", "records": records}).encode())
        return name

    first = await journal(1, [{"op": "pack", "pack": "p1", "size": 30, "t": 1},
                              put("d/gone", "p1", 0, 10, 10), put("d/kept", "p1", 10, 10, 11)])
    node = index(tmp_path, "node")
    await Journals(store, node, 60.0, PackStats()).refresh()
    node.queue([put("d/mine", "p1", 20, 10, 12)])  # a local rename, not published yet
    assert {e.key for e in node.under("d/")} == {"d/gone", "d/kept", "d/mine"}

    second = await journal(2, [deletion("d/gone", 20)])
    folder = index(tmp_path, "folder")
    await Journals(store, folder, 60.0, PackStats()).refresh()
    dels_after = time.time_ns() + 1  # after the node's replay: "d/gone"'s deletion goes
    fold = encode_fold("w", [first, second], folder.snapshot(dels_after), dels_after)
    assert b"d/gone" not in gzip.decompress(fold)
    await store.put(f"{JOURNAL_DIR}{3:020d}-w-3{FOLD_SUFFIX}", fold)
    await store.delete_many([first, second])

    await Journals(store, node, 60.0, PackStats()).refresh()
    assert {e.key for e in node.under("d/")} == {"d/kept", "d/mine"}
    assert node.outbox_records()[0] == [put("d/mine", "p1", 20, 10, 12)]
    assert node.pack_info("p1")["live"] == 20


async def _sharded_lake(tmp_path, files_per_dir: int = 30, dirs: int = 20):
    """A lake whose journals were folded into a sharded fold; the writer's
    index (which holds it all) and the fold's name."""
    store = CountingStore(LocalStore(str(tmp_path / "lake")))
    writer = index(tmp_path, "writer")
    names = []
    for d in range(dirs):
        records = [{"op": "pack", "pack": f"p{d}", "size": 10 * files_per_dir, "t": d}]
        records += [put(f"d{d}/f{i}", f"p{d}", 10 * i, 10, 100 + i)
                    for i in range(files_per_dir)]
        records.append(object_record(f"d{d}/", '"marker"', {"mode": "16877"}, 5))
        name = f"{JOURNAL_DIR}{d:020d}-w-{d}{JOURNAL_SUFFIX}"
        await store.put(name, json.dumps({"v": 1, "node": "w", "records": records}).encode())
        writer.apply(records, name)
        names.append(name)
    head, parts = encode_sharded_fold("w", names, writer.snapshot(0), 0, shards=8)
    fold = f"{JOURNAL_DIR}{99:020d}-w-99{FOLD_SUFFIX}"
    for shard, part in enumerate(parts):
        await store.put(shard_key(fold, shard), part)
    await store.put(fold, head)
    await store.delete_many(names)
    return store, writer, fold


def _files(idx: PackIndex, prefix: str) -> dict:
    return {name: entry for name, entry in idx.children(prefix)}


async def test_a_sharded_fold_is_read_one_directory_at_a_time(tmp_path):
    """A new node reads a sharded fold's head, then for each directory it lists
    only the shard that holds it: what it reads grows with the directories it
    visits, and once it has read them all its index is the writer's."""
    store, writer, fold = await _sharded_lake(tmp_path)
    reader = index(tmp_path, "reader")
    replay = Journals(store, reader, 60.0, PackStats())
    before = store.requests["GetObject"]
    await replay.refresh()
    assert store.requests["GetObject"] - before == 1  # the head alone
    assert reader.pack_info("p3")["size"] == 300  # its pack records: sizes for reads
    assert _files(reader, "d3/") == {}  # nothing about keys yet

    before = store.requests["GetObject"]
    await replay.ensure_dir("d3/")
    assert store.requests["GetObject"] - before == 1
    assert _files(reader, "d3/") == _files(writer, "d3/") and len(_files(writer, "d3/")) == 30
    await replay.ensure_dir("")  # the top's shard: the directories' markers
    assert reader.objects("") == writer.objects("") and "d3/" in reader.objects("")
    loaded = {d for d in range(20) if _files(reader, f"d{d}/")}
    assert len(loaded) < 20  # the other directories' shards were not read

    before = store.requests["GetObject"]
    await replay.ensure_dir("d3/")  # read once
    assert store.requests["GetObject"] == before
    await replay.ensure_complete()
    assert reader.pending() == {}
    assert list(reader.snapshot(0)) == list(writer.snapshot(0))
    assert replay.stats.shards_read == 8


async def test_a_sharded_fold_folded_again_is_read_from_the_newer_fold(tmp_path):
    """Another node folds again (a newer fold covers the first; the first and
    its shards are deleted) while this node has read only some shards: the
    next directory it lists comes from the newer fold."""
    store, writer, fold = await _sharded_lake(tmp_path)
    reader = index(tmp_path, "reader")
    replay = Journals(store, reader, 60.0, PackStats())
    await replay.refresh()
    await replay.ensure_dir("d1/")
    head, parts = encode_sharded_fold("w", [fold], writer.snapshot(0), 0, shards=4)
    newer = f"{JOURNAL_DIR}{100:020d}-w-100{FOLD_SUFFIX}"
    for shard, part in enumerate(parts):
        await store.put(shard_key(newer, shard), part)
    await store.put(newer, head)
    await store.delete_many([fold] + [shard_key(fold, shard) for shard in range(8)])

    missing = next(d for d in range(20)
                   if shard_of(f"d{d}/", 8) not in reader.pending()[fold]["done"])
    await replay.ensure_dir(f"d{missing}/")
    assert _files(reader, f"d{missing}/") == _files(writer, f"d{missing}/")
    assert list(reader.pending()) == [newer]
    await replay.ensure_complete()
    assert list(reader.snapshot(0)) == list(writer.snapshot(0))


def test_a_shard_of_another_fold_or_damaged_is_refused():
    lines = [json.dumps(put(f"d{i % 7}/k{i}", "p", i, 1, i)).encode() for i in range(500)]
    _, parts = encode_sharded_fold("node", ["j"], iter(lines), 0, shards=4)
    assert sum(len(records) for part in range(4)
               for records, _ in read_shard(parts[part], part, 4)) == 500
    for raw, shard, shards in ((parts[1], 2, 4), (parts[1], 1, 8), (parts[1][:40], 1, 4)):
        with pytest.raises(ValueError):
            list(read_shard(raw, shard, shards))


async def test_a_compactions_moves_wait_for_the_shards_of_the_files_they_move(tmp_path):
    """A move applies only where the file still is. A node that has read a
    sharded fold's head but not the shard of a directory, then reads another
    node's compaction of that directory's pack, must still end with the files
    in the new pack (else it would count the new pack dead, and collect it)."""
    store, writer, _ = await _sharded_lake(tmp_path)
    reader = index(tmp_path, "reader")
    replay = Journals(store, reader, 60.0, PackStats())
    await replay.refresh()
    moves = [{"op": "pack", "pack": "pnew", "size": 300, "t": 500}]
    moves += [{"op": "move", "key": f"d3/f{i}", "from": ["p3", 10 * i], "pack": "pnew",
               "off": 10 * i} for i in range(30)]
    name = f"{JOURNAL_DIR}{200:020d}-w-200{JOURNAL_SUFFIX}"
    await store.put(name, json.dumps({"v": 1, "node": "w", "records": moves}).encode())
    writer.apply(moves, name)
    await replay.refresh()
    await replay.ensure_complete()
    assert reader.entry("d3/f0").pack == "pnew"
    assert reader.pack_info("pnew")["live"] == writer.pack_info("pnew")["live"] == 300
    assert reader.pack_info("p3")["live"] == 0
    assert list(reader.snapshot(0)) == list(writer.snapshot(0))


async def test_a_shard_fetched_before_a_replay_from_scratch_is_not_applied(tmp_path):
    """A shard on its way while the node replays from scratch (a newer fold
    left out deletions) must not bring back a file deleted since."""
    store, writer, fold = await _sharded_lake(tmp_path)
    gate, reached = trio.Event(), trio.Event()

    class Gated(CountingStore):
        async def get_range(self, key, start, length, if_match=None):
            raw = await super().get_range(key, start, length, if_match)
            if key.startswith(".aifs/index/") and not gate.is_set():
                reached.set()
                await gate.wait()
            return raw

    gated = Gated(LocalStore(str(tmp_path / "lake")))
    reader = index(tmp_path, "reader")
    replay = Journals(gated, reader, 60.0, PackStats())
    await replay.refresh()
    reader.apply([put("other/x", "p0", 0, 10, 1)])  # (not empty: a reset is due)
    deleted = f"{JOURNAL_DIR}{300:020d}-w-300{JOURNAL_SUFFIX}"
    records = [deletion("d3/f0", 200)]
    await store.put(deleted, json.dumps({"v": 1, "node": "w", "records": records}).encode())
    writer.apply(records, deleted)
    keep_after = time.time_ns()
    head, parts = encode_sharded_fold("w", [fold, deleted], writer.snapshot(keep_after),
                                      keep_after, shards=4)
    newer = f"{JOURNAL_DIR}{400:020d}-w-400{FOLD_SUFFIX}"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replay.ensure_dir, "d3/")  # the old fold's shard, held back
        await reached.wait()
        for shard, part in enumerate(parts):
            await store.put(shard_key(newer, shard), part)
        await store.put(newer, head)
        await store.delete_many([fold, deleted])
        await replay.refresh()  # another listing: the newer fold, from scratch
        gate.set()
    await replay.ensure_complete()
    assert writer.entry("d3/f0") is None
    assert reader.entry("d3/f0") is None
    assert reader.entry("d3/f1") is not None


async def test_an_unreadable_shard_stops_what_needs_the_whole_index(tmp_path):
    """A damaged shard: its files stay hidden in listings, and compaction,
    collection and folding refuse to run (they would count its packs dead);
    this node never folds the fold away, so its records are not lost."""
    store, writer, fold = await _sharded_lake(tmp_path)
    await store.put(shard_key(fold, shard_of("d3/", 8)), b"not a shard")
    reader = index(tmp_path, "reader")
    replay = Journals(store, reader, 60.0, PackStats())
    await replay.refresh()
    await replay.ensure_dir("d3/")  # logged; the listing goes on
    assert _files(reader, "d3/") == {}
    with pytest.raises(LakeError, match="could not be read"):
        await replay.ensure_complete()
    assert fold in reader.pending()
    assert fold not in await replay.refresh()  # never covered by this node's fold


async def test_a_directory_without_a_marker_shows_before_its_shard_is_read(tmp_path):
    """A directory holding packed files, with no marker object (another
    tool's): its parent's listing shows it from the fold's "dir" record; once
    its own shard is read, it shows only while it holds live files."""
    store = CountingStore(LocalStore(str(tmp_path / "lake")))
    writer = index(tmp_path, "writer")
    records = [{"op": "pack", "pack": "p", "size": 100, "t": 1}]
    records += [put(f"top/d{d}/f{i}", "p", 10 * i, 10, 10 + i) for d in range(4)
                for i in range(3)]
    name = f"{JOURNAL_DIR}{1:020d}-w-1{JOURNAL_SUFFIX}"
    await store.put(name, json.dumps({"v": 1, "node": "w", "records": records}).encode())
    writer.apply(records, name)
    gone = [deletion(f"top/d2/f{i}", 100) for i in range(3)]
    writer.apply(gone)
    head, parts = encode_sharded_fold("w", [name], writer.snapshot(0), 0, shards=4)
    fold = f"{JOURNAL_DIR}{2:020d}-w-2{FOLD_SUFFIX}"
    for shard, part in enumerate(parts):
        await store.put(shard_key(fold, shard), part)
    await store.put(fold, head)
    await store.delete_many([name])

    reader = index(tmp_path, "reader")
    replay = Journals(store, reader, 60.0, PackStats())
    await replay.refresh()
    await replay.ensure_dir("")
    assert [n for n, e in reader.children("")] == ["top"]
    await replay.ensure_dir("top/")
    assert sorted(n for n, e in reader.children("top/")) == ["d0", "d1", "d3"]
    await replay.ensure_complete()
    assert sorted(n for n, e in reader.children("top/")) == ["d0", "d1", "d3"]


def test_a_fold_of_a_newer_format_is_refused():
    body = encode_fold("node", ["j"], iter([]), 0)
    header = json.loads(gzip.decompress(body).splitlines()[0])
    header["v"] = 3
    with pytest.raises(ValueError, match="newer"):
        read_fold(gzip.compress(json.dumps(header).encode() + b"\n"))


async def test_a_read_ahead_at_mount_is_no_refresh(tmp_path):
    """The journals a mount reads ahead spare its first listing their GETs,
    but not its LIST: a journal published since is read then. A listing that
    comes while the read-ahead runs lists the journals itself and replays,
    after it, only what the read-ahead did not."""
    store = LocalStore(str(tmp_path / "lake"))

    async def journal(n: int) -> str:
        records = [{"op": "pack", "pack": f"p{n}", "size": 10, "t": n},
                   put(f"d/f{n}", f"p{n}", 0, 10, 10 + n)]
        name = f"{JOURNAL_DIR}{n:020d}-w-{n}{JOURNAL_SUFFIX}"
        await store.put(name, json.dumps({"v": 1, "node": "w", "records": records}).encode())
        return name

    gate, reached = trio.Event(), trio.Event()

    class Gated(CountingStore):
        async def get_range(self, key, start, length, if_match=None):
            if not gate.is_set():
                reached.set()
                await gate.wait()
            return await super().get_range(key, start, length, if_match)

    await journal(1)
    gate.set()
    counted = Gated(LocalStore(str(tmp_path / "lake")))
    replay = Journals(counted, index(tmp_path, "a"), 60.0, PackStats())
    await replay.read_ahead()
    assert [e.key for e in replay.index.under("d/")] == ["d/f1"]
    await journal(2)  # published after the read-ahead's LIST
    lists = counted.requests["ListObjectsV2"]
    await replay.refresh_if_stale()  # the first listing
    assert [e.key for e in replay.index.under("d/")] == ["d/f1", "d/f2"]
    assert counted.requests["ListObjectsV2"] == lists + 1
    assert replay.stats.journals_read == 2  # each journal once
    await replay.refresh_if_stale()  # that one was a refresh: fresh for the TTL
    assert counted.requests["ListObjectsV2"] == lists + 1

    gate, reached = trio.Event(), trio.Event()
    replay = Journals(counted, index(tmp_path, "b"), 60.0, PackStats())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replay.read_ahead)
        await reached.wait()  # the read-ahead's GET, held back
        await journal(3)
        lists = counted.requests["ListObjectsV2"]
        nursery.start_soon(replay.refresh_if_stale)  # a listing meanwhile: it lists at once
        with trio.fail_after(10):  # (not after the read-ahead)
            while counted.requests["ListObjectsV2"] == lists:
                await trio.sleep(0.001)
        gate.set()
    assert [e.key for e in replay.index.under("d/")] == ["d/f1", "d/f2", "d/f3"]
    assert counted.requests["ListObjectsV2"] == lists + 1  # no LIST after the wait
    assert replay.stats.journals_read == 3
