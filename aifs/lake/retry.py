"""Retries with full-jitter exponential backoff: the one place lake calls retry.

:class:`RetryingStore` wraps any ObjectStore and makes each call again when it
fails transiently (:class:`LakeUnavailable`). The stores below it make one
attempt per call and say why one failed (``LakeUnavailable.cause``); so a
fault-injecting store (:mod:`aifs.lake.faulty`) can sit between the two and
every retry path is tested without a network.

Most calls are idempotent and are simply made again. Two are not, and the
retry knows what an attempt whose reply was lost may have done:

- ``create_multipart``: an earlier attempt may have started an upload nobody
  will ever complete; those are aborted once a later attempt succeeds.
- ``complete_multipart``: an earlier attempt may have completed the upload, so
  the next one finds no upload; the object is then the upload's if the store
  says so (:meth:`ObjectStore.made_by_upload`).

Hand-written rather than tenacity/backoff: the loop is ten lines, it must be
trio-native, and it must count retries by cause for the metrics.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import trio

from aifs.buffers import Body
from aifs.errors import LakeError, ObjectNotFound
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class RetryPolicy:
    def __init__(self, attempts: int = 5, base_delay: float = 0.1, max_delay: float = 5.0):
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        #: attempts made again, by the cause of the failure before them
        self.causes: Counter[str] = Counter()

    @property
    def retries(self) -> int:
        return sum(self.causes.values())

    def delay(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)]."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))

    async def call(self, what: str, fn: Callable[[], Awaitable[T]],
                   budget: float | None = None) -> T:
        """``fn`` until it succeeds, fails for good, or ``attempts`` are spent;
        with ``budget``: as many attempts as fit in that many seconds, except
        for an endpoint never reached (``LakeUnavailable.unreached``)."""
        deadline = trio.current_time() + budget if budget is not None else None
        attempt = 0
        while True:
            try:
                return await fn()
            except LakeError as exc:
                if not exc.transient:
                    raise
                attempt += 1
                pause = self.delay(attempt - 1)
                # seconds left of the budget; None: counted in attempts
                left = None if deadline is None or getattr(exc, "unreached", False) \
                    else deadline - trio.current_time()
                if (pause > left) if left is not None else attempt >= self.attempts:
                    raise
                self.causes[getattr(exc, "cause", "error")] += 1
                step = f"{attempt}, {left:.0f} s left" if left is not None \
                    else f"{attempt}/{self.attempts - 1}"
                log.warning("%s failed (%s); retry %s in %.2fs", what, exc, step, pause)
                await trio.sleep(pause)


#: seconds a mount keeps checking a lake that fails transiently (resets, cut
#: bodies, 5xx) before it gives up: what any later lake call rides out too
CHECK_BUDGET = 30.0

#: the pause before a failed promotion or pack is tried again (the same
#: jittered backoff, in whole seconds: the data waits safely in the cache)
PROMOTION_BACKOFF = RetryPolicy(base_delay=1.0, max_delay=60.0)


class RetryingStore(ObjectStore):
    """``inner`` with every call retried under one :class:`RetryPolicy`."""

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 check_budget: float = CHECK_BUDGET) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.check_budget = check_budget
        self.description = inner.description
        self.max_key_bytes = inner.max_key_bytes
        self.keys_nest = inner.keys_nest

    def listed(self, key: str) -> bool:
        return self.inner.listed(key)

    async def check(self) -> None:
        await self.policy.call("check the lake", self.inner.check, budget=self.check_budget)

    async def head(self, key: str) -> ObjectInfo:
        return await self.policy.call(f"HEAD {key}", lambda: self.inner.head(key))

    async def get_range(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> bytes:
        return await self.policy.call(f"GET {key}", lambda: self.inner.get_range(
            key, start, length, if_match))

    async def get_block(self, key: str, start: int, length: int,
                        if_match: str | None = None) -> Body:
        return await self.policy.call(f"GET {key}", lambda: self.inner.get_block(
            key, start, length, if_match))

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectInfo:
        return await self.policy.call(f"PUT {key}", lambda: self.inner.put(key, data, metadata))

    async def create_multipart(self, key: str,
                               metadata: dict[str, str] | None = None) -> str:
        attempts = 0

        async def create() -> str:
            nonlocal attempts
            attempts += 1
            return await self.inner.create_multipart(key, metadata)
        upload_id = await self.policy.call(f"create multipart {key}", create)
        if attempts > 1:
            await self._abort_lost_creates(key, upload_id)
        return upload_id

    async def _abort_lost_creates(self, key: str, kept: str) -> None:
        """A create was tried again: the server may have started an upload for
        an earlier try whose reply was lost. Those uploads belong to no one:
        aborted now (an upload of the same key by another writer at this very
        moment would go too; that writer's upload fails and is retried). What
        cannot be aborted now, ``aifs gc`` and the next mount sweep up."""
        try:
            for upload_id, _ in await self.list_multipart(key):
                if upload_id != kept:
                    await self.abort_multipart(key, upload_id)
                    log.info("aborted an upload of %s whose creation reply was lost", key)
        except LakeError as exc:
            log.warning("cannot look for lost uploads of %s: %s", key, exc)

    async def upload_part(self, key: str, upload_id: str, part_number: int,
                          data: bytes, offset: int | None = None) -> str:
        return await self.policy.call(f"upload part {part_number} of {key}",
                                      lambda: self.inner.upload_part(
                                          key, upload_id, part_number, data, offset))

    async def complete_multipart(self, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        attempts = 0

        async def complete() -> ObjectInfo:
            nonlocal attempts
            attempts += 1
            return await self.inner.complete_multipart(key, upload_id, parts)
        try:
            return await self.policy.call(f"complete multipart {key}", complete)
        except ObjectNotFound:
            # Tried again after a lost reply, the upload is gone: it completed
            # if the object there is the one it made.
            if attempts < 2:
                raise
            info = await self.head(key)
            if not self.inner.made_by_upload(info, upload_id, parts):
                raise
            return info

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            await self.policy.call(f"abort multipart {key}",
                                   lambda: self.inner.abort_multipart(key, upload_id))
        except ObjectNotFound:
            pass  # aborted already (by an attempt whose reply was lost)

    async def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        return await self.policy.call(f"list uploads of {prefix or '/'}",
                                      lambda: self.inner.list_uploads(prefix))

    async def list_multipart(self, key: str) -> list[tuple[str, float]]:
        return await self.policy.call(f"list uploads of {key}",
                                      lambda: self.inner.list_multipart(key))

    def made_by_upload(self, info: ObjectInfo, upload_id: str,
                       parts: list[tuple[int, str]]) -> bool:
        return self.inner.made_by_upload(info, upload_id, parts)

    async def list_page(self, prefix: str, delimiter: str | None = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        return await self.policy.call(f"LIST {prefix}", lambda: self.inner.list_page(
            prefix, delimiter, token, max_keys))

    async def iter_list(self, prefix: str,
                        delimiter: str | None = "/") -> AsyncIterator[ListPage]:
        if type(self.inner).iter_list is ObjectStore.iter_list:
            async for page in super().iter_list(prefix, delimiter):  # pages retried
                yield page
        else:  # the store's own paging (the local lake scans a directory once)
            async for page in self.inner.iter_list(prefix, delimiter):
                yield page

    async def delete_many(self, keys: list[str]) -> None:
        await self.policy.call("DELETE objects", lambda: self.inner.delete_many(keys))

    async def copy(self, src: str, dst: str,
                   metadata: dict[str, str] | None = None) -> str:
        return await self.policy.call(f"COPY {src} -> {dst}",
                                      lambda: self.inner.copy(src, dst, metadata))

    async def aclose(self) -> None:
        await self.inner.aclose()
