"""Retries with jittered backoff: transient lake errors retried, others not."""

from __future__ import annotations

import pytest

from aifs.errors import AccessDenied, LakeUnavailable
from aifs.lake.retry import RetryPolicy


async def test_transient_errors_are_retried_until_success():
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise LakeUnavailable("503 SlowDown", "throttled")
        return "ok"
    policy = RetryPolicy(attempts=5, base_delay=0.001)
    assert await policy.call("GET x", flaky) == "ok"
    assert len(calls) == 3
    assert policy.causes == {"throttled": 2} and policy.retries == 2


async def test_gives_up_after_the_attempts():
    calls = []

    async def down() -> None:
        calls.append(1)
        raise LakeUnavailable("connection refused")
    with pytest.raises(LakeUnavailable):
        await RetryPolicy(attempts=3, base_delay=0.001).call("GET x", down)
    assert len(calls) == 3


async def test_permanent_errors_are_not_retried():
    calls = []

    async def denied() -> None:
        calls.append(1)
        raise AccessDenied("403")
    with pytest.raises(AccessDenied):
        await RetryPolicy(attempts=5, base_delay=0.001).call("GET x", denied)
    assert len(calls) == 1


def test_backoff_is_jittered_and_capped():
    policy = RetryPolicy(attempts=10, base_delay=0.1, max_delay=2.0)
    delays = [policy.delay(8) for _ in range(200)]
    assert all(0 <= d <= 2.0 for d in delays)
    assert len(set(delays)) > 100
