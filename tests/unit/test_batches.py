"""A first listing's plain files as one record per directory (aifs.meta.batches).

The same operations run on a store with batches and one without: every read
answers the same after each step, and once the batches are turned into
records the two stores hold the same bytes. A batch that a write touches
becomes records first, so the operations below are chosen to touch batched
entries and directories in every way the store offers.
"""

from __future__ import annotations

import copy
import random
import time

import pytest
from support.meta import meta_dump

from aifs.meta.inode import DATA, META
from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore


class Pair:
    """A store with batches (``a``) and one without (``b``), driven alike."""

    def __init__(self, tmp_path) -> None:
        self.path = tmp_path
        self.a = MetaStore(tmp_path / "a")
        self.b = MetaStore(tmp_path / "b", batches=False)
        self.dirs: dict[int, str] = {ROOT_INO: ""}  # ino -> key
        self.names: dict[int, set[bytes]] = {ROOT_INO: set()}
        self.inos: set[int] = {ROOT_INO}
        self.keys: set[str] = set()

    def both(self, method: str, *args, **kwargs):
        results = []
        for store in (self.a, self.b):
            try:  # (each its own copy: some methods change the inode they get)
                own_args, own_kwargs = copy.deepcopy((args, kwargs))
                results.append(("ok", getattr(store, method)(*own_args, **own_kwargs)))
            except Exception as exc:  # the same error from both
                results.append(("error", type(exc).__name__))
        assert results[0] == results[1], (method, args, results)
        return results[0][1]

    def check(self) -> None:
        for parent in list(self.dirs):
            if self.both("get", parent) is None:
                continue
            batch = self.both("readdir", parent, 0, 100_000)
            self.names[parent] = {name for _, name, _ in batch}
            for cookie, name, inode in batch:
                self.inos.add(inode.ino)
                self.keys.add(inode.key)
                if inode.kind == DIR:
                    self.dirs[inode.ino] = inode.key
                self.both("lookup", parent, name)
                assert self.both("cookie_of", parent, name) == cookie
                assert self.both("exists", parent, name)
            self.both("lookup", parent, b"nothing-here")
            for after in (1, 3, 7):
                self.both("readdir", parent, after, 2)
            self.both("children_count", parent)
            self.both("subdir_count", parent)
        for ino in self.inos:
            self.both("get", ino)
        for key in self.keys:
            self.both("owner_of", key)
        files = [sorted((i.ino, i.key) for i in s.subtree_files(ROOT_INO))
                 for s in (self.a, self.b)]
        assert files[0] == files[1]

    def reopen(self) -> None:
        """Both stores closed and opened again (nothing of a batch in memory)."""
        self.a.close()
        self.b.close()
        self.a = MetaStore(self.path / "a")
        self.b = MetaStore(self.path / "b", batches=False)

    def close(self) -> None:
        self.a.materialize_all()
        dumps = [meta_dump(self.a), meta_dump(self.b)]
        assert dumps[0] == dumps[1]
        self.a.close()
        self.b.close()


def _listing(rng: random.Random, key: str, count: int) -> list[Listed]:
    out = []
    for i in range(count):
        roll = rng.random()
        name = f"f{i:03d}"
        if roll < 0.15:
            out.append(Listed(f"d{i:03d}", DIR, f"{key}d{i:03d}/", 0, "", 5.0))
        elif roll < 0.25:  # a packed file: fields of its own
            out.append(Listed(name, FILE, key + name, 10 + i, f"e{i}", 3.5,
                              {"pack": "p1", "pack_offset": i, "attrs_known": True}))
        elif roll < 0.3:
            out.append(Listed("ü" + name, FILE, key + "ü" + name, i, f'"{i:x}"', 7.25))
        elif roll < 0.33:  # not UTF-8 (a surrogate escape), or long: a key cut and hashed
            odd = rng.choice(["f\udcff" + name, "x" * 240 + name, "L" * 200 + name + "/"])
            if odd.endswith("/"):
                out.append(Listed(odd[:-1], DIR, key + odd, 0, "", 5.0))
            else:
                out.append(Listed(odd, FILE, key + odd, i, f"e{i}", 8.5))
        else:
            out.append(Listed(name, FILE, key + name, i * 3, f"e{i}-{rng.random()}",
                              1_700_000_000.123456789 + i))
    rng.shuffle(out)  # (LIST order is not the names' order once pages merge)
    return out


