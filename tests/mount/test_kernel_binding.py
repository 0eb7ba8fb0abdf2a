"""The kernel binding (aifs's own FUSE session on /dev/fuse) and passthrough:
files whose whole content is on the local disk are read and written by the
kernel straight from the local copy; the daemon sees only open and release.
Each case checks what a user would: bytes, sizes and times as on tmpfs,
the data in the lake after unmount, and that the daemon was bypassed
(its request counters, ``user.aifs.stats``)."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from support.faultproxy import FaultProxy
from support.lakes import Lake, lake_tree
from support.mounts import file_digest, wait_for

from aifs.daemon import mount_type
from aifs.fuse.kernel import protocol as p

MiB = 1 << 20


def stats(path: Path) -> dict[str, int]:
    return json.loads(os.getxattr(path, "user.aifs.stats"))


def kernel_mount(lake, mounter, *extra: str, **kw):
    return mounter(lake, "--fuse-binding", "kernel", "--promote-delay", "0.2", *extra, **kw)


def test_the_wire_structs_have_the_sizes_of_fuse_h() -> None:
    # sizes from include/uapi/linux/fuse.h (7.45): a wrong one garbles every reply
    assert (p.IN_HEADER.size, p.OUT_HEADER.size, p.ATTR.size) == (40, 16, 88)
    assert p.ENTRY_HEAD.size + p.ATTR.size == 128  # fuse_entry_out
    assert p.ATTR_OUT_HEAD.size + p.ATTR.size == 104  # fuse_attr_out
    assert (p.INIT_OUT.size, p.SETATTR_IN.size, p.STATFS_OUT.size) == (64, 88, 80)
    assert (p.READ_IN.size, p.WRITE_IN.size, p.OPEN_OUT.size) == (40, 40, 16)
    assert p.dirent(5, 1, b"abc", 8) == struct.pack("<QQII", 5, 1, 3, 8) + b"abc" + bytes(5)


def test_the_mount_says_which_binding_serves_it(lake, mounter) -> None:
    m = kernel_mount(lake, mounter)
    (m.path / "f").write_bytes(b"x")
    assert "kernel binding" in m.log_text()
    assert "FUSE protocol 7." in m.log_text()


def test_a_file_written_here_is_read_and_written_past_the_daemon(tmp_path, mounter,
                                                                  aifs_cli) -> None:
    from support.lakes import _make_lake  # local lake: writers go direct where nothing streams
    lake = _make_lake("local", None, tmp_path)
    m = kernel_mount(lake, mounter)
    data = os.urandom(8 * MiB + 123)
    before = stats(m.path)
    (m.path / "w.bin").write_bytes(data)
    assert (m.path / "w.bin").stat().st_size == len(data)
    assert (m.path / "w.bin").read_bytes() == data
    after = stats(m.path)
    assert after["direct_opens"] - before["direct_opens"] == 2
    assert after["write_requests"] == before["write_requests"], "writes reached the daemon"
    assert after["read_requests"] == before["read_requests"], "reads reached the daemon"
    m.unmount()
    files, _ = lake_tree(lake)
    assert files["w.bin"] == data
    again = kernel_mount(lake, mounter, name="again")  # empty cache: from the lake
    assert (again.path / "w.bin").read_bytes() == data


def test_direct_writes_keep_sizes_and_times_as_tmpfs_does(tmp_path, tmpfs, mounter) -> None:
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    m = kernel_mount(lake, mounter)
    for root in (tmpfs, m.path):
        f = root / "t.bin"
        with open(f, "wb") as out:
            out.write(b"a" * 5000)
            out.flush()
            assert os.stat(f).st_size == 5000  # seen while still open
            out.truncate(100)
            out.seek(1 << 20)
            out.write(b"end")
        os.utime(f, ns=(1_000_000_000, 2_000_000_000))  # cp -a, tar x
        with open(f, "r+b") as again:
            again.seek(0)
            again.write(b"Z")
        os.utime(f, ns=(3_000_000_000, 4_000_000_000))
    local, mounted = os.stat(tmpfs / "t.bin"), os.stat(m.path / "t.bin")
    assert (mounted.st_size, mounted.st_mtime_ns) == (local.st_size, local.st_mtime_ns)
    assert file_digest(m.path / "t.bin") == file_digest(tmpfs / "t.bin")
    m.unmount()
    again = kernel_mount(lake, mounter, name="again")
    st = os.stat(again.path / "t.bin")
    assert (st.st_size, st.st_mtime_ns) == (local.st_size, local.st_mtime_ns)
    assert file_digest(again.path / "t.bin") == file_digest(tmpfs / "t.bin")


def test_a_reader_in_passthrough_and_a_later_writer_share_the_file(tmp_path, mounter) -> None:
    # The kernel wants every open of an inode in passthrough while one is
    # (otherwise: EIO). A writer that opens while a direct reader holds the
    # file must work, and the reader must see its bytes.
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    m = kernel_mount(lake, mounter, "--stream-large-files", "false")
    f = m.path / "shared"
    f.write_bytes(b"0" * 4096)
    with open(f, "rb") as reader, open(f, "r+b") as writer:
        writer.seek(10)
        writer.write(b"written")
        writer.flush()
        reader.seek(10)
        assert reader.read(7) == b"written"
        with open(f, "ab") as appender:
            appender.write(b"tail")
    assert f.stat().st_size == 4100
    assert f.read_bytes() == b"0" * 10 + b"written" + b"0" * 4079 + b"tail"


def test_mmap_writes_reach_the_lake(tmp_path, mounter) -> None:
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    m = kernel_mount(lake, mounter)
    f = m.path / "mapped"
    f.write_bytes(bytes(MiB))
    with open(f, "r+b") as fp, mmap.mmap(fp.fileno(), MiB) as mapped:
        mapped[100:105] = b"hello"
        mapped.flush()
    m.unmount()
    files, _ = lake_tree(lake)
    assert files["mapped"][100:105] == b"hello"
    assert len(files["mapped"]) == MiB


@pytest.mark.parametrize("binding", ["kernel", "pyfuse3"])
def test_a_file_of_the_lake_not_yet_local_is_served_by_the_daemon(lake, mounter, aifs_cli,
                                                                   binding) -> None:
    data = os.urandom(3 * MiB)
    lake.put("cold.bin", data)
    m = mounter(lake, "--fuse-binding", binding)
    before = stats(m.path)
    assert (m.path / "cold.bin").read_bytes() == data
    after = stats(m.path)
    assert after["direct_opens"] == before["direct_opens"]
    assert after["read_requests"] > before["read_requests"]


def test_passthrough_off_serves_every_read_in_the_daemon(tmp_path, mounter) -> None:
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    m = kernel_mount(lake, mounter, "--passthrough", "false")
    (m.path / "f").write_bytes(b"abc" * 1000)
    assert (m.path / "f").read_bytes() == b"abc" * 1000
    s = stats(m.path)
    assert s["direct_opens"] == 0 and s["write_requests"] > 0 and s["read_requests"] > 0


def test_fusermount3_mounts_and_hands_the_session_back(tmp_path) -> None:
    # The path a user without root takes (fusermount3 mounts, the /dev/fuse fd
    # comes back over a socket), taken here as root: the mount must appear and
    # the fd must be its session (reading it yields the kernel's INIT).
    from aifs.fuse.kernel import mount
    point = tmp_path / "mnt"
    point.mkdir()
    fd = mount._mount_with_fusermount(str(point), {"default_permissions", "subtype=aifs",
                                                   "fsname=test"})
    try:
        # (no stat of the mount here: it would wait for this process to answer)
        assert mount_type(str(point)) == "fuse.aifs"
        (length, opcode, *_rest) = p.IN_HEADER.unpack(os.read(fd, 1 << 20)[:p.IN_HEADER.size])
        assert opcode == p.INIT
    finally:
        mount.unmount(str(point))
        os.close(fd)
    assert not os.path.ismount(point)


def test_a_mount_option_the_kernel_does_not_take_is_refused_in_one_line(tmp_path, mounter,
                                                                         ) -> None:
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    with pytest.raises(AssertionError) as info:
        mounter(lake, "--fuse-binding", "kernel", "-o", "no_such_option")
    assert "unknown mount option 'no_such_option'" in str(info.value)


def test_small_files_read_from_the_lake_go_direct_once_cached(lake, mounter) -> None:
    # A dataset other tools wrote: the first epoch is served by the daemon (and
    # fills the block cache); a file read again gets a local copy in the
    # background as its reader closes, and from then on is read by the kernel
    # alone. Bytes equal throughout; a writer that opens one of them while it
    # is held direct works, and its bytes reach the lake.
    files = {f"ds/s{i:03d}.jpg": os.urandom(1000 + 97 * i) for i in range(40)}
    lake.put_many(files)
    m = kernel_mount(lake, mounter)
    for key, data in files.items():  # first epoch: from the lake
        assert (m.path / key).read_bytes() == data
    first = stats(m.path)
    for key, data in files.items():  # second: from the cache, copies made behind
        assert (m.path / key).read_bytes() == data
    second = wait_for(lambda: (now := stats(m.path))["admitted"] - first["admitted"]
                      == len(files) and now, 30, "a local copy of each file read again")
    assert second["direct_opens"] == first["direct_opens"] == 0
    for key, data in files.items():  # third: direct, no admission, no READ
        assert (m.path / key).read_bytes() == data
    third = stats(m.path)
    assert third["admitted"] == second["admitted"]
    assert third["read_requests"] == second["read_requests"]
    assert third["direct_opens"] - second["direct_opens"] == len(files)
    assert third["lake_gets"] == first["lake_gets"]
    with open(m.path / "ds/s000.jpg", "rb") as reader:
        with open(m.path / "ds/s000.jpg", "r+b") as writer:
            writer.write(b"NEW")
        assert reader.read(3) == b"NEW"
    m.unmount()
    assert lake.get("ds/s000.jpg") == b"NEW" + files["ds/s000.jpg"][3:]
    again = kernel_mount(lake, mounter, name="again")
    for key, data in list(files.items())[1:]:
        assert (again.path / key).read_bytes() == data


def test_a_first_epoch_over_packed_files_makes_no_local_copies(lake, mounter,
                                                              aifs_cli) -> None:
    # A pack's block brings a small file in with its neighbours, but reading
    # them is still their first read: none gets a local copy of its own (the
    # first epoch would write the dataset to disk a second time). A file read
    # again gets one; its next open goes direct.
    from support.packed import lake_packed
    files = {f"ds/s{i:03d}.bin": os.urandom(1000 + 97 * i) for i in range(40)}
    writer = kernel_mount(lake, mounter, name="writer")
    (writer.path / "ds").mkdir()
    for key, data in files.items():
        (writer.path / key).write_bytes(data)
    result = aifs_cli("sync", str(writer.path), "--quiet", timeout=600)
    assert result.returncode == 0, result.stderr
    assert set(lake_packed(lake)) == set(files)
    m = kernel_mount(lake, mounter, name="fresh")
    for key, data in files.items():  # first epoch
        assert (m.path / key).read_bytes() == data
    first = stats(m.path)
    assert first["lake_gets"] < len(files) // 4  # the packs' blocks brought most in
    # read again: its admission is queued after any the first epoch made
    assert (m.path / "ds/s007.bin").read_bytes() == files["ds/s007.bin"]
    second = wait_for(lambda: (now := stats(m.path))["admitted"] >= 1 and now, 30,
                      "a local copy of the file read again")
    assert second["admitted"] == 1
    assert (m.path / "ds/s007.bin").read_bytes() == files["ds/s007.bin"]
    assert stats(m.path)["direct_opens"] - second["direct_opens"] == 1


def test_a_large_object_read_whole_goes_direct_from_then_on(lake, mounter) -> None:
    # Weights another tool wrote, read whole through the daemon: as the reader
    # closes, the cached blocks become one local copy (and are dropped: the
    # disk holds the object once), and the next reads go from the kernel to
    # that copy: no READ reaches the daemon, no GET the lake. A dataset's
    # shard stays blocks (they keep a stable subset of a dataset larger than
    # the cache). A remount on the same cache reads it direct; another node's
    # new version replaces the copy.
    big = os.urandom(5 * MiB + 100_000)  # five block files and a tail in a segment
    shard = os.urandom(3 * MiB)
    lake.put_many({"w/big.bin": big, "ds/shard.tar": shard})
    options = ("--block-size", "1M", "--metadata-ttl", "1")
    m = kernel_mount(lake, mounter, *options)
    os.setxattr(m.path / "ds", "user.aifs.policy", b"dataset")
    before = stats(m.path)
    # (the shard first: a copy of it would be queued, and made, before the object's)
    assert (m.path / "ds/shard.tar").read_bytes() == shard
    assert (m.path / "w/big.bin").read_bytes() == big
    first = wait_for(lambda: (now := stats(m.path))["admitted"] > before["admitted"]
                     and now["cache_bytes"] <= len(shard) and now, 30,
                     "a local copy of the object read whole, and its blocks gone")
    assert first["admitted"] == before["admitted"] + 1
    assert first["cache_bytes"] == len(shard)  # the shard's blocks stayed
    assert first["local_bytes"] == len(big)
    assert (m.path / "w/big.bin").read_bytes() == big
    second = stats(m.path)
    assert second["direct_opens"] == first["direct_opens"] + 1
    assert second["read_requests"] == first["read_requests"]
    assert second["lake_gets"] == first["lake_gets"]
    m.unmount()
    again = kernel_mount(lake, mounter, *options, name="again", cache="m")
    assert (again.path / "w/big.bin").read_bytes() == big
    assert stats(again.path)["direct_opens"] == 1
    newer = os.urandom(2 * MiB)
    lake.put("w/big.bin", newer)
    wait_for(lambda: (again.path / "w/big.bin").read_bytes() == newer, 30,
             "another node's version to replace the local copy")


def test_a_large_object_still_open_keeps_its_blocks_until_its_last_close(lake,
                                                                          mounter) -> None:
    # The copy is made when the reader that read it whole closes; another
    # reader still open may be reading the blocks, so they go at its close.
    big = os.urandom(4 * MiB + 12345)
    lake.put("w/held.bin", big)
    m = kernel_mount(lake, mounter, "--block-size", "1M")
    with open(m.path / "w/held.bin", "rb") as holder:
        assert (m.path / "w/held.bin").read_bytes() == big
        made = wait_for(lambda: (now := stats(m.path))["admitted"] == 1 and now, 30,
                        "a local copy of the object read whole")
        assert made["cache_bytes"] == len(big)  # the holder may read them
        assert holder.read() == big
    wait_for(lambda: stats(m.path)["cache_bytes"] == 0, 30, "its blocks gone at the last close")
    assert (m.path / "w/held.bin").read_bytes() == big


def test_a_directory_of_thousands_is_listed_whole(tmp_path, mounter) -> None:
    # The kernel asks for directory pages of up to 1 MiB (MAX_PAGES): a page
    # holds thousands of entries, more than one writev may carry in pieces.
    from support.lakes import _make_lake
    lake = _make_lake("local", None, tmp_path)
    names = {f"d/n{i:05d}" for i in range(5000)}
    lake.put_many({name: b"x" for name in names})
    m = kernel_mount(lake, mounter)
    assert sorted(os.listdir(m.path / "d")) == sorted(n[2:] for n in names)
    with os.scandir(m.path / "d") as entries:  # readdirplus: attributes too
        sizes = {entry.name: entry.stat().st_size for entry in entries}
    assert len(sizes) == len(names) and set(sizes.values()) == {1}


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_direct_writer_is_streamed_and_a_rewrite_after_a_part_is_caught(
        lake, mounter, aifs_cli, rewrite) -> None:
    # No WRITE reaches the daemon, yet the checkpoint's parts go up while it is
    # written (its growth is followed). A rewrite of bytes already sent cannot
    # be seen as it happens: the parts are checked against the copy before the
    # upload completes, so the lake holds the bytes written last either way.
    from support.lakes import lake_upload_parts
    from support.mounts import wait_for
    from support.packed import lake_digest, lake_size
    m = kernel_mount(lake, mounter, "--part-size", "5M", "--multipart-threshold", "5M",
                     "--stream-checkpoints", "true")
    (m.path / "ckpt").mkdir()
    data = bytearray(os.urandom(16 * MiB + 321))
    before = stats(m.path)
    with open(m.path / "ckpt" / "model.pt", "wb", buffering=0) as fp:
        for offset in range(0, 12 * MiB, MiB):
            fp.write(data[offset:offset + MiB])
        wait_for(lambda: lake_upload_parts(lake) >= 1, 20, "a part sent while open")
        if rewrite:
            patch = os.urandom(4096)
            fp.seek(100)
            fp.write(patch)
            data[100:100 + len(patch)] = patch
            fp.seek(12 * MiB)
        fp.write(data[12 * MiB:])
    after = stats(m.path)
    assert after["direct_opens"] > before["direct_opens"]
    assert after["write_requests"] == before["write_requests"]
    result = aifs_cli("sync", str(m.path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert lake_size(lake, "ckpt/model.pt") == len(data)
    import xxhash
    assert lake_digest(lake, "ckpt/model.pt") == xxhash.xxh3_128_hexdigest(bytes(data))
    assert ("part 1 was rewritten after it was sent" in m.log_text()) == rewrite


def proxied_lake(moto_server, tag: str) -> tuple[Lake, FaultProxy]:
    """A bucket of its own on the moto server, reached through a fault proxy
    (no faults; its ``replies`` gate holds the lake's answers when cleared)."""
    bucket = f"aifs-{tag}-{uuid.uuid4().hex[:12]}"
    moto_server.client.create_bucket(Bucket=bucket)
    proxy = FaultProxy(int(moto_server.endpoint.rsplit(":", 1)[1]), 0.0, 1)
    lake = Lake("moto", f"s3://{bucket}/data", moto_server.env,
                ["--endpoint-url", proxy.endpoint], server=moto_server, bucket=bucket,
                prefix="data/")
    return lake, proxy


def test_a_request_waiting_on_the_lake_holds_up_no_other(moto_server, mounter) -> None:
    """A read whose bytes the lake has not sent yet waits alone: creates,
    reads and listings of other files are answered meanwhile (the reader
    hands its role on when a handler waits), and the read ends right."""
    lake, proxy = proxied_lake(moto_server, "wait")
    data = os.urandom(3 * MiB)
    lake.put("slow/big.bin", data)
    m = None
    try:
        m = kernel_mount(lake, mounter)
        assert os.listdir(m.path / "slow") == ["big.bin"]  # listed before the lake stalls
        proxy.replies.clear()
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append((m.path / "slow/big.bin")
                                                            .read_bytes()))
        reader.start()
        deadline = time.monotonic() + 30
        while proxy.held == 0:  # the GET reached the lake, its reply is held
            assert time.monotonic() < deadline, "the read never reached the lake"
            time.sleep(0.01)
        fast: list[object] = []

        def others() -> None:
            (m.path / "fast").mkdir()
            for i in range(20):
                (m.path / "fast" / f"f{i}").write_bytes(b"%d" % i)
            fast.append(sorted(os.listdir(m.path / "fast")))
            fast.append([(m.path / "fast" / f"f{i}").read_bytes() for i in range(20)])

        worker = threading.Thread(target=others)
        worker.start()
        worker.join(30)  # (a daemon that waited with the read answers none of it)
        assert not worker.is_alive(), "other requests waited for the lake's reply"
        assert fast == [sorted(f"f{i}" for i in range(20)), [b"%d" % i for i in range(20)]]
        assert reader.is_alive() and not got  # all that while, the read waited
        proxy.replies.set()
        reader.join(60)
        assert got == [data]
    finally:
        proxy.replies.set()
        if m is not None:  # while the lake is there: unmount uploads what was written
            m.unmount()
        proxy.close()


