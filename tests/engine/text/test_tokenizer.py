"""Tokenizer from GGUF metadata, incremental detokenisation, parity with transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neuron_trio.engine.text import gguf_vocab
from neuron_trio.engine.text.gguf_vocab import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
)
from neuron_trio.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from neuron_trio.errors import ModelLoadError, UnsupportedModelError
from tests.engine.tiny_gguf import byte_symbols

# ---- a tiny byte-level vocabulary, built by hand ------------------------------------------


# GPT-2's byte alphabet, written out in the test fixtures (an oracle apart from the product's)
BYTE_CHARS = byte_symbols()
SPACE = BYTE_CHARS[ord(" ")]  # "Ġ"


def tiny_metadata(pre: str = "gpt2", extra: dict[str, Any] | None = None) -> dict[str, object]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [f"{SPACE} w", "h e", "l l", "he ll", "hell o", f"{SPACE}w o", f"{SPACE}wo r"]
    merged = [f"{SPACE}w", "he", "ll", "hell", "hello", f"{SPACE}wo", f"{SPACE}wor"]
    tokens = [*specials, *BYTE_CHARS, *merged, "<think>"]
    types = [TOKEN_CONTROL] * 3 + [TOKEN_NORMAL] * (256 + len(merged)) + [TOKEN_USER_DEFINED]
    md: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
    }
    md.update(extra or {})
    return md


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(tiny_metadata())


def test_tiny_properties(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 3 + 256 + 7 + 1
    assert (tiny.bos_id, tiny.eos_id, tiny.add_bos) == (1, 2, False)
    assert tiny.chat_template == "{{ messages }}"
    assert tiny.token_to_id("<|im_end|>") == 2
    assert tiny.special_ids == {0, 1, 2}


def test_tiny_merges_and_roundtrip(tiny: Tokenizer) -> None:
    ids = tiny.encode("hello wor", add_special_tokens=True)
    assert [tiny.tokens[i] for i in ids] == ["hello", f"{SPACE}wor"]
    for text in ["hello world", "ünï 😀 \n\t  x", "", "a<|im_end|>b"]:
        ids = tiny.encode(text, add_special_tokens=False)
        assert tiny.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_in_text_are_whole(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>hello<|im_end|><think>", add_special_tokens=False)
    assert ids == [1, tiny.token_to_id("hello"), 2, tiny.vocab_size - 1]
    # skipped by default when decoding; user-defined tokens are text, not special
    assert tiny.decode(ids) == "hello<think>"


def test_add_bos_and_eos_from_metadata() -> None:
    tok = Tokenizer.from_metadata(
        tiny_metadata(
            extra={"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
        )
    )
    assert tok.encode("he", add_special_tokens=True) == [1, tok.token_to_id("he"), 2]
    assert tok.encode("he", add_special_tokens=False) == [tok.token_to_id("he")]


def test_token_text_shows_invalid_utf8_as_bytes(tiny: Tokenizer) -> None:
    e2 = 3 + 0xE2  # the byte token 0xE2 (first byte of "—", "…")
    assert tiny.token_text(e2) == "bytes:\\xe2"
    assert tiny.token_text(tiny.token_to_id("hello") or -1) == "hello"
    assert tiny.token_text(3 + ord(" ")) == " "
    assert tiny.token_text(2) == "<|im_end|>"
    assert tiny.token_text(tiny.vocab_size) == ""  # past the vocabulary (a padded logits row)
    assert tiny.decode([tiny.vocab_size, 3 + ord("a")]) == "a"


def test_incremental_detokenizer_never_splits_a_character(tiny: Tokenizer) -> None:
    text = "hello — 😀 world"
    ids = tiny.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the multi-byte characters are several byte tokens
    detok = IncrementalDetokenizer(tiny)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    for piece in pieces:
        assert "\N{REPLACEMENT CHARACTER}" not in piece
    # the 4 bytes of the emoji: nothing until the last one
    emoji = [3 + b for b in "😀".encode()]
    detok = IncrementalDetokenizer(tiny)
    assert [detok.push(i) for i in emoji] == ["", "", "", "😀"]


def test_incremental_detokenizer_specials_and_flush(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny)
    assert detok.push(2) == ""  # <|im_end|> skipped
    assert detok.push(3 + 0xE2) == ""
    assert detok.flush() == "\N{REPLACEMENT CHARACTER}"  # a character that never completed
    keep = IncrementalDetokenizer(tiny, skip_special_tokens=False)
    assert keep.push(2) == "<|im_end|>"


def test_unknown_tokenizer_model_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.model='bert'"):
        Tokenizer.from_metadata(tiny_metadata(extra={"tokenizer.ggml.model": "bert"}))
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.pre='nonesuch'.*smollm"):
        Tokenizer.from_metadata(tiny_metadata(pre="nonesuch"))
    with pytest.raises(UnsupportedModelError, match="no tokenizer"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    assert issubclass(UnsupportedModelError, ModelLoadError)


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        # GPT-2: a space sticks to the word or number after it
        ("gpt2", "a  12", ["a", " ", " 12"]),
        # smollm-digits (StarCoder, llama.cpp's smollm): every digit alone, first
        ("smollm-digits", "a  12", ["a", "  ", "1", "2"]),
        # llama3: numbers in groups of up to three; a newline run is its own piece
        ("llama-bpe", "x 12345\n\n y", ["x", " ", "123", "45", "\n\n", " y"]),
        ("llama-bpe", "I'LL go", ["I", "'LL", " go"]),
        # default: runs of punctuation first, numbers cut in threes
        ("default", "a,,b 12345", ["a", ",,", "b", " ", "123", "45"]),
        ("qwen2", "x 123", ["x", " ", "1", "2", "3"]),
    ],
)
def test_pre_tokenizer_regexes(pre: str, text: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_metadata(tiny_metadata(pre=pre))
    assert tok.backend.pre_tokenizer is not None
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert ["".join(chr(BYTE_CHARS.index(c)) for c in p) for p in got] == pieces


def test_missing_pre_means_default() -> None:
    md = tiny_metadata()
    del md["tokenizer.ggml.pre"]
    tok = Tokenizer.from_metadata(md)
    assert tok.decode(tok.encode("a,,b 12345", add_special_tokens=False)) == "a,,b 12345"


def test_byte_level_tokens_get_the_bytes_their_characters_spell() -> None:
    """All tokens are encoded at once (gguf_vocab._alphabet_bytes); each must get what its own
    characters spell, and a token with any character outside the byte alphabet None (its
    neighbours unaffected), whatever the lengths, empty tokens included."""
    alphabet = [gguf_vocab._BYTE_TO_CHAR[b] for b in range(256)]
    rng = np.random.default_rng(5)
    # outside the alphabet: a token's first character (after a clean token, and after an
    # empty one), a middle one, and a last one
    tokens = ["", "a", "\x00x", "ok", "", "\u65e5", "b", "a b", "\u0120hello", "\u0100", "\u00e9"]
    tokens += ["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(0, 9, 500)]
    tokens += ["x\u0101" + "\u2581", "ok", ""]
    want = [
        bytes(gguf_vocab._CHAR_TO_BYTE[c] for c in t) if set(t) <= set(alphabet) else None
        for t in tokens
    ]
    got = gguf_vocab._alphabet_bytes(tokens)
    assert got == want
    assert [i for i, b in enumerate(got) if b is None] == [2, 5, 7, len(tokens) - 3]


# ---- sentencepiece (tokenizer.ggml.model = "llama") ---------------------------------------


def spm_metadata() -> dict[str, object]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256
    normal = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "\u2581h",
        "ll",
        "\u2581he",
        "\u2581hell",
        "\u2581hello",
    ]
    scores = [0.0] * len(tokens) + [-1.0, -2.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens + normal,
        "tokenizer.ggml.token_type": types + [TOKEN_NORMAL] * len(normal),
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_sentencepiece_byte_fallback_and_space_prefix() -> None:
    tok = Tokenizer.from_metadata(spm_metadata())
    assert tok.add_bos
    ids = tok.encode("hello hé", add_special_tokens=True)
    assert ids[0] == 1
    assert tok.tokens[ids[1]] == "\u2581hello"
    # "é" is not in the vocabulary: two byte tokens
    assert [tok.tokens[i] for i in ids[-2:]] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hello hé"
    assert tok.token_text(ids[-2]) == "bytes:\\xc3"
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hello hé"
    # a continuation keeps its leading space
    cont = IncrementalDetokenizer(tok, prompt_ids=[1, 5])
    assert cont.push(ids[1]) == " hello"


class DictMerges:
    """A MergesStore in memory, counting its calls."""

    def __init__(self) -> None:
        self.entries: dict[str, np.ndarray] = {}
        self.gets = self.puts = 0

    def get(self, key: str) -> np.ndarray | None:
        self.gets += 1
        return self.entries.get(key)

    def put(self, key: str, pairs: np.ndarray) -> None:
        self.puts += 1
        self.entries[key] = pairs.copy()


def test_derived_merges_come_back_from_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    store = DictMerges()
    fresh = Tokenizer.from_metadata(spm_metadata(), merges_store=store)
    assert (store.gets, store.puts) == (1, 1)
    (pairs,) = store.entries.values()
    tokens = spm_metadata()["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list)
    # "▁hello" is "▁hell" + "o"; the best-scored merge comes first: "▁h" = "▁" + "h" (-3.0)
    named = [(tokens[a], tokens[b]) for a, b in pairs.tolist()]
    assert named[0] == ("\u2581", "h")
    assert ("\u2581hell", "o") in named

    # the second build reads them and derives nothing
    def derive(*args: object) -> None:
        raise AssertionError("derived again")

    monkeypatch.setattr(gguf_vocab, "_merges_from_scores", derive)
    cached = Tokenizer.from_metadata(spm_metadata(), merges_store=store)
    assert store.puts == 1
    for text in ("hello hé", "hell", "ll lo oh", ""):
        assert cached.encode(text, add_special_tokens=False) == fresh.encode(
            text, add_special_tokens=False
        )


def test_stored_merges_that_do_not_fit_the_vocabulary_are_derived_again() -> None:
    store = DictMerges()
    want = Tokenizer.from_metadata(spm_metadata()).encode("hello hello", add_special_tokens=False)
    metadata = spm_metadata()
    tokens, types, scores = (
        metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores")
    )
    key = gguf_vocab.merges_key(tokens, types, scores)  # type: ignore[arg-type]
    for bad in (
        np.array([[0, 10_000]]),
        np.array([[-1, 3]]),
        np.zeros((3,), np.int32),
        np.array([[0.5, 1.0]]),
    ):
        store.entries[key] = bad
        tok = Tokenizer.from_metadata(metadata, merges_store=store)
        assert tok.encode("hello hello", add_special_tokens=False) == want
        stored = store.entries[key]  # replaced by the derived pairs
        assert stored.shape[1] == 2 and int(stored.max()) < len(tokens)  # type: ignore[arg-type]


def test_the_merges_key_follows_the_scores() -> None:
    metadata = spm_metadata()
    tokens, types, scores = (
        metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores")
    )
    key = gguf_vocab.merges_key(tokens, types, scores)  # type: ignore[arg-type]
    assert key == gguf_vocab.merges_key(list(tokens), list(types), list(scores))  # type: ignore[call-overload]
    changed = list(scores)  # type: ignore[call-overload]
    changed[-1] = -8.0
    assert gguf_vocab.merges_key(tokens, types, changed) != key  # type: ignore[arg-type]
    # the same characters split into other tokens: another vocabulary
    assert gguf_vocab.merges_key(["ab", "c"], [1, 1], [0.0, 0.0]) != gguf_vocab.merges_key(
        ["a", "bc"], [1, 1], [0.0, 0.0]
    )


class HeaderOnly:
    """What `Tokenizer.from_gguf` reads of a GGUFFile: its path, metadata and header bytes."""

    def __init__(self, header: bytes) -> None:
        self.path = "model.gguf"
        self.metadata = spm_metadata()
        self.header = header

    def header_bytes(self) -> bytes:
        return self.header


def test_a_files_merges_are_kept_under_its_headers_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    # a restart does not join and hash the whole vocabulary again (Gemma 3: ~0.04 s)
    def content_key(*args: object) -> str:
        raise AssertionError("the vocabulary was hashed")

    monkeypatch.setattr(gguf_vocab, "merges_key", content_key)
    store = DictMerges()
    first = Tokenizer.from_gguf(HeaderOnly(b"header A"), merges_store=store)  # type: ignore[arg-type]
    again = Tokenizer.from_gguf(HeaderOnly(b"header A"), merges_store=store)  # type: ignore[arg-type]
    assert (store.gets, store.puts) == (2, 1)
    assert list(store.entries) == [gguf_vocab.header_merges_key(b"header A")]
    Tokenizer.from_gguf(HeaderOnly(b"header B"), merges_store=store)  # type: ignore[arg-type]
    assert store.puts == 2  # other header bytes: another entry
    for text in ("hello hé", "ll lo oh"):
        assert again.encode(text, add_special_tokens=False) == first.encode(
            text, add_special_tokens=False
        )


# ---- the built-in model, against transformers ---------------------------------------------

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "3.14159 + 2.71828 = 5.85987; 1,000,000 and 42% of $19.99",
    "1 2 3 100000 a1b2 x=1e-9 0xFF",
    "naïve café — “quotes” ‘single’ ünïcödé Straße",
    "日本語のテキスト、中文文本，한국어 텍스트, русский текст, العربية",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 ✨🔥",
    "   leading and    runs\n\n\n\ttabs\t\t end   ",
    "\n\n\n",
    " ",
    "",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y<|im_end|>",
    "I'm sure you'll see they've WE'RE it's",
    "<tag attr='v'>text</tag> &amp; https://example.com/a?b=c#d",
    "Ω≈ç√∫ ∑ µ ≤ ≥ ÷",
    "line one\r\nline two\rline three",
]

# Whitespace before digits: the model's own tokenizer (StarCoder-style, llama.cpp "smollm")
# splits digits before anything else; transformers' GGUF loader splits as GPT-2 does.
DIGIT_TEXTS = ["   12  34 \n 5", "a  12", "x = 1", "½ ² ³ ٣"]


@pytest.fixture(scope="module")
def builtin_path() -> Path:
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    return builtin_model_path()


@pytest.fixture(scope="module")
def smol(builtin_path: Path) -> Tokenizer:
    """Through the engine's own GGUF header parser: 0.2 s, against 2 s for gguf.GGUFReader."""
    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(builtin_path) as gf:
        return Tokenizer.from_metadata(gf.metadata)


