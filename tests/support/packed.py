"""A lake's packed files read from its journals and packs as docs/packing.md
describes them (written here independently of aifs), and the per-file views
that see through packing: a file's size, digest and metadata."""

from __future__ import annotations

import gzip
import json
import os

from support.lakes import Lake, lake_objects

JOURNALS = ".aifs/journal/"
PACKS = ".aifs/packs/"


_replayed: dict[tuple, dict[str, dict]] = {}


def lake_packed(lake: Lake, objects: dict[str, int] | None = None) -> dict[str, dict]:
    """The packed files of the lake, read from its journals as docs/packing.md
    describes them (written here independently of aifs): key -> its put record."""
    objects = lake_objects(lake) if objects is None else objects
    journals = tuple(sorted((k, v) for k, v in objects.items()
                            if k.startswith(JOURNALS) and not k.endswith("/")))
    cached = _replayed.get((lake.url, journals))
    if cached is not None:
        return cached
    newest: dict[str, dict] = {}
    for key, _ in journals:
        raw = lake.get_object(key)
        if key.endswith(".gz"):  # a fold: a header line, then a record per line
            lines = gzip.decompress(raw).splitlines()
            records = [json.loads(line) for line in lines[1:]]
            # a sharded fold: the records about keys are in its shards, a
            # header line then a record per line each
            ident = key[len(JOURNALS):-len(".fold.jsonl.gz")]
            for shard in range(json.loads(lines[0]).get("shards", 0)):
                part = gzip.decompress(lake.get_object(f".aifs/index/{ident}/{shard}.jsonl.gz"))
                records += [json.loads(line) for line in part.splitlines()[1:]]
        else:
            records = json.loads(raw)["records"]
        for record in records:
            current = newest.get(record.get("key", ""))
            if record["op"] in ("put", "del", "obj"):  # (obj: an object replaced it)
                stale_copy = (current is not None and record["op"] == current["op"] == "put"
                              and record["t"] == current["t"]
                              and record.get("mv", 0) < current.get("mv", 0))
                if (current is None or record["t"] >= current["t"]) and not stale_copy:
                    newest[record["key"]] = record
            elif record["op"] == "move" and current is not None \
                    and current["op"] == "put" \
                    and [current["pack"], current["off"]] == record["from"]:
                newest[record["key"]] = dict(current, pack=record["pack"], off=record["off"],
                                             mv=current.get("mv", 0) + 1)
    out = {key: record for key, record in newest.items() if record["op"] == "put"}
    _replayed[(lake.url, journals)] = out
    return out


def lake_packed_bytes(lake: Lake, record: dict) -> bytes:
    """A packed file's bytes, cut from its pack object."""
    data = lake.get_object(PACKS + record["pack"])
    return data[record["off"]:record["off"] + record["len"]]


def _plain_size(lake: Lake, key: str) -> int | None:
    import botocore.exceptions
    if lake.server:
        try:
            return lake.server.client.head_object(Bucket=lake.bucket,
                                                  Key=lake.prefix + key)["ContentLength"]
        except botocore.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
    assert lake.root is not None
    try:
        return os.stat(lake.root / key).st_size
    except FileNotFoundError:
        return None


def lake_size(lake: Lake, key: str) -> int | None:
    """The size of the file under ``key`` in the lake now (its object, else its
    packed entry), or None when there is none."""
    size = _plain_size(lake, key)
    if size is None and (record := lake_packed(lake).get(key)) is not None:
        return record["len"]
    return size


def lake_digest(lake: Lake, key: str) -> str:
    """xxh3-128 of a file's bytes in the lake (streamed from its object, else cut
    from its pack)."""
    import xxhash
    if _plain_size(lake, key) is None and (record := lake_packed(lake).get(key)) is not None:
        return xxhash.xxh3_128_hexdigest(lake_packed_bytes(lake, record))
    hasher = xxhash.xxh3_128()
    if lake.server:
        body = lake.server.client.get_object(Bucket=lake.bucket, Key=lake.prefix + key)["Body"]
        for chunk in body.iter_chunks(4 << 20):
            hasher.update(chunk)
        return hasher.hexdigest()
    assert lake.root is not None
    with open(lake.root / key, "rb") as fp:
        while chunk := fp.read(4 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def lake_meta(lake: Lake, key: str) -> dict[str, str]:
    """The user metadata of one object (s3fs names: mode, uid, gid, mtime, xattr),
    or of a packed file as its journal record gives it."""
    if _plain_size(lake, key) is None and (record := lake_packed(lake).get(key)):
        import urllib.parse
        seconds, nanos = divmod(record["mtime"], 1_000_000_000)
        meta = {"mode": str(0o100000 | (record["mode"] or 0o644)), "uid": str(record["uid"]),
                "gid": str(record["gid"]),
                "mtime": f"{seconds}.{nanos:09d}" if nanos else str(seconds)}
        if record.get("xattrs"):
            meta["xattr"] = urllib.parse.quote(json.dumps(
                record["xattrs"], separators=(",", ":"), sort_keys=True), safe="")
        return meta
    if lake.server:
        return lake.server.client.head_object(Bucket=lake.bucket,
                                              Key=lake.prefix + key)["Metadata"]
    assert lake.root is not None
    path = lake.root / key
    return {name[len("user.aifs.meta."):]: os.getxattr(path, name).decode()
            for name in os.listxattr(path) if name.startswith("user.aifs.meta.")}


def mtime_ns_of(value: str) -> int:
    """The s3fs ``mtime`` metadata ("SECONDS" or "SECONDS.NNNNNNNNN") in nanoseconds."""
    seconds, _, fraction = value.partition(".")
    return int(seconds) * 1_000_000_000 + int((fraction or "0").ljust(9, "0")[:9])
