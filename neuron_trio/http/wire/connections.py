"""Which connections the server keeps when a client tries to hold them all.

Measured before this module: 4,096 sockets from one client, each sending one byte and then
nothing, filled `server.max_connections` and every other client was refused for ~75 s (the
idle timeout), again and again. Two rules now:

- per peer address: at most `per_peer` connections (`server.max_connections_per_peer`); one
  more from that address is closed at once;
- when the node is full, a new connection takes the place of one that is doing nothing:
  first one that never carried a complete request (oldest first: the one-byte sockets of a
  slow-loris), then one idle between requests (least recently active first). A connection
  with a request in flight (a router's, streaming) is never evicted; if every connection is
  busy, the new one is refused as before.

`ConnectionTable` is the decision, no I/O: the server (`_hypercorn_fixes.py`) calls `enter`
on accept and closes the victim it names, `busy`/`idle` as hypercorn reports a connection's
state, and `leave` when the connection ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Admission", "ConnectionEntry", "ConnectionTable"]


@dataclass(eq=False)
class ConnectionEntry:
    """One open connection: its peer, what it has done; `handle` is the server's (to close it)."""

    peer: str
    handle: Any = None
    in_flight: bool = False
    completed: int = 0  # requests it carried to the end (idle after busy)
    gone: bool = False  # no longer in the table (closed, or evicted)


@dataclass(frozen=True)
class Admission:
    """`enter`'s answer: the new connection's entry (None: refused) and whom to close for it."""

    entry: ConnectionEntry | None
    victim: ConnectionEntry | None = None
    reason: str = ""


@dataclass
class ConnectionTable:
    """Open connections against `limit` in all and `per_peer` from one address.

    Invariant: every open entry is in exactly one of `_fresh` (never completed a request,
    nothing in flight), `_idle` (completed one, nothing in flight, least recently active
    first) or `_busy`; a busy entry is never chosen as a victim.
    """

    limit: int
    per_peer: int
    refused: int = 0  # connections closed at once (full, or their peer over its limit)
    evicted: int = 0  # connections closed to make room
    _fresh: OrderedDict[int, ConnectionEntry] = field(default_factory=OrderedDict)
    _idle: OrderedDict[int, ConnectionEntry] = field(default_factory=OrderedDict)
    _busy: dict[int, ConnectionEntry] = field(default_factory=dict)
    _per_peer: dict[str, int] = field(default_factory=dict)

    @property
    def open(self) -> int:
        return len(self._fresh) + len(self._idle) + len(self._busy)

    def peer_count(self, peer: str) -> int:
        return self._per_peer.get(peer, 0)

    @property
    def busy_count(self) -> int:
        return len(self._busy)

    def enter(self, peer: str, handle: Any = None) -> Admission:
        """Admit a connection from `peer`, making room by evicting an idle one if needed."""
        if self._per_peer.get(peer, 0) >= self.per_peer:
            self.refused += 1
            return Admission(None, reason=f"{peer} already holds {self.per_peer} connections")
        victim = None
        if self.open >= self.limit:
            victim = self._pick_victim()
            if victim is None:
                self.refused += 1
                return Admission(None, reason=f"all {self.limit} connections are busy")
            self._remove(victim)
            self.evicted += 1
        entry = ConnectionEntry(peer, handle)
        self._fresh[id(entry)] = entry
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        return Admission(entry, victim)

    def busy(self, entry: ConnectionEntry) -> None:
        """`entry` has a request in flight: it may not be evicted."""
        if entry.gone or entry.in_flight:
            return
        self._fresh.pop(id(entry), None)
        self._idle.pop(id(entry), None)
        entry.in_flight = True
        self._busy[id(entry)] = entry

    def idle(self, entry: ConnectionEntry) -> None:
        """`entry` has nothing in flight now; if it had, one more request completed."""
        if entry.gone or not entry.in_flight:
            return
        del self._busy[id(entry)]
        entry.in_flight = False
        entry.completed += 1
        self._idle[id(entry)] = entry  # most recently active: evicted last

    def leave(self, entry: ConnectionEntry) -> None:
        """`entry` has closed (idempotent; an evicted entry has already left)."""
        if not entry.gone:
            self._remove(entry)

    def _pick_victim(self) -> ConnectionEntry | None:
        for pool in (self._fresh, self._idle):
            if pool:
                return next(iter(pool.values()))
        return None

    def _remove(self, entry: ConnectionEntry) -> None:
        key = id(entry)
        if self._fresh.pop(key, None) is None and self._idle.pop(key, None) is None:
            self._busy.pop(key, None)
        left = self._per_peer.get(entry.peer, 0) - 1
        if left > 0:
            self._per_peer[entry.peer] = left
        else:
            self._per_peer.pop(entry.peer, None)
        entry.gone = True