@pytest.fixture(scope="module")
def hf_tok(builtin_path: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(builtin_path.parent), gguf_file=builtin_path.name
    )


def test_builtin_tokenizer_basics(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    assert smol.token_to_id("<|im_end|>") == 2
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.encode("<|im_start|>user", add_special_tokens=True)[0] == 1
    # split as transformers' GGUF loader splits "smollm" (GPT-2), not digits-first
    assert [smol.tokens[i] for i in smol.encode("a  12", add_special_tokens=False)] == [
        "a",
        "Ġ",
        "Ġ",
        "1",
        "2",
    ]


@pytest.mark.slow
def test_builtin_matches_transformers(smol: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        ours = smol.encode(text, add_special_tokens=True)
        theirs = hf_tok.encode(text)
        assert len(ours) == len(theirs), text
        assert ours == theirs, text
        assert smol.decode(ours, skip_special_tokens=False) == hf_tok.decode(theirs), text
        assert smol.decode(ours) == hf_tok.decode(theirs, skip_special_tokens=True), text


@pytest.mark.slow
def test_builtin_smollm_digits_matches_the_models_own_pre_tokenizer(builtin_path: Path) -> None:
    """pre="smollm-digits": the model's tokenizer.json recipe, rebuilt with `tokenizers`' steps."""
    from tokenizers import pre_tokenizers

    from neuron_trio.engine.gguf.file import GGUFFile

    with GGUFFile(builtin_path) as gf:
        smol = Tokenizer.from_metadata({**gf.metadata, "tokenizer.ggml.pre": "smollm-digits"})
    backend = smol.backend.__class__.from_str(smol.backend.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in TEXTS + DIGIT_TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        assert smol.encode(text, add_special_tokens=False) == ids, text


@pytest.mark.slow
def test_default_pre_matches_transformers_around_digits(smol: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    tok = smol
    for text in TEXTS + DIGIT_TEXTS:
        assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text), text


def test_builtin_incremental_detokenizer(smol: Tokenizer) -> None:
    for text in TEXTS:
        ids = smol.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(smol)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == smol.decode(ids), text
        assert not any("\N{REPLACEMENT CHARACTER}" in p for p in pieces), text


@dataclass
class ParsedFile:
    """What `Tokenizer.from_gguf` reads of a parsed `GGUFFile`: its metadata and path."""

    metadata: dict[str, Any]
    path: Path


def test_from_gguf_uses_the_parsed_metadata_and_overrides_pre() -> None:
    parsed = ParsedFile(tiny_metadata(pre="smollm-digits"), Path("tok.gguf"))
    tok = Tokenizer.from_gguf(parsed)  # type: ignore[arg-type]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (267, 1, 2)
    assert tok.chat_template == "{{ messages }}"
    assert tok.encode("<|im_end|>hello", add_special_tokens=False) == [2, tok.token_to_id("hello")]
    # smollm-digits: " " and "1" apart; gpt2: " 1" is one piece (no merge for it here, so same ids)
    assert tok.backend.pre_tokenizer is not None
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str("a 12")
    assert [p for p, _ in pieces] == ["a", SPACE, "1", "2"]
    gpt2 = Tokenizer.from_gguf(parsed, pre="gpt2")  # type: ignore[arg-type]
    assert gpt2.backend.pre_tokenizer is not None
    assert [p for p, _ in gpt2.backend.pre_tokenizer.pre_tokenize_str("a 12")] == [
        "a",
        f"{SPACE}12",
    ]
    assert parsed.metadata["tokenizer.ggml.pre"] == "smollm-digits"  # the file's, untouched


def test_from_gguf_errors_name_the_file() -> None:
    parsed = ParsedFile(tiny_metadata(pre="nonesuch"), Path("/models/bad.gguf"))
    with pytest.raises(UnsupportedModelError, match=r"bad\.gguf.*nonesuch"):
        Tokenizer.from_gguf(parsed)  # type: ignore[arg-type]


FRAGMENTS = [
    *["the", "The", " quick", "brown", "fox", "'s", "'T", "'re", "don't", "I'M", "def", "return"],
    *[" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000"],
    *["0", "7", "42", "3.14", "1,000", "-5", "1e9", "½", "²", "x_1", "__init__"],
    *["(", ")", "{", "}", "==", "->", "//", "#", "$", "%", "&&", "…", "—", "“", "”"],
    *[
        "é",
        "ü",
        "ß",
        "ñ",
        "日本",
        "語",
        "中文",
        "한국",
        "россия",
        "ا",
        "😀",
        "👍🏽",
        "🇫🇷",
        "👨‍👩‍👧",
    ],
    *["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "http://a.b/c?d=e"],
]


def _random_texts(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


@pytest.mark.slow
def test_builtin_random_texts(builtin_path: Path, smol: Tokenizer, hf_tok) -> None:  # type: ignore[no-untyped-def]
    """300 random mixes of words, code, numbers, whitespace, scripts, emoji and special tokens.

    Measured with 1000 such texts: by default (smollm split as GPT-2) our ids equal
    transformers' on 1000/1000; with pre="smollm-digits" the model's own recipe on 1000/1000.
    """
    from tokenizers import pre_tokenizers

    from neuron_trio.engine.gguf.file import GGUFFile

    recipe = smol.backend.__class__.from_str(smol.backend.to_str())
    recipe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    with GGUFFile(builtin_path) as gf:
        digits = Tokenizer.from_metadata({**gf.metadata, "tokenizer.ggml.pre": "smollm-digits"})
    for text in _random_texts(300, seed=1234):
        ours = smol.encode(text, add_special_tokens=True)
        theirs = hf_tok.encode(text)
        assert ours == theirs, text
        assert (
            digits.encode(text, add_special_tokens=True)
            == recipe.encode(text, add_special_tokens=False).ids
        ), text
        assert smol.decode(ours, skip_special_tokens=False) == text


def test_a_token_spelled_twice_keeps_the_vocabulary_size() -> None:
    md: dict[str, Any] = tiny_metadata()
    tokens = [*md["tokenizer.ggml.tokens"], "hello"]  # a second "hello", as some files have
    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], TOKEN_NORMAL]
    tok = Tokenizer.from_metadata(md)
    assert tok.vocab_size == len(tokens)
    first = tokens.index("hello")
    assert tok.encode("hello", add_special_tokens=False) == [first]
    assert tok.decode([len(tokens) - 1]) == "hello"


def test_sentencepiece_token_bytes_and_first_ids_for_every_kind() -> None:
    """Each kind of token gets its own bytes (normal and user-defined: "▁" a space; a control
    token as written, "▁" kept; a byte token its byte; unknown U+FFFD; an unused one as a
    normal one), a token spelled twice encodes as its first id, control and user-defined
    tokens are matched whole: built a kind at a time, not a token at a time."""
    md: dict[str, Any] = spm_metadata()
    extra = [
        ("<ctl\u2581x>", TOKEN_CONTROL),
        ("\u2581my\u2581word", TOKEN_USER_DEFINED),
        ("<unused0>", gguf_vocab.TOKEN_UNUSED),
        ("<0x4>", TOKEN_BYTE),  # not a byte token's spelling: its text
        ("\u2581hello", TOKEN_NORMAL),  # spelled twice
        ("\u00e9\u2581", TOKEN_NORMAL),
    ]
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], *(t for t, _ in extra)]
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], *(k for _, k in extra)]
    md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], *[-9.0] * len(extra)]
    tok = Tokenizer.from_metadata(md)
    tokens = md["tokenizer.ggml.tokens"]
    first = len(tokens) - len(extra)
    assert tok.token_bytes[:3] == ["\N{REPLACEMENT CHARACTER}".encode(), b"<s>", b"</s>"]
    assert tok.token_bytes[3:259] == [bytes([b]) for b in range(256)]
    assert tok.token_bytes[first:] == [
        "<ctl\u2581x>".encode(),
        b" my word",
        b"<unused0>",
        b"<0x4>",
        b" hello",
        "\u00e9 ".encode(),
    ]
    assert tok.special_ids == {1, 2, first}
    hello = tokens.index("\u2581hello")
    assert hello < first + 4 and tok.encode("hello", add_special_tokens=False) == [hello]
    assert tok.token_to_id("\u2581hello") == hello
    assert tok.encode("a<ctl\u2581x>", add_special_tokens=False)[-1] == first


def test_no_automatic_collection_while_a_tokenizer_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The build's tuples (Gemma 3: 513,511 merges) are not walked by the collector as they are
    made: it is paused during the build, and on again after it, even when the build fails;
    a collector that was off stays off."""
    import gc

    seen: list[bool] = []
    real = gguf_vocab.build_sentencepiece

    def watching(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr("neuron_trio.engine.text.tokenizer.build_sentencepiece", watching)
    assert gc.isenabled()
    Tokenizer.from_metadata(spm_metadata())
    assert seen == [False] and gc.isenabled()
    bad = spm_metadata()
    bad["tokenizer.ggml.tokens"] = [*bad["tokenizer.ggml.tokens"][:-1], "<0xZZ>"]  # type: ignore[misc]
    bad["tokenizer.ggml.token_type"] = [*bad["tokenizer.ggml.token_type"][:-1], TOKEN_BYTE]  # type: ignore[misc]
    with pytest.raises(ModelLoadError):
        Tokenizer.from_metadata(bad)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        Tokenizer.from_metadata(spm_metadata())
        assert not gc.isenabled()
    finally:
        gc.enable()
