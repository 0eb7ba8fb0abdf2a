"""The one interface every lake implements.

Keys are relative to the store's own prefix: core never sees the bucket or
prefix. Every call is idempotent so that a retry, or a call whose outcome is
unknown after cancellation, can simply be made again (the two exceptions,
create and complete of a multipart upload, are handled in
:mod:`aifs.lake.retry`). A store makes one attempt per call; a transient
failure raises LakeUnavailable with its cause, and the RetryingStore above it
tries again.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from aifs.buffers import Body

NO_METADATA: Mapping[str, str] = MappingProxyType({})


class ObjectInfo(NamedTuple):
    """An object as LIST or HEAD tells it (a named tuple: a LIST makes one per
    object, and a frozen dataclass's constructor cost 0.7 us of that)."""

    key: str
    size: int
    etag: str
    mtime: float
    metadata: Mapping[str, str] = NO_METADATA


@dataclass
class ListPage:
    objects: list[ObjectInfo]
    prefixes: list[str]
    next_token: str | None


class ObjectStore(abc.ABC):
    """Object-store operations used by aifs (S3 semantics)."""

    #: a short description for logs and error messages (never secrets)
    description: str = ""
    #: the longest key (UTF-8 bytes, relative to the store's prefix) it can hold
    max_key_bytes: int = 1024
    #: an object ``a`` and one under ``a/`` exclude each other (a local
    #: directory: ``a`` is a file or a directory); S3 holds both
    keys_nest = False

    async def check(self) -> None:
        """Fail with a clear LakeError if the lake cannot be used."""
        return None

    def listed(self, key: str) -> bool:
        """Whether a LIST finds an object of ``key`` under that name (not so
        for a key the lake holds under another: :mod:`aifs.lake.longkeys`)."""
        return True

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        """Bytes [start, start+length) of the object; fewer at its end.

        With ``if_match`` a changed object raises PreconditionFailed instead
        of returning bytes of another version.
        """

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        """:meth:`get_range` for the block fetcher, whose bodies the block
        cache writes with O_DIRECT: a large one may come as a view of a
        reused aligned buffer (:mod:`aifs.buffers`; valid while referenced,
        never written to). Every other caller gets bytes from get_range."""
        return await self.get_range(key, start, length, if_match)

    @abc.abstractmethod
    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo: ...

    @abc.abstractmethod
    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str: ...

    @abc.abstractmethod
    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        """Part ``part_number``; ``offset``, where known, is where its bytes
        begin in the object (S3 does without; the local lake writes them
        there at once and completes without copying)."""

    @abc.abstractmethod
    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo: ...

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        """Whether the object ``info`` is the one that completing ``upload_id``
        with ``parts`` made (asked when the reply to a complete was lost and
        the upload is gone). S3's form: a multipart ETag ends in ``-<parts>``."""
        return info.etag.strip('"').endswith(f"-{len(parts)}")

    @abc.abstractmethod
    async def abort_multipart(self, key: str, upload_id: str) -> None: ...

    @abc.abstractmethod
    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Unfinished multipart uploads of keys starting with ``prefix``:
        (key, upload id, started)."""

    async def list_multipart(self, key: str) -> list[tuple[str, float]]:
        """Unfinished multipart uploads of exactly ``key``: (upload id, started)."""
        return [(upload, started) for found, upload, started in await self.list_uploads(key)
                if found == key]

    @abc.abstractmethod
    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage: ...

    async def iter_list(self, prefix: str,
                        delimiter: str | None = "/") -> AsyncIterator[ListPage]:
        """All pages of a listing."""
        token: str | None = None
        while True:
            page = await self.list_page(prefix, delimiter, token)
            yield page
            token = page.next_token
            if not token:
                return

    @abc.abstractmethod
    async def delete_many(self, keys: list[str]) -> None:
        """Delete keys; keys that do not exist are not an error."""

    @abc.abstractmethod
    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        """Server-side copy (``metadata`` replaces the source's); the copy's ETag."""

    async def aclose(self) -> None:
        """Release resources (connection pools)."""
        return None
