"""LMDB metadata without a mount."""

from __future__ import annotations

import pytest
from support.meta import meta_dump

from aifs.meta.batches import batchable
from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore, valid_name


def _files(*names: str, prefix: str = "") -> list[Listed]:
    return [Listed(n, FILE, prefix + n, len(n), f"e-{n}", 1.0) for n in names]


def test_valid_names():
    assert valid_name("a.txt") and valid_name("x" * 255) and valid_name("ünï")
    for bad in ("", ".", "..", "x" * 256, "a\0b", "é" * 128):
        assert not valid_name(bad), bad


def test_lookup_and_stable_inode_numbers(tmp_path):
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, _files("a", "b") + [Listed("d", DIR, "d/")], now=10)
    a = meta.lookup(ROOT_INO, b"a")
    assert a is not None and a.key == "a" and a.size == 1 and a.etag == "e-a"
    assert meta.lookup(ROOT_INO, b"zz") is None
    assert meta.get(ROOT_INO).listed_at == 10
    meta.close()
    again = MetaStore(tmp_path / "m")  # remount: same numbers
    assert again.lookup(ROOT_INO, b"a").ino == a.ino
    assert again.lookup(ROOT_INO, b"d").is_dir


def test_listing_updates_and_removes(tmp_path):
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, _files("a", "b", "c"))
    b = meta.lookup(ROOT_INO, b"b")
    changed = [Listed("a", FILE, "a", 99, "new", 2.0), *_files("c")]
    removed, replaced = meta.apply_listing(ROOT_INO, changed)
    assert removed == [b.ino] and replaced == [meta.lookup(ROOT_INO, b"a").ino]
    assert meta.get(b.ino).orphan and meta.lookup(ROOT_INO, b"b") is None
    assert meta.lookup(ROOT_INO, b"a").etag == "new"
    meta.delete_orphan(b.ino)
    assert meta.get(b.ino) is None
    # a file that became a directory gets a fresh inode
    old = meta.lookup(ROOT_INO, b"c").ino
    meta.apply_listing(ROOT_INO, [Listed("c", DIR, "c/")])
    assert meta.lookup(ROOT_INO, b"c").is_dir and meta.lookup(ROOT_INO, b"c").ino != old
    assert len(meta.purge_orphans()) >= 1


def test_readdir_cookies_are_stable(tmp_path):
    meta = MetaStore(tmp_path / "m")
    names = [f"f{i:04d}" for i in range(2500)]
    meta.apply_listing(ROOT_INO, _files(*names))
    first = meta.readdir(ROOT_INO, 0, 1000)
    assert [n for _, n, _ in first] == [n.encode() for n in names[:1000]]
    # entries vanish and appear between two readdir calls: the rest is unaffected
    survivors = [n for n in names if n not in ("f0000", "f1500")] + ["zz-new"]
    meta.apply_listing(ROOT_INO, _files(*survivors))
    rest, cookie = [], first[-1][0]
    while batch := meta.readdir(ROOT_INO, cookie, 700):
        rest += [n.decode() for _, n, _ in batch]
        cookie = batch[-1][0]
    assert rest == [n for n in names[1000:] if n != "f1500"] + ["zz-new"]
    assert meta.children_count(ROOT_INO) == len(survivors)


def test_local_state_wins_over_listings(tmp_path):
    from aifs.meta.store import DATA, Inode
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, _files("old", "gone"))
    new = meta.create(ROOT_INO, b"new", Inode(0, FILE, "new", ROOT_INO, pending=DATA))
    meta.remove(ROOT_INO, b"gone")  # deleted here, not yet in the lake
    assert meta.tombstoned("gone")
    # a LIST that does not know "new" yet and still shows "gone"
    meta.apply_listing(ROOT_INO, _files("old", "gone"), started=0.0)
    assert meta.lookup(ROOT_INO, b"new").ino == new.ino
    assert meta.lookup(ROOT_INO, b"gone") is None
    assert [i.ino for i in meta.pending_inodes()] == [new.ino]


