"""TPRunner's lockstep driving, on a toy row-parallel model (no GGUF needed)."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator

import pytest
import torch

from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.errors import CommAbortedError, FailpointError
from neuron_trio.executor.tp.inprocess import InProcessCommunicator
from neuron_trio.executor.tp.runner import TPRunner
from tests.executor.tp.threaded import TIMEOUT, SignallingFailpoints, Worker

TOY = LlamaConfig(
    n_layers=2,
    dim=8,
    n_heads=6,
    n_kv_heads=3,
    head_dim=4,
    ffn_dim=12,
    vocab_size=16,
    rope_base=10000.0,
    rope_dim=4,
    rms_eps=1e-5,
    context_length=32,
    tied_output=True,
)


class ToyShard:
    """Per layer: x += W_down[:, cols] @ relu(W_up[cols] @ x), the sum over ranks all-reduced."""

    def __init__(
        self, up: list[torch.Tensor], down: list[torch.Tensor], embed: torch.Tensor, tp: int
    ):
        self.config = TOY.shard(tp)
        self.device = torch.device("cpu")
        self.act_dtype = torch.float32
        self.up, self.down, self.embed = up, down, embed
        self.closed = 0
        self.partial_sums = tp > 1
        self.output = torch.nn.Identity()  # unused: TPRunner replaces it on ranks > 0

    def init_rope(self, positions: int) -> None:
        pass  # no RoPE in the toy

    def modules(self) -> Iterator[torch.nn.Module]:
        return iter(())  # no projection modules: no dense copies (dense_prefill_rows)

    def forward_steps(
        self, input_ids, start_pos, slots, kv, *, lengths=None, all_logits=False
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed[input_ids]  # [B, T, dim]
        try:
            for up, down in zip(self.up, self.down, strict=True):
                y = torch.relu(x @ up.T) @ down.T
                if self.partial_sums:
                    y = yield y
                x = x + y
        except GeneratorExit:
            self.closed += 1
            raise
        last = -1 if lengths is None else lengths - 1  # padded rows: the last real token
        out = x if all_logits else x[torch.arange(x.shape[0]), last]
        return (out @ self.embed.T).float()


def _models(tp: int) -> tuple[list[ToyShard], ToyShard]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(TOY.vocab_size, TOY.dim, generator=g)
    up = [torch.randn(TOY.ffn_dim, TOY.dim, generator=g) for _ in range(TOY.n_layers)]
    down = [torch.randn(TOY.dim, TOY.ffn_dim, generator=g) for _ in range(TOY.n_layers)]
    n = TOY.ffn_dim // tp
    shards = [
        ToyShard(
            [u[r * n : (r + 1) * n] for u in up],
            [d[:, r * n : (r + 1) * n] for d in down],
            embed,
            tp,
        )
        for r in range(tp)
    ]
    return shards, ToyShard(up, down, embed, 1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([[1, 5, 7]]), torch.tensor([0]), torch.tensor([[2]])


def _reference(full: ToyShard, *, all_logits: bool = False) -> torch.Tensor:
    gen = full.forward_steps(*_inputs(), None, all_logits=all_logits)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    return stop.value.value


@pytest.mark.parametrize("all_logits", [False, True])
def test_tp3_matches_the_unsharded_model(all_logits: bool) -> None:
    shards, full = _models(3)
    comm = InProcessCommunicator(3)
    runner = TPRunner(shards, comm, blocks=3, context=8)
    assert runner.config.n_heads == 6 and runner.config.ffn_dim == 12
    # one KV head per rank: K and V, each pool of the same blocks
    assert [kv.layers[0].shape[0] for kv in runner.kv] == [2, 2, 2]
    assert {kv.n_blocks for kv in runner.kv} == {3}
    logits = runner.forward(*_inputs(), all_logits=all_logits)
    torch.testing.assert_close(logits, _reference(full, all_logits=all_logits))
    assert comm.all_reduces == TOY.n_layers


def test_a_hung_collective_fails_the_step_with_comm_aborted_once_aborted() -> None:
    shards, _ = _models(3)
    failpoints = SignallingFailpoints("tp.allreduce=hang")
    comm = InProcessCommunicator(3, failpoints=failpoints)
    runner = TPRunner(shards, comm, blocks=3, context=8)
    step = Worker(lambda: runner.forward(*_inputs()), "step")
    assert failpoints.reached["tp.allreduce"].wait(TIMEOUT)
    assert not step.done.wait(0.05)
    threading.Thread(target=comm.abort, name="abort", daemon=True).start()
    step.join()
    assert isinstance(step.error, CommAbortedError)
    assert [s.closed for s in shards] == [1, 1, 1]  # every rank's generator was closed

    # Re-created communicator: the runner serves again.
    runner.rebind(InProcessCommunicator(3))
    torch.testing.assert_close(runner.forward(*_inputs()), _reference(_models(1)[1]))


def test_a_failing_collective_propagates() -> None:
    shards, _ = _models(3)
    comm = InProcessCommunicator(3, failpoints=SignallingFailpoints("tp.allreduce=error"))
    runner = TPRunner(shards, comm, blocks=3, context=8)
    with pytest.raises(FailpointError):
        runner.forward(*_inputs())
    runner.forward(*_inputs())  # fired once


def test_world_size_must_match() -> None:
    shards, _ = _models(3)
    with pytest.raises(ValueError):
        TPRunner(shards, InProcessCommunicator(2), blocks=3, context=8)
