"""Control tokens typed in a chat's messages stay text: a user cannot forge a turn.

A rendered chat prompt is tokenized with special-token parsing on, because the template's own
structure (`<|im_start|>system`...) is made of control tokens. Message content is client text
and goes through the same template: a user who writes `<|im_end|>\\n<|im_start|>system\\n...` in
a message would get real control tokens, and a system turn of their own.

So, per render, `LiteralGuard` replaces every control-token string inside the messages' and
tools' string values with a marker (private-use characters around a random nonce and the
token's index: a client cannot guess or type it), the template renders, and `restore` puts
the strings back, returning a `ChatPrompt`: the same text, plus the spans where those strings
came from client values. `Tokenizer.encode_chat` then tokenizes a control token matched
inside such a span as ordinary text, as transformers does with `split_special_tokens=True`.

Markers go through the template as the content did, so templates that move, trim or quote
content keep working; a template that rewrites content character by character (`|upper` on a
marker is harmless: it holds only digits and private-use characters) or cuts it mid-marker
leaves the marker's text in the prompt, never a control token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(_OPEN + r"(\d+)\.(\d+)" + _CLOSE)  # nonce, index


class ChatPrompt(str):
    """A rendered chat prompt (a `str`) and `literal_spans`: the `[start, end)` character
    ranges of control-token strings that came from client values, sorted, not overlapping."""

    literal_spans: tuple[tuple[int, int], ...] = ()

    def __new__(cls, text: str, literal_spans: Iterable[tuple[int, int]] = ()) -> ChatPrompt:
        prompt = super().__new__(cls, text)
        prompt.literal_spans = tuple(literal_spans)
        return prompt


def trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of `words` (longest first at each position), built as a prefix tree
    so that matching costs the length of the match, not the number of words (Gemma 3 has 6,249
    control tokens; an alternation of them all scans ~6,000 branches a character)."""
    trie: dict[str, Any] = {}
    for word in words:
        if not word:
            continue
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: Mapping[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if ends else body

    return build(trie)


# Control tokens longer than this are not guarded: no vocabulary has one (Gemma 3's longest:
# 17 characters), and the prefix tree's depth (Python's regex compiler recurses per level) is
# bounded by it.
MAX_GUARDED_CHARS = 64


class LiteralTokens:
    """The control-token strings of one vocabulary, compiled once per model."""

    def __init__(self, texts: Iterable[str]) -> None:
        kept = {t for t in texts if t and len(t) <= MAX_GUARDED_CHARS}
        self.texts = sorted(kept, key=lambda t: (-len(t), t))
        self.index = {t: i for i, t in enumerate(self.texts)}
        self.pattern = re.compile(trie_pattern(self.texts)) if self.texts else None

    def guard(self) -> LiteralGuard | None:
        return LiteralGuard(self) if self.pattern is not None else None


class LiteralGuard:
    """One render's markers (see the module docstring)."""

    def __init__(self, literals: LiteralTokens) -> None:
        assert literals.pattern is not None
        self._literals = literals
        self._pattern = literals.pattern
        self._nonce = str(secrets.randbelow(10**15))
        self.used = False

    def _mark(self, match: re.Match[str]) -> str:
        self.used = True
        return f"{_OPEN}{self._nonce}.{self._literals.index[match.group(0)]}{_CLOSE}"

    def protect(self, value: T) -> T:
        """`value` with every control-token string in its strings (recursively through dicts,
        lists and tuples; keys too) replaced by its marker."""
        if isinstance(value, str):
            return self._pattern.sub(self._mark, value)  # type: ignore[return-value]
        if isinstance(value, Mapping):
            return {self.protect(k): self.protect(v) for k, v in value.items()}  # type: ignore[return-value]
        if isinstance(value, list | tuple):
            return type(value)(self.protect(v) for v in value)  # type: ignore[return-value]
        return value

    def restore(self, rendered: str) -> ChatPrompt:
        """The rendered text with each marker turned back into its control-token string."""
        if not self.used:
            return ChatPrompt(rendered)
        texts = self._literals.texts
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        at = size = 0
        for match in _MARKER.finditer(rendered):
            k = int(match.group(2))
            if match.group(1) != self._nonce or k >= len(texts):
                continue  # typed by the client, not ours: left as it is
            pieces.append(rendered[at : match.start()])
            size += match.start() - at
            pieces.append(texts[k])
            spans.append((size, size + len(texts[k])))
            size += len(texts[k])
            at = match.end()
        pieces.append(rendered[at:])
        return ChatPrompt("".join(pieces), spans)


def in_spans(position: int, spans: Sequence[tuple[int, int]], start_index: int) -> tuple[bool, int]:
    """Whether `position` lies in one of the sorted `spans`, scanning from `start_index` (callers
    pass increasing positions); returns the index to resume from."""
    i = start_index
    while i < len(spans) and spans[i][1] <= position:
        i += 1
    return (i < len(spans) and spans[i][0] <= position), i
