"""A thinking model's `<think>…</think>` split from its answer as the text streams."""

from __future__ import annotations

import pytest

from neuron_trio.engine.text.reasoning import (
    ReasoningSplitter,
    prompt_opens_thinking,
    thinks_in_tags,
)


def _split(pieces: list[str], *, inside: bool = False) -> tuple[list[str], list[str]]:
    splitter = ReasoningSplitter(inside=inside)
    reasoning, content = [], []
    for i, piece in enumerate(pieces):
        r, c = splitter.push(piece, final=i == len(pieces) - 1)
        reasoning.append(r)
        content.append(c)
    return reasoning, content


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_thinking_and_answer_are_apart_however_the_text_is_cut(size: int) -> None:
    text = "\n<think>\nLet me think: a < b.\n</think>\n\nThe answer is 4."
    pieces = [text[i : i + size] for i in range(0, len(text), size)] + [""]
    reasoning, content = _split(pieces)
    assert "".join(reasoning) == "Let me think: a < b."
    assert "".join(content) == "The answer is 4."
    assert not any("</" in r or "<t" in r for r in reasoning)  # never half a tag


def test_a_prompt_that_opens_the_thinking_starts_inside_it() -> None:
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reasoning, content = _split(["Hmm.", "</think>", "Hi."], inside=True)
    assert ("".join(reasoning), "".join(content)) == ("Hmm.", "Hi.")


def test_an_answer_without_thinking_is_all_content() -> None:
    reasoning, content = _split(["  Hello <th", "ere>", ""])
    assert ("".join(reasoning), "".join(content)) == ("", "  Hello <there>")
    # thinking cut off by max_tokens stays reasoning
    reasoning, content = _split(["<think>I was", " thinking"])
    assert ("".join(reasoning), "".join(content)) == ("I was thinking", "")


def test_templates_that_think_in_tags() -> None:
    assert thinks_in_tags("{{ '<think>\\n\\n</think>\\n\\n' }}")
    assert not thinks_in_tags("{{ messages }}") and not thinks_in_tags(None)
