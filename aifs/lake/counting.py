"""Counts what the mount asks of the lake: requests, errors and bytes per
operation, for ``aifs status`` and the metrics endpoint.

A thin wrapper around any ObjectStore, so every lake is counted the same way
and no implementation needs to know about metrics. Retries happen below, in
the RetryingStore this one wraps (one logical call, several HTTP requests);
they are counted by its RetryPolicy, by cause, and read through
:attr:`CountingStore.retries`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from aifs.buffers import Body
from aifs.errors import CAUSES, LakeError, ObjectNotFound
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore

T = TypeVar("T")

#: S3 API names of the operations counted (the label values in metrics)
OPERATIONS = ("HeadObject", "GetObject", "PutObject", "CreateMultipartUpload", "UploadPart",
              "CompleteMultipartUpload", "AbortMultipartUpload", "ListMultipartUploads",
              "ListObjectsV2", "DeleteObjects", "CopyObject")


class CountingStore(ObjectStore):
    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.description = inner.description
        self.max_key_bytes = inner.max_key_bytes
        self.keys_nest = inner.keys_nest
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        # time spent waiting, per operation: a Counter (0 for one never made) of
        # floats, which typeshed's Counter (int values) cannot say
        self.seconds: dict[str, float] = Counter()  # type: ignore[assignment]
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def retries(self) -> dict[str, int]:
        """Requests made again, by cause (:data:`aifs.errors.CAUSES`)."""
        policy = getattr(self.inner, "policy", None)
        causes = getattr(policy, "causes", {})
        return {cause: int(causes.get(cause, 0)) for cause in CAUSES}

    async def _count(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.requests[op] += 1
        started = time.monotonic()
        try:
            return await call()
        except ObjectNotFound:
            raise  # an answer, not a failure (HEAD of a new key, delete of a gone one)
        except LakeError:
            self.errors[op] += 1
            raise
        finally:
            self.seconds[op] += time.monotonic() - started

    def listed(self, key: str) -> bool:
        return self.inner.listed(key)

    async def check(self) -> None:
        await self.inner.check()

    async def head(self, key: str) -> ObjectInfo:
        return await self._count("HeadObject", lambda: self.inner.head(key))

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        data = await self._count("GetObject",
                                 lambda: self.inner.get_range(key, start, length, if_match))
        self.bytes_read += len(data)
        return data

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        data = await self._count("GetObject",
                                 lambda: self.inner.get_block(key, start, length, if_match))
        self.bytes_read += len(data)
        return data

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        info = await self._count("PutObject", lambda: self.inner.put(key, data, metadata))
        self.bytes_written += len(data)
        return info

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        return await self._count("CreateMultipartUpload",
                                 lambda: self.inner.create_multipart(key, metadata))

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        etag = await self._count("UploadPart", lambda: self.inner.upload_part(
            key, upload_id, part_number, data, offset))
        self.bytes_written += len(data)
        return etag

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        return await self._count("CompleteMultipartUpload", lambda: self.inner.complete_multipart(
            key, upload_id, parts))

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        return self.inner.made_by_upload(info, upload_id, parts)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._count("AbortMultipartUpload",
                          lambda: self.inner.abort_multipart(key, upload_id))

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return await self._count("ListMultipartUploads",
                                 lambda: self.inner.list_uploads(prefix))

    async def list_multipart(self, key: str) -> list[tuple[str, float]]:
        return await self._count("ListMultipartUploads",
                                 lambda: self.inner.list_multipart(key))

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        return await self._count("ListObjectsV2", lambda: self.inner.list_page(
            prefix, delimiter, token, max_keys))

    async def iter_list(self, prefix: str,
                        delimiter: str | None = "/") -> AsyncIterator[ListPage]:
        """The inner store's own paging (the local lake scans a directory once
        for all its pages), each page counted as one LIST."""
        pages = self.inner.iter_list(prefix, delimiter)
        while True:
            self.requests["ListObjectsV2"] += 1
            started = time.monotonic()
            try:
                page = await pages.__anext__()
            except StopAsyncIteration:
                self.requests["ListObjectsV2"] -= 1  # the end, not a request
                return
            except LakeError:
                self.errors["ListObjectsV2"] += 1
                raise
            finally:
                self.seconds["ListObjectsV2"] += time.monotonic() - started
            yield page

    async def delete_many(self, keys: list[str]) -> None:
        await self._count("DeleteObjects", lambda: self.inner.delete_many(keys))

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        return await self._count("CopyObject", lambda: self.inner.copy(src, dst, metadata))

    async def aclose(self) -> None:
        await self.inner.aclose()