def test_a_listing_begun_before_an_entry_reached_the_lake_keeps_it(tmp_path):
    """A LIST that started before a new directory's marker (or a new file)
    landed, and is applied after its promotion settled, does not show it: the
    entry must stay (it did not: lookup said ENOENT, then mkdir EEXIST)."""
    import time

    from aifs.meta.store import DATA, META, Inode
    meta = MetaStore(tmp_path / "m")
    made = time.time() - 10
    d = meta.create(ROOT_INO, b"d", Inode(0, DIR, "d/", ROOT_INO, pending=META, ctime=made))
    f = meta.create(ROOT_INO, b"f", Inode(0, FILE, "f", ROOT_INO, pending=DATA, ctime=made))
    started = time.time()  # the LIST begins; then both promotions settle
    meta.settle(d.ino, "d/", META)
    meta.settle(f.ino, "f", DATA, etag='"new"', size=3)
    removed, replaced = meta.apply_listing(ROOT_INO, [], started=started)
    assert (removed, replaced) == ([], [])
    assert meta.lookup(ROOT_INO, b"d").ino == d.ino
    assert meta.lookup(ROOT_INO, b"f").etag == '"new"'
    # a LIST that began after they landed is believed
    removed, _ = meta.apply_listing(ROOT_INO, [], started=time.time() + 1)
    assert sorted(removed) == sorted([d.ino, f.ino])


def test_rename_rekeys_the_subtree(tmp_path):
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, [Listed("d", DIR, "d/")])
    d = meta.lookup(ROOT_INO, b"d")
    meta.apply_listing(d.ino, [*_files("x", prefix="d/"), Listed("s", DIR, "d/s/")])
    s = meta.lookup(d.ino, b"s")
    meta.apply_listing(s.ino, _files("y", prefix="d/s/"))
    moved, replaced = meta.rename(ROOT_INO, b"d", ROOT_INO, b"e", "e/",
                                  tombstones=["d/x", "d/s/y", "d/"],
                                  etags={"e/x": "ex", "e/s/y": "ey"})
    assert replaced is None and moved.key == "e/"
    assert meta.lookup(ROOT_INO, b"d") is None
    y = meta.lookup(meta.lookup(moved.ino, b"s").ino, b"y")
    assert (y.key, y.etag) == ("e/s/y", "ey")
    assert meta.owner_of("e/s/y") == y.ino and meta.owner_of("d/s/y") is None
    assert sorted(meta.tombstones()) == ["d/", "d/s/y", "d/x"]


def test_a_key_tombstoned_again_during_its_delete_keeps_its_tombstone(tmp_path):
    """The promoter drops a tombstone after its delete only if no one tombstoned the
    key again meanwhile (an upload that landed after the delete started)."""
    meta = MetaStore(tmp_path / "meta")
    meta.add_tombstone("a")
    meta.add_tombstone("b")
    marks = meta.tombstone_marks(["a", "b"])  # a delete of a and b starts
    meta.add_tombstone("a")  # a stale upload of "a" landed meanwhile
    meta.drop_tombstones(marks)  # the delete returned
    assert meta.tombstones() == {"a": 0}
    meta.drop_tombstones(meta.tombstone_marks(["a"]))
    assert meta.tombstones() == {}


def test_a_store_of_schema_2_opens_with_its_dirty_data(tmp_path):
    """An upgrade migrates the store: the record of a file not yet promoted
    survives, and mode 0 of schema 2 ('the default') becomes -1."""
    import json

    import lmdb

    from aifs.meta.store import DATA, FILE, MetaStore, u64
    path = tmp_path / "meta"
    meta = MetaStore(path)
    dirty = meta.create(1, b"dirty.bin", Inode(0, FILE, "dirty.bin", 1, size=5, pending=DATA,
                                                 mode=0o600))
    plain = meta.create(1, b"plain.bin", Inode(0, FILE, "plain.bin", 1, size=9, etag='"e"'))
    meta.close()
    env = lmdb.open(str(path), max_dbs=20)  # written back as schema 2 had it
    inodes, sys_db = env.open_db(b"inode"), env.open_db(b"sys")
    with env.begin(write=True) as txn:
        for inode in (dirty, plain):
            raw = _schema_3_record(inode)
            if inode is plain:
                raw["mode"] = 0
            raw.pop("atime_ns", None), raw.pop("rdev", None)  # (schema 2 had neither)
            txn.put(u64(inode.ino), json.dumps(raw).encode(), db=inodes)
        txn.put(b"schema", b"2", db=sys_db)
    env.close()
    meta = MetaStore(path)
    assert [i.ino for i in meta.pending_inodes()] == [dirty.ino]
    assert meta.get(dirty.ino).mode == 0o600 and meta.get(dirty.ino).size == 5
    assert meta.get(plain.ino).mode == -1
    assert meta.lookup(1, b"plain.bin").ino == plain.ino
    meta.close()


