"""A tenant's own limits on one model: sequences running, requests waiting, tokens a minute.

`[[tenants]]` (config.py) gives each tenant optional limits; the model actor's request table
applies them: `max_sequences` holds its requests in the queue (the others' go by), and past
`max_queued` waiting requests or `tokens_per_minute` a new request is refused with a 429 whose
`Retry-After` says when to come back and whose code names the limit (`TenantLimitError`).

Time is trio's clock (`trio.current_time()`, passed in as `now`), so tests use MockClock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from neuron_trio.errors import QueueFullError

__all__ = [
    "TenantEntry",
    "TenantLimitError",
    "TenantLimits",
    "TenantPolicy",
    "TokenWindow",
    "policies_from_config",
]

WINDOW_S = 60.0  # tokens_per_minute's window
BUCKET_S = 1.0  # the window's resolution: at most 60 buckets a tenant


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's weight (its share against the others') and limits (None: none)."""

    weight: float = 1.0
    max_sequences: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None


class TenantEntry(Protocol):
    """What a `[[tenants]]` entry (config.TenantConfig) says of fair service."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def max_sequences(self) -> int | None: ...
    @property
    def max_queued(self) -> int | None: ...
    @property
    def tokens_per_minute(self) -> int | None: ...


def policies_from_config(tenants: Iterable[TenantEntry]) -> dict[str, TenantPolicy]:
    """The policies of `[[tenants]]` entries, by name."""
    return {
        t.name: TenantPolicy(t.weight, t.max_sequences, t.max_queued, t.tokens_per_minute)
        for t in tenants
    }


class TenantLimitError(QueueFullError):
    """Raised if a tenant's request is past one of its own limits (429, Retry-After); the
    code names the limit: tenant_max_queued or tenant_tokens_per_minute."""

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = f"tenant_{limit}"
        self.limit = limit


class TokenWindow:
    """Tokens used in the last `WINDOW_S` seconds, in `BUCKET_S` buckets (bounded memory)."""

    def __init__(self) -> None:
        self._buckets: deque[list[float]] = deque()  # [bucket start, tokens], oldest first
        self._total = 0.0

    def add(self, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        self._expire(now)
        start = math.floor(now / BUCKET_S) * BUCKET_S
        if self._buckets and self._buckets[-1][0] == start:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([start, float(tokens)])
        self._total += tokens

    def used(self, now: float) -> int:
        self._expire(now)
        return int(self._total)

    def retry_after(self, now: float, limit: int) -> float:
        """Seconds until less than `limit` tokens are in the window (0: now)."""
        self._expire(now)
        total = self._total
        for start, tokens in self._buckets:
            if total < limit:
                break
            total -= tokens
            wait = start + BUCKET_S + WINDOW_S - now
            if total < limit:
                return max(0.0, wait)
        return 0.0

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] + BUCKET_S + WINDOW_S <= now:
            self._total -= self._buckets.popleft()[1]


class TenantLimits:
    """Every tenant's policy and token window, for one model's request table."""

    def __init__(self, policies: Mapping[str, TenantPolicy] | None = None) -> None:
        self.policies = dict(policies or {})
        self._windows: dict[str, TokenWindow] = {}

    def policy(self, tenant: str | None) -> TenantPolicy:
        if tenant is None:
            return TenantPolicy()
        return self.policies.get(tenant) or TenantPolicy()

    def used(self, tenant: str | None, now: float, tokens: int) -> None:
        """`tenant` was served `tokens` (prompt or output) at `now`."""
        if tenant is None or self.policy(tenant).tokens_per_minute is None:
            return
        self._windows.setdefault(tenant, TokenWindow()).add(now, tokens)

    def check(
        self, tenant: str | None, now: float, *, queued: int, running: int, max_batch: int
    ) -> None:
        """Raise TenantLimitError if a new request of `tenant` (with `queued` waiting and
        `running` sequences) is past one of its limits."""
        policy = self.policy(tenant)
        if policy.max_queued is not None:
            slots = policy.max_sequences or max_batch
            if queued >= policy.max_queued + max(0, slots - running):
                raise TenantLimitError(
                    f"tenant {tenant!r}: {queued} requests already wait (its max_queued is "
                    f"{policy.max_queued}, its max_sequences {policy.max_sequences})",
                    limit="max_queued",
                    retry_after_s=max(1, queued // max(1, slots)),
                )
        tpm = policy.tokens_per_minute
        window = self._windows.get(tenant) if tenant is not None else None
        if tpm is not None and window is not None and window.used(now) >= tpm:
            raise TenantLimitError(
                f"tenant {tenant!r}: {window.used(now)} tokens in the last minute "
                f"(its tokens_per_minute is {tpm})",
                limit="tokens_per_minute",
                retry_after_s=max(1, math.ceil(window.retry_after(now, tpm))),
            )
