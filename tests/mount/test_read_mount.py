"""The read path through a real FUSE mount, on every lake kind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash
from support.lakes import HEAVY_LAKES
from support.mounts import wait_for

KiB, MiB = 1 << 10, 1 << 20
BLOCK = MiB  # tests mount with --block-size 1M so block edges are cheap to reach


def test_tree_with_implicit_directories(lake, mounter):
    files = {
        "top.txt": b"top",
        "a/one.bin": b"1" * 10,
        "a/b/c/deep.bin": b"deep",
        "a/b/two.bin": b"22",
        "x/y/z.bin": b"",
    }
    lake.put_many(files)
    lake.mkdir_marker("empty-dir")
    mount = mounter(lake, "--block-size", "1M")
    seen_files, seen_dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(mount.path):
        rel = os.path.relpath(dirpath, mount.path)
        for d in dirnames:
            seen_dirs.add(os.path.normpath(os.path.join(rel, d)))
        for f in filenames:
            path = os.path.join(dirpath, f)
            seen_files[os.path.normpath(os.path.join(rel, f))] = open(path, "rb").read()
    assert seen_files == files
    assert seen_dirs == {"a", "a/b", "a/b/c", "x", "x/y", "empty-dir"}
    st = os.stat(mount.path / "a" / "one.bin")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 10
    assert stat.S_ISDIR(os.stat(mount.path / "a" / "b").st_mode)
    with pytest.raises(FileNotFoundError):
        os.stat(mount.path / "a" / "missing")
    with pytest.raises(NotADirectoryError):
        os.listdir(mount.path / "top.txt")


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17])
def test_bytes_exact_at_block_edges(lake, mounter, size):
    data = random.Random(size).randbytes(size)
    lake.put("f.bin", data)
    mount = mounter(lake, "--block-size", "1M")
    path = mount.path / "f.bin"
    assert os.stat(path).st_size == size
    assert xxhash.xxh3_128_hexdigest(path.read_bytes()) == xxhash.xxh3_128_hexdigest(data)
    rng = random.Random(1)
    offsets = {0, max(size - 1, 0), BLOCK - 1, BLOCK, BLOCK + 1, size, size + 10}
    offsets |= {rng.randrange(size + 1) for _ in range(20)}
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in sorted(offsets):
            for length in (1, 3, 4097, BLOCK + 5):
                assert os.pread(fd, length, offset) == data[offset:offset + length], \
                    (offset, length)
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_large_file_300mib(lake, mounter):
    size = 300 * MiB
    data = os.urandom(size)
    digest = xxhash.xxh3_128_hexdigest(data)
    if lake.server:
        import io
        lake.server.client.upload_fileobj(io.BytesIO(data), lake.bucket, lake.prefix + "big")
    else:
        lake.put("big", data)
    mount = mounter(lake)
    hasher = xxhash.xxh3_128()
    with open(mount.path / "big", "rb") as fp:
        while chunk := fp.read(4 * MiB):
            hasher.update(chunk)
        for offset in (8 * MiB - 3, 150 * MiB + 1, size - 5):
            fp.seek(offset)
            assert fp.read(10) == data[offset:offset + 10]
    assert hasher.hexdigest() == digest
    # blocks reach the NVMe tier just after they are served
    wait_for(lambda: int(os.getxattr(mount.path / "big", "user.aifs.cached_bytes")) == size,
             30, "all blocks in the NVMe cache")


def test_replaced_object_seen_after_ttl_never_stale(lake, mounter):
    old = b"A" * (3 * BLOCK)
    new = b"B" * (3 * BLOCK)
    lake.put("f", old)
    mount = mounter(lake, "--block-size", "1M", "--metadata-ttl", "1")
    path = mount.path / "f"
    assert path.read_bytes() == old  # now cached: kernel pages, memory and disk blocks
    etag_before = os.getxattr(path, "user.aifs.etag")
    lake.put("f", new)
    replaced_at = time.monotonic()

    def read_now() -> bytes:
        content = path.read_bytes()
        assert content in (old, new), "a read mixed two versions"
        return content

    wait_for(lambda: read_now() == new, 15, "the new version through the mount")
    assert time.monotonic() - replaced_at < 15
    assert os.getxattr(path, "user.aifs.etag") != etag_before
    for _ in range(3):
        assert read_now() == new


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_many_objects_list_completely(lake, mounter):
    count = 100_000 if lake.kind == "local" else 5_000
    names = [f"s{i:06d}.bin" for i in range(count)]
    if lake.kind == "local":
        big = lake.root / "many"
        big.mkdir()
        for name in names:
            (big / name).write_bytes(b"")
    else:
        lake.put_many({f"many/{name}": b"" for name in names}, threads=32)
    mount = mounter(lake)
    listed = os.listdir(mount.path / "many")
    assert len(listed) == count and sorted(listed) == names
    with os.scandir(mount.path / "many") as it:
        sizes = {entry.name: entry.stat().st_size for entry in it}
    assert len(sizes) == count


def lake_requests(path) -> dict[str, int]:
    return json.loads(os.getxattr(path, "user.aifs.metrics"))["lake"]["requests"]


def test_a_walk_reads_the_attributes_ahead_once_each(lake, mounter):
    """With object_attrs on, a fresh node walks objects another tool wrote
    with s3fs attributes: the first lstat starts reading the attributes of the
    entries after it, many at
    once, so the walk does not wait for one HEAD per file in turn; every
    object is asked once (a symlink among them twice: its own lookup gives it
    its number) and every lstat shows its own mode."""
    count = 600
    modes = {f"o{i:04d}": (0o600, 0o640, 0o755)[i % 3] for i in range(count)}
    body = b"x" * 5000  # larger than a symlink can be: readdir asks nothing
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: lake.put(f"w/{kv[0]}", body,
                                          {"mode": str(stat.S_IFREG | kv[1])}), modes.items()))
    lake.put("w/o0300", b"o0001", {"mode": str(stat.S_IFLNK | 0o777)})  # a symlink
    mount = mounter(lake, "--object-attrs", "true")
    names = sorted(modes)
    assert os.path.isdir(mount.path / "w")  # its own HEAD: an implicit directory
    before = lake_requests(mount.path)["HeadObject"]
    assert stat.S_IMODE(os.lstat(mount.path / "w" / names[0]).st_mode) == modes[names[0]]
    # no other lookup: the attributes of the next entries come by themselves
    wait_for(lambda: lake_requests(mount.path)["HeadObject"] - before >= 200, 30,
             "the attributes of the next entries to be read")
    for name in names:
        st = os.lstat(mount.path / "w" / name)
        if name == "o0300":
            assert stat.S_ISLNK(st.st_mode) and os.readlink(mount.path / "w" / name) == "o0001"
        else:
            assert stat.S_IMODE(st.st_mode) == modes[name], name
    assert sorted(os.listdir(mount.path / "w")) == names
    assert lake_requests(mount.path)["HeadObject"] - before == count + 1


def test_a_walk_trusting_listings_needs_no_lookup_per_file(lake, mounter):
    """With object_attrs false, a listing's entries go to the kernel with
    their attributes (readdirplus) for the TTL: a walk + lstat makes no
    lookup per file and no HEAD."""
    count = 300
    lake.put_many({f"w/o{i:04d}": b"x" * 5000 for i in range(count)})
    mount = mounter(lake, "--object-attrs", "false")

    def fs_metrics() -> tuple[int, int]:
        m = json.loads(os.getxattr(mount.path, "user.aifs.metrics"))
        return m["fs"]["lookup_requests"], m["lake"]["requests"]["HeadObject"]

    before = fs_metrics()
    with os.scandir(mount.path / "w") as it:
        sizes = [os.lstat(entry.path).st_size for entry in it]
    assert sizes == [5000] * count
    lookups, heads = (a - b for a, b in zip(fs_metrics(), before, strict=True))
    assert heads == 0
    assert lookups < count // 10, f"{lookups} lookups for a walk of {count} files"


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_readers_going_through_a_directory_find_the_rest_fetched_ahead(lake, mounter, order):
    """A first epoch over small objects another tool wrote: once a few of a
    directory are opened, the rest of it is fetched ahead, many at once, so
    the reads that follow wait for no GET of their own; each object is
    fetched once and every file reads back its own bytes."""
    count = 300
    bodies = {f"o{i:04d}": random.randbytes(16 << 10) for i in range(count)}
    lake.put_many({f"e/{name}": body for name, body in bodies.items()})
    lake.put("other/x", b"y" * 100)  # another directory: not fetched
    mount = mounter(lake)  # on by default
    names = sorted(bodies)
    if order == "shuffled":
        random.Random(7).shuffle(names)

    def metrics() -> tuple[int, int, int, int]:
        m = json.loads(os.getxattr(mount.path, "user.aifs.metrics"))
        return (m["lake"]["requests"]["GetObject"], m["prefetch"]["directory_objects"],
                m["cache"]["misses"], m["prefetch"]["directory_scans"])

    gets, _, _, _ = metrics()
    for name in names[:3]:
        assert (mount.path / "e" / name).read_bytes() == bodies[name]
    wait_for(lambda: metrics()[1] == count - 3, 30, "the rest of the directory to be fetched")
    _, _, misses, _ = metrics()
    for name in names[3:]:
        assert (mount.path / "e" / name).read_bytes() == bodies[name], name
    # no reader waited for a GET, and the opens that found their object fetched
    # started no scan of their own (each one re-read the directory)
    assert metrics() == (gets + count, count - 3, misses, 1)


def test_what_is_fetched_ahead_is_bounded_across_directories(lake, mounter):
    """Scans of several directories share one budget (an eighth of the cache):
    with a 8 MiB cache, at most 1 MiB fetched and not opened yet, whatever the
    number of directories readers go through; a scan waits for its readers
    and goes on as they open what it fetched; nothing is fetched twice."""
    per_dir, size = 60, 16 << 10
    bodies = {f"d{d}/o{i:04d}": random.randbytes(size) for d in range(3)
              for i in range(per_dir)}
    lake.put_many(bodies)
    mount = mounter(lake, *SMALL_CACHE)
    names = sorted(bodies)
    for d in range(3):  # three misses in each directory: three scans
        for name in names[d * per_dir:d * per_dir + 3]:
            assert (mount.path / name).read_bytes() == bodies[name]
    budget = (8 << 20) // 8
    wait_for(lambda: prefetch_metrics(mount)["ahead"] == budget // size, 30,
             "the budget to be fetched")
    for i, name in enumerate(names):  # the readers go on: the scans go on behind them
        if i % per_dir >= 3:
            assert (mount.path / name).read_bytes() == bodies[name], name
    m = prefetch_metrics(mount)
    assert (m["peak"], m["scans"], m["gets"]) == (budget, 3, len(bodies))


def test_a_shuffled_read_of_a_directory_bigger_than_the_budget_is_not_fetched_ahead(
        lake, mounter):
    """Readers in a shuffled order open any object next: a directory whose
    objects do not all fit the budget would have most of what is fetched wait
    (or be evicted and fetched twice), so only the opened objects are fetched."""
    bodies = {f"e/o{i:04d}": random.randbytes(16 << 10) for i in range(100)}  # 1.6 MiB
    lake.put_many(bodies)
    mount = mounter(lake, *SMALL_CACHE)  # budget 1 MiB
    names = sorted(bodies)
    random.Random(3).shuffle(names)
    for name in names[:20]:
        assert (mount.path / name).read_bytes() == bodies[name]
    m = prefetch_metrics(mount)
    assert (m["gets"], m["scans"], m["ahead"]) == (20, 0, 0)


def test_readers_in_order_from_the_middle_of_a_big_directory_get_it_fetched_ahead(
        lake, mounter):
    """Readers in order (two interleaved, starting half way) through a
    directory bigger than the budget: a scan runs ahead of them all the same
    (bounded by the budget), and nothing is fetched twice."""
    bodies = {f"e/o{i:04d}": random.randbytes(16 << 10) for i in range(160)}  # 2.5 MiB
    lake.put_many(bodies)
    mount = mounter(lake, *SMALL_CACHE)  # budget 1 MiB
    names = sorted(bodies)[80:]
    for a, b in zip(names[0::2], names[1::2], strict=True):  # two readers, interleaved
        assert (mount.path / a).read_bytes() == bodies[a]
        assert (mount.path / b).read_bytes() == bodies[b]
    m = prefetch_metrics(mount)
    assert m["scans"] >= 1 and m["ahead"] > 0
    assert m["gets"] == len(names)


SMALL_CACHE = ("--block-size", "64K", "--cache-size", "8M")


def prefetch_metrics(mount) -> dict[str, int]:
    m = json.loads(os.getxattr(mount.path, "user.aifs.metrics"))
    return {"gets": m["lake"]["requests"].get("GetObject", 0),
            "ahead": m["prefetch"]["directory_objects"],
            "scans": m["prefetch"]["directory_scans"],
            "peak": m["prefetch"]["directory_peak_bytes"]}


def test_dir_prefetch_off_fetches_only_what_is_opened(lake, mounter):
    bodies = {f"e/o{i:04d}": random.randbytes(4096) for i in range(50)}
    lake.put_many(bodies)
    mount = mounter(lake, "--dir-prefetch", "false")
    for name in sorted(bodies)[:10]:
        assert (mount.path / name).read_bytes() == bodies[name]
    m = json.loads(os.getxattr(mount.path, "user.aifs.metrics"))
    assert m["lake"]["requests"]["GetObject"] == 10
    assert m["prefetch"]["directory_scans"] == 0


def test_xattrs_are_facts(lake, mounter):
    lake.put("d/f.bin", b"x" * 1000)
    mount = mounter(lake)
    path = mount.path / "d" / "f.bin"
    assert os.getxattr(path, "user.aifs.key") == b"d/f.bin"
    assert os.getxattr(path, "user.aifs.etag")
    assert int(os.getxattr(path, "user.aifs.cached_bytes")) == 0
    path.read_bytes()
    wait_for(lambda: int(os.getxattr(path, "user.aifs.cached_bytes")) == 1000, 10,
             "block written to the cache")
    # read by name, never listed: copies (rsync -X, cp -a) would try to set them
    assert [n for n in os.listxattr(path) if n.startswith("user.aifs.")] == []
    with pytest.raises(OSError) as info:
        os.getxattr(path, "user.nothing")
    assert info.value.errno == errno.ENODATA
    with pytest.raises(OSError) as info:
        os.setxattr(path, "user.aifs.key", b"forged")
    assert info.value.errno == errno.EPERM  # the facts are read-only
    st = os.statvfs(mount.path)
    assert st.f_bavail > 0 and st.f_namemax == 255


def test_cache_survives_remount(lake, mounter):
    data = os.urandom(3 * BLOCK + 5)
    lake.put("w.bin", data)
    mount = mounter(lake, "--block-size", "1M", name="first", cache="shared")
    assert (mount.path / "w.bin").read_bytes() == data
    wait_for(lambda: int(os.getxattr(mount.path / "w.bin", "user.aifs.cached_bytes"))
             == len(data), 10, "blocks on disk")
    mount.unmount()
    again = mounter(lake, "--block-size", "1M", name="second", cache="shared")
    assert int(os.getxattr(again.path / "w.bin", "user.aifs.cached_bytes")) == len(data)
    assert (again.path / "w.bin").read_bytes() == data
    stats = json.loads(os.getxattr(again.path, "user.aifs.stats"))
    # (from its blocks, or from the local copy they became: read direct)
    assert stats["lake_gets"] == 0 and stats["disk_hits"] + stats["direct_opens"] > 0


def test_cache_capacity_is_respected(lake, mounter):
    for i in range(10):
        lake.put(f"c{i}", os.urandom(BLOCK))
    mount = mounter(lake, "--block-size", "1M", "--cache-size", "4M", "--memory-cache", "1M")
    for i in range(10):
        (mount.path / f"c{i}").read_bytes()
    blocks = mount.cache_dir / "blocks"

    def on_disk() -> int:  # eviction removes files and directories meanwhile
        total = 0
        for top, _dirs, names in os.walk(blocks):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(top, name)).st_size
        return total
    wait_for(lambda: 0 < on_disk() <= 4 * BLOCK, 10, "cache within its capacity")


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_mount_gets_its_kernel_readahead_and_request_queue(lake, mounter):
    """What makes large reads arrive as 1 MiB requests, many at once (root only;
    the queue lives in fusectl, which the daemon mounts where nothing did)."""
    if os.geteuid() != 0:
        pytest.skip("the kernel settings need root")
    mount = mounter(lake, "--kernel-readahead", "32M", "--max-connections", "20")
    device = os.stat(mount.path).st_dev
    bdi = f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb"
    connection = f"/sys/fs/fuse/connections/{os.minor(device)}"
    expected = {bdi: str(32 * 1024), f"{connection}/max_background": "40",
                f"{connection}/congestion_threshold": "30"}

    def settings() -> dict[str, str]:
        return {path: open(path).read().strip() for path in expected}
    # The daemon writes them one after the other once the mount answers.
    wait_for(lambda: settings() == expected, 10, "the kernel settings")
    assert settings() == expected


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_a_damaged_cached_block_is_fetched_again_not_served(lake, mounter):
    damaged, intact = os.urandom(20 * KiB), os.urandom(30 * KiB)
    lake.put("damaged.bin", damaged)
    lake.put("intact.bin", intact)
    mount = mounter(lake, name="first", cache="shared")
    for name, data in (("damaged.bin", damaged), ("intact.bin", intact)):
        assert (mount.path / name).read_bytes() == data
        wait_for(lambda name=name, data=data: int(os.getxattr(
            mount.path / name, "user.aifs.cached_bytes")) == len(data), 10, "cached")
    mount.unmount()
    # a crash that tore one block: its bytes in the segment are not what was stored
    segment = mount.cache_dir / "segments" / "1.seg"
    body = segment.read_bytes()
    at = body.index(damaged[:64])
    with open(segment, "r+b") as f:
        f.seek(at + 100)
        f.write(b"\0" * 100)

    again = mounter(lake, name="second", cache="shared")
    assert (again.path / "intact.bin").read_bytes() == intact
    stats = json.loads(os.getxattr(again.path, "user.aifs.stats"))
    assert stats["lake_gets"] == 0 and stats["disk_hits"] > 0
    assert (again.path / "damaged.bin").read_bytes() == damaged
    stats = json.loads(os.getxattr(again.path, "user.aifs.stats"))
    assert stats["lake_gets"] == 1