def _schema_3_record(inode: Inode) -> dict:
    """An inode record as schema 3 and older stored it: an object of the
    fields not at their defaults."""
    full = Inode(0, "file", "", 0).__dict__
    return {name: value for name, value in inode.__dict__.items()
            if name in ("ino", "kind", "key", "parent") or value != full[name]}


def test_a_store_of_schema_3_opens_with_its_records_made_compact(tmp_path, monkeypatch):
    """Schema 3 stored each inode as a JSON object with its field names; now
    the common fields go in a list: a store of schema 3 opens with every
    record, dirty ones above all, and each takes less room (rewritten a few
    records per transaction: here two)."""
    import json

    import lmdb

    from aifs.meta import schema
    from aifs.meta.store import DATA, DIR, FILE, MetaStore, u64
    monkeypatch.setattr(schema, "MIGRATE_CHUNK", 2)
    path = tmp_path / "meta"
    meta = MetaStore(path)
    made = [meta.create(1, b"dirty.bin", Inode(0, FILE, "dirty.bin", 1, size=5, pending=DATA,
                                                 mode=0o600, xattrs={"user.k": "dg=="})),
            meta.create(1, b"d", Inode(0, DIR, "d/", 1, mode=0o750)),
            meta.create(1, b"plain.bin", Inode(0, FILE, "plain.bin", 1, size=9, etag='"e"',
                                               mtime_ns=12345))]
    meta.close()
    env = lmdb.open(str(path), max_dbs=20)
    inodes, sys_db = env.open_db(b"inode"), env.open_db(b"sys")
    with env.begin(write=True) as txn:
        old_sizes = {}
        for inode in made:
            raw = json.dumps(_schema_3_record(inode), separators=(",", ":")).encode()
            old_sizes[inode.ino] = len(raw)
            txn.put(u64(inode.ino), raw, db=inodes)
        txn.put(b"schema", b"3", db=sys_db)
    env.close()
    meta = MetaStore(path)
    for inode in made:
        assert meta.get(inode.ino) == inode
    assert [i.ino for i in meta.pending_inodes()] == [made[0].ino]
    assert meta.subdir_count(1) == 1
    with meta.env.begin() as txn:
        for inode in made:
            assert len(txn.get(u64(inode.ino), db=meta.inodes)) < old_sizes[inode.ino]
    meta.close()