def _step(rng: random.Random, pair: Pair, clock: list[float]) -> None:
    clock[0] += 1
    now = clock[0]
    parents = [p for p in pair.dirs if pair.names.get(p) is not None]
    parent = rng.choice(parents)
    names = sorted(pair.names.get(parent, set()))
    name = rng.choice(names) if names else None
    op = rng.randrange(18)
    if op <= 2:  # list a directory (a first listing, or a refresh with changes)
        key = pair.dirs[parent]
        listed = _listing(rng, key, rng.randrange(1, 12))
        if rng.random() < 0.3 and names:  # a refresh keeps some and changes one
            text = [n.decode("utf-8", "surrogateescape") for n in names[:3]]
            keep = [Listed(t, FILE, key + t, 1, "x", now) for t in text]
            listed = keep + [e for e in listed[:2] if e.name not in text]
        results = []
        for store in (pair.a, pair.b):
            names_out: list[bytes] = []
            try:
                removed = store.apply_listing(parent, copy.deepcopy(listed), now=now,
                                              started=now - 0.5, names=names_out)
                results.append((removed, sorted(names_out)))
            except Exception as exc:  # (the same error from both)
                results.append((type(exc).__name__, []))
        assert results[0] == results[1]
    elif op == 3:
        new = f"new{rng.randrange(1000)}"
        if not pair.b.exists(parent, new.encode()):
            pair.both("create", parent, new.encode(),
                      Inode(0, FILE, pair.dirs[parent] + new, parent, pending=DATA, ctime=now))
    elif op == 4 and name:
        pair.both("remove", parent, name)
    elif op == 5 and name:
        target = rng.choice(parents)
        new = f"moved{rng.randrange(100)}"
        inode = pair.a.lookup(parent, name)
        suffix = "/" if inode is not None and inode.kind == DIR else ""
        pair.both("rename", parent, name, target, new.encode(),
                  pair.dirs[target] + new + suffix)
    elif op == 6 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None:
            pair.both("update", inode.ino, size=rng.randrange(100), ctime=now)
    elif op == 7 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None:
            pair.both("set_times", {inode.ino: (int(now * 1e9), now)})
    elif op == 8 and name:
        inode = pair.a.lookup(parent, name)
        target = rng.choice(parents)
        new = f"link{rng.randrange(100)}"
        if inode is not None and inode.kind == FILE and not pair.b.exists(target, new.encode()):
            pair.both("link", inode.ino, target, new.encode(), pair.dirs[target] + new, "g1")
    elif op == 9 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None and inode.kind == FILE:
            pair.both("settle", inode.ino, inode.key, META, etag="settled")
    elif op == 10 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None and inode.kind == FILE:
            pair.both("reincarnate", inode)
    elif op == 11 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None and inode.kind == FILE:
            pair.both("unpublish", inode.ino)
    elif op == 12 and name:  # a changed inode stored whole (an attribute read, a chmod)
        inode = pair.a.lookup(parent, name)
        if inode is not None:
            inode.mode, inode.attrs_known = 0o600, True
            pair.both("put", inode)
    elif op == 13 and name:  # a fresh node finds a name of a hard-link group
        inode = pair.a.lookup(parent, name)
        if inode is not None and inode.kind == FILE:
            inode.link_id, inode.nlink_hint = f"g{rng.randrange(3)}", 2
            pair.both("join_link_group", inode)
    elif op == 14:
        key = pair.dirs[parent] + (name.decode("utf-8", "surrogateescape") if name else "x")
        if rng.random() < 0.5:
            pair.both("add_tombstone", key, 0)
        else:
            pair.both("drop_tombstone", key)
    elif op == 15 and name:
        inode = pair.a.lookup(parent, name)
        if inode is not None:
            pair.both("mark_unclosed", inode.ino)
            pair.both("clear_unclosed", inode.ino)
            pair.both("renew_order", inode.ino)
    elif op == 16:
        pair.both("purge_orphans")
        pair.both("expire_all")
        for ino in list(pair.inos):
            inode = pair.b.get(ino)
            if inode is not None and inode.orphan:
                pair.both("delete_orphan", ino)
    elif op == 17:
        pair.reopen()
    pair.check()


@pytest.mark.parametrize("seed", range(40))
def test_a_store_with_batches_reads_and_ends_as_one_without(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(time, "time", lambda: 4321.5)  # (ctimes the store sets itself)
    rng = random.Random(seed)
    pair = Pair(tmp_path)
    clock = [1000.0]
    pair.both("apply_listing", ROOT_INO, _listing(rng, "", 8), now=clock[0])
    pair.check()
    for _ in range(80):
        _step(rng, pair, clock)
    pair.close()


def test_a_walk_of_a_listed_directory_writes_one_batch_and_no_entry_records(tmp_path):
    meta = MetaStore(tmp_path / "m")
    meta.apply_listing(ROOT_INO, [Listed("d", DIR, "d/")], now=1)
    d = meta.lookup(ROOT_INO, b"d")
    files = [Listed(f"f{i}", FILE, f"d/f{i}", i, f"e{i}", 2.0) for i in range(1000)]
    with meta.env.begin() as txn:
        before = {db: txn.stat(db)["entries"] for db in (meta.inodes, meta.dentries)}
    meta.apply_listing(d.ino, files, now=2)
    with meta.env.begin() as txn:
        after = {db: txn.stat(db)["entries"] for db in (meta.inodes, meta.dentries)}
        assert txn.stat(meta.batch_heads)["entries"] == 1
    assert after == before  # (the directory's own record was rewritten, not added)
    listed = meta.readdir(d.ino, 0, 2000)
    assert [name for _, name, _ in listed] == [f"f{i}".encode() for i in range(1000)]
    assert meta.lookup(d.ino, b"f7").size == 7 and meta.owner_of("d/f7") == listed[7][2].ino
    # the first write in the directory turns the batch into records
    meta.remove(d.ino, b"f7")
    with meta.env.begin() as txn:
        assert txn.stat(meta.batch_heads)["entries"] == 0
        assert txn.stat(meta.dentries)["entries"] == before[meta.dentries] + 999
    assert meta.lookup(d.ino, b"f7") is None and meta.lookup(d.ino, b"f8").size == 8


def test_a_store_of_schema_5_opens_as_6_with_its_records_as_they_were(tmp_path):
    from aifs.meta.schema import DB_SYS, SCHEMA_VERSION, SYS_SCHEMA
    meta = MetaStore(tmp_path / "m", batches=False)
    meta.apply_listing(ROOT_INO, [Listed("d", DIR, "d/"), Listed("f", FILE, "f", 3, "e", 2.0)],
                       now=1)
    with meta.env.begin(write=True) as txn:
        txn.put(SYS_SCHEMA, b"5", db=meta.env.open_db(DB_SYS, txn=txn))
    before = meta_dump(meta)
    meta.close()
    meta = MetaStore(tmp_path / "m")
    after = meta_dump(meta)
    assert after.pop(b"sys") != before.pop(b"sys") and SCHEMA_VERSION == b"6"
    assert after == before
    assert meta.lookup(ROOT_INO, b"f").size == 3
    meta.close()
