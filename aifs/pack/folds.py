"""Folds: the records of many journals in one object, and for a big index,
split by directory so that a node reads only the directories it lists.

A fold of a small index is one object under ``.aifs/journal/``: a header
line, then a record per line, gzip-compressed (``encode_fold``). Past
``fold_shard_records`` records a fold is **sharded** (``encode_sharded_fold``):
the fold object (its head) holds the header and the ``pack`` records, and
each record about a key goes to one of N shard objects under
``.aifs/index/<fold id>/``, chosen by a hash of the key's directory. A node
that lists a directory reads that directory's shard of each sharded fold,
once: what it reads grows with the directories it visits, not with the lake
(``docs/packing.md``, Folds).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from aifs.meta.schema import compact_json

JOURNAL_DIR = ".aifs/journal/"
FOLD_SUFFIX = ".fold.jsonl.gz"  # a fold: the records of many journals, in one object
SHARD_DIR = ".aifs/index/"  # the shards of sharded folds, a folder per fold
FORMAT_VERSION = 1
SHARDED_VERSION = 2  # a fold whose records about keys are in shard objects

Record = dict[str, Any]


def directory_of(key: str) -> str:
    """The directory prefix a key is listed under ("" at the top): ``a/b/``
    for the file ``a/b/f``, ``a/`` for the directory marker ``a/b/``."""
    return key[:key.rstrip("/").rfind("/") + 1]


def shard_of(prefix: str, shards: int) -> int:
    """Which shard holds the records of the keys directly in ``prefix``."""
    return xxhash.xxh3_64_intdigest(prefix.encode("utf-8", "surrogateescape")) % shards


def shard_key(fold: str, shard: int) -> str:
    """The lake key of shard ``shard`` of the fold object ``fold``."""
    return f"{shard_dir(fold)}{shard}.jsonl.gz"


def shard_dir(fold: str) -> str:
    """The folder of the shards of the fold object ``fold``."""
    return SHARD_DIR + fold[len(JOURNAL_DIR):-len(FOLD_SUFFIX)] + "/"


class _GzipLines:
    """Lines gzip-compressed as they come (a fold may hold millions)."""

    def __init__(self, first: Record) -> None:
        self._packer = zlib.compressobj(3, wbits=31)  # gzip format
        self._out = [self._packer.compress(compact_json(first).encode() + b"\n")]
        self._chunk: list[bytes] = []

    def add(self, line: bytes) -> None:
        self._chunk.append(line)
        if len(self._chunk) >= 4096:
            self._flush()

    def _flush(self) -> None:
        if self._chunk:
            self._out.append(self._packer.compress(b"\n".join(self._chunk) + b"\n"))
            self._chunk = []

    def close(self) -> bytes:
        self._flush()
        self._out.append(self._packer.flush())
        return b"".join(self._out)


def encode_fold(node: str, covers: list[str], records: Iterable[bytes],
                dels_after: int) -> bytes:
    """A fold object: the index's records (raw JSON, one per line, after a
    header line) standing for the journals and folds named in ``covers``,
    without the deletions stamped before ``dels_after`` (ns)."""
    out = _GzipLines({"v": FORMAT_VERSION, "node": node, "dels_after": dels_after,
                      "covers": covers})
    for record in records:
        out.add(record)
    return out.close()


def encode_sharded_fold(node: str, covers: list[str], records: Iterable[bytes],
                        dels_after: int, shards: int) -> tuple[bytes, list[bytes]]:
    """A sharded fold: its head (header and ``pack`` records) and its
    ``shards`` shard objects (each a header line, then the records of the
    keys whose directory hashes to it). The head names each shard's size,
    so a reader needs no LIST to fetch one."""
    parts = [_GzipLines({"v": SHARDED_VERSION, "shard": i, "shards": shards})
             for i in range(shards)]
    packs: list[bytes] = []
    holding: set[str] = set()  # directories with packed files at or below them
    for record in records:
        if b'"op":"pack"' in record:
            packs.append(record)
            continue
        key = json.loads(record)["key"]
        directory = directory_of(key)
        parts[shard_of(directory, shards)].add(record)
        if b'"op":"put"' in record:
            while directory and directory not in holding:
                holding.add(directory)
                directory = directory_of(directory)
    # A "dir" record in its parent's shard: the parent's listing shows the
    # directory before the directory's own shard is read (it may have no
    # marker object: made by another tool, its last plain object gone).
    for directory in sorted(holding):
        parts[shard_of(directory_of(directory), shards)].add(
            compact_json({"op": "dir", "key": directory, "t": 0}).encode())
    bodies = [part.close() for part in parts]
    head = _GzipLines({"v": SHARDED_VERSION, "node": node, "dels_after": dels_after,
                       "covers": covers, "shards": shards,
                       "shard_sizes": [len(body) for body in bodies]})
    for record in packs:
        head.add(record)
    return head.close(), bodies


@dataclass(frozen=True)
class FoldHeader:
    covers: list[str]  # the journals and folds it stands for
    dels_after: int  # ns: older deletions were left out
    shards: int = 0  # sharded: how many shard objects hold its records about keys
    shard_sizes: list[int] = field(default_factory=list)


def _lines(raw: bytes) -> Iterator[bytes]:
    unpacker = zlib.decompressobj(wbits=31)
    rest = b""
    try:
        for start in range(0, len(raw), 1 << 20):
            rest += unpacker.decompress(raw[start:start + (1 << 20)])
            *complete, rest = rest.split(b"\n")
            yield from complete
        rest += unpacker.flush()
    except zlib.error as exc:
        raise ValueError(f"not gzip: {exc}") from None
    if not unpacker.eof or rest.strip():
        raise ValueError("truncated")


def _batches(stream: Iterator[bytes], batch: int
             ) -> Iterator[tuple[list[Record], list[bytes]]]:
    def parse(lines: list[bytes]) -> list[Record]:
        try:  # one parse per batch: much cheaper than one per line
            records = json.loads(b"[" + b",".join(lines) + b"]")
        except ValueError:
            raise ValueError("a record is not JSON") from None
        if not all(isinstance(record, dict) for record in records):
            raise ValueError("a record is not a JSON object")
        return records

    lines: list[bytes] = []
    for line in stream:
        if line.strip():
            lines.append(line)
        if len(lines) >= batch:
            yield parse(lines), lines
            lines = []
    if lines:
        yield parse(lines), lines


def read_fold(raw: bytes, batch: int = 5000
              ) -> tuple[FoldHeader, Iterator[tuple[list[Record], list[bytes]]]]:
    """The header and the batches of records (parsed, and as their lines) of
    a fold object, decompressed as it is read; ValueError if it cannot be
    read (from the batches too)."""
    stream = _lines(raw)
    try:
        header = json.loads(next(stream))
        covers, dels_after = header["covers"], header.get("dels_after", 0)
        shards, sizes = header.get("shards", 0), header.get("shard_sizes", [])
    except (StopIteration, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"no header: {exc!r}") from None
    if not isinstance(covers, list) or not isinstance(dels_after, int):
        raise ValueError("covers is not a list, or dels_after not a number")
    version = header.get("v", FORMAT_VERSION)
    if not isinstance(version, int) or version > SHARDED_VERSION:
        raise ValueError(f"format {version!r}: not one this aifs reads (a newer aifs's?)")
    if not isinstance(shards, int) or not isinstance(sizes, list) or \
            (shards and len(sizes) != shards):
        raise ValueError("shards is not a number, or shard_sizes not one size per shard")
    return FoldHeader(covers, dels_after, shards, sizes), _batches(stream, batch)


def read_shard(raw: bytes, shard: int, shards: int,
               batch: int = 5000) -> Iterator[tuple[list[Record], list[bytes]]]:
    """The batches of records of a shard object; ValueError if it cannot be
    read or is not shard ``shard`` of ``shards``."""
    stream = _lines(raw)
    try:
        header = json.loads(next(stream))
        ok = header.get("shard") == shard and header.get("shards") == shards
    except (StopIteration, ValueError, AttributeError) as exc:
        raise ValueError(f"no header: {exc!r}") from None
    if not ok:
        raise ValueError(f"not shard {shard} of {shards}")
    return _batches(stream, batch)
