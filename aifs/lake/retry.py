"""Retries with full-jitter exponential backoff: the one place lake calls retry."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from aifs.errors import LakeError

log = logging.getLogger(__name__)
T = TypeVar("T")


class RetryPolicy:
    def __init__(self, attempts: int = 5, base_delay: float = 0.1, max_delay: float = 5.0):
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.retries = 0  # attempts made again, for the metrics

    def delay(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)]."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))

    async def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(self.attempts):
            try:
                return await fn()
            except LakeError as exc:
                if not exc.transient or attempt + 1 >= self.attempts:
                    raise
                pause = self.delay(attempt)
                self.retries += 1
                log.warning("%s failed (%s); retry %d/%d in %.2fs",
                            what, exc, attempt + 1, self.attempts - 1, pause)
                await trio.sleep(pause)
        raise AssertionError("unreachable")
