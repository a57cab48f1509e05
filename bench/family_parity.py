"""The family table: each model family's tiny GGUF file (tests/engine/tiny_families.py) in
neuron against transformers, float32, and tp = 2 against tp = 1.

    .venv/bin/python bench/family_parity.py

Per family: the largest logit difference over a 20-token prompt (absolute, and relative to
the largest logit), how many of 32 greedy tokens agree, whether the prompt token ids equal
transformers' on the test texts, and the largest difference of tp = 2 (in-process, CPU)
against one model. The tests assert the same (tests/engine/gguf/test_families.py,
tests/executor/tp/test_family_tp.py); this prints the numbers.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_trio.engine.model.load.loader import load_transformer
from tests.engine.gguf.test_families import TEXTS, greedy, hf_model, prompt_ids, tokenizer_of
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_families import FAMILIES, write_tiny_family
from tests.executor.tp.test_family_tp import run_both


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        "| family | file | logits max diff (abs / rel) | greedy 32 | prompt tokens | tp=2 max diff |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for family in FAMILIES:
            path = write_tiny_family(d / f"{family}.gguf", family)
            model = load_transformer(path, dtype="float32", device="cpu")
            runner = SlotRunner(model, slots=1, context=96)
            hf = hf_model(d, family)
            ids = prompt_ids(model.config.vocab_size, 20, seed=1)
            got = runner.forward(
                torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), all_logits=True
            )[0]
            with torch.no_grad():
                want = hf(torch.tensor([ids])).logits[0].float()
                hf_out = hf.generate(
                    torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                    do_sample=False, eos_token_id=None, pad_token_id=0,
                )[0, len(ids):].tolist()  # fmt: skip
            diff = float((got - want).abs().max())
            ours = greedy(runner, ids, 32)
            same = sum(a == b for a, b in zip(ours, hf_out, strict=True))
            tok = tokenizer_of(path)
            htok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=path.name)
            counts = [
                (len(tok.encode(t, add_special_tokens=True)), len(htok(t)["input_ids"]))
                for t in TEXTS
            ]
            equal = all(a == b for a, b in counts)
            whole, sharded = run_both(path, 2)
            tp_diff = max(float((a - b).abs().max()) for a, b in zip(whole, sharded, strict=True))
            print(
                f"| {family} | tiny ({model.config.arch}) | {diff:.1e} / "
                f"{diff / float(want.abs().max()):.1e} | {same}/32 | "
                f"{'equal' if equal else 'DIFFER'} ({sum(a for a, _ in counts)} tokens) | "
                f"{tp_diff:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
