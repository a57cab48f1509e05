"""neuron's side of bench_table.py: the engine (`Engine.from_gguf`, dtype auto, the CPU) in a
process of its own, answering the parent's requests over `table_worker`'s protocol.

Each op runs requests through `Engine.add` / `Engine.step` as serving does (scheduler,
chunked prefill, sampler; greedy, EOS ignored), with the prefix cache off so a prompt sent
again is computed again. Ops: `encode` (token ids of texts: both engines get these ids),
`filler` (a prompt of exactly N tokens), `decode` (T(n) and T(1) of one sequence), `streams`
(8 sequences decoded together), `prefill` (a prompt's time to its first token), `info`
(weights' bytes read per decode step, the scheme), `chat` (a chat prompt's ids, rendered by the
model's template) and `speculate` (one greedy chat answer at batch 1, stopping at its end, with
prompt-lookup speculation or without: its tokens and decode time).

    python bench/table_neuron.py MODEL.gguf --threads 2 --context 2304 --seqs 8
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.roofline import decode_weight_bytes  # noqa: E402
from bench.table_worker import serve  # noqa: E402
from neuron_trio.engine.engine import Engine  # noqa: E402
from neuron_trio.engine.speculation.speculative import Speculator  # noqa: E402
from neuron_trio.engine.types import SamplingParams  # noqa: E402
from neuron_trio.errors import RequestError  # noqa: E402

# Filler prompts for prefill: plain English words in a seeded order (any text costs the same
# to prefill; real words keep the tokenizer on its ordinary path).
FILLER_TEXT = (
    "the node serves models over a cluster network while operators watch metrics and logs "
    "every request carries tokens through a scheduler that batches sequences on each step "
    "memory blocks hold keys and values for attention layers until a sequence finishes "
    "routers send chats to healthy machines and retry elsewhere when a queue is full"
)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class NeuronSide:
    def __init__(self, path: str, context: int, seqs: int) -> None:
        started = time.perf_counter()
        self.engine = Engine.from_gguf(
            path, dtype="auto", device="cpu", max_batch=seqs, context=context, prefix_cache=False
        )
        self.load_s = time.perf_counter() - started

    def _run(self, prompt: list[int], max_tokens: int) -> float:
        """Seconds from `add` to the request's last token (its first when max_tokens is 1)."""
        engine = self.engine
        start = time.perf_counter()
        engine.add(prompt, greedy(max_tokens), chat=False)
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start

    def encode(self, texts: list[str]) -> dict[str, Any]:
        return {"ids": [self.engine.encode_prompt(t, chat=False) for t in texts]}

    def filler(self, tokens: int, seed: int = 0) -> dict[str, Any]:
        rng, words = random.Random(seed), FILLER_TEXT.split()
        text = " ".join(rng.choice(words) for _ in range(tokens))  # >= 1 token a word
        ids = self.engine.encode_prompt(text, chat=False)[:tokens]
        if len(ids) != tokens:
            raise ValueError(f"the filler text has {len(ids)} tokens, fewer than {tokens}")
        return {"ids": ids}

    def decode(self, prompt: list[int], n: int, repeats: int = 1) -> dict[str, Any]:
        self._run(prompt, 4)  # warm-up
        t_n = [self._run(prompt, n) for _ in range(repeats)]
        t_1 = [self._run(prompt, 1) for _ in range(repeats)]
        return {"t_n": t_n, "t_1": t_1}

    def streams(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        """All prompts added at once; once each has its first token, the steps that follow are
        timed: aggregate decode tokens/s of the sequences together."""
        engine = self.engine
        for prompt in prompts:
            engine.add(prompt, greedy(n), chat=False)
        started: set[int] = set()
        while len(started) < len(prompts):
            started |= {e.seq_id for e in engine.step() if e.token_ids}
        tokens = 0
        start = time.perf_counter()
        while engine.has_work:
            tokens += sum(len(e.token_ids) for e in engine.step())
        return {"tokens": tokens, "seconds": time.perf_counter() - start}

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        return {"tokens": len(prompt), "seconds": self._run(prompt, 1)}

    def chat(self, texts: list[str]) -> dict[str, Any]:
        """Each text as a user's message in the model's chat template, or as a plain prompt
        where the file has none (Gemma 3 270M's)."""
        engine = self.engine
        ids = []
        for text in texts:
            try:
                rendered = engine.render_chat([{"role": "user", "content": text}])
            except RequestError:
                ids.append(engine.encode_prompt(text, chat=False))
            else:
                ids.append(engine.encode_prompt(rendered, chat=True))
        return {"ids": ids}

    def speculate(self, prompt: list[int], max_tokens: int, lookup: int) -> dict[str, Any]:
        """One greedy answer to a chat prompt, to its end or `max_tokens`, drafting up to
        `lookup` tokens by prompt lookup (0: no speculation). `count`: the tokens after the
        first step's; `seconds`: from the first step's tokens to the last (the prefill is
        left out: it is the same either way)."""
        engine = self.engine
        engine.speculator = Speculator(lookup) if lookup else None
        try:
            engine.add(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), chat=True)
            tokens: list[int] = []
            first = last = 0.0
            while engine.has_work:
                for event in engine.step():
                    if event.token_ids:
                        last = time.perf_counter()
                        first = first or last
                        tokens += event.token_ids
            return {"tokens": tokens, "count": len(tokens) - 1, "seconds": last - first}
        finally:
            engine.speculator = None

    def info(self) -> dict[str, Any]:
        model = self.engine.runner.model  # type: ignore[attr-defined]
        return {
            "decode_bytes": decode_weight_bytes(model),
            "scheme": model.scheme,
            "load_s": self.load_s,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=2304, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    side = NeuronSide(args.model, args.context, args.seqs)
    handlers = {
        "encode": side.encode,
        "filler": side.filler,
        "decode": side.decode,
        "streams": side.streams,
        "prefill": side.prefill,
        "info": side.info,
        "chat": side.chat,
        "speculate": side.speculate,
    }
    serve(handlers, {})


if __name__ == "__main__":
    main()
