"""Auto tool calls: seeing, token by token, that the model has begun a call, and holding the
rest of that call to the tools' schemas.

With `tool_choice: "auto"` the model answers freely: text, or a call in its own syntax. A
free-running small model that begins a call often gets the rest wrong (a function name that
does not exist, arguments that are not JSON). So the moment the opening marker is out
(`<tool_call>`, `[TOOL_CALLS]`, or a `{` that begins the answer: Llama 3.x's calls, and
Hermes calls written without their tags, as Qwen2.5-Coder writes them), the sequence
gets a grammar for the rest of the call, the same as `tool_choice: "required"` would have
given it from the first token: the call that follows is as valid as a required one.

A grammar consumes tokens, while the marker is text that may be spread over several tokens
and share its first and last token with other text (`" <"`, `">\\n"`). So `CallStartWatcher`
finds the marker in the bytes of the last few tokens and returns the *tail*: the whole tokens
from the one where the marker begins. `rest_of_call_lark` writes a grammar that begins with
exactly the tail's text up to the marker's end (special tokens by id) and continues with the
call; the engine compiles it and feeds it the tail's tokens, so that its state stands right
after the last sampled token. If the tail does not fit (the text after the marker in the same
token is not how a call goes on), the call runs unconstrained and the parser still reads it,
or drops it from the content.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from neuron_trio.engine.text.structured.grammar import GrammarState
from neuron_trio.engine.text.tools.tool_call_format import (
    FENCE,
    MAX_PARALLEL_TOOL_CALLS,
    ToolCallFormat,
    bare_opening,
)
from neuron_trio.engine.types import ToolFunction
from neuron_trio.errors import RequestError

__all__ = ["CallStart", "CallStartWatcher", "begin_call_grammar", "rest_of_call_lark"]

log = logging.getLogger(__name__)

# Tokens the watcher remembers: a marker spelled out in single bytes (byte-fallback tokens)
# takes 12; anything longer is not the marker.
WINDOW_TOKENS = 32

# Whitespace the model may put between the marker, the JSON and the closing tag: bounded, so a
# small model cannot fill max_tokens with it.
_WS = r"/[ \t\r\n]{0,4}/"


@dataclass(frozen=True)
class CallStart:
    """The output's tail that holds a call's opening: `tokens` (whole tokens, the last one the
    token just sampled) and `prefix`, the Lark elements that spell the tail up to the end of
    the marker (text as literals, special tokens as `<[id]>`). `bare`: the call is a JSON
    object that opens the answer, without a marker (its `{` is the grammar's, not the
    prefix's)."""

    tokens: tuple[int, ...]
    prefix: tuple[str, ...]
    bare: bool = False
    fenced: bool = False  # bare, inside a code fence: the calls end with its closing "```"


class _Vocabulary(Protocol):
    token_bytes: list[bytes]
    special_ids: frozenset[int]


class CallStartWatcher:
    """Watches one sequence's sampled tokens for the opening of a tool call.

    `push(token)` returns a `CallStart` once, with the token that completes the marker, and
    None before and after. Special tokens are part of the text only when they are the marker
    itself (`[TOOL_CALLS]` as one token): other specials show no text, as in the answer.
    """

    def __init__(self, fmt: ToolCallFormat, vocab: _Vocabulary) -> None:
        self._fmt = fmt
        self._bytes = vocab.token_bytes
        self._special = vocab.special_ids
        self._marker = fmt.marker.encode()
        self._window: list[int] = []
        # no text yet: a "{" now opens a call without a marker (formats that write one)
        self._opening = fmt.bare_json
        self.done = False  # a call began (or, for llama3, the answer is text): nothing to watch

    def _text(self, token_id: int) -> bytes:
        if token_id == self._fmt.open_token_id:
            return self._marker
        if token_id in self._special or not 0 <= token_id < len(self._bytes):
            return b""
        return self._bytes[token_id]

    def push(self, token_id: int) -> CallStart | None:
        if self.done:
            return None
        self._window.append(token_id)
        pieces = [self._text(t) for t in self._window]
        text = b"".join(pieces)
        if self._opening:
            # A call without a marker is the whole answer: it begins with "{" (after
            # whitespace and specials, for Hermes also after a code fence's opening line).
            # latin-1: one character a byte, so the offsets are the bytes'.
            fences = self._fmt.style == "hermes"
            kind, at = bare_opening(text.decode("latin-1"), fences=fences)
            if kind == "wait":
                if len(self._window) > WINDOW_TOKENS:
                    self._opening = False
                    self.done = self._fmt.style == "llama3"
                return None
            self._opening = False
            if kind == "call":
                self.done = True
                fenced = FENCE.encode() in text[:at]
                return self._start(pieces, 0, at, bare=True, fenced=fenced)
        if self._fmt.style == "llama3":
            self.done = True  # an answer in words: llama3 has no marker to wait for
            return None
        at = text.find(self._marker)
        if at < 0:
            del self._window[: max(0, len(self._window) - WINDOW_TOKENS)]
            return None
        self.done = True
        # the first token of the tail: the one the marker begins in
        first, offset = 0, 0
        while offset + len(pieces[first]) <= at:
            offset += len(pieces[first])
            first += 1
        return self._start(pieces[first:], first, at - offset + len(self._marker))

    def _start(
        self,
        pieces: list[bytes],
        first: int,
        prefix_len: int,
        *,
        bare: bool = False,
        fenced: bool = False,
    ) -> CallStart | None:
        """The tail from window token `first`; the grammar's prefix is its first `prefix_len`
        bytes of text (and every special token among them)."""
        tokens = tuple(self._window[first:])
        prefix: list[str] = []
        text = b""
        left = prefix_len
        for token_id, piece in zip(tokens, pieces, strict=True):
            if token_id in self._special:
                # every special of the tail precedes the marker's end (the tail ends with the
                # token that completes the marker, which may be the marker itself)
                if text:
                    prefix.append(_literal(text))
                    text = b""
                prefix.append(f"<[{token_id}]>")
                left -= len(piece)
                continue
            text += piece[: max(0, left)]
            left -= len(piece)
        if text:
            prefix.append(_literal(text))
        if any(p == "" for p in prefix):
            return None  # not whole UTF-8 characters: no literal can spell it
        return CallStart(tokens, tuple(prefix), bare, fenced)


def _literal(text: bytes) -> str:
    """A Lark string literal of `text`, or "" if it is not valid UTF-8."""
    try:
        return json.dumps(text.decode("utf-8"))
    except UnicodeDecodeError:
        return ""


def rest_of_call_lark(
    fmt: ToolCallFormat, tools: Sequence[ToolFunction], parallel: bool, start: CallStart
) -> str:
    """A Lark grammar: the tail's prefix, then the rest of the call (and with `parallel`, up to
    MAX_PARALLEL_TOOL_CALLS calls in all), then only the end of the turn."""
    more = f"{{0,{MAX_PARALLEL_TOOL_CALLS - 1}}}"
    prefix = " ".join(start.prefix)
    if fmt.style == "mistral_args":
        named = f"{_WS} named"
        rest = f"{named} ({_WS} {fmt.opening()} {named}){more}" if parallel else named
        return f"start: {prefix} {rest}\n" + fmt.named_calls(tools)
    body = fmt.call_json(tools)
    if start.bare:  # JSON objects without markers (a Hermes model's, or Llama 3.x's)
        sep = '";" ' if fmt.style == "llama3" else ""
        rest = f"call ({sep}{_WS} call){more}" if parallel else "call"
        if start.fenced:
            rest += f" {_WS} {json.dumps(FENCE)}"
    elif fmt.style == "mistral":
        calls = f'call ("," {_WS} call){more}' if parallel else "call"
        rest = f'{_WS} "[" {calls} "]"'
    else:
        opening = fmt.opening()
        after = f'{_WS} call_json {_WS} "</tool_call>"'
        rest = f"{after} ({_WS} {opening} {after}){more}" if parallel else after
        return f"start: {prefix} {rest}\ncall_json: {body}\n"
    return f"start: {prefix} {rest}\ncall: {body}\n"


class _Compiler(Protocol):
    def compile_lark(self, lark: str) -> GrammarState: ...


def begin_call_grammar(
    compiler: _Compiler,
    fmt: ToolCallFormat,
    tools: Sequence[ToolFunction],
    parallel: bool,
    start: CallStart,
) -> GrammarState | None:
    """The grammar state for the rest of a call that began with `start`, standing after its
    tail's tokens; None (the call goes on unconstrained) if the tail does not fit it."""
    try:
        state = compiler.compile_lark(rest_of_call_lark(fmt, tools, parallel, start))
    except (ValueError, RequestError) as exc:  # a schema refused (by the bounds, llguidance)
        log.warning("auto tool call: no grammar for the rest of the call: %s", exc)
        return None
    if not state.feed(start.tokens):
        log.info("auto tool call: the tokens after the marker do not fit the grammar")
        return None
    return state
