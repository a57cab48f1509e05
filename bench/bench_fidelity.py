"""Fidelity per GGUF type: the built-in model made in each type neuron accepts, and for each
file the top-1 agreement of neuron's default path ("auto") and of llama.cpp with the same
file's float32 (neuron's float32 path, which equals transformers' on these prompts), and both
engines' batch-1 decode speed.

    python bench/bench_fidelity.py                      # every type (llama.cpp's quantizer)
    python bench/bench_fidelity.py --types Q4_0,IQ4_NL --positions 24
    python bench/bench_fidelity.py --maker gguf         # gguf's quantizers: Q4_0..Q8_0 only
    python bench/bench_fidelity.py --threads 1 --markdown  # README's table, after the rows
    python bench/bench_fidelity.py --types '' --files gemma3  # one real file only

Agreement is bench_decode.py's `top1_agreement`: float32 continues each of the 8 parity
prompts greedily by `--positions` tokens; each engine prefills the prompt, then decodes one
step per position fed float32's tokens (teacher forcing), and its argmax at each step is
compared: positions counted, not a share of text. llama.cpp runs in the peer venv
(bench/llamacpp_peer.py: `--llamacpp-venv`, default ~/.cache/llamacpp-peer), in a process of
its own, on the same token ids and thread count; its column is skipped when there is none.

Files are made from the built-in SmolLM2 (Q4_1) into `--out` (default
~/.cache/neuron-fidelity), once: `--maker llamacpp` (default where the peer venv exists)
runs llama.cpp's `llama_model_quantize` with `allow_requantize` and the type's usual mix
(e.g. Q4_K_M keeps some tensors in Q6_K, and the tied embedding becomes Q6_K or Q8_0);
`--maker gguf` requantises the projections only, with the `gguf` package's quantizers
(tests/engine/model/requantize.py, which the tests' agreement floors use too).

After the made types, the real files of the table (`--files`, default Gemma 3 270M and
Qwen2.5-Coder-0.5B, their published Q4_K_M: bench/table_models.py) are measured the same way:
the float32 reference is the same file dequantised to float32 by neuron's loader, as for the
made files.

This file is also the peer's side (`--peer quantize|agree`, run by the peer venv's Python):
so its top level imports the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# llama.cpp's file types (llama_ftype names) for each row of the table, in its order
FTYPES = {
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "Q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}
DEFAULT_OUT = Path.home() / ".cache" / "neuron-fidelity"


# ---- the peer's side (the peer venv's Python: llama_cpp, numpy, the standard library) ----


def peer_quantize(source: str, target: str, ftype: str, threads: int) -> None:
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, FTYPES[ftype])
    params.allow_requantize = True
    params.nthread = threads
    code = lc.llama_model_quantize(source.encode(), target.encode(), params)
    if code != 0:
        raise SystemExit(f"llama_model_quantize returned {code}")


def peer_agree(model: str, threads: int, cases_path: str) -> None:
    """Print one JSON line: llama.cpp's teacher-forced argmax per position of each case."""
    from bench.llamacpp_peer import Measure

    cases = json.loads(Path(cases_path).read_text())
    context = max(len(c["prompt"]) + len(c["cont"]) for c in cases) + 8
    peer = Measure(model, threads, context, 1)
    picks = []
    for case in cases:
        prompt, cont = case["prompt"], case["cont"]
        peer.clear()
        row = [peer._prefill(prompt)]
        for i, token in enumerate(cont[:-1]):
            peer._decode([(token, len(prompt) + i, 0, True)])
            row.append(peer._argmax(0))
        picks.append(row)
    print(json.dumps({"picks": picks, "version": peer.lc.__version__}))


# ---- neuron's side ----------------------------------------------------------------------


