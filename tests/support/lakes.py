"""Lakes for the tests: a fresh, empty one per test (``lake``: local, moto and
Ceph RGW; ``s3_lake``: the S3 servers), and direct (non-aifs) views of what a
lake holds: its objects, files, trees and unfinished uploads. The files packed
into pack objects are read by support/packed.py."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from support.servers import S3Server, ceph_left_out

LAKE_KINDS = ["local", "moto", "ceph"]
S3_KINDS = ["moto", "ceph"]

# The heaviest cases (tens of seconds each on a 2-core machine: thousands of files,
# pip, a 300 MiB file, kill loops) run on one S3 server, not on both: the Ceph RGW
# where the run has one (the real server), else moto. Every other case still runs on
# both. AIFS_ALL_S3=1 runs the heavy ones on both too.
if os.environ.get("AIFS_ALL_S3") == "1":
    ONE_S3 = ["moto", "ceph"]
else:
    ONE_S3 = ["moto"] if ceph_left_out() else ["ceph"]
HEAVY_LAKES = ["local", *ONE_S3]


class Lake:
    """A fresh, empty lake of one kind, with direct (non-aifs) access to it."""

    def __init__(self, kind: str, url: str, env: dict[str, str], args: list[str],
                 server: S3Server | None = None, root: Path | None = None,
                 bucket: str = "", prefix: str = "") -> None:
        self.kind = kind
        self.url = url
        self.env = env
        self.args = args
        self.server = server
        self.root = root
        self.bucket = bucket
        self.prefix = prefix

    def put(self, key: str, data: bytes, meta: dict[str, str] | None = None) -> None:
        """Write an object as another tool would (``meta``: its user metadata,
        e.g. s3fs's ``mode``)."""
        if self.server:
            self.server.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data,
                                          Metadata=meta or {})
            return
        assert self.root is not None
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".put-{uuid.uuid4().hex}"
        tmp.write_bytes(data)
        for name, value in (meta or {}).items():  # where the local lake keeps metadata
            os.setxattr(tmp, "user.aifs.meta." + name, value.encode())
        os.rename(tmp, path)  # atomic, like an object PUT

    def put_many(self, items: dict[str, bytes], threads: int = 16) -> None:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda kv: self.put(*kv), items.items()))

    def mkdir_marker(self, key: str) -> None:
        if self.server:
            self.put(key.rstrip("/") + "/", b"")
        else:
            assert self.root is not None
            (self.root / key).mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> bytes:
        """The bytes of a file in the lake: its object, else its packed entry
        (a missing file raises what the lake raises: FileNotFoundError, NoSuchKey)."""
        try:
            return self.get_object(key)
        except Exception as exc:
            if not self._missing(exc):
                raise
            from support.packed import lake_packed, lake_packed_bytes  # (it builds on this)
            record = lake_packed(self).get(key)
            if record is None:
                raise
            return lake_packed_bytes(self, record)

    def _missing(self, exc: Exception) -> bool:
        if self.server:
            return isinstance(exc, self.server.client.exceptions.NoSuchKey)
        return isinstance(exc, (FileNotFoundError, IsADirectoryError))

    def get_object(self, key: str) -> bytes:
        """The bytes of one object."""
        if self.server:
            return self.server.client.get_object(
                Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        assert self.root is not None
        return (self.root / key).read_bytes()


def _make_lake(kind: str, request, tmp_path: Path) -> Lake:
    if kind == "local":
        root = tmp_path / "lake"
        root.mkdir()
        return Lake("local", f"file://{root}", {}, [], root=root)
    server: S3Server = request.getfixturevalue(f"{kind}_server")
    bucket = f"aifs-test-{uuid.uuid4().hex[:12]}"
    server.client.create_bucket(Bucket=bucket)
    return Lake(kind, f"s3://{bucket}/data", server.env,
                ["--endpoint-url", server.endpoint], server=server, bucket=bucket,
                prefix="data/")


@pytest.fixture(params=LAKE_KINDS)
def lake(request, tmp_path) -> Lake:
    return _make_lake(request.param, request, tmp_path)


@pytest.fixture(params=S3_KINDS)
def s3_lake(request, tmp_path) -> Lake:
    return _make_lake(request.param, request, tmp_path)


# -- direct views of a lake's contents (for the write-path tests) ----------------
LOCAL_STAGING = ".aifs-uploads"   # the local lake's multipart staging directory
LOCAL_TMP_PREFIX = ".aifs-tmp-"   # the local lake's not-yet-renamed objects


def lake_sizes(lake: Lake) -> dict[str, int]:
    """Every file and directory marker in the lake as a mount shows them, and its
    size: the objects (without aifs's own under ``.aifs/``) and the packed files
    the journals list. See :func:`lake_objects` for the objects alone."""
    from support.packed import JOURNALS, lake_packed  # (it builds on this module)
    objects = lake_objects(lake)
    out = {key: size for key, size in objects.items() if not key.startswith(".aifs/")}
    if any(key.startswith(JOURNALS) for key in objects):
        for key, record in lake_packed(lake, objects).items():
            out.setdefault(key, record["len"])
    return out


def lake_objects(lake: Lake) -> dict[str, int]:
    """Every object in the lake and its size, from one LIST, without the lake's
    prefix; a directory marker ends with "/" (on the local lake every directory
    counts as one, size 0)."""
    out: dict[str, int] = {}
    if lake.server:
        pages = lake.server.client.get_paginator("list_objects_v2").paginate(
            Bucket=lake.bucket, Prefix=lake.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][len(lake.prefix):]] = obj["Size"]
        return out
    assert lake.root is not None
    for dirpath, dirnames, filenames in os.walk(lake.root):
        rel = os.path.relpath(dirpath, lake.root)
        prefix = "" if rel == "." else rel + "/"
        dirnames[:] = [d for d in dirnames if not d.startswith(LOCAL_TMP_PREFIX)
                       and not (prefix == "" and d == LOCAL_STAGING)]
        if prefix:
            out[prefix] = 0
        for name in filenames:
            if name.startswith(LOCAL_TMP_PREFIX):
                continue
            try:
                out[prefix + name] = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass  # replaced between the listing and the stat
    return out


