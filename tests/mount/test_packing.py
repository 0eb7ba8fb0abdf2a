"""Small-file packing, end to end: files written through one mount reach the lake
as a few pack objects plus journals (read here from the lake directly, as
docs/packing.md describes them) and show, byte for byte, in a second mount with
its own cache directory and metadata. Changes, compaction, damage, a killed
daemon and `aifs pack` of objects written by another tool."""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash
from support.lakes import HEAVY_LAKES, lake_objects
from support.mounts import wait_for
from support.packed import JOURNALS, PACKS, lake_digest, lake_packed, lake_packed_bytes

KiB = 1 << 10
MiB = 1 << 20


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def sync(aifs_cli, path: Path) -> None:
    result = aifs_cli("sync", str(path), "--quiet", timeout=600)
    assert result.returncode == 0, f"aifs sync failed: {result.stderr[-2000:]}"


def write_files(root: Path, files: dict[str, bytes], threads: int = 4) -> None:
    dirs = {os.path.dirname(name) for name in files}
    for directory in sorted(dirs):
        (root / directory).mkdir(parents=True, exist_ok=True)

    def one(item: tuple[str, bytes]) -> None:
        (root / item[0]).write_bytes(item[1])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files.items()))


def read_digests(root: Path, names: list[str], threads: int = 4) -> dict[str, str]:
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(lambda n: digest((root / n).read_bytes()), names),
                        strict=True))


def small_files(count: int, seed: int, low: int = 1 * KiB, high: int = 64 * KiB,
                dirs: int = 10, top: str = "ds") -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"{top}/d{i % dirs}/s{i:06d}.dat": rng.randbytes(rng.randint(low, high))
            for i in range(count)}


def lake_layout(lake) -> tuple[list[str], list[str], list[str]]:
    """(plain data objects, pack objects, journal objects) in the lake."""
    keys = [k for k in lake_objects(lake) if not k.endswith("/")]
    packs = [k for k in keys if k.startswith(PACKS)]
    journals = [k for k in keys if k.startswith(JOURNALS)]
    plain = [k for k in keys if not k.startswith(".aifs/")]
    return plain, packs, journals


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_twenty_thousand_small_files_reach_a_second_mount(lake, mounter, aifs_cli):
    """20,000 files of 1-64 KiB through one mount: at most one pack per 500 files
    in the lake, every byte the same through a second mount with its own cache."""
    files = small_files(20_000, seed=5)
    writer = mounter(lake, name="writer")
    write_files(writer.path, files)
    sync(aifs_cli, writer.path)
    plain, packs, journals = lake_layout(lake)
    assert plain == [], f"small files stored as objects of their own: {plain[:5]}"
    assert 0 < len(packs) <= len(files) // 500, f"{len(packs)} packs for {len(files)} files"
    assert journals, "no journal in the lake"
    packed = lake_packed(lake)
    assert set(packed) == set(files), "the journals do not list exactly the files written"

    reader = mounter(lake, name="reader")
    names = sorted(files)
    assert sorted(os.listdir(reader.path / "ds")) == [f"d{i}" for i in range(10)]
    assert len(os.listdir(reader.path / "ds" / "d3")) == 2000
    got = read_digests(reader.path, names)
    wrong = [n for n in names if got[n] != digest(files[n])]
    assert not wrong, f"{len(wrong)} files differ through the second mount: {wrong[:5]}"
    stats = json.loads(os.getxattr(reader.path, "user.aifs.stats"))
    assert stats["lake_gets"] < len(files) // 20, \
        f"{stats['lake_gets']} GETs to read {len(files)} packed files"


