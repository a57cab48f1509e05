"""A vocabulary of single characters, a few multi-character tokens and two specials, its
tokenizer, and a GrammarCompiler over it (`char_compiler`), for the grammar and schema tests;
`allowed_ids` reads the token ids a grammar state allows; `PERSON` is a JSON schema with bounded
strings, integers and arrays."""

from __future__ import annotations

import json

import torch

from neuron_trio.engine.text.structured.grammar import (
    GrammarCompiler,
    allowed_tokens,
    detect_tool_format,
    fill_masks,
)

# A vocabulary of single characters, a few multi-character tokens, and specials.
SPECIALS = ["<eos>", "<|im_end|>"]
CHARS = list('{}[]":, -.0123456789abcdefghijklmnopqrstuvwxyz_<>/\n')
MULTI = ['{"', '":', '","', "true", "false", "null", "name", "<tool_call>", "</tool_call>"]
VOCAB = SPECIALS + CHARS + MULTI
EOS, IM_END = 0, 1
V = len(VOCAB) + 5  # the model's logits are wider than the vocabulary (padding rows)


class CharTokenizer:
    def __init__(self) -> None:
        self.token_bytes = [t.encode() for t in VOCAB]
        self.special_ids = frozenset({EOS, IM_END})
        self.eos_id: int | None = EOS
        self.bos_id: int | None = None

    def token_to_id(self, text: str) -> int | None:
        return VOCAB.index(text) if text in VOCAB else None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [VOCAB.index(c) for c in text]


def char_compiler() -> GrammarCompiler:
    tok = CharTokenizer()
    return GrammarCompiler(
        tok, stop_ids=[EOS, IM_END], vocab_size=V, tool_format=detect_tool_format(tok, None)
    )


def allowed_ids(state, vocab: int = V) -> set[int]:
    mask = fill_masks([state], vocab)
    assert mask is not None
    return set(
        torch.nonzero(allowed_tokens(mask, vocab, torch.device("cpu"))[0]).flatten().tolist()
    )


PERSON = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
)