def test_a_store_of_schema_4_opens_with_smaller_records_even_after_a_cut_migration(
        tmp_path, monkeypatch):
    """Schema 4 stored the kind as a letter and an S3 ETag with its quotes
    (escaped: four bytes); schema 5 a number and no quotes. A store of schema 4
    opens with every record as it was, smaller; one whose migration was cut
    short (some records already rewritten, the schema still 4) too."""
    import json

    import lmdb

    from aifs.meta import schema
    from aifs.meta.store import DATA, DIR, FILE, LINK, u64
    monkeypatch.setattr(schema, "MIGRATE_CHUNK", 2)
    path = tmp_path / "meta"
    meta = MetaStore(path)
    made = [meta.create(1, b"s3.bin", Inode(0, FILE, "s3.bin", 1, size=9, etag='"0a1b-2"',
                                              mtime_ns=12345)),
            meta.create(1, b"local.bin", Inode(0, FILE, "local.bin", 1, size=3,
                                                 etag="1a-2b-3c", pending=DATA)),
            meta.create(1, b"odd.bin", Inode(0, FILE, "odd.bin", 1, etag='"=x"')),
            meta.create(1, b"new.bin", Inode(0, FILE, "new.bin", 1, etag="?")),
            meta.create(1, b"d", Inode(0, DIR, "d/", 1, mode=0o750)),
            meta.create(1, b"l", Inode(0, LINK, "l", 1, target="s3.bin"))]
    meta.close()
    letters = {FILE: "f", DIR: "d", LINK: "l"}
    env = lmdb.open(str(path), max_dbs=20)
    inodes, sys_db = env.open_db(b"inode"), env.open_db(b"sys")
    with env.begin(write=True) as txn:
        now = {inode.ino: bytes(txn.get(u64(inode.ino), db=inodes)) for inode in made}
        old = {}
        for inode in made[1:2] + made[3:]:  # the rest as a migration cut short left them
            record = json.loads(now[inode.ino])
            record[1], record[5] = letters[inode.kind], inode.etag
            old[inode.ino] = json.dumps(record, separators=(",", ":")).encode()
            txn.put(u64(inode.ino), old[inode.ino], db=inodes)
        txn.put(b"schema", b"4", db=sys_db)
    env.close()
    meta = MetaStore(path)
    for inode in made:
        assert meta.get(inode.ino) == inode
    assert [i.ino for i in meta.pending_inodes()] == [made[1].ino]
    assert meta.subdir_count(1) == 1
    with meta.env.begin() as txn:
        assert {inode.ino: bytes(txn.get(u64(inode.ino), db=meta.inodes))
                for inode in made} == now
    assert len(now[made[1].ino]) == len(old[made[1].ino]) - 2 + 1  # a number; "=" etag
    assert b'"0a1b-2"' in now[made[0].ino]  # no quotes, no escapes
    meta.close()


def test_a_store_of_an_unknown_schema_is_refused_and_kept(tmp_path):
    import lmdb

    from aifs.meta.store import SchemaError
    path = tmp_path / "meta"
    MetaStore(path).close()
    env = lmdb.open(str(path), max_dbs=20)
    sys_db = env.open_db(b"sys")  # opened outside the write transaction, which it would wait on
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"99", db=sys_db)
    env.close()
    with pytest.raises(SchemaError, match="schema 99"):
        MetaStore(path)
    assert (path / "data.mdb").exists()


def test_a_record_that_comes_after_its_object_was_listed_gives_its_attributes(tmp_path):
    """Another node's journal may come after a LIST showed its object: the
    next listing of the same version takes the record's attributes (they are
    not read otherwise), and never over ones already known."""
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, _files("a", "b"), now=1)
    ino = meta.lookup(ROOT_INO, b"a").ino
    assert meta.get(ino).mode == -1 and not meta.get(ino).attrs_known
    described = Listed("a", FILE, "a", 1, "e-a", 1.0,
                       {"mode": 0o600, "uid": 7, "attrs_known": True})
    meta.apply_listing(ROOT_INO, [described] + _files("b"), now=2)
    a = meta.get(ino)
    assert (a.ino, a.mode, a.uid, a.attrs_known) == (ino, 0o600, 7, True)
    meta.update(ino, mode=0o640)  # known (here, say by a chmod promoted since)
    meta.apply_listing(ROOT_INO, [described] + _files("b"), now=3)
    assert meta.get(ino).mode == 0o640


def test_every_database_is_in_the_schema_table(tmp_path):
    """aifs.meta.schema tables every database of the environment: the store
    and the pack index open exactly those, and the table names each."""
    from aifs.meta import schema
    from aifs.pack.index import PackIndex

    meta = MetaStore(tmp_path / "m")
    PackIndex(meta)
    with meta.env.begin() as txn:
        names = {bytes(key) for key, _ in txn.cursor()}
    assert names == set(schema.DATABASES)
    assert len(schema.DATABASES) <= schema.MAX_DBS
    rows = {line.split()[0] for line in schema.__doc__.splitlines() if line[:1].isalpha()}
    assert {name.decode() for name in schema.DATABASES} <= rows
    meta.close()