def test_small_files_pack_by_size_not_by_name(lake, mounter, aifs_cli):
    """Small ``*.bin``, ``*.pt`` and extension-less files go into packs like
    any small file (the weights policy is about readahead, not storage);
    checkpoint shards (in a checkpoint directory, or one given the policy by
    xattr) and their markers keep objects of their own."""
    rng = random.Random(3)
    files = {f"data/s{i:03d}{ext}": rng.randbytes(16 * KiB)
             for i in range(30) for ext in (".bin", ".pt", "")}
    ckpt = {"ckpt/global_step10/mp_rank_00_model_states.pt": rng.randbytes(32 * KiB),
            "ckpt/latest": b"global_step10", "mine/shard-0": rng.randbytes(8 * KiB)}
    mount = mounter(lake, "--pack-wait", "0.2", name="a")
    (mount.path / "mine").mkdir()
    os.setxattr(mount.path / "mine", "user.aifs.policy", b"checkpoint")  # by choice
    write_files(mount.path, files)
    write_files(mount.path, {k: v for k, v in ckpt.items() if not k.endswith("latest")},
                threads=1)
    (mount.path / "ckpt/latest").write_bytes(ckpt["ckpt/latest"])
    sync(aifs_cli, mount.path)
    plain, packs, _ = lake_layout(lake)
    assert sorted(plain) == sorted(ckpt), f"stored as objects of their own: {plain[:8]}"
    assert 1 <= len(packs) <= 3, f"{len(packs)} packs (PUTs) for {len(files)} small files"
    assert set(lake_packed(lake)) == set(files)
    for name, data in ckpt.items():
        assert lake_digest(lake, name) == digest(data), name
    reader = mounter(lake, name="reader")
    got = read_digests(reader.path, sorted(files))
    assert all(got[n] == digest(d) for n, d in files.items())


def test_changes_to_packed_files_show_in_a_second_mount(lake, mounter, aifs_cli):
    """Overwrite, rename, unlink, chmod and growth past the threshold of packed
    files, and a rename of their directory, show in a second mount after the TTL."""
    files = small_files(200, seed=7, dirs=2)
    a = mounter(lake, "--metadata-ttl", "1", "--pack-wait", "0.2", name="a")
    write_files(a.path, files)
    sync(aifs_cli, a.path)
    b = mounter(lake, "--metadata-ttl", "1", name="b")
    assert (b.path / "ds/d0/s000000.dat").read_bytes() == files["ds/d0/s000000.dat"]
    assert os.getxattr(b.path / "ds/d0/s000000.dat", "user.aifs.pack"), "not read from a pack"

    (a.path / "ds/d0/s000000.dat").write_bytes(b"overwritten")
    os.rename(a.path / "ds/d1/s000001.dat", a.path / "ds/d0/renamed.dat")
    os.unlink(a.path / "ds/d0/s000002.dat")
    os.chmod(a.path / "ds/d1/s000003.dat", 0o600)
    big = random.Random(1).randbytes(2 * MiB)
    (a.path / "ds/d0/s000004.dat").write_bytes(big)
    os.rename(a.path / "ds/d1", a.path / "ds/moved")
    sync(aifs_cli, a.path)

    def shows() -> bool:
        try:
            return ((b.path / "ds/d0/s000000.dat").read_bytes() == b"overwritten"
                    and not (b.path / "ds/d0/s000002.dat").exists()
                    and not (b.path / "ds/d1").exists())
        except OSError:
            return False

    wait_for(shows, 30, "the changes to show in the second mount")
    assert (b.path / "ds/d0/renamed.dat").read_bytes() == files["ds/d1/s000001.dat"]
    assert not (b.path / "ds/moved/s000001.dat").exists()
    assert stat.S_IMODE(os.stat(b.path / "ds/moved/s000003.dat").st_mode) == 0o600
    assert (b.path / "ds/d0/s000004.dat").read_bytes() == big
    assert lake_digest(lake, "ds/d0/s000004.dat") == digest(big)  # an object of its own
    moved = {n: d for n, d in files.items() if n.startswith("ds/d1/")
             and n not in ("ds/d1/s000001.dat",)}
    for name, data in moved.items():
        assert (b.path / "ds/moved" / os.path.basename(name)).read_bytes() == data, name
    # and a third mount, from scratch, agrees
    c = mounter(lake, name="c")
    assert (c.path / "ds/d0/s000000.dat").read_bytes() == b"overwritten"
    assert sorted(os.listdir(c.path / "ds/moved")) == sorted(
        os.path.basename(n) for n in moved)


