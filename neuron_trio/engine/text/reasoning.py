"""Reasoning: a thinking model's `<think>…</think>` kept apart from its answer.

Models whose chat template thinks in `<think>` tags (Qwen3, the DeepSeek-R1 distills:
`thinks_in_tags` reads the template's source) write their thinking first, then the answer.
Clients expect the thinking in `reasoning_content` (vLLM's and llama.cpp's field) and only
the answer in `content`, so `ReasoningSplitter` splits one sequence's streamed text in two.
A template may open the thinking itself (DeepSeek-R1's ends its prompt with `<think>\\n`):
`prompt_opens_thinking` says so, and the output then starts inside the thinking. A Qwen3
template asked not to think (`enable_thinking: false`) ends its prompt with an empty
`<think>\\n\\n</think>`: the output then starts in the answer.

The split happens before tool calls are read (`tool_call_parser`), so a call written after
the thinking is parsed from the answer, and one mentioned in the thinking is not a call.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReasoningSplitter", "prompt_opens_thinking", "think_tag_ids", "thinks_in_tags"]

OPEN, CLOSE = "<think>", "</think>"


def thinks_in_tags(template_source: str | None) -> bool:
    """Whether a chat template's model thinks in `<think>` tags."""
    return template_source is not None and CLOSE in template_source


def think_tag_ids(tokenizer: Any) -> tuple[int, ...]:
    """The think tags that the vocabulary holds as special tokens (a GGUF may mark them
    control tokens): shown as text, so that the splitter sees them."""
    ids = (tokenizer.token_to_id(tag) for tag in (OPEN, CLOSE))
    return tuple(i for i in ids if i is not None and i in tokenizer.special_ids)


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters) leaves the model inside `<think>`."""
    return prompt_tail.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Splits one sequence's text into reasoning and answer, as it streams.

    `push(text)` returns (reasoning, content) that are safe to show: the start of a tag is
    held back until it is known. The output is in its answer (`answering`) once `</think>`
    has passed, or at once when it does not open with `<think>` (a model that chose not to
    think). Whitespace between the thinking and the answer goes to neither.
    """

    def __init__(self, *, inside: bool) -> None:
        # "start": no text yet (a `<think>` may open it); "thinking"; "answer"
        self._state = "thinking" if inside else "start"
        self._pending = ""
        self._trim = inside  # the whitespace after `<think>` is not reasoning

    @property
    def answering(self) -> bool:
        return self._state == "answer"

    def push(self, text: str, *, final: bool) -> tuple[str, str]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._state == "start":
                lead = self._pending.lstrip()
                if lead.startswith(OPEN):
                    self._state, self._trim = "thinking", True
                    self._pending = lead[len(OPEN) :]
                    continue
                if not final and OPEN.startswith(lead):
                    break  # whitespace, or maybe the start of `<think>`
                self._state = "answer"
            if self._trim:  # the whitespace that opens the thinking, or the answer after it
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._trim = False
            if self._state == "answer":
                content.append(self._pending)
                self._pending = ""
                break
            at = self._pending.find(CLOSE)
            if at >= 0:
                reasoning.append(self._pending[:at].rstrip())
                self._pending = self._pending[at + len(CLOSE) :]
                self._state, self._trim = "answer", True
                continue
            keep = len(self._pending) if final else _held(self._pending)
            reasoning.append(self._pending[:keep])
            self._pending = self._pending[keep:]
            break
        if final and self._pending:  # an unfinished tag at the end is text
            (content if self._state == "answer" else reasoning).append(self._pending)
            self._pending = ""
        return "".join(reasoning), "".join(content)


def _held(text: str) -> int:
    """Where thinking text stops being safe to show: before a suffix that may begin
    `</think>`, and before the whitespace ahead of it (which may end the thinking)."""
    for k in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if text.endswith(CLOSE[:k]):
            return len(text[:-k].rstrip())
    return len(text.rstrip())
