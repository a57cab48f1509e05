"""The communicator interface: what the TP runner and the watchdog need of NCCL (or its stand-in).

Implementations: `executor.tp.nccl_comm.NcclCommunicator` (GPUs, one process drives every rank)
and `executor.tp.inprocess.InProcessCommunicator` (CPU ranks, sum in the process; tests and
machines without GPUs). Both honour the failpoints `tp.allreduce` and `tp.abort`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    world_size: int
    devices: list[torch.device]  # one per rank

    @property
    def aborted(self) -> bool:
        """True once `abort` was called: results of a collective since may be garbage."""
        ...

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum one tensor per rank, in place, on every rank (a grouped call across ranks).

        Blocks the calling (worker) thread. Raises CommAbortedError if the communicator is
        aborted while it waits, CommError (NcclError) on failure.
        """
        ...

    def abort(self) -> None:
        """Abort every rank's communicator; unblocks a hung all_reduce with an error.

        May itself block (NCCL's abort can hang): call it on a thread of its own.
        """
        ...

    def destroy(self) -> None:
        """Free the communicator (may block, like abort)."""
        ...

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of any rank, or None; never blocks."""
        ...

    def describe(self) -> dict[str, object]:
        """Kind, library path and version, devices: for logs, /v1/node and forensics."""
        ...