def test_sync_right_after_many_closes_makes_one_pack(lake, mounter, aifs_cli):
    """`aifs sync` forces the pack while the promoter still hands the files
    over; the pack waits for them instead of going with a handful."""
    files = small_files(400, seed=11, low=16 * KiB, high=32 * KiB, dirs=1)
    mount = mounter(lake, "--pack-wait", "60", name="a")  # no pack goes on a timer
    write_files(mount.path, files, threads=1)
    sync(aifs_cli, mount.path)
    plain, packs, journals = lake_layout(lake)
    assert plain == []
    assert len(packs) == 1, f"{len(files)} files synced at once went into {len(packs)} packs"
    # one journal holds every file's record (another may hold only the
    # directories' records: their markers are plain objects)
    with_files = [j for j in journals if any(
        r["op"] == "put" for r in json.loads(lake.get(j))["records"])]
    assert len(with_files) == 1, journals
    assert set(lake_packed(lake)) == set(files)


def test_gc_folds_the_journals_and_a_fresh_node_reads_only_the_fold(lake, mounter,
                                                                     aifs_cli):
    files = small_files(600, seed=13, dirs=3)
    names = sorted(files)
    a = mounter(lake, "--pack-wait", "60", name="a")
    for start in range(0, 600, 200):  # three packs, three journals
        write_files(a.path, {n: files[n] for n in names[start:start + 200]})
        sync(aifs_cli, a.path)
    gone = names[::10]
    for name in gone:
        os.unlink(a.path / name)
    os.rename(a.path / names[1], a.path / "ds/renamed.dat")
    sync(aifs_cli, a.path)
    expected = {n: files[n] for n in names if n not in gone and n != names[1]}
    expected["ds/renamed.dat"] = files[names[1]]
    _, _, journals = lake_layout(lake)
    assert len(journals) >= 4

    result = aifs_cli("gc", str(a.path))
    assert result.returncode == 0, result.stderr
    assert f"{len(journals)} journals folded into one" in result.stdout
    _, _, folded = lake_layout(lake)
    assert len(folded) == 1 and folded[0].endswith(".fold.jsonl.gz"), folded
    assert set(lake_packed(lake)) == set(expected)  # the fold, read as docs/packing.md says

    fresh = mounter(lake, name="fresh")
    got = read_digests(fresh.path, sorted(expected))
    assert all(got[n] == digest(expected[n]) for n in expected)
    assert not (fresh.path / gone[0]).exists() and not (fresh.path / names[1]).exists()
    assert json.loads(os.getxattr(fresh.path, "user.aifs.stats"))["journals_read"] == 1

    # The writer goes on: its next journal and the fold are folded in turn.
    (a.path / "ds/after.dat").write_bytes(b"after the fold")
    sync(aifs_cli, a.path)
    result = aifs_cli("gc", str(a.path))
    assert "2 journals folded into one" in result.stdout, result.stdout
    third = mounter(lake, name="third")
    assert (third.path / "ds/after.dat").read_bytes() == b"after the fold"
    assert (third.path / "ds/renamed.dat").read_bytes() == files[names[1]]


def test_a_mount_reads_the_journals_before_a_listing_asks(lake, mounter, aifs_cli) -> None:
    """A mount replays the lake's journals while it starts, so its first
    listing waits for no journal GET; that listing still lists the journals:
    what another node published since the mount shows at once."""
    first = small_files(30, seed=31, low=1 * KiB, high=4 * KiB, dirs=1, top="one")
    later = small_files(30, seed=32, low=1 * KiB, high=4 * KiB, dirs=1, top="two")
    a = mounter(lake, "--pack-wait", "60", name="a")
    write_files(a.path, first)
    sync(aifs_cli, a.path)
    ahead = len(lake_layout(lake)[2])  # (S3 lakes: one more for a directory's marker)
    b = mounter(lake, name="b")

    def stats() -> dict:
        return json.loads(os.getxattr(b.path, "user.aifs.stats"))

    wait_for(lambda: stats()["journals_read"] == ahead, 30, "the journals read at mount")
    write_files(a.path, later)
    sync(aifs_cli, a.path)
    files = {**first, **later}
    got = read_digests(b.path, sorted(files))
    assert all(got[n] == digest(files[n]) for n in files)
    # each once: those read ahead, and those published since
    assert stats()["journals_read"] == len(lake_layout(lake)[2]) > ahead


