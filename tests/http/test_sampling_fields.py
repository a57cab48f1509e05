"""A request's sampling fields reach the engine's SamplingParams by name: a plain parameter
given in the body arrives as given, one left out keeps the engine's default."""

from __future__ import annotations

import dataclasses
import json

from neuron_trio.http.openai import requests as chat_requests
from neuron_trio.http.openai.requests import parse_chat_request
from neuron_trio.service.api import SamplingParams

# One legal, non-default value for every plain parameter the HTTP layer passes on by name.
GIVEN = {
    "temperature": 0.25,
    "top_p": 0.5,
    "min_p": 0.125,
    "repetition_penalty": 1.5,
    "presence_penalty": -0.5,
    "frequency_penalty": 0.75,
    "seed": 7,
}


def _params(**fields: object) -> SamplingParams:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode()).job.params


def test_every_same_named_field_is_covered_here() -> None:
    # A field added to both structs is passed on by _sampling; this table must name it too.
    assert set(chat_requests._SAME_NAMED) == set(GIVEN)


def test_given_values_arrive_as_given() -> None:
    params = _params(**GIVEN)
    for name, value in GIVEN.items():
        assert getattr(params, name) == value, name


def test_left_out_values_are_the_engines_defaults() -> None:
    params, defaults = _params(), SamplingParams()
    for name in GIVEN:
        assert getattr(params, name) == getattr(defaults, name), name


def test_a_null_is_the_default_too() -> None:
    params = _params(**{name: None for name in GIVEN})
    assert dataclasses.replace(params, max_tokens=None) == dataclasses.replace(
        _params(), max_tokens=None
    )
