"""Fair service between tenants: the Virtual Token Counter (Sheng et al., OSDI 2024,
"Fairness in Serving Large Language Models").

Each tenant has a counter of the service it has received: prompt tokens × `PROMPT_COST`
(charged when its request is admitted) plus output tokens × `OUTPUT_COST` (as they are
sampled), divided by its weight. Then:

- admission takes the waiting request of the tenant with the smallest counter (`pick`),
  so a tenant that floods the queue is served its share and no more, while another's single
  request goes next;
- preemption, when the KV pool runs out, takes from the tenant with the largest counter
  (`engine/scheduler.py` reads `counter`);
- a tenant that comes back from idle (nothing queued, nothing running) has its counter lifted
  to the smallest counter among the active tenants (`arrive`): idleness banks no credit, else
  a tenant quiet for an hour would then hold the node for as long. When no tenant is active
  at all, the counters start over at zero (nobody is owed anything).

Requests without a tenant (no keys configured) are one tenant, `None`: one tenant's requests
are taken oldest first, so a node without tenants serves first come, first served as before.

Plain bookkeeping, no trio: the model actor's loop charges and admits between steps (on the
trio thread); the scheduler reads the counters during a step (a worker thread), while the
actor may only lift a tenant that has no sequence running.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

__all__ = ["OUTPUT_COST", "PROMPT_COST", "RECENT_S", "FairShare", "Tenant"]

# The paper's w_p and w_q: an output token costs a step's row each (and holds its blocks for
# the rest of the answer), a prompt token is one of many rows prefilled at once.
PROMPT_COST = 1.0
OUTPUT_COST = 2.0

Tenant = str | None

# A tenant whose last request ended this recently may send its next any moment (`recent`):
# an agent's tool call, or a person reading an answer and typing the next turn. 5 s covered
# only programs: in the tenancy drill a tenant back after 5-6 s found the flood's 256-token
# prefill steps (0.2-0.4 s each on 2 cores) and its first token took 4-6x its idle time.
# Longer gaps are not protected, so a tenant that talks to the node now and then does not
# shorten a busier tenant's prefill steps for long.
RECENT_S = 30.0


class FairShare:
    """The tenants' virtual token counters for one model.

    `weights`: a tenant's share against the others' (default 1.0); 2.0 gets twice the tokens
    of a tenant of weight 1.0 while both are backlogged.
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._weights = dict(weights or {})
        self._clock = clock
        self._left: dict[Tenant, float] = {}  # when each tenant's last request ended
        for name, weight in self._weights.items():
            if not weight > 0:
                raise ValueError(f"tenant {name!r}: weight must be positive, got {weight}")
        self._counters: dict[Tenant, float] = {}
        self._active: dict[Tenant, int] = {}  # requests queued or running, per tenant

    @property
    def weights(self) -> dict[str, float]:
        """The configured tenants' weights (a copy)."""
        return dict(self._weights)

    def weight(self, tenant: Tenant) -> float:
        return self._weights.get(tenant, 1.0) if tenant is not None else 1.0

    def counter(self, tenant: Tenant) -> float:
        return self._counters.get(tenant, 0.0)

    def active(self, tenant: Tenant) -> int:
        return self._active.get(tenant, 0)

    def served(self) -> tuple[Tenant, ...]:
        """The tenants served since the node was last idle (those with a counter). Read by
        the scheduler during a step: one copy of the keys, whatever the actor adds meanwhile."""
        return tuple(self._counters)

    def recent(self) -> tuple[Tenant, ...]:
        """The tenants with a request queued or running, and those whose last request ended
        within `RECENT_S` (their next request may come any moment). Not those merely served
        since the node was last idle: under a lasting flood the node is never idle, and a
        tenant gone for good would shorten the flood's steps forever. Read by the scheduler
        during a step, like `served`."""
        now = self._clock()
        active = [t for t, n in list(self._active.items()) if n]
        gone = [t for t, at in list(self._left.items()) if now - at <= RECENT_S]
        return tuple(dict.fromkeys([*active, *gone]))

    def charge(self, tenant: Tenant, *, prompt: int = 0, output: int = 0) -> None:
        """`tenant` received `prompt` prompt tokens and `output` output tokens of service."""
        cost = prompt * PROMPT_COST + output * OUTPUT_COST
        if cost:
            self._counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)

    def arrive(self, tenant: Tenant) -> None:
        """A request of `tenant` is queued; from idle, its counter is lifted (see above)."""
        if not self._active.get(tenant):
            others = [self.counter(t) for t, n in self._active.items() if n and t != tenant]
            if others:
                self._counters[tenant] = max(self.counter(tenant), min(others))
        self._active[tenant] = self._active.get(tenant, 0) + 1

    def leave(self, tenant: Tenant) -> None:
        """A request of `tenant` ended (finished, cancelled, failed), queued or running."""
        left = self._active.get(tenant, 0) - 1
        if left > 0:
            self._active[tenant] = left
            return
        self._active.pop(tenant, None)
        self._left[tenant] = self._clock()  # one entry a tenant (configured names)
        if not self._active:
            self._counters.clear()  # nobody active: nobody is owed anything

    def pick(self, tenants: Iterable[Tenant]) -> Tenant:
        """The tenant to serve next among `tenants` (each with a request waiting): the one
        with the smallest counter; ties go to the first given (the oldest waiting)."""
        best: Tenant = None
        best_counter = float("inf")
        for tenant in tenants:
            c = self.counter(tenant)
            if c < best_counter:
                best, best_counter = tenant, c
        if best_counter == float("inf"):
            raise ValueError("pick() needs at least one tenant")
        return best
