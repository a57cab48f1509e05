"""Record transformers' float32 reference for the real Gemma 3 270M (the slow parity test's data).

transformers takes minutes on a small machine to load this file (its tokenizer conversion
alone ~30 s on 2 busy cores) and decodes at ~10 tokens/s, so the slow test
(tests/engine/model/test_gemma_real.py) compares neuron with this recording instead of running
transformers each time. Rerun it after a transformers upgrade and commit the result:

    .venv/bin/python bench/gemma_reference.py   # writes tests/engine/data/gemma3_270m_reference.json

For each prompt: transformers' prompt token ids, its 32 greedy token ids and text, and its
last-position logits at its 16 best tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gemma_model import PROMPTS, gemma_path  # noqa: E402

OUT = ROOT / "tests" / "engine" / "data" / "gemma3_270m_reference.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    path = gemma_path()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"transformers {transformers.__version__} loaded in {time.perf_counter() - t0:.1f} s")
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)[
                0, len(ids) :
            ].tolist()
        top = logits.topk(16)
        cases.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "greedy_ids": out,
                "greedy_text": tok.decode(out, skip_special_tokens=True),
                "top_ids": top.indices.tolist(),
                "top_logits": top.values.tolist(),
            }
        )
        print(repr(prompt), len(ids), repr(cases[-1]["greedy_text"][:60]))
    doc = {"transformers": transformers.__version__, "tokens": args.tokens, "cases": cases}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
