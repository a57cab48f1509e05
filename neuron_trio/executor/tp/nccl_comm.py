"""`NcclCommunicator`: one process drives every rank (ncclCommInitAll), one thread per step.

A step's all-reduce is one grouped call: `ncclGroupStart`, one `ncclAllReduce` per rank on
that device's current torch CUDA stream, `ncclGroupEnd`. When several ranks share one GPU
(NCCL >= 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`), each rank gets a stream of its own,
ordered after the compute stream and before it again, so the ranks' kernels can run at once.

Blocking: `init_all`, `abort` and `destroy` can block for ever (a sick GPU, a wedged
collective). Call them on a worker thread with a deadline, never on an event loop thread;
cffi releases the GIL during each NCCL call, so a blocked call costs its thread only.
After `ncclCommAbort` the handles are freed: `destroy` then does nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from neuron_trio import failpoints as fp
from neuron_trio.errors import CommAbortedError, CommError, NcclError
from neuron_trio.executor.tp.inprocess import abort_with_failpoint
from neuron_trio.executor.tp.nccl_lib import NcclLibrary, load_nccl

_TORCH_TO_NCCL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


class NcclCommunicator:
    """NCCL communicators for `world_size` ranks, one per device, all in this process."""

    kind = "nccl"

    def __init__(
        self,
        library: NcclLibrary,
        comms: list[Any],
        devices: list[torch.device],
        *,
        failpoints: fp.Failpoints | None = None,
    ) -> None:
        self.library = library
        self.world_size = len(comms)
        self.devices = list(devices)
        self._comms = comms
        self._failpoints = fp.REGISTRY if failpoints is None else failpoints
        self._aborted = threading.Event()
        self._state = "live"  # live -> aborted (handles freed) | destroyed
        self._state_lock = threading.Lock()
        # Ranks that share a GPU need streams of their own, or their kernels would serialise
        # on one stream and wait for each other for ever.
        shared = len({(d.type, d.index) for d in self.devices}) < len(self.devices)
        self._streams: list[torch.cuda.Stream] | None = (
            [torch.cuda.Stream(device=d) for d in self.devices] if shared else None
        )
        self.all_reduces = 0

    @classmethod
    def init_all(
        cls,
        devices: list[torch.device],
        *,
        failpoints: fp.Failpoints | None = None,
        library: NcclLibrary | None = None,
    ) -> NcclCommunicator:
        """ncclCommInitAll over `devices` (CUDA). Blocks; raises NcclError on failure."""
        lib = library or load_nccl()
        ordinals = []
        for d in devices:
            if d.type != "cuda":
                raise CommError(f"NCCL needs CUDA devices, got {d}")
            ordinals.append(d.index if d.index is not None else torch.cuda.current_device())
        comms = lib.comm_init_all(ordinals)
        devs = [torch.device("cuda", i) for i in ordinals]
        return cls(lib, comms, devs, failpoints=failpoints)

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        if self._aborted.is_set():
            raise CommAbortedError("NCCL communicator was aborted")
        if self._state != "live":
            raise CommError(f"NCCL communicator is {self._state}")
        if len(tensors) != self.world_size:
            raise CommError(f"all_reduce got {len(tensors)} tensors for {self.world_size} ranks")
        self._failpoints.reach("tp.allreduce", until=self._aborted)
        if self._aborted.is_set():
            raise CommAbortedError("NCCL communicator was aborted during all_reduce")
        # Check every rank before the group starts: a group with some ranks' collectives
        # missing would wait for them for ever.
        dtypes = [self._check_tensor(rank, t) for rank, t in enumerate(tensors)]
        lib = self.library
        try:
            lib.group_start()
            try:
                for rank, (t, dtype) in enumerate(zip(tensors, dtypes, strict=True)):
                    self._enqueue(rank, t, dtype)
            finally:
                lib.group_end()
            if self._streams is not None:
                for rank, t in enumerate(tensors):
                    torch.cuda.current_stream(t.device).wait_stream(self._streams[rank])
        except NcclError as exc:
            if self._aborted.is_set():
                raise CommAbortedError(f"NCCL communicator was aborted: {exc}") from exc
            raise
        self.all_reduces += 1

    def _check_tensor(self, rank: int, t: torch.Tensor) -> str:
        """The NCCL type name of rank `rank`'s tensor; CommError if NCCL cannot take it."""
        if not t.is_contiguous():
            raise CommError(f"rank {rank}: all_reduce needs a contiguous tensor")
        if t.device != self.devices[rank]:
            raise CommError(
                f"rank {rank}: tensor on {t.device}, communicator on {self.devices[rank]}"
            )
        dtype = _TORCH_TO_NCCL.get(t.dtype)
        if dtype is None:
            raise CommError(f"NCCL cannot reduce {t.dtype}")
        return dtype

    def _enqueue(self, rank: int, t: torch.Tensor, dtype: str) -> None:
        if self._streams is None:
            stream = torch.cuda.current_stream(t.device)
        else:
            stream = self._streams[rank]
            stream.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(stream)  # the allocator must not reuse t before NCCL is done
        self.library.all_reduce(
            t.data_ptr(), t.numel(), dtype, self._comms[rank], stream.cuda_stream
        )

    def abort(self) -> None:
        """ncclCommAbort on every rank (within a node, all of them). May block for ever."""
        abort_with_failpoint(self._failpoints, self._aborted, self._abort_all)

    def _abort_all(self) -> None:
        with self._state_lock:
            if self._state != "live":
                return
            self._state = "aborted"  # the handles are freed by the abort, even on failure
        errors = []
        for rank, comm in enumerate(self._comms):
            try:
                self.library.comm_abort(comm)
            except NcclError as exc:
                errors.append(f"rank {rank}: {exc}")
        if errors:
            raise CommError("ncclCommAbort failed: " + "; ".join(errors))

    def destroy(self) -> None:
        """ncclCommDestroy on every rank, unless aborted (abort already freed them)."""
        with self._state_lock:
            if self._state != "live":
                return
            self._state = "destroyed"
        self._aborted.set()  # nothing may go on waiting on a destroyed communicator
        errors = []
        for rank, comm in enumerate(self._comms):
            try:
                self.library.comm_destroy(comm)
            except NcclError as exc:
                errors.append(f"rank {rank}: {exc}")
        if errors:
            raise CommError("ncclCommDestroy failed: " + "; ".join(errors))

    def async_error(self) -> str | None:
        """The first rank's asynchronous NCCL error, or None. Never blocks."""
        if self._state != "live":
            return None
        for rank, comm in enumerate(self._comms):
            try:
                code = self.library.comm_async_error(comm)
            except NcclError as exc:
                return f"rank {rank}: {exc}"
            if code not in (0, 7):  # success, in progress
                return f"rank {rank}: ncclResult_t {code} ({self.library.error_string(code)})"
        return None

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "world_size": self.world_size,
            "devices": [str(d) for d in self.devices],
            "library": self.library.path,
            "version": self.library.version,
            "state": self._state,
            "aborted": self.aborted,
            "all_reduces": self.all_reduces,
        }
