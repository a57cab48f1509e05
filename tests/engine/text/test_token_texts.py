"""TokenTexts: the texts by id, and the first id of a text (duplicates, collisions, misses)."""

from __future__ import annotations

import pickle

import pytest

from neuron_trio.engine.text import token_texts
from neuron_trio.engine.text.token_texts import TokenTexts

TEXTS = ["<s>", "\u2581hello", "wor", "", "\u2581hello", "🙂x", "<0xC3>", "wor"]


def test_texts_by_id() -> None:
    texts = TokenTexts(TEXTS)
    assert len(texts) == len(TEXTS)
    assert [texts[i] for i in range(len(TEXTS))] == TEXTS
    assert list(texts) == TEXTS
    assert texts[-1] == "wor" and texts[1:3] == ["\u2581hello", "wor"]
    with pytest.raises(IndexError):
        texts[len(TEXTS)]


def test_the_first_id_of_a_text() -> None:
    texts = TokenTexts(TEXTS)
    assert texts.id_of("\u2581hello") == 1  # spelled again at 4
    assert texts.id_of("wor") == 2  # and at 7
    assert texts.id_of("") == 3
    assert texts.id_of("🙂x") == 5
    assert texts.id_of("hello") is None


def test_equal_hashes_are_told_apart_by_the_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_texts, "_hash", lambda text: 7)  # every text collides
    texts = TokenTexts(TEXTS)
    assert [texts.id_of(t) for t in ("<s>", "wor", "<0xC3>", "🙂x")] == [0, 2, 6, 5]
    assert texts.id_of("nope") is None


def test_a_pickled_copy_hashes_afresh() -> None:
    copy = pickle.loads(pickle.dumps(TokenTexts(TEXTS)))
    assert list(copy) == TEXTS and copy.id_of("<0xC3>") == 6


def test_the_first_id_among_many_equal_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    # enough entries for an unstable sort to shuffle equal keys: ids are put back in order
    texts = [f"t{i % 50}" for i in range(5000)]
    plain = TokenTexts(texts)
    assert [plain.id_of(f"t{i}") for i in range(50)] == list(range(50))
    monkeypatch.setattr(token_texts, "_hash", lambda text: len(text))  # runs of 10 and 40
    colliding = TokenTexts(texts)
    assert [colliding.id_of(f"t{i}") for i in range(50)] == list(range(50))
