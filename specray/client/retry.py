"""Retries on UNAVAILABLE, with exponential backoff and jitter: unary calls (model_info,
health, abort) always; Generate only until its first chunk arrives.

Generate streams tokens as they are committed, so once a delta has been delivered a retry
would duplicate output (or, with a new seed, contradict it); before that nothing was delivered
and a retry is safe. (A request whose coordinator fails midway is resumed by the server from
the tokens it delivered, so the caller sees one stream.)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from specray.client.errors import SpecrayClientError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before retry ``n`` (0-based): ``min(max_backoff_s, initial_backoff_s *
    multiplier**n)``, of which a random fraction up to ``jitter`` is taken off (so that clients
    that failed together do not retry together).

    Example (defaults): retry 2 waits ``min(2.0, 0.1 * 2**2) = 0.4`` s scaled by a factor in
    ``(0.5, 1]``: between 0.2 and 0.4 s.
    """

    max_retries: int = 3  # retries after the first attempt; 0 = none
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5  # in [0, 1]: the largest fraction of a delay drawn off at random

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise ValueError(f"max_retries must be an integer, got {self.max_retries!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        if not (isinstance(self.multiplier, (int, float)) and self.multiplier >= 1):
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if not (isinstance(self.jitter, (int, float)) and 0 <= self.jitter <= 1):
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter!r}")

    def backoff_s(self, retry: int, uniform: float) -> float:
        """The delay before retry ``retry`` given ``uniform`` drawn from [0, 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retry)
        return base * (1.0 - self.jitter * uniform)

    def next_delay_s(
        self, retry: int, code: grpc.StatusCode, remaining_s: float | None, uniform: float
    ) -> float | None:
        """How long to wait before retry ``retry`` after a failure with ``code``; None: give up
        (not UNAVAILABLE, retries used up, or the delay would pass the call's deadline)."""
        if code != grpc.StatusCode.UNAVAILABLE or retry >= self.max_retries:
            return None
        delay_s = self.backoff_s(retry, uniform)
        if remaining_s is not None and delay_s >= remaining_s:
            return None
        return delay_s


class Deadline:
    def __init__(self, timeout_s: float | None):
        self.end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def expired(self) -> SpecrayClientError:
        return SpecrayClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


def call_with_retries(
    call: Callable[[float | None], T],
    policy: RetryPolicy,
    timeout_s: float | None,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """``call(timeout_s)`` until it succeeds or fails for good; ``timeout_s`` bounds the whole,
    retries and delays included; ``on_retry()`` before each retry. Raises
    :class:`SpecrayClientError`."""
    deadline = Deadline(timeout_s)
    retry = 0
    while True:
        remaining_s = deadline.remaining_s()
        if remaining_s is not None and remaining_s <= 0:
            raise deadline.expired()
        try:
            return call(remaining_s)
        except grpc.RpcError as error:
            delay_s = policy.next_delay_s(
                retry, error.code(), deadline.remaining_s(), random.random()
            )
            if delay_s is None:
                raise SpecrayClientError.from_rpc_error(error) from error
        if on_retry is not None:
            on_retry()
        time.sleep(delay_s)
        retry += 1


async def call_with_retries_async(
    call: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    timeout_s: float | None,
    on_retry: Callable[[], None] | None = None,
) -> T:
    """:func:`call_with_retries` for coroutines."""
    deadline = Deadline(timeout_s)
    retry = 0
    while True:
        remaining_s = deadline.remaining_s()
        if remaining_s is not None and remaining_s <= 0:
            raise deadline.expired()
        try:
            return await call(remaining_s)
        except grpc.RpcError as error:
            delay_s = policy.next_delay_s(
                retry, error.code(), deadline.remaining_s(), random.random()
            )
            if delay_s is None:
                raise SpecrayClientError.from_rpc_error(error) from error
        if on_retry is not None:
            on_retry()
        await asyncio.sleep(delay_s)
        retry += 1
