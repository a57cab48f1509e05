"""The memory-bandwidth roofline of batch-1 decode: how fast this machine streams memory, and
how many bytes each engine must read per decoded token. bandwidth / bytes is the decode rate
no kernel can beat on this machine (the weights do not fit in cache), so each measured decode
is also shown as a share of that limit.

- `stream_bandwidth`: a plain streaming read (torch's sum over a 1 GiB float32 tensor) with
  1 and 2 threads, best of several: the simplest read a decode kernel competes with.
- `decode_weight_bytes` (neuron): the buffers its decode kernels read per step, from the
  loaded model: every buffer of the blocks and the output head, counted once each, except
  the `dense` copies that only prefill reads and the head's exact `table` (a refined head
  reads a few of its rows per token). The embedding reads one row: left out.
- `gguf_decode_bytes` (llama.cpp): the GGUF file's tensor bytes, less `token_embd` when the
  file has its own `output.weight` (then the embedding only gives one row per token).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

# Buffers a decode step does not stream (see the module docstring).
PREFILL_ONLY = frozenset({"dense", "table"})


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights neuron's decode step reads: the buffers and parameters of
    `model.layers` and `model.output` (and the final `norm`), each tensor once, less
    PREFILL_ONLY."""
    seen: set[tuple[int, int]] = set()
    total = 0
    parts: list[nn.Module] = [model.layers, model.output]  # type: ignore[list-item]
    tensors = [(n, t) for part in parts for n, t in part.named_buffers()]
    tensors += [(n, p.data) for part in parts for n, p in part.named_parameters()]
    tensors.append(("norm", model.norm))  # type: ignore[arg-type]
    for name, tensor in tensors:
        if tensor is None or name.rsplit(".", 1)[-1] in PREFILL_ONLY:
            continue
        # by address and size, not storage: a buffer may be a view of a mapped file or arena
        key = (tensor.data_ptr(), tensor.nbytes)
        if key in seen or tensor.device.type == "meta":
            continue
        seen.add(key)
        total += tensor.nbytes
    return total


def gguf_decode_bytes(path: Path) -> int:
    """Tensor bytes of a GGUF file that llama.cpp reads per decoded token."""
    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(path) as gguf:
        sizes = {name: info.nbytes for name, info in gguf.tensors.items()}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def stream_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` sums over a `gib` GiB float32 tensor, with
    torch on `threads` threads (its setting is restored)."""
    before = torch.get_num_threads()
    data = torch.ones(int(gib * (1 << 30)) // 4)
    try:
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return data.numel() * 4 / best