def lake_keys(lake: Lake) -> list[str]:
    """Every file and marker key in the lake, sorted (see :func:`lake_sizes`)."""
    return sorted(lake_sizes(lake))


def lake_tree(lake: Lake, under: str = "") -> tuple[dict[str, bytes], set[str]]:
    """(files, directories) below ``under`` ("" or "some/dir/"), as paths relative to it:
    files map to their bytes; directories are markers and every implied parent."""
    from concurrent.futures import ThreadPoolExecutor
    object_keys: list[str] = []
    dirs: set[str] = set()
    for key in lake_keys(lake):
        if not key.startswith(under) or key == under:
            continue
        rel = key[len(under):]
        if rel.endswith("/"):
            rel = rel.rstrip("/")
            dirs.add(rel)
        else:
            object_keys.append(key)
        parts = rel.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    with ThreadPoolExecutor(16) as pool:
        contents = list(pool.map(lake.get, object_keys))
    files = {key[len(under):]: data for key, data in zip(object_keys, contents, strict=True)}
    return files, dirs


def lake_uploads(lake: Lake) -> list[str]:
    """Unfinished multipart uploads in the lake: their keys on S3, the staging
    entries on the local lake."""
    if lake.server:
        found: list[str] = []
        pages = lake.server.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=lake.bucket)
        for page in pages:
            found += [u["Key"] for u in page.get("Uploads", [])]
        return found
    assert lake.root is not None
    try:
        return sorted(name for name in os.listdir(lake.root / LOCAL_STAGING)
                      if not name.startswith(".aifs-tmp-"))  # a create cut short: no upload
    except FileNotFoundError:
        return []


def lake_upload_parts(lake: Lake) -> int:
    """How many parts the lake holds for its unfinished multipart uploads
    (in a local lake, parts sent with their offsets share one file, "object",
    which counts as one: tests ask whether any part is there)."""
    if lake.server:
        client = lake.server.client
        uploads = client.list_multipart_uploads(Bucket=lake.bucket).get("Uploads", [])
        parts = 0
        for upload in uploads:
            try:
                parts += len(client.list_parts(Bucket=lake.bucket, Key=upload["Key"],
                                               UploadId=upload["UploadId"]).get("Parts", []))
            except client.exceptions.ClientError as exc:
                # completed or aborted since the listing (Ceph RGW says NoSuchKey)
                if exc.response["Error"]["Code"] not in ("NoSuchUpload", "NoSuchKey"):
                    raise
        return parts
    assert lake.root is not None
    parts = 0
    try:
        uploads = os.listdir(lake.root / LOCAL_STAGING)
    except FileNotFoundError:
        return 0
    for upload in uploads:
        try:
            parts += sum(1 for name in os.listdir(lake.root / LOCAL_STAGING / upload)
                         if name.startswith("part-") or name == "object")
        except (FileNotFoundError, NotADirectoryError):
            continue  # completed or aborted since the listing (as on S3 above)
    return parts


def delete_prefix(lake: Lake, prefix: str) -> None:
    """Remove every object under ``prefix`` (bucket-relative on S3, lake-relative locally)."""
    if lake.server:
        client = lake.server.client
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=lake.bucket,
                                                                  Prefix=prefix)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=lake.bucket, Delete={"Objects": keys})
        return
    assert lake.root is not None
    path = lake.root / prefix
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