def test_a_fresh_node_reads_only_the_shards_of_the_directories_it_lists(lake, mounter,
                                                                       aifs_cli):
    """Past fold_shard_records a fold is split by directory: a fresh node that
    reads one directory reads the fold's head and the shards of the
    directories on its way, not the whole index; renaming a directory whose
    subdirectories it never listed still moves every packed file below."""
    files = small_files(400, seed=21, low=1 * KiB, high=4 * KiB, dirs=8)
    names = sorted(files)
    a = mounter(lake, "--pack-wait", "60", "--fold-shard-records", "40", name="a")
    for start in range(0, 400, 200):  # two packs, two journals
        write_files(a.path, {n: files[n] for n in names[start:start + 200]})
        sync(aifs_cli, a.path)
    result = aifs_cli("gc", str(a.path))
    assert result.returncode == 0, result.stderr
    shards = [k for k in lake_objects(lake) if k.startswith(".aifs/index/")]
    assert len(shards) >= 8, shards
    assert set(lake_packed(lake)) == set(files)  # as docs/packing.md says to read it

    fresh = mounter(lake, name="fresh")
    one = [n for n in names if n.startswith("ds/d3/")]
    got = read_digests(fresh.path, one)
    assert all(got[n] == digest(files[n]) for n in one)
    stats = json.loads(os.getxattr(fresh.path, "user.aifs.stats"))
    assert stats["journals_read"] == 1  # the fold's head
    assert 1 <= stats["shards_read"] <= 3, stats  # "", "ds/" and "ds/d3/" at most

    os.rename(fresh.path / "ds", fresh.path / "moved")
    sync(aifs_cli, fresh.path)
    third = mounter(lake, name="third")
    moved = {"moved/" + n[len("ds/"):]: data for n, data in files.items()}
    got = read_digests(third.path, sorted(moved))
    assert all(got[n] == digest(moved[n]) for n in moved)
    assert not (third.path / "ds").exists()


def test_gc_collects_no_pack_while_a_journal_cannot_be_read(lake, mounter, aifs_cli):
    """A journal damaged in the lake may describe live files: their packs look
    dead to a node that cannot read it, and must not be collected for that."""
    files = small_files(50, seed=31, dirs=1)
    a = mounter(lake, "--pack-wait", "60", name="a")
    write_files(a.path, files)
    sync(aifs_cli, a.path)
    _, packs, journals = lake_layout(lake)
    # the journal of the pack (on S3 another one holds the directory marker's record)
    [journal] = [j for j in journals if any(
        r["op"] == "put" for r in json.loads(lake.get_object(j))["records"])]
    assert len(packs) == 1, packs
    good = lake.get_object(journal)
    lake.put(journal, b"not a journal")

    b = mounter(lake, "--pack-gc-grace", "0", name="b")
    result = aifs_cli("gc", str(b.path))
    assert result.returncode != 0
    assert packs[0] in lake_objects(lake)

    lake.put(journal, good)  # repaired: every file is there
    c = mounter(lake, name="c")
    got = read_digests(c.path, sorted(files))
    assert all(got[n] == digest(files[n]) for n in files)


