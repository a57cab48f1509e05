"""llama.cpp's description of a tokenizer (`tokenizer.ggml.*`) rebuilt as a Hugging Face
`tokenizers` backend: the vocabulary, the merges, the pre-tokenizer's split regexes.

- `tokenizer.ggml.model = "gpt2"`: byte-level BPE with the merges from the file, and the split
  regexes of `tokenizer.ggml.pre` (`PRE_SPLITS`, the same chains as llama.cpp's
  `llama_vocab::impl::load`), then the GPT-2 byte alphabet (`build_byte_level`).
- `tokenizer.ggml.model = "llama"`: sentencepiece-style BPE with byte fallback, merges derived
  from the token scores (llama.cpp's SPM tokenizer), "▁" for spaces (`build_sentencepiece`).

Each builder also gives every token id its exact bytes, which `tokenizer.Tokenizer` decodes
with; control and user-defined tokens are added by `Tokenizer` itself.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import inspect
import itertools
import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from neuron_trio.engine.gguf.checks import gpt2_byte_alphabet
from neuron_trio.errors import ModelFileError, UnsupportedModelError

# llama.cpp's token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# The split regexes behind llama.cpp's pre-tokenizer names. llama.cpp applies them in order,
# each one splitting the pieces the previous one left (matches and the text between them both
# become pieces): a `Split(..., "isolated")` per regex does the same.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

PRE_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (also what a file without `pre` gets)
    "default": _DEFAULT,
    # LLAMA_VOCAB_PRE_TYPE_GPT2 and the names llama.cpp gives the same regex
    "gpt2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "trillion": (_GPT2,),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "pixtral": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    # "smollm" is split as transformers' GGUF loader splits it (plain GPT-2), because token
    # counts must equal transformers' for the same file: a router's accounting and the
    # parity references use it. llama.cpp's recipe (digits alone first) is "smollm-digits".
    "smollm": (_GPT2,),
    # LLAMA_VOCAB_PRE_TYPE_STARCODER and friends: every digit alone, then the GPT-2 regex
    "smollm-digits": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "exaone": (r"\p{N}", _GPT2),
    "minerva-7b": (r"\p{N}", _GPT2),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}

SUPPORTED_MODELS = ("gpt2", "llama")
# The sum of the squared lengths of a SentencePiece vocabulary's tokens bounds the work of
# deriving its merges (`_merges_from_scores`). Gemma 3's 262,144 tokens: 10.8 million, 1.4 s
# on a 2-core machine; so this bound is ~12 s there, where one 1,000,000-character token
# (10^12) took ~100 s before it (gguf_checks also caps a token at 1024 bytes).
MAX_MERGE_DERIVATION_COST = 128_000_000


class MergesStore(Protocol):
    """Where merges derived from a vocabulary's scores are kept between starts, as pairs of
    token ids under a key (`merges_key`); the daemon's is its packed-weight cache
    (executor.executor.CachedMerges). Deriving Gemma 3's 513,511 merges takes ~1 s of a ~5 s
    start; reading them back ~0.2 s."""

    def get(self, key: str) -> np.ndarray | None:
        """The pairs stored under `key` (int [N, 2]), or None."""

    def put(self, key: str, pairs: np.ndarray) -> None:
        """Keep `pairs` (int32 [N, 2]) under `key`; never raises."""


_BYTE_TO_CHAR = dict(enumerate(gpt2_byte_alphabet()))
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# The byte alphabet as a codec: text spelled in it encodes to its bytes in one C loop.
_ALPHABET_CODEC = codecs.charmap_build("".join(_BYTE_TO_CHAR[b] for b in range(256)))
_OUTSIDE_ALPHABET = re.compile("[^" + "".join(re.escape(c) for c in sorted(_CHAR_TO_BYTE)) + "]")


def _alphabet_bytes(tokens: Sequence[str]) -> list[bytes | None]:
    """Each token's bytes where it is spelled in the byte alphabet (almost all), else None.
    All tokens are encoded at once: Qwen2.5's 151,936 took ~0.25 s token by token in Python,
    ~0.05 s this way, of a restart's ~0.65 s tokenizer build."""
    joined = "".join(tokens)
    data = codecs.charmap_encode(joined, "replace", _ALPHABET_CODEC)[0]  # a byte a character
    ends = list(itertools.accumulate(map(len, tokens)))
    outside = {bisect.bisect_right(ends, m.start()) for m in _OUTSIDE_ALPHABET.finditer(joined)}
    starts = [0, *ends[:-1]]
    return [
        None if i in outside else data[start:end]
        for i, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    name = pre if pre is not None else "default"
    splits = PRE_SPLITS.get(name)
    if splits is None:
        raise UnsupportedModelError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"supported: {', '.join(sorted(PRE_SPLITS))}"
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def build_byte_level(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> tuple[HFTokenizer, list[bytes], bool]:
    pre = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
    merges_raw = metadata.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise UnsupportedModelError("byte-level BPE tokenizer without tokenizer.ggml.merges")
    spelled = _alphabet_bytes(tokens)
    vocab: dict[str, int] = {}
    token_bytes: list[bytes] = []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        raw_spelled = spelled[i]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            # stored as raw text, matched whole and printed as it is (as llama.cpp does)
            raw = text.encode("utf-8")
            key = text
        elif raw_spelled is not None:
            raw = raw_spelled
            key = text
        else:
            # a normal token stored as raw text: spell it in the byte alphabet like the rest
            raw = text.encode("utf-8")
            key = "".join(_BYTE_TO_CHAR[b] for b in raw)
        vocab.setdefault(key, i)
        token_bytes.append(raw)
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise UnsupportedModelError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=False)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre  # type: ignore[assignment]
    backend.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    return backend, token_bytes, False


def build_sentencepiece(
    metadata: Mapping[str, Any],
    tokens: Sequence[str],
    types: Sequence[int],
    merges_store: MergesStore | None = None,
    store_key: Callable[[], str] | None = None,
) -> tuple[HFTokenizer, list[bytes], bool]:
    """llama.cpp's SPM vocabulary: BPE over "▁"-spelled text with byte fallback (<0xXX>).
    Merges the file does not list are derived from the scores, or read from `merges_store`
    (under the key `store_key` gives, else `merges_key` of the vocabulary)."""
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = first_ids(tokens)
    token_bytes, unk_token = _sentencepiece_bytes(tokens, types)
    merges_raw = metadata.get("tokenizer.ggml.merges")
    if merges_raw:
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    else:
        merges = _stored_merges(tokens, types, scores, vocab, merges_store, store_key)
    model = models.BPE(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = HFTokenizer(model)
    add_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if add_space and metadata.get("general.architecture") != "phi3":
        # As transformers' GGUF loader builds Llama 2 / Mistral vocabularies (Metaspace, so
        # that token counts equal its own): "▁" in front of the text's first piece unless it
        # already starts with a space ("  hi" is ▁▁hi; llama.cpp and phi3 say ▁▁▁hi).
        backend.pre_tokenizer = pre_tokenizers.Metaspace(  # type: ignore[assignment]
            replacement="\u2581", prepend_scheme="first", split=False
        )
        return backend, token_bytes, add_space
    norm: list[normalizers.Normalizer] = []
    if add_space:
        norm.append(normalizers.Prepend("\u2581"))
    norm.append(normalizers.Replace(" ", "\u2581"))
    backend.normalizer = normalizers.Sequence(norm)  # type: ignore[assignment]
    return backend, token_bytes, add_space


def first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Each token text's first id (a file may spell a token twice). Built from the last id
    down, so that the first id is the one left: Gemma 3's 262,144 tokens in ~0.06 s, ~0.1 s
    with a `setdefault` a token."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1), strict=True))


def _sentencepiece_bytes(
    tokens: Sequence[str], types: Sequence[int]
) -> tuple[list[bytes], str | None]:
    """Each token's bytes ("▁" is a space; a byte token <0xXX> its byte; an unknown token
    U+FFFD; a control token its text as written) and the first unknown token's text. Normal
    tokens (all but ~7,000 of Gemma 3's 262,144) in one comprehension, the others after."""
    token_bytes = [text.replace("\u2581", " ").encode("utf-8") for text in tokens]
    unk_token: str | None = None
    for i in np.flatnonzero(np.asarray(types) != TOKEN_NORMAL).tolist():
        text, kind = tokens[i], types[i]
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x"):
            token_bytes[i] = bytes([int(text[3:5], 16)])
        elif kind == TOKEN_UNKNOWN:
            unk_token = unk_token or text
            token_bytes[i] = "\N{REPLACEMENT CHARACTER}".encode()
        elif kind == TOKEN_CONTROL:
            token_bytes[i] = text.encode("utf-8")
    return token_bytes, unk_token


def merges_key(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> str:
    """What derived merges depend on: the tokens, their types and scores, and the code that
    derives them (its source: a changed derivation is a new key). 32 hex digits."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(_DERIVATION)
    digest.update(array("q", [len(t) for t in tokens]).tobytes())  # no two vocabularies alike
    digest.update("".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(array("q", types).tobytes())
    digest.update(array("d", scores).tobytes())
    return digest.hexdigest()


def header_merges_key(header: bytes) -> str:
    """What derived merges depend on, for a vocabulary read from a GGUF file: its header's
    bytes (which hold the tokens, their types and scores) and the derivation's code. Hashing
    the header (~0.01 s for Gemma 3's 7 MB) spares `merges_key`'s ~0.04 s of joining and
    packing 262,144 tokens. 32 hex digits."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(_DERIVATION)
    digest.update(b"\0gguf header\0")
    digest.update(header)
    return digest.hexdigest()


def _stored_merges(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float],
    vocab: Mapping[str, int],
    store: MergesStore | None,
    keyed: Callable[[], str] | None = None,
) -> list[tuple[str, str]]:
    """`_merges_from_scores`, through `store` when there is one: its pairs under the key that
    `keyed` gives (else `merges_key`) if it holds this vocabulary's (ids in range, else
    derived again), else derived and handed to it."""
    if store is None:
        return _merges_from_scores(tokens, types, scores, vocab)
    key = keyed() if keyed is not None else merges_key(tokens, types, scores)
    pairs = store.get(key)
    if pairs is not None and _pairs_fit(pairs, len(tokens)):
        # whole columns at once (a list of 513,511 pairs took ~0.5 s through tolist())
        texts = np.asarray(tokens, dtype=object)
        return list(zip(texts[pairs[:, 0]].tolist(), texts[pairs[:, 1]].tolist(), strict=True))
    merges = _merges_from_scores(tokens, types, scores, vocab)
    ids = [(vocab[left], vocab[right]) for left, right in merges]
    store.put(key, np.asarray(ids, dtype=np.int32).reshape(-1, 2))
    return merges


def _pairs_fit(pairs: np.ndarray, vocab_size: int) -> bool:
    """Whether `pairs` is an [N, 2] array of token ids below `vocab_size`."""
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        return False
    return pairs.size == 0 or (int(pairs.min()) >= 0 and int(pairs.max()) < vocab_size)


def _merges_from_scores(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every way to split a normal token into two tokens, best merged score first (llama.cpp
    merges the pair whose joined token scores highest).

    A token of n characters costs ~n^2 (n cuts, each hashing up to n characters): refused
    past MAX_MERGE_DERIVATION_COST in all, before any of the work (ModelFileError).
    """
    cost = sum(len(t) ** 2 for t, k in zip(tokens, types, strict=True) if k == TOKEN_NORMAL)
    if cost > MAX_MERGE_DERIVATION_COST:
        raise ModelFileError(
            f"deriving this vocabulary's merges from its scores would cost {cost} character "
            f"operations (the sum of its tokens' squared lengths; at most "
            f"{MAX_MERGE_DERIVATION_COST}): its tokens are too long"
        )
    found: list[tuple[float, int, str, str]] = []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != TOKEN_NORMAL or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            left = text[:cut]
            if left in vocab and (right := text[cut:]) in vocab:
                found.append((-float(scores[i]), i, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def _derivation() -> bytes:
    """`_merges_from_scores` as merges_key takes it: its source, or where none was installed
    its bytecode and constants."""
    try:
        return inspect.getsource(_merges_from_scores).encode()
    except (OSError, TypeError):
        code = _merges_from_scores.__code__
        return code.co_code + repr(code.co_consts).encode()


# Read once, at import (a test may replace the function afterwards).
_DERIVATION = _derivation()
