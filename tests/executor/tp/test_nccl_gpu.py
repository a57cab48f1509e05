"""NCCL on real GPUs (skipped without CUDA; bench/gpu_check.sh runs these on a GPU machine)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from neuron_trio import failpoints as fp
from neuron_trio.errors import CommAbortedError
from neuron_trio.executor.tp.nccl_comm import NcclCommunicator
from neuron_trio.executor.tp.nccl_lib import load_nccl
from tests.executor.tp.threaded import TIMEOUT, SignallingFailpoints, Worker

pytestmark = pytest.mark.gpu


def _devices() -> list[torch.device]:
    """Every GPU (up to 3); with one GPU, 3 ranks on it where NCCL allows, else 1 rank."""
    n = torch.cuda.device_count()
    if n >= 2:
        return [torch.device("cuda", i) for i in range(min(n, 3))]
    multi = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
    if multi and load_nccl().version_code >= 23000:
        return [torch.device("cuda", 0)] * 3
    return [torch.device("cuda", 0)]


def _init(failpoints: fp.Failpoints | None = None) -> NcclCommunicator:
    """init_all on a thread; several ranks on one GPU fall back to one rank if refused."""
    devices = _devices()
    while True:
        worker = Worker(
            functools.partial(NcclCommunicator.init_all, devices, failpoints=failpoints),
            "nccl-init",
        )
        worker.join()
        if worker.error is None:
            assert isinstance(worker.result, NcclCommunicator)
            return worker.result
        if len(set(devices)) == len(devices):
            raise worker.error
        devices = devices[:1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_all_reduce_sums(dtype: torch.dtype) -> None:
    comm = _init(fp.Failpoints())
    try:
        n = comm.world_size
        base = torch.arange(4096, dtype=torch.float32) % 5
        tensors = [(base * (r + 1)).to(dtype).to(d) for r, d in enumerate(comm.devices)]
        comm.all_reduce(tensors)
        torch.cuda.synchronize()
        for t in tensors:
            torch.testing.assert_close(t.float().cpu(), base * (n * (n + 1) / 2))
        assert comm.async_error() is None
    finally:
        comm.destroy()


def test_hung_collective_released_by_a_real_abort() -> None:
    failpoints = SignallingFailpoints("tp.allreduce=hang")
    comm = _init(failpoints)
    step = Worker(lambda: comm.all_reduce([torch.ones(8, device=d) for d in comm.devices]), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    abort = Worker(comm.abort, "nccl-abort")
    abort.join()
    step.join()
    assert abort.error is None
    assert isinstance(step.error, CommAbortedError)
    assert comm.describe()["state"] == "aborted"
    comm.destroy()  # a no-op after abort