def test_compaction_reclaims_space_and_keeps_the_data(lake, mounter, aifs_cli):
    files = small_files(400, seed=9, low=16 * KiB, high=32 * KiB, dirs=1)
    a = mounter(lake, "--pack-gc-grace", "0", "--pack-wait", "60", name="a")
    write_files(a.path, files)
    sync(aifs_cli, a.path)
    names = sorted(files)
    # Three files of every four go: every pack of more than a couple of files is
    # left about a quarter live, however the files were split into packs.
    kept = names[::4]
    for name in set(names) - set(kept):
        os.unlink(a.path / name)
    sync(aifs_cli, a.path)
    before = sum(size for key, size in lake_objects(lake).items() if key.startswith(PACKS))
    result = aifs_cli("gc", str(a.path))
    assert result.returncode == 0, result.stderr
    assert "packs compacted" in result.stdout
    after = sum(size for key, size in lake_objects(lake).items() if key.startswith(PACKS))
    live = sum(len(files[n]) for n in kept)
    assert after < before, f"gc reclaimed nothing ({before} -> {after} bytes of packs)"
    assert after <= live * 1.05, f"{after} bytes of packs hold {live} live bytes"
    for name in kept:
        assert (a.path / name).read_bytes() == files[name], name
    packed = lake_packed(lake)
    assert set(packed) == set(kept)
    for name in kept[:20]:
        assert lake_packed_bytes(lake, packed[name]) == files[name]
    fresh = mounter(lake, name="fresh")
    assert sorted(os.listdir(fresh.path / "ds/d0")) == sorted(os.path.basename(n) for n in kept)
    got = read_digests(fresh.path, kept)
    assert all(got[n] == digest(files[n]) for n in kept)


def _flip_byte(lake, key: str, offset: int) -> None:
    data = bytearray(lake.get(key))
    data[offset] ^= 0xFF
    lake.put(key, bytes(data))


def test_a_corrupted_byte_in_a_pack_gives_eio(lake, mounter, aifs_cli):
    files = small_files(50, seed=11, dirs=1)
    a = mounter(lake, "--pack-wait", "0.2", name="a")
    write_files(a.path, files)
    sync(aifs_cli, a.path)
    a.unmount()
    victim, neighbour = "ds/d0/s000010.dat", "ds/d0/s000020.dat"
    record = lake_packed(lake)[victim]
    _flip_byte(lake, PACKS + record["pack"], record["off"] + record["len"] // 2)

    b = mounter(lake, name="b")
    with pytest.raises(OSError) as caught:
        (b.path / victim).read_bytes()
    assert caught.value.errno == errno.EIO
    assert (b.path / neighbour).read_bytes() == files[neighbour]
    # read as part of a directory scan (the whole pack) too: still EIO, never bytes
    for name in sorted(files):
        if name != victim:
            assert (b.path / name).read_bytes() == files[name], name
    with pytest.raises(OSError) as again:
        (b.path / victim).read_bytes()
    assert again.value.errno == errno.EIO
    assert "checksum mismatch" in b.log_text()


WRITER = r"""
import os, sys
root, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import random
rng = random.Random(seed)
os.makedirs(os.path.join(root, "ds"), exist_ok=True)
for i in range(count):
    data = rng.randbytes(rng.randint(1024, 65536))
    with open(os.path.join(root, "ds", f"k{i:05d}.dat"), "wb") as fp:
        fp.write(data)
    print("closed", i, flush=True)
"""


def test_sigkill_during_pack_promotion_loses_no_closed_file(lake, mounter, aifs_cli,
                                                            tmp_path):
    """Packs of 1 MiB published one after another; the daemon is killed once the
    first journal is in the lake, while the writer is still closing files."""
    count, seed = 1500, 13
    rng = random.Random(seed)
    files = {f"ds/k{i:05d}.dat": rng.randbytes(rng.randint(1024, 65536)) for i in range(count)}
    mount = mounter(lake, "--pack-size", "1M", "--pack-wait", "0", "--promote-delay", "0",
                    name="first")
    log = open(tmp_path / "writer.out", "w+")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mount.path), str(count),
                               str(seed)], stdout=log, stderr=subprocess.STDOUT)
    try:
        # A journal of a pack (not only one of the directory's record) with
        # files the writer already saw closed.
        def published() -> bool:
            keys = lake_objects(lake)
            return (any(k.startswith(JOURNALS) for k in keys)
                    and any(k.startswith(PACKS) for k in keys)
                    and "closed " in (tmp_path / "writer.out").read_text())
        wait_for(published, 120, "the first pack and journal in the lake", interval=0.01)
        mount.proc.kill()
        mount.kill()
    finally:
        writer.kill()
        writer.wait()
    log.seek(0)
    closed = [f"ds/k{int(line.split()[1]):05d}.dat" for line in log.read().splitlines()
              if line.startswith("closed ")]
    assert closed, "no file was closed before the kill"
    assert len(closed) < count, "the writer finished before the kill: nothing was tested"
    again = mounter(lake, name="second", cache="first")
    sync(aifs_cli, again.path)
    packed = lake_packed(lake)
    missing = [n for n in closed if n not in packed]
    assert not missing, f"{len(missing)} closed files are not in the lake: {missing[:5]}"
    wrong = [n for n in closed if lake_packed_bytes(lake, packed[n]) != files[n]]
    assert not wrong, f"{len(wrong)} closed files have other bytes in the lake"
    fresh = mounter(lake, name="fresh")
    for name in closed:
        assert (fresh.path / name).read_bytes() == files[name], name


