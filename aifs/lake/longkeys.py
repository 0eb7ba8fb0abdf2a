"""Keys longer than S3 holds: the mapping (docs/SEMANTICS.md, "Lake key length").

S3 keys stop at 1,024 bytes (the mount's prefix included); a path on the
mount may be as long as a local disk's. A key the lake cannot hold is stored
under ``.aifs/long/<xxh3-128 of the key, hex>`` (a directory marker with a
``/`` after it): derived from the key, so every node finds the object from
the path alone. Other tools see that short key. The whole key travels in the
journal record aifs publishes for every object it puts (an ``obj`` record,
:mod:`aifs.pack.index`), from which other nodes list it, and a packed file's
record holds its whole key anyway.

This wrapper sits right above the S3 store: every call by key maps the key,
and answers carry the caller's key again. A LIST under a long prefix finds
nothing (nothing is stored under it): the listing takes such directories'
entries from the records. Uploads found by ``list_uploads`` keep their short
keys (they are only ever aborted).
"""

from __future__ import annotations

import xxhash

from aifs.buffers import Body
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore

LONG_KEYS = ".aifs/long/"  # under the mount's prefix
#: the longest key, whole in the journal records: a local disk's paths go
#: past PATH_MAX (below a directory reached by descriptor)
MAX_KEY = 65536


def short_key(key: str) -> str:
    """The key an object of ``key`` is stored under where ``key`` is too long."""
    digest = xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogateescape"))
    return LONG_KEYS + digest + ("/" if key.endswith("/") else "")


class LongKeys(ObjectStore):
    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.limit = inner.max_key_bytes  # what the lake itself holds
        self.description = inner.description
        self.max_key_bytes = MAX_KEY
        self.keys_nest = inner.keys_nest

    def is_long(self, key: str) -> bool:
        return len(key.encode("utf-8", "surrogateescape")) > self.limit

    def listed(self, key: str) -> bool:
        return not self.is_long(key)

    def _k(self, key: str) -> str:
        return short_key(key) if self.is_long(key) else key

    @staticmethod
    def _as(key: str, info: ObjectInfo) -> ObjectInfo:
        return info if info.key == key else info._replace(key=key)

    async def check(self) -> None:
        await self.inner.check()

    async def head(self, key: str) -> ObjectInfo:
        return self._as(key, await self.inner.head(self._k(key)))

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        return await self.inner.get_range(self._k(key), start, length, if_match)

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        return await self.inner.get_block(self._k(key), start, length, if_match)

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        return self._as(key, await self.inner.put(self._k(key), data, metadata))

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        return await self.inner.create_multipart(self._k(key), metadata)

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        return await self.inner.upload_part(self._k(key), upload_id, part_number, data, offset)

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        return self._as(key, await self.inner.complete_multipart(self._k(key), upload_id,
                                                                 parts))

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        return self.inner.made_by_upload(info, upload_id, parts)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self.inner.abort_multipart(self._k(key), upload_id)

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        if self.is_long(prefix):
            return []  # (list_multipart asks for one key: below)
        return await self.inner.list_uploads(prefix)

    async def list_multipart(self, key: str) -> list[tuple[str, float]]:
        return await self.inner.list_multipart(self._k(key))

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        if self.is_long(prefix):  # (iter_list pages through here: retried above)
            return ListPage([], [], None)
        return await self.inner.list_page(prefix, delimiter, token, max_keys)

    async def delete_many(self, keys: list[str]) -> None:
        await self.inner.delete_many([self._k(key) for key in keys])

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        return await self.inner.copy(self._k(src), self._k(dst), metadata)

    async def aclose(self) -> None:
        await self.inner.aclose()
