"""The pack index without a mount: journal records applied in any order give
the same packed files (last writer wins per key), directory children come
from a skip scan, moves apply only where the entry still is, and live bytes
per pack follow every change."""

from __future__ import annotations

import itertools

from aifs.meta.packindex import PackedEntry, PackIndex, checksum, deletion
from aifs.meta.store import MetaStore


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