def test_aifs_pack_of_objects_written_by_another_tool(lake, mounter, aifs_cli):
    files = small_files(300, seed=17, dirs=3, top="ext")
    lake.put_many(files)
    a = mounter(lake, "--metadata-ttl", "1", name="a")
    result = aifs_cli("pack", str(a.path / "ext"))
    assert result.returncode == 0, result.stderr
    assert "300 files" in result.stdout
    plain, packs, _ = lake_layout(lake)
    assert sorted(plain) == sorted(files), "aifs pack must leave the objects in place"
    assert len(packs) == 1
    for name, data in files.items():
        assert (a.path / name).read_bytes() == data, name
        assert os.getxattr(a.path / name, "user.aifs.pack"), f"{name}: not read from a pack"
    b = mounter(lake, name="b")
    got = read_digests(b.path, sorted(files))
    assert all(got[n] == digest(files[n]) for n in files)
    stats = json.loads(os.getxattr(b.path, "user.aifs.stats"))
    assert stats["lake_gets"] < 30, f"{stats['lake_gets']} GETs for 300 packed files"
    # an original that changes bypasses its packed copy
    changed = "ext/d1/s000001.dat"
    lake.put(changed, b"replaced by another tool")
    wait_for(lambda: (a.path / changed).read_bytes() == b"replaced by another tool", 30,
             "the changed original to show")
    with pytest.raises(OSError):
        os.getxattr(a.path / changed, "user.aifs.pack")
    again = aifs_cli("pack", str(a.path / "ext"), "--quiet")
    assert again.returncode == 0 and "1 files" in again.stdout, again.stdout


def test_aifs_pack_keeps_the_s3fs_attributes_of_the_objects(s3_lake, mounter, aifs_cli):
    """Objects written by s3fs carry mode, owner and mtime in their metadata:
    their packed copies must show the same, on this node and on a fresh one."""
    files = small_files(12, seed=5, dirs=2, top="s3fs")
    attrs = {name: (0o100600 | (0o040 if i % 2 else 0), 1000 + i, 2000 + i, 1_600_000_000 + i)
             for i, name in enumerate(sorted(files))}
    for name, data in files.items():
        mode, uid, gid, mtime = attrs[name]
        s3_lake.server.client.put_object(
            Bucket=s3_lake.bucket, Key=s3_lake.prefix + name, Body=data,
            Metadata={"mode": str(mode), "uid": str(uid), "gid": str(gid), "mtime": str(mtime)})
    a = mounter(s3_lake, "--metadata-ttl", "1", "--object-attrs", "true", name="a")
    result = aifs_cli("pack", str(a.path / "s3fs"), "--quiet")
    assert result.returncode == 0, result.stderr
    b = mounter(s3_lake, "--object-attrs", "true", name="b")
    for mount in (a, b):
        for name, data in files.items():
            path = mount.path / name
            assert path.read_bytes() == data
            assert os.getxattr(path, "user.aifs.pack"), f"{name}: not read from a pack"
            st = os.stat(path)
            assert (st.st_mode, st.st_uid, st.st_gid, int(st.st_mtime)) == attrs[name], name
