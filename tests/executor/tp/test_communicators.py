"""The in-process communicator, and the failpoints both communicators honour.

Ordering comes from events (a Failpoints that signals when a failpoint is reached), never
from sleeps; every thread is joined with a timeout so a bug fails instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch

from neuron_trio import failpoints as fp
from neuron_trio.errors import CommAbortedError, FailpointError
from neuron_trio.executor.tp.inprocess import InProcessCommunicator
from neuron_trio.executor.tp.nccl_comm import NcclCommunicator
from neuron_trio.executor.tp.nccl_lib import _wheel_library, load_nccl
from tests.executor.tp.threaded import TIMEOUT, SignallingFailpoints, Worker


def _in_process(spec: str = "") -> tuple[InProcessCommunicator, SignallingFailpoints]:
    failpoints = SignallingFailpoints(spec)
    return InProcessCommunicator(3, failpoints=failpoints), failpoints


def _nccl_stub(spec: str = "") -> tuple[NcclCommunicator, SignallingFailpoints]:
    """A NcclCommunicator over NULL handles: abort/destroy on NULL return 0, no GPU needed."""
    lib = load_nccl()
    failpoints = SignallingFailpoints(spec)
    devices = [torch.device("cuda", i) for i in range(3)]
    return NcclCommunicator(lib, [lib.null_comm] * 3, devices, failpoints=failpoints), failpoints


needs_wheel = pytest.mark.skipif(_wheel_library() is None, reason="needs the NCCL wheel")
KINDS = [
    pytest.param(_in_process, id="in-process"),
    pytest.param(_nccl_stub, id="nccl", marks=needs_wheel),
]


def test_all_reduce_sums_in_place() -> None:
    comm, _ = _in_process()
    tensors = [torch.full((2, 4), float(r + 1)) for r in range(3)]
    comm.all_reduce(tensors)
    for t in tensors:
        assert torch.equal(t, torch.full((2, 4), 6.0))
    assert comm.all_reduces == 1
    assert comm.describe()["world_size"] == 3
    assert comm.async_error() is None


def test_all_reduce_keeps_dtype_and_the_sum_is_rank_ordered() -> None:
    comm = InProcessCommunicator(2, failpoints=fp.Failpoints())
    a = torch.randn(8, dtype=torch.bfloat16)
    b = torch.randn(8, dtype=torch.bfloat16)
    expected = a + b
    comm.all_reduce([a, b])
    assert a.dtype == torch.bfloat16
    assert torch.equal(a, expected) and torch.equal(b, expected)


def test_unarmed_failpoints_do_nothing() -> None:
    failpoints = fp.Failpoints(fp.parse("tp.allreduce=hang"))  # configured, never armed
    comm = InProcessCommunicator(2, failpoints=failpoints)
    comm.all_reduce([torch.ones(1), torch.ones(1)])
    assert failpoints.fired == []


@pytest.mark.parametrize("make", KINDS)
def test_allreduce_hang_blocks_until_abort(make) -> None:
    comm, failpoints = make("tp.allreduce=hang")
    step = Worker(lambda: comm.all_reduce([torch.ones(1)] * 3), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    assert not step.done.wait(0.05)  # still blocked (not an ordering wait)
    abort = Worker(comm.abort, "abort")
    abort.join()
    assert abort.error is None
    step.join()
    assert isinstance(step.error, CommAbortedError)
    assert comm.aborted
    with pytest.raises(CommAbortedError):  # the communicator stays aborted
        comm.all_reduce([torch.ones(1)] * 3)


@pytest.mark.parametrize("make", KINDS)
def test_allreduce_error(make) -> None:
    comm, _ = make("tp.allreduce=error")
    with pytest.raises(FailpointError):
        comm.all_reduce([torch.ones(1)] * 3)
    if isinstance(comm, InProcessCommunicator):  # fires once: the next one runs clean
        comm.all_reduce([torch.ones(1)] * 3)


@pytest.mark.parametrize("make", KINDS)
def test_abort_hang_blocks_forever_and_releases_nothing(make) -> None:
    comm, failpoints = make("tp.allreduce=hang;tp.abort=hang")
    step = Worker(lambda: comm.all_reduce([torch.ones(1)] * 3), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    abort = Worker(comm.abort, "abort")  # daemon thread: left blocked, as in production
    assert failpoints.reached["tp.abort"].wait(TIMEOUT)
    assert not abort.done.wait(0.2)
    assert not step.done.is_set()
    assert not comm.aborted


@pytest.mark.parametrize("make", KINDS)
def test_abort_sleep_then_really_aborts(make) -> None:
    comm, failpoints = make("tp.allreduce=hang;tp.abort=sleep(0.2)")
    step = Worker(lambda: comm.all_reduce([torch.ones(1)] * 3), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    started = time.monotonic()
    comm.abort()
    assert time.monotonic() - started >= 0.2
    step.join()
    assert isinstance(step.error, CommAbortedError)
    if isinstance(comm, NcclCommunicator):
        assert comm.describe()["state"] == "aborted"


@pytest.mark.parametrize("make", KINDS)
def test_abort_error_comes_back_and_releases_the_step(make) -> None:
    comm, failpoints = make("tp.allreduce=hang;tp.abort=error")
    step = Worker(lambda: comm.all_reduce([torch.ones(1)] * 3), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    with pytest.raises(FailpointError):
        comm.abort()
    step.join()
    assert isinstance(step.error, CommAbortedError)
    assert comm.aborted
    if isinstance(comm, NcclCommunicator):  # not really aborted: destroy frees the handles
        assert comm.describe()["state"] == "live"
        comm.destroy()
        assert comm.describe()["state"] == "destroyed"


@needs_wheel
def test_destroy_after_abort_does_not_touch_freed_handles() -> None:
    comm, _ = _nccl_stub()
    comm.abort()
    comm.destroy()  # no ncclCommDestroy on handles the abort freed
    assert comm.describe()["state"] == "aborted"
    assert comm.async_error() is None


@needs_wheel
def test_nccl_checks_every_rank_before_the_group_starts() -> None:
    from neuron_trio.errors import CommError

    comm, _ = _nccl_stub()
    with pytest.raises(CommError, match="rank 0: tensor on cpu"):
        comm.all_reduce([torch.ones(1)] * 3)  # CPU tensors: refused before any NCCL call
    with pytest.raises(CommError, match="3 ranks"):
        comm.all_reduce([torch.ones(1)] * 2)


def test_the_same_tensor_for_every_rank_sums_correctly() -> None:
    comm, _ = _in_process()
    t = torch.ones(2)
    comm.all_reduce([t, t, t])
    assert torch.equal(t, torch.full((2,), 3.0))
