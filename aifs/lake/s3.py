"""S3 lake through boto3.

boto3 is blocking: every call runs in a worker thread, under a CapacityLimiter
sized to the connection pool so threads never wait on the pool. The client is
built once, before any thread uses it. botocore's own retries are off: each
call is one attempt, and retry with backoff happens once, in
:class:`aifs.lake.retry.RetryingStore` above this store.
"""

from __future__ import annotations

import functools
import http.client
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import trio
import urllib3.exceptions

from aifs.buffers import Body
from aifs.errors import (
    AccessDenied,
    BucketNotFound,
    LakeError,
    LakeUnavailable,
    ObjectNotFound,
)
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore
from aifs.lake.s3http import SignedHTTP, error_of

log = logging.getLogger(__name__)
T = TypeVar("T")

#: GETs up to this many bytes are sent from the event loop, larger ones from
#: threads (a large body copied in the event loop would stall the requests)
SMALL_GET = 256 << 10

class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str = "",
                 region: str = "", profile: str = "", path_style: bool = True,
                 max_connections: int = 32, timeout: float = 30.0,
                 sign_payload: bool = False) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        # S3 (and Ceph RGW) keys hold at most 1,024 bytes, the prefix included
        self.max_key_bytes = 1024 - len(self.prefix.encode())
        self.limiter = trio.CapacityLimiter(max_connections)
        try:
            session = boto3.session.Session(profile_name=profile or None)
        except botocore.exceptions.ProfileNotFound as exc:
            raise AccessDenied(f"AWS profile not found: {profile}") from exc
        config = botocore.config.Config(
            max_pool_connections=max_connections,
            connect_timeout=min(timeout, 10.0),
            read_timeout=timeout,
            retries={"total_max_attempts": 1},
            # Unsigned bodies (UNSIGNED-PAYLOAD), as the S3 CRT and mountpoint-s3
            # send them: SigV4 over plain HTTP would hash every uploaded byte
            # with SHA-256 (about a core-second per GiB) in the upload path.
            s3={"addressing_style": "path" if path_style else "auto",
                "payload_signing_enabled": sign_payload},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = session.client(
            "s3", endpoint_url=endpoint_url or None,
            region_name=region or session.region_name or "us-east-1", config=config)
        endpoint = self.client.meta.endpoint_url
        self.description = f"s3://{bucket}/{self.prefix} at {endpoint}"
        # HEAD and GET, the per-file calls, skip botocore's machinery where the
        # URL is plain (path style, an explicit endpoint): see s3http.py
        credentials = session.get_credentials()
        self.http = SignedHTTP(endpoint, bucket, self.client.meta.region_name, credentials,
                               max_connections, timeout) \
            if path_style and endpoint_url and credentials is not None else None

    # -- plumbing -------------------------------------------------------
    def _k(self, key: str) -> str:
        return self.prefix + key

    def _translate(self, exc: Exception, what: str) -> LakeError:
        if isinstance(exc, botocore.exceptions.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            return error_of(code, status, err.get("Message") or code or status, what,
                            self.client.meta.endpoint_url, self.bucket)
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return AccessDenied("no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                                "AWS_SECRET_ACCESS_KEY, a profile, or an instance role)")
        endpoint = self.client.meta.endpoint_url
        if isinstance(exc, botocore.exceptions.EndpointConnectionError):
            return LakeUnavailable(f"cannot reach {endpoint}: {type(exc).__name__}",
                                   "connection", unreached=True)
        if isinstance(exc, botocore.exceptions.ConnectTimeoutError):
            return LakeUnavailable(f"cannot reach {endpoint}: {type(exc).__name__}", "timeout")
        if isinstance(exc, botocore.exceptions.ReadTimeoutError):
            return LakeUnavailable(f"{what}: no answer from {endpoint} in time", "timeout")
        if isinstance(exc, botocore.exceptions.ConnectionClosedError):
            return LakeUnavailable(f"{what}: connection to {endpoint} reset before a whole "
                                   "answer came (the request may or may not have been done)",
                                   "connection")
        if isinstance(exc, (botocore.exceptions.ResponseStreamingError,
                            botocore.exceptions.IncompleteReadError)):
            return LakeUnavailable(f"{what}: the answer from {endpoint} was cut short "
                                   f"({exc})", "truncated")
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return LakeUnavailable(f"{what}: {exc}")
        raise exc

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One attempt of ``fn`` in a worker thread, its errors translated."""
        def guarded() -> T:
            try:
                return fn()
            except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
                raise self._translate(exc, what) from None
            except (urllib3.exceptions.HTTPError, http.client.HTTPException,
                    ConnectionError, TimeoutError) as exc:
                # a connection broken where botocore does not wrap it (a body read)
                raise LakeUnavailable(f"{what}: connection to "
                                      f"{self.client.meta.endpoint_url} broken: "
                                      f"{type(exc).__name__}", "connection") from None
        return await trio.to_thread.run_sync(guarded, limiter=self.limiter)

    @staticmethod
    def _meta_of(resp: dict[str, Any]) -> dict[str, str]:
        return {k.lower(): v for k, v in (resp.get("Metadata") or {}).items()}

    # -- interface ------------------------------------------------------
    async def check(self) -> None:
        try:
            await self._call(f"bucket {self.bucket}",
                             lambda: self.client.head_bucket(Bucket=self.bucket))
        except ObjectNotFound:  # HEAD has no body: a bare 404 means no bucket
            raise BucketNotFound(f"bucket {self.bucket!r} does not exist at "
                                 f"{self.client.meta.endpoint_url}") from None
        # HEAD bucket answers 403 for a wrong key on some servers but 404 on
        # others; a one-key listing proves that we may read.
        # (as every LIST: through s3http where it applies, which tells a cut
        # body from a connection reset)
        await self.list_page("", None, None, 1)

    async def head(self, key: str) -> ObjectInfo:
        if self.http is not None:
            http = self.http
            return await self._call(f"HEAD {key}", lambda: http.head(self._k(key), key))
        resp = await self._call(f"HEAD {key}", lambda: self.client.head_object(
            Bucket=self.bucket, Key=self._k(key)))
        return ObjectInfo(key, resp["ContentLength"], resp["ETag"],
                          resp["LastModified"].timestamp(), self._meta_of(resp))

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        return bytes(await self._get(key, start, length, if_match, False))

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        return await self._get(key, start, length, if_match, True)

    async def _get(self, key: str, start: int, length: int, if_match: str | None,
                   pooled: bool) -> Body:
        if length <= 0:
            return b""
        if self.http is not None:
            http = self.http
            if http.loop is not None and length <= SMALL_GET and not http.credentials_due():
                async with self.limiter:  # a small GET: from the event loop
                    return await http.get_range_async(self._k(key), key, start, length,
                                                       if_match)
            return await self._call(f"GET {key}", lambda: http.get_range(
                self._k(key), key, start, length, if_match, pooled))
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(key),
                                "Range": f"bytes={start}-{start + length - 1}"}
        if if_match:
            args["IfMatch"] = if_match

        def do() -> bytes:
            try:
                resp = self.client.get_object(**args)
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""
                raise
            body = resp["Body"]  # botocore's StreamingBody: read through it, not
            try:                 # its urllib3 stream ("with" gives that one)
                data: bytes = body.read()
            finally:
                body.close()
            if len(data) != resp["ContentLength"]:  # a cut body is an error, never data
                raise botocore.exceptions.IncompleteReadError(
                    actual_bytes=len(data), expected_bytes=resp["ContentLength"])
            return data
        return await self._call(f"GET {key}", do)

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        resp = await self._call(f"PUT {key}", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self._k(key), Body=data, Metadata=metadata or {}))
        return ObjectInfo(key, len(data), resp["ETag"], time.time(),
                          dict(metadata or {}))

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        resp = await self._call(f"create multipart {key}",
                                lambda: self.client.create_multipart_upload(
                                    Bucket=self.bucket, Key=self._k(key),
                                    Metadata=metadata or {}))
        upload_id: str = resp["UploadId"]
        return upload_id

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        resp = await self._call(f"upload part {part_number} of {key}",
                                lambda: self.client.upload_part(
                                    Bucket=self.bucket, Key=self._k(key), UploadId=upload_id,
                                    PartNumber=part_number, Body=data))
        etag: str = resp["ETag"]
        return etag

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        await self._call(f"complete multipart {key}",
                         lambda: self.client.complete_multipart_upload(
                             Bucket=self.bucket, Key=self._k(key), UploadId=upload_id,
                             MultipartUpload={"Parts": [
                                 {"PartNumber": n, "ETag": e} for n, e in sorted(parts)]}))
        return await self.head(key)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._call(f"abort multipart {key}",
                         lambda: self.client.abort_multipart_upload(
                             Bucket=self.bucket, Key=self._k(key), UploadId=upload_id))

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        found: list[tuple[str, str, float]] = []
        marks: dict[str, str] = {}
        cut = len(self.prefix)
        while True:
            args = {"Bucket": self.bucket, "Prefix": self._k(prefix), **marks}
            resp = await self._call(f"list uploads of {prefix or '/'}",
                                    functools.partial(self.client.list_multipart_uploads,
                                                      **args))
            found += [(u["Key"][cut:], u["UploadId"], u["Initiated"].timestamp())
                      for u in resp.get("Uploads", [])]
            if not resp.get("IsTruncated"):
                return found
            marks = {"KeyMarker": resp.get("NextKeyMarker", ""),
                     "UploadIdMarker": resp.get("NextUploadIdMarker", "")}

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        what = f"LIST s3://{self.bucket}/{self._k(prefix)}"
        if self.http is not None:
            http = self.http
            return await self._call(what, lambda: http.list_page(
                self._k(prefix), len(self.prefix), delimiter, token, max_keys, what))
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._k(prefix),
                                "MaxKeys": max_keys}
        if delimiter:
            args["Delimiter"] = delimiter
        if token:
            args["ContinuationToken"] = token
        resp = await self._call(what, lambda: self.client.list_objects_v2(**args))
        cut = len(self.prefix)
        objects = [ObjectInfo(o["Key"][cut:], o["Size"], o["ETag"],
                              o["LastModified"].timestamp())
                   for o in resp.get("Contents", [])]
        prefixes = [p["Prefix"][cut:] for p in resp.get("CommonPrefixes", [])]
        token = resp.get("NextContinuationToken") if resp.get("IsTruncated") else None
        return ListPage(objects, prefixes, token)

    async def delete_many(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[start:start + 1000]]
            resp = await self._call("DELETE objects", functools.partial(
                self.client.delete_objects, Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True}))
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise LakeError(f"DELETE {first.get('Key')}: {first.get('Code')} "
                                f"{first.get('Message')}")

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(dst),
                                "CopySource": {"Bucket": self.bucket, "Key": self._k(src)}}
        if metadata is not None:
            args["Metadata"] = metadata
            args["MetadataDirective"] = "REPLACE"
        resp = await self._call(f"COPY {src} -> {dst}",
                                lambda: self.client.copy_object(**args))
        etag = resp["CopyObjectResult"]["ETag"]
        # Some servers (Ceph RGW) leave the quotes off here, not in HEAD or LIST.
        return etag if etag.startswith('"') else f'"{etag}"'

    async def aclose(self) -> None:
        self.client.close()
        if self.http is not None:
            self.http.close()
