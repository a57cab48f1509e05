"""What the watchdog records and shows: its states, its statistics, the last wedge, and the
requests in flight at a wedge (`/v1/node`, forensics). Plain msgspec Structs: no trio, so
`neuron status` decodes them without the watchdog's machinery."""

from __future__ import annotations

from typing import Literal

import msgspec

ReturnOutcome = Literal["returned", "error", "deadline"]
# Invariant: "stepping"/"probing" only while a call holds the busy lock and runs under the
# step deadline; "recovering"/"aborting" exactly while a wedge is pending (`_wedge` set), and
# then no step or probe is started; "wedged" is final (the deadman is firing, the process
# exits); every other state returns to "idle".
# The state of the watchdog's calls, shown under a model's `watchdog`; the model's own state is
# its actor's `model_state.ModelHealth`, which the watchdog tells "wedged" when it fires.
WatchdogState = Literal["idle", "stepping", "probing", "recovering", "aborting", "wedged"]


class InflightRequest(msgspec.Struct, frozen=True):
    """A queued or running request, as forensics and `last_wedge` record it."""

    model: str
    seq_id: int | None  # None while queued
    state: Literal["queued", "running"]
    age_s: float
    prompt_tokens: int
    generated_tokens: int


class LastWedge(msgspec.Struct, kw_only=True):
    """The model's most recent wedge, in `/v1/node`; filled in as its recovery goes on.

    Defaults, as every `/v1/node` type has them: `neuron status` reads other versions."""

    what: str = ""  # "step", "probe"
    at: str = ""  # when the wedged call started (UTC)
    detected_after_s: float = 0.0
    outcome: str = ""  # "recovering", "recovered", "deadman: <reason>"
    inflight: list[InflightRequest] | None = None  # the requests in flight at the wedge
    inflight_error: str | msgspec.UnsetType = msgspec.UNSET  # reading them failed
    abort: ReturnOutcome | msgspec.UnsetType = msgspec.UNSET  # tp > 1 only
    abort_s: float | msgspec.UnsetType = msgspec.UNSET
    recovered_after_s: float | msgspec.UnsetType = msgspec.UNSET


class WatchdogStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A model's watchdog, as `/v1/node` shows it (a snapshot: later changes do not show).

    Defaults, as every `/v1/node` type has them: `neuron status` reads other versions."""

    state: WatchdogState = "idle"
    since: str = ""  # when this state began (UTC)
    step_timeout_s: float = 0.0
    abort_deadline_s: float = 0.0
    probe_interval_s: float = 0.0
    wedges: int = 0
    aborts: dict[str, int] = {}
    recoveries: int = 0
    probes: int = 0  # idle probes run (ok, failed or wedged)
    last_wedge: LastWedge | None = None
