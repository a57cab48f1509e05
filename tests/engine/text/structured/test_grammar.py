"""Constrained decoding: grammar masks over a small character vocabulary, and the sampler."""

from __future__ import annotations

import json

import pytest
import torch

from neuron_trio.engine.sampling import Sampler, SamplingState
from neuron_trio.engine.text.structured.grammar import (
    MAX_PARALLEL_TOOL_CALLS,
    ToolCallFormat,
    allowed_tokens,
    apply_masks,
    detect_tool_format,
    fill_masks,
)
from neuron_trio.engine.types import Constraint, SamplingParams, ToolFunction
from neuron_trio.errors import RequestError
from tests.engine.text.char_vocab import (
    EOS,
    IM_END,
    PERSON,
    VOCAB,
    CharTokenizer,
    V,
    allowed_ids,
    char_compiler,
)


def test_unpacking_matches_bit_arithmetic() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 10), dtype=torch.int32, generator=gen)
    got = allowed_tokens(words, 300, torch.device("cpu"))
    want = torch.tensor(
        [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(300)] for r in range(3)]
    )
    assert torch.equal(got, want)


def test_masks_apply_alike_through_numpy_and_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(2, 100, generator=gen)
    via_numpy = apply_masks(logits, words)  # float32 on the CPU
    via_torch = apply_masks(logits.double(), words).float()  # the device path
    assert torch.equal(via_numpy, via_torch)
    allowed = allowed_tokens(words, 100, torch.device("cpu"))
    assert torch.equal(via_numpy[allowed], logits[allowed])
    assert bool((via_numpy[~allowed] == float("-inf")).all())


def test_free_rows_need_no_mask_and_stay_all_ones() -> None:
    assert fill_masks([None, None], V) is None
    state = char_compiler().compile(Constraint("json", schema=PERSON))
    mask = fill_masks([None, state], V)
    assert mask is not None
    allowed = allowed_tokens(mask, V, torch.device("cpu"))
    assert bool(allowed[0].all())
    assert set(torch.nonzero(allowed[1]).flatten().tolist()) <= {
        VOCAB.index("{"),
        VOCAB.index('{"'),
    }


def test_mask_follows_the_schema_and_ends_with_a_stop_token() -> None:
    state = char_compiler().compile(Constraint("json", schema=PERSON))
    text = '{"name":"ab","age":7,"tags":["a"]}'
    for ch in text:
        token = VOCAB.index(ch)
        assert token in allowed_ids(state), (ch, text)
        state.accept(token)
    assert allowed_ids(state) <= {EOS, IM_END}
    assert VOCAB.index(" ") not in allowed_ids(state)


def test_random_sampling_under_the_mask_always_validates() -> None:
    """Temperature 1 over random logits: whatever is drawn, the text is valid for the schema."""
    compiler = char_compiler()
    sampler = Sampler()
    for seed in range(12):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200)
        state = SamplingState(params)
        state.grammar = compiler.compile(Constraint("json", schema=PERSON))
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(200):
            logits = torch.randn(1, V, generator=gen) * 3
            mask = fill_masks([state.grammar], V)
            assert mask is not None
            token = sampler.sample(apply_masks(logits, mask), [state], logits)[0]
            out.append(token.token_id)
            if token.token_id in (EOS, IM_END) or state.grammar.finished:
                break
        text = "".join(VOCAB[t] for t in out if t not in (EOS, IM_END))
        doc = json.loads(text)
        assert set(doc) == {"name", "age", "tags"}, text
        assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 150
        assert len(doc["name"]) <= 6 and set(doc["tags"]) <= {"a", "b"}