def make_file(kind: str, maker: str, out: Path, venv: Path, threads: int) -> Path:
    """The built-in model in `kind`, made once into `out`."""
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    source = builtin_model_path()
    if kind == "Q4_1":
        return source  # the built-in file itself
    target = out / f"SmolLM2-135M-Instruct.{kind}-by-{maker}.gguf"
    if target.exists() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    if maker == "gguf":
        from tests.engine.model.requantize import requantize

        requantize(source, partial, kind)
    else:
        argv = [str(venv / "bin" / "python"), __file__, "--peer", "quantize", str(source)]
        argv += [str(partial), kind, "--threads", str(threads)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial.rename(target)
    return target


def peer_ready(venv: Path) -> bool:
    """Whether `venv` has a Python that imports llama_cpp."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    done = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True)
    return done.returncode == 0


def llamacpp_agreement(
    venv: Path | None, path: Path, cases: list[dict[str, list[int]]], threads: int
) -> float | None:
    """llama.cpp's share of positions whose argmax is float32's token, or None (no peer)."""
    if venv is None:
        return None
    with tempfile.TemporaryDirectory(prefix="bench-fidelity-") as tmp:
        cases_path = Path(tmp) / "cases.json"  # not beside `path`: a real file's cache
        cases_path.write_text(json.dumps(cases))
        argv = [str(venv / "bin" / "python"), __file__, "--peer", "agree", str(path)]
        argv += [str(cases_path), "--threads", str(threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    picks = json.loads(done.stdout.strip().splitlines()[-1])["picks"]
    same = total = 0
    for case, row in zip(cases, picks, strict=True):
        same += sum(int(a == b) for a, b in zip(row, case["cont"], strict=True))
        total += len(case["cont"])
    return same / total


def measure(path: Path, positions: int, tokens: int, venv: Path | None) -> dict[str, Any]:
    """One file's row: agreement and decode speed of neuron's auto and of llama.cpp."""
    import torch

    from bench.bench_decode import PROMPTS, forced_agreement, greedy, time_llamacpp, time_ours
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.model.load.load_phases import LoadPhases
    from neuron_trio.engine.model.load.loader import load_transformer
    from neuron_trio.engine.text.tokenizer import Tokenizer
    from tests.engine.slot_runner import SlotRunner

    with GGUFFile(path) as gf:
        prompts = [Tokenizer.from_gguf(gf).encode(p, add_special_tokens=True) for p in PROMPTS]
    context = max(len(p) for p in prompts) + positions + 1
    reference = load_transformer(path, dtype="float32")
    ref_runner = SlotRunner(reference, slots=1, context=context)
    cases = [{"prompt": p, "cont": greedy(ref_runner, p, positions)} for p in prompts]
    del reference, ref_runner  # a 0.5B model's float32 is 2 GB: not beside the packed one
    phases = LoadPhases()
    auto = load_transformer(path, dtype="auto", phases=phases)
    share, count = forced_agreement(SlotRunner(auto, slots=1, context=context), cases)
    threads = torch.get_num_threads()
    peer_share = llamacpp_agreement(venv, path, cases, threads)
    ours = time_ours(SlotRunner(auto, slots=1, context=512), prompts[0], tokens)
    peer_rate = None if venv is None else time_llamacpp(venv, path, prompts[0], tokens)
    schemes = next((n for n in phases.statistics().notes if n.startswith("projections")), "")
    return {
        "neuron": share,
        "positions": count,
        "llamacpp": peer_share,
        "neuron_tok_s": ours,
        "llamacpp_tok_s": peer_rate,
        "schemes": schemes,
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def builds(venv: Path | None) -> str:
    """The builds measured: neuron's commit (+ "dirty" with uncommitted changes) and
    llama-cpp-python's version in the peer venv."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "neuron_trio"]).returncode
    neuron = (head.stdout.strip() or "unknown") + (" + uncommitted changes" if dirty else "")
    peer = "none"
    if venv is not None:
        code = "import llama_cpp; print(llama_cpp.__version__)"
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True)
        peer = "llama-cpp-python " + (done.stdout.decode().strip() or "unknown")
    return f"neuron {neuron}, {peer}"


def markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The README's table of `rows`: agreement (the share of positions) and decode tok/s per
    type, the better agreement in bold, and what each file's projections were kept as."""
    lines = [
        "| type (llama.cpp's file) | neuron auto | llama.cpp | neuron tok/s | llama.cpp tok/s "
        "| kept as (start-up log) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for kind, row in rows:
        ours, peer = row["neuron"], row["llamacpp"]
        a, b = f"{ours:.4f}", _cell(peer, ".4f")
        if peer is not None and ours != peer:
            a, b = (f"**{a}**", b) if ours > peer else (a, f"**{b}**")
        kept = str(row["schemes"]).removeprefix("projections ")
        lines.append(
            f"| {kind} | {a} | {b} | {row['neuron_tok_s']:.1f} "
            f"| {_cell(row['llamacpp_tok_s'], '.1f')} | {kept} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--types", default=",".join(FTYPES), help="comma-separated, of: " + ", ".join(FTYPES)
    )
    ap.add_argument("--positions", type=int, default=48, help="per prompt (8 prompts)")
    ap.add_argument("--tokens", type=int, default=32, help="decode speed: n of (n-1)/(T(n)-T(1))")
    ap.add_argument("--maker", choices=("llamacpp", "gguf"), default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=0, help="torch's and llama.cpp's (0: torch's)")
    ap.add_argument("--llamacpp-venv", type=Path, default=None)
    ap.add_argument(
        "--files",
        default="gemma3,qwen2.5-0.5b",
        help="real files after the made types (bench/table_models.py keys; '' for none)",
    )
    ap.add_argument("--markdown", action="store_true", help="the rows again as README's table")
    ap.add_argument("--peer", choices=("quantize", "agree"), help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer == "quantize":
        peer_quantize(*args.args, threads=args.threads or 2)
        return
    if args.peer == "agree":
        peer_agree(args.args[0], args.threads or 2, args.args[1])
        return

    import torch

    from bench import llamacpp_peer
    from tests.engine.model.requantize import QUANTIZABLE

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    venv = args.llamacpp_venv or llamacpp_peer.default_venv()
    has_peer = peer_ready(venv)
    maker = args.maker or ("llamacpp" if has_peer else "gguf")
    kinds = [k for k in args.types.split(",") if k]
    unknown = [k for k in kinds if k not in FTYPES]
    if unknown:
        raise SystemExit(f"unknown types {unknown}; known: {', '.join(FTYPES)}")
    if maker == "gguf":
        skipped = [k for k in kinds if k not in QUANTIZABLE]
        kinds = [k for k in kinds if k in QUANTIZABLE]
        if skipped:
            print(f"skipped (gguf cannot quantise them): {', '.join(skipped)}")
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{_cpu_name()}, {threads} threads, torch {torch.__version__}, files by {maker}, "
        f"llama.cpp peer: {venv if has_peer else 'none'}; {builds(venv if has_peer else None)}"
    )
    print(
        f"{'type':8} {'neuron auto':>11} {'llama.cpp':>9} {'neuron tok/s':>12} {'llama.cpp tok/s':>15}"
    )
    files = [(k, lambda k=k: make_file(k, maker, args.out, venv, threads)) for k in kinds]
    files += real_files([k for k in args.files.split(",") if k])
    rows = []
    for label, resolve in files:
        row = measure(resolve(), args.positions, args.tokens, venv if has_peer else None)
        rows.append((label, row))
        print(
            f"{label:8} {row['neuron']:>11.4f} {_cell(row['llamacpp'], '.4f'):>9} "
            f"{row['neuron_tok_s']:>12.1f} {_cell(row['llamacpp_tok_s'], '.1f'):>15}  "
            f"({row['positions']} positions; {row['schemes']})",
            flush=True,
        )
    if args.markdown:
        print(markdown(rows))


def real_files(keys: list[str]) -> list[tuple[str, Callable[[], Path]]]:
    """The table's published files named by `keys` (bench/table_models.py), each labelled
    "<model> (published file)" and resolved (assembled) only when its row is measured."""
    from bench.table_models import MODELS

    unknown = [k for k in keys if k not in MODELS or MODELS[k].builtin]
    if unknown:
        known = ", ".join(k for k, m in MODELS.items() if not m.builtin)
        raise SystemExit(f"unknown files {unknown}; known: {known}")
    return [(f"{MODELS[k].label} (published file)", MODELS[k].resolve) for k in keys]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
