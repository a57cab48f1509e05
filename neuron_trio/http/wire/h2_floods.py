"""Budgets for the HTTP/2 frames that cost the server work but carry no request.

The 2019 HTTP/2 advisories (ping flood CVE-2019-9512, settings flood CVE-2019-9515, empty
frames CVE-2019-9518, resource loop CVE-2019-9513), rapid reset (CVE-2023-44487) and the 2024
CONTINUATION floods share one lesson: a peer may send frames that the server must answer or
process (PING and SETTINGS are acknowledged, a reset stream was created and torn down) far
faster than any client needs to, and a limit per connection alone is beaten by opening many
connections. Here, measured on the built-in node: 500,000 PINGs and 200,000 SETTINGS frames
were all answered, and 50 connections x 1,000 rapid resets cost 15 s of the server's CPU.

So each connection spends tokens from two buckets (`FloodGuard.spend`):
- its own (`rate` per second, `burst` at most): a connection that empties it is told GOAWAY
  ENHANCE_YOUR_CALM and closed;
- the node's (`NodeFloodBudget`, shared by every connection; resets have a node-wide bucket
  of their own): when that one is empty, the connections that have spent more than `grace`
  of their own burst lately, or sent more than `grace` frames beyond `grace_rate` a second
  lately (`DecayingCount`), are closed, so a router that resets a few streams a second is
  never the one cut while many floods run.

Issue 47 (#4): the node's rule looked only at a connection's own bucket, which a connection
resetting at its own sustained rate (100 a second) keeps full: 50 such connections were never
closed, and 50 x 1,000 resets still cost 7 s of CPU. The decaying count sees them.

What counts (`ControlFrame`): PING, SETTINGS, PRIORITY, a DATA frame with no payload that
does not end its stream, a WINDOW_UPDATE beyond the two each DATA frame sent earns (a client
acknowledging response data is not flooding), an unknown frame type, and a stream reset by
the client. Pure logic, no I/O: time comes in as `now` (trio.current_time() in the server).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "ControlFrame",
    "DecayingCount",
    "FloodGuard",
    "FloodVerdict",
    "NodeFloodBudget",
    "TokenBucket",
]


class ControlFrame(enum.Enum):
    PING = "ping"
    SETTINGS = "settings"
    PRIORITY = "priority"
    EMPTY_DATA = "empty_data"
    WINDOW_UPDATE = "window_update"
    UNKNOWN = "unknown"
    RESET = "reset"


class FloodVerdict(enum.Enum):
    OK = "ok"
    CONNECTION_OVER_BUDGET = "connection"  # this connection alone floods
    NODE_OVER_BUDGET = (
        "node"  # the node's budget is spent and this connection is among the spenders
    )


@dataclass
class TokenBucket:
    """`rate` tokens a second, at most `burst`; starts full. `take(now)` spends one token and
    says whether there was one."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    stamp: float | None = None

    def refill(self, now: float) -> None:
        if self.stamp is None:
            self.tokens, self.stamp = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, now: float) -> bool:
        self.refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    @property
    def spent(self) -> float:
        """Tokens below full at the last refill: how much this bucket was used lately."""
        return self.burst - self.tokens if self.stamp is not None else 0.0


@dataclass
class DecayingCount:
    """Frames lately: one more per frame, `rate` fewer a second (never below zero). What a
    connection sends beyond `rate` a second accumulates; what stays under it never does."""

    rate: float
    value: float = 0.0
    stamp: float | None = None

    def add(self, now: float) -> float:
        if self.stamp is not None:
            self.value = max(0.0, self.value - max(0.0, now - self.stamp) * self.rate)
        self.stamp = now
        self.value += 1.0
        return self.value


@dataclass
class NodeFloodBudget:
    """The budgets every connection of the node shares: control frames (`rate`, `burst`)
    and stream resets (the node-wide rapid-reset budget; by default as large), and what they
    refused."""

    rate: float
    burst: float
    reset_rate: float | None = None
    reset_burst: float | None = None
    bucket: TokenBucket = field(init=False)
    resets: TokenBucket = field(init=False)
    closed_connections: int = 0  # connections told ENHANCE_YOUR_CALM (either verdict)

    def __post_init__(self) -> None:
        self.bucket = TokenBucket(self.rate, self.burst)
        reset_rate = self.rate if self.reset_rate is None else self.reset_rate
        reset_burst = self.burst if self.reset_burst is None else self.reset_burst
        self.resets = TokenBucket(reset_rate, reset_burst)


@dataclass
class FloodGuard:
    """One connection's budgets (control frames; stream resets), tied to the node's.

    Invariant: a connection that has spent at most `grace` tokens of its own bucket, and sent
    at most `grace` frames of that kind beyond `grace_rate` a second, is never closed for the
    node's budget, however many other connections flood.
    """

    node: NodeFloodBudget
    rate: float  # control frames
    burst: float
    reset_rate: float  # streams reset by the client (rapid reset)
    reset_burst: float
    grace: float
    # Frames a second of one kind that never make a connection a spender of the node's budget
    # (a router cancelling the streams of clients that went away: a few a second).
    grace_rate: float = 5.0
    own: TokenBucket = field(init=False)
    resets: TokenBucket = field(init=False)
    counts: dict[ControlFrame, int] = field(default_factory=dict)
    lately: dict[bool, DecayingCount] = field(init=False)  # by "is a reset"

    def __post_init__(self) -> None:
        self.own = TokenBucket(self.rate, self.burst)
        self.resets = TokenBucket(self.reset_rate, self.reset_burst)
        self.lately = {kind: DecayingCount(self.grace_rate) for kind in (False, True)}

    def spend(self, frame: ControlFrame, now: float) -> FloodVerdict:
        self.counts[frame] = self.counts.get(frame, 0) + 1
        reset = frame is ControlFrame.RESET
        bucket = self.resets if reset else self.own
        lately = self.lately[reset].add(now)
        if not bucket.take(now):
            self.node.closed_connections += 1
            return FloodVerdict.CONNECTION_OVER_BUDGET
        node = self.node.resets if reset else self.node.bucket
        if not node.take(now) and max(bucket.spent, lately) > self.grace:
            self.node.closed_connections += 1
            return FloodVerdict.NODE_OVER_BUDGET
        return FloodVerdict.OK