def held_list_of(proxy: FaultProxy, directory: bytes) -> bool:
    """Whether the proxy holds the reply to a LIST of ``directory``/ (its
    prefix in the query, as aifs sends it: URL-encoded)."""
    return any(b"list-type=2" in line and b"prefix=data%2F" + directory + b"%2F" in line
               for line in proxy.held_lines)


STAT_IN_C = """
import ctypes, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGUSR1, lambda *_: None)  # a signal the program handles and goes on
result = libc.stat(sys.argv[1].encode(), ctypes.create_string_buffer(256))
print(result, ctypes.get_errno())  # (libc's stat, as C calls it: no retry on EINTR)
"""


STAT_IN_PYTHON = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a job run with & has it ignored)
os.stat(sys.argv[1])
"""


def test_ctrl_c_ends_a_stat_the_lake_is_slow_to_answer(moto_server, mounter) -> None:
    """A program interrupted by Ctrl-C (SIGINT) while its stat waits on the
    lake (a directory not listed yet, a lake that does not answer) stops at
    once instead of when the lake answers. A signal a program handles and
    goes on from (here SIGUSR1) does not fail its stat with EINTR, which no
    local filesystem does. The mount goes on, and the same stat, once the lake
    answers, finds the file. (A read through the page cache is the kernel's
    readahead, which no signal but SIGKILL cuts short, as on a local disk.)"""
    lake, proxy = proxied_lake(moto_server, "intr")
    lake.put("slow/f.bin", b"twelve bytes")
    lake.put("other/g.bin", b"g")
    m = None
    programs: list[subprocess.Popen] = []
    try:
        m = kernel_mount(lake, mounter)
        assert sorted(os.listdir(m.path)) == ["other", "slow"]  # listed before the lake stalls
        proxy.replies.clear()
        going_on = subprocess.Popen([sys.executable, "-c", STAT_IN_C,
                                     str(m.path / "slow/f.bin")], stdout=subprocess.PIPE,
                                    text=True)
        programs.append(going_on)
        wait_for(lambda: held_list_of(proxy, b"slow"), 30, "the LIST of slow/ to be held")
        going_on.send_signal(signal.SIGUSR1)  # (its handler is in: it asked the lake since)
        with pytest.raises(subprocess.TimeoutExpired):
            going_on.wait(timeout=1)  # still waiting on the lake, not failed with EINTR
        stopped = subprocess.Popen([sys.executable, "-c", STAT_IN_PYTHON,
                                    str(m.path / "other/g.bin")], stderr=subprocess.PIPE,
                                   text=True)
        programs.append(stopped)
        wait_for(lambda: held_list_of(proxy, b"other"), 30, "the LIST of other/ to be held")
        stopped.send_signal(signal.SIGINT)
        _, err = stopped.communicate(timeout=10)  # (not answered: waits for the lake)
        assert stopped.returncode != 0 and "KeyboardInterrupt" in err, err
        assert proxy.held and going_on.poll() is None  # the lake still held the reply
        proxy.replies.set()
        out, _ = going_on.communicate(timeout=30)
        assert out.split() == ["0", "0"]
        assert (m.path / "slow/f.bin").stat().st_size == 12
        assert (m.path / "slow/f.bin").read_bytes() == b"twelve bytes"
        m.unmount()
    finally:
        proxy.replies.set()
        for program in programs:
            program.kill()
            program.wait()
        if m is not None:
            m.unmount()
        proxy.close()


@pytest.mark.parametrize("binding", ["kernel", "pyfuse3"])
def test_another_nodes_changes_reach_the_kernels_caches_once_listed(lake, mounter,
                                                                    binding) -> None:
    """The kernel keeps names and attributes for the listing TTL. Once a
    listing refresh finds another node's change (a file rewritten, a file
    added where this node was told there was none, a file removed), the
    kernel is told to drop what it holds: the change shows at once, not a
    TTL later, when what the kernel cached from the stale answers expires."""
    ttl = 2.0
    options = ("--fuse-binding", binding, "--metadata-ttl", str(ttl))
    a = mounter(lake, *options, name="a")
    b = mounter(lake, *options, name="b")
    (b.path / "d").mkdir()
    (b.path / "d/f").write_bytes(b"1")
    (b.path / "d/h").write_bytes(b"here")
    os.getxattr(b.path, "user.aifs.sync")
    assert (a.path / "d/f").stat().st_size == 1
    assert (a.path / "d/h").exists()
    listed = time.monotonic()  # A listed d/ before this
    (b.path / "d/f").write_bytes(b"22")
    (b.path / "d/g").write_bytes(b"new")
    os.unlink(b.path / "d/h")
    os.getxattr(b.path, "user.aifs.sync")
    assert not (a.path / "d/g").exists()  # A's listing is fresh: no g, and the kernel keeps that
    time.sleep(max(0.0, listed + ttl + 0.1 - time.monotonic()))  # A's listing is stale now
    assert (a.path / "d/f").stat().st_size in (1, 2)  # answered at once; a LIST goes behind
    (a.path / "d/h").exists()  # (the same: the kernel caches it again for a TTL)

    def shows() -> bool:
        return ((a.path / "d/f").stat().st_size == 2 and (a.path / "d/g").exists()
                and not (a.path / "d/h").exists())

    wait_for(shows, ttl / 2, "B's changes to show in A before A's caches expire")
    assert (a.path / "d/f").read_bytes() == b"22"
    assert (a.path / "d/g").read_bytes() == b"new"


def test_the_daemon_finds_its_fuse_connection_to_end_it(lake, mounter) -> None:
    # Unmount ends the connection (/sys/fs/fuse/connections/N/abort) when a
    # kernel cache notice is stuck behind a request no one will answer; the
    # number comes from /proc/self/mountinfo, never from a stat of the mount.
    from aifs.fuse.kernel.mount import connection_id
    m = kernel_mount(lake, mounter)
    found = connection_id(str(m.path))
    assert found == os.minor(os.stat(m.path).st_dev)
    assert os.path.exists(f"/sys/fs/fuse/connections/{found}/abort")