@pytest.mark.parametrize("key", ["a", "dir/f\u00fc\u00df.bin", 'q"uote\\back\tslash',
                                 "bad\udcff-byte", "\u65e5\u672c/\U0001f600"])
@pytest.mark.parametrize("etag", ["", '"0123456789abcdef"', "plain", '"=odd"', '"a"b"'])
def test_a_plain_record_is_the_json_list_every_reader_parses(key, etag):
    """The fast form of a record with only the head fields is byte for byte
    the JSON list the general form writes, and decodes to the same inode."""
    from aifs.meta.inode import _HEAD
    from aifs.meta.schema import compact_json, stored_json
    for kind in (FILE, DIR):
        inode = Inode(2**40 + 7, kind, key, 3, 16384, etag, 1_700_000_000_123_456_789)
        raw = inode.encode()
        values = [getattr(inode, name) for name in _HEAD]
        values[1] = 1 if kind == DIR else 0
        values[5] = etag[1:-1] if etag.startswith('"') and etag.count('"') == 2 \
            and etag[1] != "=" else ("=" + etag if etag else "")
        assert raw == compact_json(values).encode()
        assert stored_json(raw) == values
        assert Inode.decode(raw) == inode
        inode.mode = 0o600  # with a field past the head: the general form
        assert Inode.decode(inode.encode()) == inode


@pytest.mark.parametrize("odd", [{"ino": True}, {"size": 1.0}, {"size": None},
                                 {"mtime_ns": 1.5e9}, {"parent": False}, {"key": None}])
def test_a_record_with_odd_types_is_written_as_the_json_encoder_does(odd):
    from aifs.meta.inode import _HEAD
    from aifs.meta.schema import compact_json
    inode = Inode(5, FILE, "k", 1, 3, "", 7)
    inode.__dict__.update(odd)
    values = [getattr(inode, name) for name in _HEAD]
    values[1] = 0
    assert inode.encode() == compact_json(values).encode()


def test_a_stored_record_reads_back_as_stored_though_the_writer_changes_its_inode():
    """What a write stores is remembered as a copy: changing the inode the
    writer holds (or its containers) afterwards changes nothing read back."""
    inode = Inode(11, FILE, "f", 1, 3, "", 5, mode=0o644, xattrs={"user.a": "eA=="},
                  links=[[1, "g"]])
    raw = inode.encode_stored()
    inode.size = 99
    inode.xattrs["user.b"] = "eQ=="
    inode.links[0][1] = "h"
    back = Inode.decode(raw)
    assert (back.size, back.xattrs, back.links) == (3, {"user.a": "eA=="}, [[1, "g"]])


def test_a_decoded_inode_changed_in_place_leaves_the_next_decode_alone():
    """Adding a link or an xattr to a decoded inode (as ``link`` does before
    storing it) does not change what the same record decodes to next time
    (decodes are remembered by their bytes)."""
    raw = Inode(9, FILE, "f", 1, 3, '"e"', 5).encode()
    first = Inode.decode(raw)
    first.links.append([1, "g"])
    first.xattrs["user.a"] = "eA=="
    again = Inode.decode(raw)
    assert again.links == [] and again.xattrs == {}


