"""A lake that fails on purpose: a seeded fault-injecting ObjectStore wrapper.

Put it under the :class:`~aifs.lake.retry.RetryingStore` (``RetryingStore(
FaultyStore(store))``) and every retry path of every lake operation runs
without a network; ``tests/support/faultproxy.py`` does the same at the TCP level in
front of a real S3 server. Each call draws from one seeded generator, so a run
is repeatable. The kinds:

``before``     the request fails before the store saw it (connection refused)
``after``      the store did the work, then the reply was lost (reset)
``truncated``  the reply body was cut: the store did the work, and the short
               body is an error, never data (what S3Store's length check makes
               of it)
``slow``       the reply comes late, but comes
``slowdown``   503 SlowDown before the store saw the request
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from aifs.buffers import Body
from aifs.errors import LakeUnavailable
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore

T = TypeVar("T")

KINDS = ("before", "after", "truncated", "slow", "slowdown")
_CAUSE = {"before": "connection", "after": "connection", "truncated": "truncated",
          "slowdown": "throttled"}


class FaultyStore(ObjectStore):
    def __init__(self, inner: ObjectStore, rate: float, seed: int,
                 kinds: tuple[str, ...] = KINDS, slow_seconds: float = 0.05) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        self.inner = inner
        self.rate = rate
        self.kinds = kinds
        self.slow_seconds = slow_seconds
        self.random = random.Random(seed)
        self.enabled = True
        self.description = f"{inner.description} (faults: {rate:.0%} {', '.join(kinds)})"
        self.max_key_bytes = inner.max_key_bytes
        self.keys_nest = inner.keys_nest
        #: faults injected, by kind
        self.faults: Counter[str] = Counter()

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.enabled or self.random.random() >= self.rate:
            return await fn()
        kind = self.random.choice(self.kinds)
        self.faults[kind] += 1
        if kind == "slow":
            await trio.sleep(self.slow_seconds)
            return await fn()
        if kind in ("before", "slowdown"):
            raise LakeUnavailable(f"{what}: injected {kind}", _CAUSE[kind])
        await fn()  # the store acted on it; the caller never hears
        raise LakeUnavailable(f"{what}: injected {kind}", _CAUSE[kind])

    def listed(self, key: str) -> bool:
        return self.inner.listed(key)

    async def check(self) -> None:
        await self._call("check", self.inner.check)

    async def head(self, key: str) -> ObjectInfo:
        return await self._call(f"HEAD {key}", lambda: self.inner.head(key))

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        return await self._call(f"GET {key}", lambda: self.inner.get_range(
            key, start, length, if_match))

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        return await self._call(f"GET {key}", lambda: self.inner.get_block(
            key, start, length, if_match))

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        return await self._call(f"PUT {key}", lambda: self.inner.put(key, data, metadata))

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        return await self._call(f"create multipart {key}",
                                lambda: self.inner.create_multipart(key, metadata))

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        return await self._call(f"upload part {part_number} of {key}",
                                lambda: self.inner.upload_part(
                                    key, upload_id, part_number, data, offset))

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        return await self._call(f"complete multipart {key}",
                                lambda: self.inner.complete_multipart(key, upload_id, parts))

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        return self.inner.made_by_upload(info, upload_id, parts)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._call(f"abort multipart {key}",
                         lambda: self.inner.abort_multipart(key, upload_id))

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return await self._call(f"list uploads of {prefix}",
                                lambda: self.inner.list_uploads(prefix))

    async def list_multipart(self, key: str) -> list[tuple[str, float]]:
        return await self._call(f"list uploads of {key}",
                                lambda: self.inner.list_multipart(key))

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        return await self._call(f"LIST {prefix}", lambda: self.inner.list_page(
            prefix, delimiter, token, max_keys))

    async def delete_many(self, keys: list[str]) -> None:
        await self._call("DELETE objects", lambda: self.inner.delete_many(keys))

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        return await self._call(f"COPY {src} -> {dst}",
                                lambda: self.inner.copy(src, dst, metadata))

    async def aclose(self) -> None:
        await self.inner.aclose()
