"""llama.cpp's side of the benchmarks: llama-cpp-python run by the peer venv's Python (it is a
benchmark peer, never our dependency), in a process of its own, on the same GGUF file, token
ids and thread count as neuron.

Parent side (bench_table.py, bench_decode.py): `peer_python(venv)` and `spawn(...)`, which
start this file as a `table_worker` process:

- mode `measure`: the model and one context through the low-level bindings, with llama.cpp's
  own context defaults (as llama-server gets them) but for n_ctx = `seqs` × `context`,
  n_seq_max = `seqs` (each sequence its own `context` cells), n_batch = n_ubatch = 512 and the
  threads. Ops: `decode` (T(n) and T(1) of a greedy batch-1 continuation), `streams` (8
  sequences decoded together: one llama_batch of one token per sequence per step),
  `prefill` (a prompt's time to its first token's logits), `info`.
- mode `cold`: `Llama(...)` as a user writes it, timed by the parent from the spawn until
  the ready line (sent once `Llama(...)` has returned); op `ttft`: a short prompt's time to
  its first token.

Greedy picks are an argmax over the last logits (numpy), as neuron's sampler does at
temperature 0; EOS is never special (the benches ask neuron to ignore it too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script by the peer's Python: the repository root
    sys.path.insert(0, str(REPO))

from bench.table_worker import Worker, serve  # noqa: E402  (standard library only)

DEFAULT_PEER = Path.home() / ".cache" / "llamacpp-peer"


def default_venv() -> Path:
    return Path(os.environ.get("LLAMACPP_PEER", DEFAULT_PEER))


def peer_python(venv: Path) -> Path | None:
    """The peer venv's interpreter, or None if there is none."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


def spawn(
    venv: Path,
    mode: str,
    model: Path,
    log_path: Path,
    *,
    threads: int,
    context: int,
    seqs: int,
) -> Worker:
    """A llama.cpp worker (`mode` "measure" or "cold") on `model`; FileNotFoundError when the
    venv has no Python."""
    python = peer_python(venv)
    if python is None:
        raise FileNotFoundError(
            f"no llama-cpp-python venv at {venv} (build one as docs/STACK-NOTES.md says, "
            "or pass --llamacpp-venv)"
        )
    argv = [str(python), __file__, mode, str(model), "--threads", str(threads)]
    argv += ["--context", str(context), "--seqs", str(seqs)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    return Worker(argv, log_path, env)


# ---- the worker (peer venv's Python; imports llama_cpp and numpy only here) --------------


class Measure:
    """The `measure` mode's model, context and batch (low-level bindings)."""

    def __init__(self, path: str, threads: int, context: int, seqs: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = context * seqs
        params.n_seq_max = seqs
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_batch = 512
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, seqs)
        self.memory = lc.llama_get_memory(self.ctx)
        self.flash_attn = int(params.flash_attn_type)

    def _decode(self, rows: Sequence[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of `rows` (token, position, sequence, wants logits)."""
        batch = self.batch
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        code = self.lc.llama_decode(self.ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, row: int) -> int:
        import numpy as np

        logits = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _prefill(self, prompt: Sequence[int], seq: int = 0) -> int:
        """Clear nothing; feed `prompt` to `seq` in n_batch chunks; the first greedy token."""
        for start in range(0, len(prompt), self.n_batch):
            chunk = prompt[start : start + self.n_batch]
            last = start + len(chunk) == len(prompt)
            rows = [(t, start + i, seq, last and i == len(chunk) - 1) for i, t in enumerate(chunk)]
            self._decode(rows)
        return self._argmax(len(chunk) - 1)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.memory, True)

    def generate(self, prompt: Sequence[int], n: int) -> float:
        """Seconds to `n` greedy tokens after `prompt` (prefill included), from a clear cache."""
        self.clear()
        start = time.perf_counter()
        out = [self._prefill(prompt)]
        while len(out) < n:
            self._decode([(out[-1], len(prompt) + len(out) - 1, 0, True)])
            out.append(self._argmax(0))
        return time.perf_counter() - start

    def decode(self, prompt: list[int], n: int, repeats: int = 1) -> dict[str, Any]:
        self.generate(prompt, 4)  # warm-up
        t_n = [self.generate(prompt, n) for _ in range(repeats)]
        t_1 = [self.generate(prompt, 1) for _ in range(repeats)]
        return {"t_n": t_n, "t_1": t_1}

    def streams(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        """All prompts prefilled together (one batch each, logits at each one's last token),
        then n - 1 steps of one token per sequence, timed: aggregate tokens/s."""
        self.clear()
        rows = [
            (t, i, seq, i == len(p) - 1) for seq, p in enumerate(prompts) for i, t in enumerate(p)
        ]
        if len(rows) > self.n_batch:
            raise ValueError(f"the prompts hold {len(rows)} tokens, more than n_batch")
        self._decode(rows)
        ends = [i for i, row in enumerate(rows) if row[3]]
        tokens = [self._argmax(i) for i in ends]
        positions = [len(p) for p in prompts]
        start = time.perf_counter()
        for step in range(n - 1):
            pairs = enumerate(zip(tokens, positions, strict=True))
            self._decode([(t, pos + step, seq, True) for seq, (t, pos) in pairs])
            tokens = [self._argmax(i) for i in range(len(prompts))]
        elapsed = time.perf_counter() - start
        return {"tokens": len(prompts) * (n - 1), "seconds": elapsed}

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        self.clear()
        start = time.perf_counter()
        self._prefill(prompt)
        return {"tokens": len(prompt), "seconds": time.perf_counter() - start}

    def info(self) -> dict[str, Any]:
        return {
            "version": self.lc.__version__,
            "system_info": self.lc.llama_print_system_info().decode(errors="replace"),
            "flash_attn_type": self.flash_attn,
        }


def run_measure(args: argparse.Namespace) -> None:
    peer = Measure(args.model, args.threads, args.context, args.seqs)
    handlers = {
        "decode": peer.decode,
        "streams": peer.streams,
        "prefill": peer.prefill,
        "info": peer.info,
    }
    serve(handlers, {})


def run_cold(args: argparse.Namespace) -> None:
    """`Llama(...)` as a user writes it (the parent times the spawn until the ready line);
    then `ttft`: a short prompt's time to its first greedy token."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.model,
        n_ctx=args.context * args.seqs,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )

    def ttft(prompt: list[int]) -> dict[str, Any]:
        start = time.perf_counter()
        llm.eval(prompt)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        int(logits.argmax())
        return {"seconds": time.perf_counter() - start}

    serve({"ttft": ttft}, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("mode", choices=["measure", "cold"])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096, help="cells per sequence")
    parser.add_argument("--seqs", type=int, default=8)
    args = parser.parse_args()
    (run_measure if args.mode == "measure" else run_cold)(args)


if __name__ == "__main__":
    main()
