"""llama.cpp's side of bench_table.py's speculation rows: llama-cpp-python's high-level `Llama`
with and without its prompt-lookup decoding (`LlamaPromptLookupDecoding` from
llama_cpp.llama_speculative, passed as `draft_model`), run by the peer venv's Python in a
process of its own (a `table_worker` process, as bench/llamacpp_peer.py's).

Two `Llama` objects on the same file (the weights are mapped once): one plain, one with the
lookup, which llama-cpp-python builds with logits for every row (it needs them to verify a
draft). Op `speculate`: one greedy answer (temp 0, its sampler chain's greedy pick) to the
given token ids, until an end-of-generation token or `max_tokens`; its tokens, the count after
the first and the seconds from the first to the last (the prefill is left out, as on neuron's
side). Op `info`: the version.

    ~/.cache/llamacpp-peer/bin/python bench/table_lookup.py MODEL.gguf --threads 2
        --context 2304 --num-pred 10
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script by the peer's Python: the repository root
    sys.path.insert(0, str(REPO))

from bench import llamacpp_peer  # noqa: E402  (standard library only)
from bench.table_worker import Worker, serve  # noqa: E402

NUM_PRED = 10  # LlamaPromptLookupDecoding's default draft length


def spawn(venv: Path, model: Path, log_path: Path, *, threads: int, context: int) -> Worker:
    """The worker under the peer venv's Python; FileNotFoundError when it has none."""
    python = llamacpp_peer.peer_python(venv)
    if python is None:
        raise FileNotFoundError(f"no llama-cpp-python venv at {venv}")
    argv = [str(python), __file__, str(model), "--threads", str(threads)]
    argv += ["--context", str(context)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    return Worker(argv, log_path, env)


class Lookup:
    def __init__(self, path: str, threads: int, context: int, num_pred: int) -> None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lc = llama_cpp
        common = {"n_ctx": context, "n_threads": threads, "n_threads_batch": threads}
        self.plain = Llama(model_path=path, verbose=False, **common)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred)
        # logits_all: a draft model makes Llama keep every row's logits, but it sizes that
        # array from the argument (n_batch rows unless True): a prompt over 512 tokens failed
        self.lookup = Llama(
            model_path=path, verbose=False, draft_model=draft, logits_all=True, **common
        )
        self.vocab = self.lc.llama_model_get_vocab(self.plain.model)

    def speculate(self, prompt: list[int], max_tokens: int, lookup: int) -> dict[str, Any]:
        llm = self.lookup if lookup else self.plain
        tokens: list[int] = []
        first = last = 0.0
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            last = time.perf_counter()
            first = first or last
            tokens.append(int(token))
            if len(tokens) >= max_tokens or self.lc.llama_vocab_is_eog(self.vocab, token):
                break
        return {"tokens": tokens, "count": len(tokens) - 1, "seconds": last - first}

    def info(self) -> dict[str, Any]:
        return {"version": self.lc.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=2304)
    parser.add_argument("--num-pred", type=int, default=NUM_PRED)
    args = parser.parse_args()
    side = Lookup(args.model, args.threads, args.context, args.num_pred)
    serve({"speculate": side.speculate, "info": side.info}, {})


if __name__ == "__main__":
    main()
