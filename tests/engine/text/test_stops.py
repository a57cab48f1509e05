"""Stop strings: exact cuts across pieces, holding back only a possible start."""

from __future__ import annotations

import pytest

from neuron_trio.engine.text.stops import StopMatcher


def run(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = []
    for piece in pieces:
        emit, stopped = m.push(piece)
        out.append(emit)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stops_passes_everything_through() -> None:
    assert run((), ["a", "b"]) == (["a", "b", ""], False)
    assert run(("",), ["a"]) == (["a", ""], False)


def test_cut_before_stop_in_one_piece() -> None:
    assert run(("\n\n",), ["Hello.\n\nMore"]) == (["Hello."], True)
    assert run(("STOP",), ["STOP"]) == ([""], True)


def test_stop_across_pieces_is_held_then_cut() -> None:
    m = StopMatcher(("Observation:",))
    assert m.push("The answer Obs") == ("The answer ", False)  # "Obs" may start the stop
    assert m.push("erv") == ("", False)
    assert m.push("ation: 42") == ("", True)
    assert m.matched == "Observation:"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_held_text_released_when_it_is_not_a_stop() -> None:
    m = StopMatcher(("Observation:",))
    assert m.push("Obs") == ("", False)
    assert m.push("cure") == ("Obscure", False)
    assert m.push(" O") == (" ", False)
    assert m.flush() == "O"  # the end: what was held is text after all


def test_only_a_possible_start_is_held() -> None:
    m = StopMatcher(("abc",))
    assert m.push("xxab") == ("xx", False)
    assert m.push("ab") == ("ab", False)  # "abab": only the last "ab" can still start "abc"
    assert m.push("c!") == ("", True)


def test_earliest_stop_wins_and_overlaps() -> None:
    assert run(("world", "o w"), ["hello world"]) == (["hell"], True)
    assert run(("aab",), ["a", "a", "a", "b"]) == (["", "", "a", ""], True)
    # the longer stop started first, so it is the one that cuts
    assert run(("abcd", "cd"), ["ab", "cd"]) == (["", ""], True)


@pytest.mark.parametrize("split_at", range(1, 12))
def test_any_split_of_the_text_gives_the_same_result(split_at: int) -> None:
    text = "say <END> now"
    pieces = [text[:split_at], text[split_at:]]
    out, stopped = run(("<END>", "<E>"), pieces)
    assert stopped
    assert "".join(out) == "say "


def test_unicode_and_character_pieces() -> None:
    text = "日本語😀テキスト"
    out, stopped = run(("😀テ",), list(text))
    assert stopped and "".join(out) == "日本語"
