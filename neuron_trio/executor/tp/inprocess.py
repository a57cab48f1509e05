"""`InProcessCommunicator`: the all-reduce of CPU ranks, summed in this process.

It stands in for NCCL on machines without GPUs (drills, tests, `devices = "cpu"` with
`tp > 1`) and honours the same failpoints as `NcclCommunicator`:

- `tp.allreduce`: `hang` blocks the collective until `abort()`, which then raises
  CommAbortedError; `sleep(S)` delays it; `error` raises FailpointError.
- `tp.abort` (in `abort()`): `hang` blocks for ever (the abort thread is lost, as with a
  wedged `ncclCommAbort`); `sleep(S)` waits, then really aborts; `error` marks the
  communicator aborted (so a hung collective comes back) and raises FailpointError: an
  abort that returns an error has come back, and the caller re-creates the communicator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from neuron_trio import failpoints as fp
from neuron_trio.errors import CommAbortedError, CommError, FailpointError


def abort_with_failpoint(
    failpoints: fp.Failpoints, aborted: threading.Event, really_abort: Callable[[], None]
) -> None:
    """The `tp.abort` failpoint, then `really_abort()`, then mark `aborted`.

    Shared by both communicators. With `error`, `aborted` is set (a hung collective waiting
    on it comes back) but `really_abort` is not called; FailpointError propagates.
    """
    try:
        failpoints.reach("tp.abort")  # hang: no `until`, blocks for ever
    except FailpointError:
        aborted.set()
        raise
    try:
        really_abort()
    finally:
        aborted.set()


class InProcessCommunicator:
    """Sums one tensor per rank in place; every rank's tensor ends up holding the sum."""

    kind = "in-process"

    def __init__(
        self,
        world_size: int,
        devices: list[torch.device] | None = None,
        *,
        failpoints: fp.Failpoints | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.devices = list(devices) if devices else [torch.device("cpu")] * world_size
        if len(self.devices) != world_size:
            raise ValueError(f"{len(self.devices)} devices for world_size {world_size}")
        self._failpoints = fp.REGISTRY if failpoints is None else failpoints
        self._aborted = threading.Event()
        self._destroyed = False
        self.all_reduces = 0

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if self._aborted.is_set():
            raise CommAbortedError("in-process communicator was aborted")
        if self._destroyed:
            raise CommError("in-process communicator was destroyed")
        if len(tensors) != self.world_size:
            raise CommError(f"all_reduce got {len(tensors)} tensors for {self.world_size} ranks")
        self._failpoints.reach("tp.allreduce", until=self._aborted)
        if self._aborted.is_set():
            raise CommAbortedError("in-process communicator was aborted during all_reduce")
        # Summed in rank order on rank 0's device, in the tensors' dtype (as NCCL does).
        total = tensors[0].clone()  # a copy: the same tensor may be passed for two ranks
        for t in tensors[1:]:
            total.add_(t.to(total.device))
        for t in tensors:
            t.copy_(total)
        self.all_reduces += 1

    def abort(self) -> None:
        abort_with_failpoint(self._failpoints, self._aborted, lambda: None)

    def destroy(self) -> None:
        self._destroyed = True
        self._aborted.set()  # nothing may wait on a destroyed communicator

    def async_error(self) -> str | None:
        return None

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "world_size": self.world_size,
            "devices": [str(d) for d in self.devices],
            "aborted": self.aborted,
            "all_reduces": self.all_reduces,
        }
