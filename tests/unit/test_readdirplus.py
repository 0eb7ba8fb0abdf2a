"""READDIRPLUS of files as a first listing gave them, packed straight from the
listing's rows (``Filesystem.plain_entries``): the same bytes, and the same
references counted, as packed from an inode each. Driven in process (the
kernel binding's Operations over a Filesystem on a real local lake)."""

from __future__ import annotations

import os
import random

import pytest

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem
from aifs.fuse.kernel import protocol as p
from aifs.fuse.kernel.operations import Operations
from aifs.fuse.kernel.passthrough import Passthrough
from aifs.lake.local import LocalStore
from aifs.meta.store import ROOT_INO, MetaStore


@pytest.fixture
async def ops(tmp_path, nursery):
    rng = random.Random(4)
    lake = tmp_path / "lake"
    (lake / "d").mkdir(parents=True)
    for i in range(400):  # names of many lengths (records padded to 8 bytes)
        (lake / "d" / (f"f{i:03d}" + "x" * (i % 11))).write_bytes(rng.randbytes(i * 37))
    for i in range(5):
        (lake / "d" / f"sub{i}").mkdir()
    os.mkdir(lake / "d" / "dir-with-file")
    (lake / "d" / "dir-with-file" / "y").write_bytes(b"y")
    (lake / "d" / b"caf\xe9".decode("utf-8", "surrogateescape")).write_bytes(b"latin-1")
    config = Config(lake=f"file://{lake}", metadata_ttl=60)
    fs = Filesystem(config, LocalStore(str(lake)), MetaStore(tmp_path / "meta"),
                    BlockCache(tmp_path / "cache", 1 << 30), LocalFiles(tmp_path / "cache"))
    fs.start(nursery)
    return Operations(fs, Passthrough(fs))


async def replies(ops: Operations, ino: int, size: int) -> list[bytes]:
    """READDIRPLUS replies of directory ``ino`` with buffers of ``size``, to the end."""
    fh = await ops.fs.opendir(ino)
    body = bytearray(p.READ_IN.size)
    cookie, out = 0, []
    while True:
        p.READ_IN.pack_into(body, 0, fh, cookie, size, 0, 0, 0, 0)
        records = await ops._readdir(memoryview(body), plus=True)
        if not records:
            break
        out.append(b"".join(records))
        cookie = p.DIRENT_HEAD.unpack_from(records[-1], p.ENTRY_HEAD.size + p.ATTR.size)[1]
    ops.fs.releasedir(fh)
    return out


@pytest.mark.parametrize("size", [300, 4096, 32768, 1 << 20])
async def test_files_as_listed_are_packed_from_the_rows_as_from_inodes(ops, size):
    fs = ops.fs
    d = await fs.lookup(ROOT_INO, b"d")
    # an open file's entry is packed from its inode (one being written has a size of
    # its own; a write turns the batch into records anyway)
    busy = await fs.lookup(d.ino, b"f007xxxxxxx")
    fh, _ = await fs.open(busy.ino, os.O_RDONLY)
    plain_entries, used = fs.plain_entries, []

    def counted(fh: int, cookie: int):
        rows = plain_entries(fh, cookie)
        used.append(rows is not None)
        return rows

    def counts() -> list[int]:
        return [fs.lookups.get(ino) for ino in range(1, 1000)]

    def taken(before: list[int]) -> dict[int, int]:  # references counted since
        return {i: b - a for i, (a, b) in enumerate(zip(before, counts(), strict=True))
                if b != a}

    fs.plain_entries = counted
    before = counts()
    from_rows = await replies(ops, d.ino, size)
    counted_rows = taken(before)
    assert any(used)
    fs.plain_entries = lambda fh, cookie: None  # every entry from its inode
    before = counts()
    from_inodes = await replies(ops, d.ino, size)
    counted_inodes = taken(before)
    assert from_rows == from_inodes
    assert counted_rows == counted_inodes
    assert len(counted_rows) == 400 + 5 + 1 + 1  # every entry but . and .. once
    fs.release(fh)
