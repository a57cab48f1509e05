"""Every model family against transformers, on tiny random GGUF files written as llama.cpp's
converter writes them: float32 logits, greedy tokens, prompt token counts, chat templates."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from neuron_trio.engine.gguf.file import GGUFFile
from neuron_trio.engine.model.load.loader import load_transformer
from neuron_trio.engine.model.placement import WINDOW_ALIGN
from neuron_trio.engine.model.transformer import Transformer
from neuron_trio.engine.text.chat import ChatTemplate, end_of_turn_ids
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.errors import UnsupportedModelError
from tests.engine.slot_runner import SlotRunner
from tests.engine.tiny_families import FAMILIES, LLAMA3_SCALING, write_tiny_family

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TEXTS = [
    "The capital of France is Paris.",
    "hello world, and the world is in a hello",
    "  two leading spaces and trailing  ",
    "Numbers 12345 and 7, then ünïcödé: 東京 😀",
    "line one\nline two\n\n\ttabbed",
    "<|im_start|>user special tokens<|im_end|> <start_of_turn>model <|end|>",
]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        write_tiny_family(d / f"{family}.gguf", family)
    return d


def hf_model(directory: Path, family: str) -> Any:
    kwargs: dict[str, Any] = {}
    if family == "llama3":
        # transformers reads neither the rope_freqs tensor nor rope.scaling.* from a GGUF
        # file: give it the rope_scaling that the file's rope_freqs was computed from.
        config = transformers.AutoConfig.from_pretrained(directory, gguf_file=f"{family}.gguf")
        s = LLAMA3_SCALING
        config.rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": s["factor"],
            "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"],
            "original_max_position_embeddings": s["original"],
        }
        kwargs["config"] = config
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=f"{family}.gguf",
        dtype=torch.float32,
        attn_implementation="eager",
        **kwargs,
    ).eval()


def tokenizer_of(path: Path) -> Tokenizer:
    with GGUFFile(path) as gf:
        return Tokenizer.from_gguf(gf)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, size=n).tolist()


def greedy(runner: SlotRunner, ids: list[int], n: int) -> list[int]:
    logits = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]))
    out = [int(logits.argmax())]
    for i in range(n - 1):
        step = runner.forward(
            torch.tensor([[out[-1]]]), torch.tensor([len(ids) + i]), torch.tensor([0])
        )
        out.append(int(step.argmax()))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_equal_transformers(family_dir: Path, family: str) -> None:
    path = family_dir / f"{family}.gguf"
    model = load_transformer(path, dtype="float32", device="cpu")
    hf = hf_model(family_dir, family)
    assert hf.config.num_hidden_layers == model.config.n_layers
    runner = SlotRunner(model, slots=1, context=96)
    # 20 tokens: past gemma's sliding window of 8, and far enough for Llama 3's scaled RoPE
    ids = prompt_ids(model.config.vocab_size, 20, seed=1)
    got = runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), all_logits=True)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    scale = want.abs().max()
    assert float((got[0] - want).abs().max() / scale) < 1e-5, family
    torch.testing.assert_close(got[0, -1], want[-1], rtol=1e-5, atol=1e-5 * float(scale))
    # greedy, 32 tokens: the decode path (cache, sliding window masks) against transformers'
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=32,
        )[0, len(ids) :].tolist()
    assert greedy(runner, ids, 32) == hf_out


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_prompt_chunks_past_the_sliding_window_equal_transformers(
    family_dir: Path, family: str, scattered: bool
) -> None:
    """The chunk of 25 at position 75 starts past the window of 8 and past WINDOW_ALIGN: its
    sliding layers read and attend from position 64 on (Placement.window_start), not from 0;
    its K/V as a view of consecutive blocks, or gathered from blocks scattered in the pool."""
    path = family_dir / f"{family}.gguf"
    model = load_transformer(path, dtype="float32", device="cpu")
    assert model.config.sliding_window == 8 and WINDOW_ALIGN == 64
    runner = SlotRunner(model, slots=2, context=128, scattered=scattered)
    ids = prompt_ids(model.config.vocab_size, 100, seed=2)
    chunks = [
        runner.forward(torch.tensor([ids[s : s + 25]]), torch.tensor([s]), torch.tensor([1]),
                       all_logits=True)[0]
        for s in range(0, 100, 25)
    ]  # fmt: skip
    with torch.no_grad():
        want = hf_model(family_dir, family)(torch.tensor([ids])).logits[0].float()
    scale = float(want.abs().max())
    assert float((torch.cat(chunks) - want).abs().max()) < 1e-5 * scale, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_tokens_equal_transformers(family_dir: Path, family: str) -> None:
    path = family_dir / f"{family}.gguf"
    ours = tokenizer_of(path)
    theirs = transformers.AutoTokenizer.from_pretrained(family_dir, gguf_file=path.name)
    for text in TEXTS:
        want = theirs(text)["input_ids"]
        got = ours.encode(text, add_special_tokens=True)
        assert len(got) == len(want), (family, text, got, want)
        assert got == want, (family, text)
        assert ours.decode(got) == theirs.decode(want, skip_special_tokens=True), (family, text)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_template_renders_and_ends_turns(family_dir: Path, family: str) -> None:
    path = family_dir / f"{family}.gguf"
    tokenizer = tokenizer_of(path)
    template = ChatTemplate(
        tokenizer.chat_template,
        bos_token=tokenizer.token_text(tokenizer.bos_id or 0),
        eos_token=tokenizer.token_text(tokenizer.eos_id or 0),
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Capital of France?"},
    ]
    if family == "mistral":  # its template has no system role
        messages = messages[1:]
    text = template.render(messages, add_generation_prompt=True)
    theirs = transformers.AutoTokenizer.from_pretrained(family_dir, gguf_file=path.name)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    stops = end_of_turn_ids(tokenizer)
    turn_end = {
        "llama3": "<|eot_id|>",
        "mistral": "</s>",
        "qwen2": "<|im_end|>",
        "qwen3": "<|im_end|>",
        "gemma2": "<end_of_turn>",
        "gemma3": "<end_of_turn>",
        "phi3": "<|end|>",
    }[family]
    assert tokenizer.token_to_id(turn_end) in stops
    if family.startswith("gemma"):  # Gemma's assistant is "model", the system is folded in
        assert "<start_of_turn>model\nHello" in text and "system" not in text
        assert "Be brief.\n\nHi" in text


def test_description_read_from_metadata(family_dir: Path) -> None:
    def config(family: str) -> Any:
        with GGUFFile(family_dir / f"{family}.gguf") as gf:
            return gf.config

    assert config("qwen2").qkv_bias and not config("qwen2").qk_norm
    q3 = config("qwen3")
    assert q3.qk_norm and q3.head_dim == 128 and q3.dim // q3.n_heads == 16
    g2 = config("gemma2")
    assert (g2.attn_softcap, g2.final_softcap, g2.sliding_window) == (50.0, 30.0, 8)
    assert g2.sliding_layers == (True, False, True, False) and g2.activation == "gelu_tanh"
    assert g2.embed_scale == pytest.approx(8.0) and g2.attn_scale == pytest.approx(1 / 16)
    g3 = config("gemma3")
    assert g3.sliding_layers == (True,) * 5 + (False, True) and g3.rope_base_local == 10000.0
    assert g3.qk_norm and g3.post_norms and not g3.attn_softcap
    assert len(config("llama3").rope_freq_factors) == 8
    assert config("phi3").arch == "phi3" and not config("phi3").qkv_bias


def logits_of(model: Transformer, ids: list[int]) -> torch.Tensor:
    runner = SlotRunner(model, slots=1, context=64)
    return runner.forward(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]))[0]


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("llama3", "rope_freq_factors", ()),
        ("gemma2", "sliding_window", 0),
        ("gemma2", "attn_softcap", 0.0),
        ("gemma3", "rope_base_local", 0.0),
    ],
)
def test_each_feature_changes_the_logits(
    family_dir: Path, family: str, field: str, value: Any
) -> None:
    """Control: without the feature, the model computes something else (so the parity tests
    above see each feature)."""
    path = family_dir / f"{family}.gguf"
    with GGUFFile(path) as gf:
        ids = prompt_ids(gf.config.vocab_size, 20, seed=2)
        model = load_transformer(gf, dtype="float32", device="cpu")
        gf.config = dataclasses.replace(gf.config, **{field: value})
        altered = load_transformer(gf, dtype="float32", device="cpu")
    assert not torch.allclose(logits_of(model, ids), logits_of(altered, ids), atol=1e-3)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from tests.engine.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"architecture 'mamba' is not supported"):
        GGUFFile(path)


def test_linear_rope_scaling_equals_transformers(tmp_path: Path) -> None:
    from tests.engine.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(
        tmp_path / "linear.gguf",
        rope_base=500.0,
        extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    model = load_transformer(path, dtype="float32", device="cpu")
    assert model.config.rope_scale == 4.0
    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    config.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=config, dtype=torch.float32
    ).eval()
    ids = prompt_ids(model.config.vocab_size, 24, seed=3)
    got = logits_of(model, ids)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"llama.rope.scaling.type": "yarn"}, r"RoPE scaling 'yarn' is not supported"),
        ({"llama.attention.value_length": 8}, r"key length 16 != value length 8"),
    ],
)
def test_unsupported_variants_are_named(
    tmp_path: Path, metadata: dict[str, Any], message: str
) -> None:
    from tests.engine.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=message):
        GGUFFile(path)