def test_masked_greedy_picks_the_best_allowed_token_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(2, V)
    logits[:, VOCAB.index("a")] = 10.0  # the model's favourite, not allowed in row 0
    logits[:, VOCAB.index("{")] = 1.0
    state = char_compiler().compile(Constraint("json", schema=PERSON))
    rows = [
        SamplingState(SamplingParams(temperature=0.0, logprobs=True)),
        SamplingState(SamplingParams(temperature=0.0)),
    ]
    rows[0].grammar = state
    mask = fill_masks([state, None], V)
    assert mask is not None
    results = Sampler().sample(apply_masks(logits, mask), rows, logits)
    assert results[0].token_id == VOCAB.index("{")
    assert results[1].token_id == VOCAB.index("a")  # the free row is untouched
    raw = torch.log_softmax(logits[0], dim=-1)[VOCAB.index("{")].item()
    assert results[0].logprob is not None
    assert results[0].logprob.logprob == pytest.approx(raw)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ('{"type":"frobnicate"}', "frobnicate"),
        ('{"type":"object","if":{},"then":{}}', "if"),
        ('{"type":"string","format":"telepathy"}', "telepathy"),
        ('{"$ref":"#/$defs/missing"}', "missing"),
        ("[1, 2]", "schema"),
    ],
)
def test_bad_or_unenforceable_schemas_are_400s_naming_the_problem(schema: str, words: str) -> None:
    with pytest.raises(RequestError) as err:
        char_compiler().compile(Constraint("json", schema=schema))
    assert err.value.param == "response_format"
    assert words in err.value.message
    assert err.value.status == 400 and err.value.code == "invalid_schema"


def test_compiled_grammars_are_cached_by_constraint() -> None:
    compiler = char_compiler()
    constraint = Constraint("json", schema=PERSON)
    first = compiler.compile(constraint)
    second = compiler.compile(Constraint("json", schema=PERSON))
    assert len(compiler.cache) == 1
    first.accept(VOCAB.index("{"))  # the copies are independent
    assert VOCAB.index("{") in allowed_ids(second)


WEATHER = ToolFunction(
    "get_weather",
    "",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)


def test_a_tool_call_grammar_forces_the_hermes_wrapper_and_the_arguments() -> None:
    state = char_compiler().compile(Constraint("tool_call", tools=(WEATHER,)))
    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"rome"}}\n</tool_call>'
    i = 0
    while i < len(text):
        # the multi-character tokens are allowed where they fit; walk by single characters
        token = VOCAB.index(text[i])
        assert token in allowed_ids(state), (text[: i + 1],)
        state.accept(token)
        i += 1
    assert allowed_ids(state) <= {EOS, IM_END}


def test_parallel_calls_stop_at_the_bound() -> None:
    state = char_compiler().compile(Constraint("tool_call", tools=(WEATHER,), parallel=True))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"rome"}}\n</tool_call>'
    text = "\n".join([call] * MAX_PARALLEL_TOOL_CALLS)
    for i, ch in enumerate(text):
        assert VOCAB.index(ch) in allowed_ids(state), (i, text[: i + 1])
        state.accept(VOCAB.index(ch))
        if text[: i + 1].endswith("</tool_call>") and i + 1 < len(text):
            assert VOCAB.index("\n") in allowed_ids(state)  # another call may follow
    # after the last call allowed, only the end of the turn
    assert allowed_ids(state) <= {EOS, IM_END}


def test_llama3_calls_are_bare_json_with_parameters() -> None:
    fmt = ToolCallFormat("llama3")
    lark = fmt.lark([WEATHER], parallel=False)
    assert "<tool_call>" not in lark and '"parameters"' in lark


def test_a_refused_token_leaves_the_state_in_error_and_the_row_unmasked() -> None:
    state = char_compiler().compile(Constraint("json", schema=PERSON))
    state.accept(VOCAB.index("x"))  # not JSON: the matcher gives up
    assert state.error
    mask = fill_masks([state], V)
    assert mask is not None and bool(allowed_tokens(mask, V, torch.device("cpu")).all())


def test_tool_format_follows_the_template() -> None:
    tok = CharTokenizer()
    assert detect_tool_format(tok, "{{ '<|python_tag|>' }}<|eot_id|>").style == "llama3"
    hermes = detect_tool_format(tok, "{% if tools %}<tool_call>{% endif %}")
    assert hermes.style == "hermes" and hermes.open_token_id is None  # not a special token here
    tok.special_ids = tok.special_ids | {VOCAB.index("<tool_call>")}
    assert detect_tool_format(tok, None).open_token_id == VOCAB.index("<tool_call>")
