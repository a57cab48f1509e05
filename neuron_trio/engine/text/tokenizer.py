"""The tokenizer stored in a GGUF file, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

A GGUF file has no `tokenizer.json`: it holds llama.cpp's description of the tokenizer
(`tokenizer.ggml.*`): the vocabulary, the merges, each token's type, the special token ids and
the name of the pre-tokenizer (`tokenizer.ggml.pre`), which llama.cpp maps to a chain of split
regexes. `Tokenizer.from_metadata` turns that into a fast BPE tokenizer (byte-level for
`tokenizer.ggml.model = "gpt2"`, sentencepiece-style for "llama": `gguf_vocab.py`).

Control tokens (token type 3, e.g. `<|im_start|>`) and user-defined tokens (type 4) are added
tokens: they are matched whole in any text, never cut into pieces.

Decoding does not go through the backend: every token id has its exact bytes (`token_bytes`),
so `decode` and `IncrementalDetokenizer` join bytes and decode UTF-8, which is what the
byte-level decoder does, and lets the incremental decoder hold back half a character.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from neuron_trio.engine.text.chat_literals import in_spans
from neuron_trio.engine.text.collections_paused import collections_paused
from neuron_trio.engine.text.gguf_vocab import (
    SUPPORTED_MODELS,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    MergesStore,
    build_byte_level,
    build_sentencepiece,
    header_merges_key,
)
from neuron_trio.engine.text.native_errors import panics_as_model_file_errors
from neuron_trio.engine.text.token_texts import TokenTexts
from neuron_trio.errors import ModelFileError, ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from neuron_trio.engine.gguf.file import GGUFFile


class Tokenizer:
    """Text to token ids and back, for one model. Build it with `from_gguf` or `from_metadata`.

    Thread-safe for concurrent `encode`/`decode` (the backend is immutable once built).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        tokens: Sequence[str],
        token_bytes: Sequence[bytes],
        special_ids: Iterable[int],
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        strip_leading_space: bool = False,
        byte_level: bool = False,
    ) -> None:
        self.backend = backend
        self._byte_level = byte_level  # GPT-2 byte-level BPE (else sentencepiece-style)
        self.tokens = TokenTexts(tokens)
        self.token_bytes = list(token_bytes)
        self.special_ids = frozenset(special_ids)
        self._bos_id = bos_id
        self._eos_id = eos_id
        self.pad_id = pad_id
        self._add_bos = add_bos
        self.add_eos = add_eos
        self._chat_template = chat_template
        # sentencepiece: the space added in front of the text is dropped again when decoding
        self.strip_leading_space = strip_leading_space

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls, gguf: GGUFFile, *, pre: str | None = None, merges_store: MergesStore | None = None
    ) -> Tokenizer:
        """The tokenizer of a GGUF file already parsed (its metadata is not read again);
        ModelLoadError naming the file if it has none we support.

        `pre` overrides the file's pre-tokenizer name (`tokenizer.ggml.pre`), e.g. "gpt2" to
        split as transformers' GGUF loader does for names it does not know (see from_metadata).
        `merges_store` keeps merges derived from scores between starts (gguf_vocab.MergesStore),
        under a key from the file's header bytes (`header_merges_key`).
        """
        metadata = dict(gguf.metadata)
        if pre is not None:
            metadata["tokenizer.ggml.pre"] = pre

        def key() -> str:  # asked only where merges are derived (not for a byte-level BPE)
            return header_merges_key(gguf.header_bytes())

        try:
            return cls.from_metadata(metadata, merges_store=merges_store, merges_key=key)
        except ModelLoadError as e:
            raise type(e)(f"{gguf.path}: {e}") from None

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        merges_store: MergesStore | None = None,
        merges_key: Callable[[], str] | None = None,
    ) -> Tokenizer:
        """Build from GGUF metadata as plain values (keys as in the file: `tokenizer.ggml.tokens`...).

        The pre-tokenizer follows llama.cpp's meaning of `tokenizer.ggml.pre`, except "smollm",
        which is split as transformers' GGUF loader splits it (plain GPT-2) so that token counts
        equal transformers' for the same file; llama.cpp's digits-first recipe for it (also the
        model's original `tokenizer.json`) is pre="smollm-digits". The two differ only around
        digits: "a  12" is ["a", "Ġ", "Ġ", "1", "2"] by default, ["a", "ĠĠ", "1", "2"] with
        smollm-digits (on 1000 random texts: 923 identical, every difference at a digit).
        `merges_key` gives the key of this vocabulary's merges in `merges_store` (default: a
        digest of its tokens, types and scores, `gguf_vocab.merges_key`).
        """
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise UnsupportedModelError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
        types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise UnsupportedModelError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        if model not in SUPPORTED_MODELS:
            raise UnsupportedModelError(
                f"unsupported tokenizer model tokenizer.ggml.model={model!r}; "
                f"supported: {', '.join(SUPPORTED_MODELS)}"
            )
        # The tokenizers library's edge: a vocabulary it cannot take is the file's fault (a
        # 422), whether it says so with a bare Exception or panics (see native_errors).
        try:
            # the build's hundreds of thousands of tuples are not walked as they are made
            with panics_as_model_file_errors("the tokenizer"), collections_paused():
                return cls._from_checked_metadata(
                    metadata, model, tokens, types, (merges_store, merges_key)
                )
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelFileError(f"the tokenizer cannot be built from this file: {exc}") from None

    @classmethod
    def _from_checked_metadata(
        cls,
        metadata: Mapping[str, Any],
        model: str,
        tokens: list[str],
        types: list[int],
        store: tuple[MergesStore | None, Callable[[], str] | None],
    ) -> Tokenizer:
        if model == "gpt2":
            backend, token_bytes, strip = build_byte_level(metadata, tokens, types)
            add_bos_default = False
        else:
            backend, token_bytes, strip = build_sentencepiece(metadata, tokens, types, *store)
            add_bos_default = True

        special: list[int] = []
        added: list[AddedToken] = []
        # only the few control and user-defined tokens are visited (Gemma 3: 6,414 of 262,144)
        kinds = np.asarray(types)
        for i in np.flatnonzero((kinds == TOKEN_CONTROL) | (kinds == TOKEN_USER_DEFINED)).tolist():
            text, kind = tokens[i], types[i]
            if kind == TOKEN_CONTROL:
                special.append(i)
                added.append(AddedToken(text, special=True, normalized=False))
            elif kind == TOKEN_USER_DEFINED:
                added.append(AddedToken(text, special=False, normalized=False))
        if added:
            backend.add_special_tokens([t for t in added if t.special])
            backend.add_tokens([t for t in added if not t.special])
        # Fewer entries is fine (a token spelled twice: encoding uses its first id). More would
        # mean an added token got an id past the model's vocabulary.
        if backend.get_vocab_size(with_added_tokens=True) > len(tokens):
            raise UnsupportedModelError(
                f"tokenizer vocabulary of {len(tokens)} tokens rebuilt with "
                f"{backend.get_vocab_size(with_added_tokens=True)} entries"
            )

        def opt_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is None:
                return None
            value = int(value)
            return value if 0 <= value < len(tokens) else None

        return cls(
            backend,
            tokens=tokens,
            token_bytes=token_bytes,
            special_ids=special,
            bos_id=opt_id("tokenizer.ggml.bos_token_id"),
            eos_id=opt_id("tokenizer.ggml.eos_token_id"),
            pad_id=opt_id("tokenizer.ggml.padding_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            strip_leading_space=strip,
            byte_level=model == "gpt2",
        )

    # ---- properties ---------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` puts BOS in front (the file says)."""
        return self._add_bos and self._bos_id is not None

    def token_to_id(self, text: str) -> int | None:
        """The id of the token spelled `text` in the vocabulary (e.g. "<|im_end|>"), or None."""
        return self.tokens.id_of(text)

    # ---- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are
        recognised as such; `add_special_tokens` adds BOS (and EOS) where the file asks for it."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                assert self._bos_id is not None
                ids = [self._bos_id, *ids]
            if self.add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def encode_chat(self, text: str, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
        """Token ids of a rendered chat: as `encode` (no BOS/EOS added), except that a special
        token matched inside one of `literal_spans` (sorted character ranges that came from
        client text, `chat_literals.ChatPrompt`) is tokenized as ordinary text."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for token_id, (start, _) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self.special_ids:
                inside, at = in_spans(start, literal_spans, at)
                if inside:
                    ids.extend(self.plain_ids(self.tokens[token_id]))
                    continue
            ids.append(token_id)
        return ids

    def plain_ids(self, text: str) -> list[int]:
        """`text` as ordinary text, special tokens never matched (as in the middle of a
        prompt: no sentencepiece prefix space)."""
        if self._byte_level:
            pre = self.backend.pre_tokenizer
            assert pre is not None
            pieces = [piece for piece, _ in pre.pre_tokenize_str(text)]
        else:
            pieces = [text.replace(" ", "\u2581")]
        return [token.id for piece in pieces for token in self.backend.model.tokenize(piece)]

    def ids_to_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> bytes:
        special = self.special_ids if skip_special_tokens else frozenset()
        tb = self.token_bytes
        n = len(tb)
        return b"".join(tb[i] for i in ids if i not in special and 0 <= i < n)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        text = self.ids_to_bytes(ids, skip_special_tokens=skip_special_tokens).decode(
            "utf-8", errors="replace"
        )
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs; a token that is not valid UTF-8 on its own is shown as
        OpenAI does, e.g. "bytes:\\xe2\\x80"."""
        if not 0 <= token_id < len(self.token_bytes):
            return ""  # a padded row of the model's output, past the vocabulary
        raw = self.token_bytes[token_id]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def __repr__(self) -> str:
        return f"<Tokenizer vocab={self.vocab_size} bos={self._bos_id} eos={self._eos_id}>"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, a piece at a time.

    `push` returns only new, complete text: a UTF-8 character split over several byte-level or
    byte-fallback tokens comes out whole, with the token that completes it. Special tokens
    (EOS, `<|im_end|>`...) produce no text unless `skip_special_tokens=False`. `flush` returns
    what is left at the end (an incomplete character becomes U+FFFD).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        show_special: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # `show_special`: specials shown even so (a tool-call marker such as [TOOL_CALLS])
        self._skip = (
            tokenizer.special_ids - frozenset(show_special) if skip_special_tokens else frozenset()
        )
        # sentencepiece drops the space it put in front of the text, only at its very start
        self._strip_pending = tokenizer.strip_leading_space and not prompt_ids

    def push(self, token_id: int) -> str:
        token_bytes = self._tokenizer.token_bytes
        if token_id in self._skip or not 0 <= token_id < len(token_bytes):
            return ""
        out = self._decoder.decode(token_bytes[token_id])
        return self._emit(out)

    def flush(self) -> str:
        return self._emit(self._decoder.decode(b"", final=True))

    def _emit(self, out: str) -> str:
        if self._strip_pending and out:
            self._strip_pending = False
            if out.startswith(" "):
                out = out[1:]
        return out