def test_a_first_listing_in_bulk_stores_what_the_entry_by_entry_path_does(tmp_path,
                                                                          monkeypatch):
    """A directory's first listing writes its records in bulk; the store ends
    byte for byte as the general path leaves it: a tombstoned key stays
    hidden unless packed, a key that has an inode already (a name moved here)
    keeps it, a packed file's fields are kept, ``names`` gets every name."""
    from aifs.meta import listing

    def build(path, bulk):
        if not bulk:
            # (the general path in the order the bulk one numbers: batched files first)
            monkeypatch.setattr(
                listing.ListingMixin, "_link_new",
                lambda self, txn, parent, listed, counters, names, dir_key:
                [e for e in listed if batchable(e, dir_key)]
                + [e for e in listed if not batchable(e, dir_key)])
        meta = MetaStore(path)
        meta.apply_listing(ROOT_INO, [Listed("src", DIR, "src/"), Listed("dst", DIR, "dst/")],
                           now=5)
        src, dst = meta.lookup(ROOT_INO, b"src"), meta.lookup(ROOT_INO, b"dst")
        meta.apply_listing(src.ino, _files("moved", "gone", prefix="src/"), now=5)
        meta.remove(src.ino, b"gone")  # tombstoned: dst/gone's own key is not
        with meta.env.begin(write=True) as txn:  # a name moved here keeps its inode
            moved = meta.lookup(src.ino, b"moved")
            txn.put(b"dst/moved", moved.ino.to_bytes(8, "big"), db=meta.objkeys)
        with meta.env.begin(write=True) as txn:
            meta._tomb(txn, "dst/dead", 99)
            meta._tomb(txn, "dst/dead-but-packed", 98)
        names: list[bytes] = []
        listed = _files("a", "b", "moved", "dead", "gone", prefix="dst/") + [
            Listed("dead-but-packed", FILE, "dst/dead-but-packed", 5, "e", 2.0,
                   {"pack": "p1", "pack_offset": 7, "attrs_known": True, "mode": 0o600}),
            Listed("sub", DIR, "dst/sub/"), Listed("ünï", FILE, "dst/ünï", 3, "e-u", 3.0),
            # a LIST gives neither, but the general path's answer holds for them too:
            Listed("twin", FILE, "dst/a", 1, "e-a", 1.0),  # a key listed twice
            Listed("moved", FILE, "dst/moved2", 2, "e-m", 1.0)]  # a name listed twice
        result = meta.apply_listing(dst.ino, listed, now=7, started=6, names=names)
        # (dst's batch became records within the listing: "twin" names a batched key)
        assert meta.materialize_all() == 0
        dump = meta_dump(meta)
        meta.close()
        monkeypatch.undo()
        return result, names, dump

    bulk = build(tmp_path / "bulk", True)
    general = build(tmp_path / "general", False)
    assert bulk[0] == general[0] and sorted(bulk[1]) == sorted(general[1])
    assert b"dead" not in bulk[1] and b"dead-but-packed" in bulk[1] and len(bulk[1]) == 9
    assert bulk[2].keys() == general[2].keys()
    for db in bulk[2]:
        if db not in (b"cookie", b"dentry"):
            assert bulk[2][db] == general[2][db], db
    # (cookies give the order of a directory's entries: the moved name comes last in bulk)
    assert [(k, v[:8]) for k, v in bulk[2][b"dentry"]] == \
        [(k, v[:8]) for k, v in general[2][b"dentry"]]
    assert sorted(v for _, v in bulk[2][b"cookie"]) == sorted(v for _, v in general[2][b"cookie"])


def test_an_orphan_directory_dropped_leaves_a_hard_linked_file_its_other_names(tmp_path):
    """A directory another node deleted (gone from its parent's listing) is
    dropped with what is below it once the kernel forgets it (or at the next
    mount); a file in it hard-linked from elsewhere keeps its other name."""
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, [Listed("a", DIR, "a/"), Listed("b", DIR, "b/")], now=1)
    a, b = meta.lookup(ROOT_INO, b"a"), meta.lookup(ROOT_INO, b"b")
    meta.apply_listing(a.ino, [Listed("f", FILE, "a/f", 3, "e", 2.0)], now=1)
    f = meta.lookup(a.ino, b"f")
    meta.link(f.ino, b.ino, b"g", "b/g", "group-1")
    removed, _ = meta.apply_listing(ROOT_INO, [Listed("b", DIR, "b/")], now=2, started=2)
    assert removed == [a.ino] and meta.get(a.ino).orphan
    meta.delete_orphan(a.ino)
    g = meta.lookup(b.ino, b"g")
    assert g is not None and g.ino == f.ino and not g.orphan and g.size == 3
    assert [name for _, name, _ in meta.readdir(b.ino, 0, 10)] == [b"g"]
    assert meta.purge_orphans() == [] and meta.lookup(b.ino, b"g") == g
    meta.close()
