"""ORCA load reports: neuron's `endpoint-load-metrics` header, read as Envoy reads it.

First the reimplementation of Envoy's parser (orca_envoy.py) is checked against the vectors of
Envoy's own test/common/orca/orca_parser_test.cc; then it reads what a real server sends.
"""

from __future__ import annotations

import math

import pytest

from neuron_trio.http.orca import orca_header_value
from neuron_trio.service.api import LoadReport
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h1_client, h2_client, run, serving
from tests.http.orca_envoy import HEADER, OrcaError, OrcaLoadReport, parse_orca_headers

# --- the reimplementation against Envoy's test vectors --------------------------------------

EXAMPLE = OrcaLoadReport(
    cpu_utilization=0.7, application_utilization=0.8, mem_utilization=0.9, eps=2,
    rps_fractional=1000, named_metrics={"foo": 123, "bar": 0.2},
)  # fmt: skip


def _parse(value: str) -> OrcaLoadReport:
    return parse_orca_headers([(HEADER, value)])


def test_envoy_vectors_that_parse() -> None:
    text = (
        "TEXT cpu_utilization:0.7,application_utilization:0.8,mem_utilization:0.9,"
        "rps_fractional:1000,eps:2,named_metrics.foo:123,named_metrics.bar:0.2"
    )
    assert _parse(text) == EXAMPLE
    json_value = (
        'JSON {"cpu_utilization": 0.7, "application_utilization": 0.8, '
        '"mem_utilization": 0.9, "rps_fractional": 1000, "eps": 2, '
        '"named_metrics": {"foo": 123,"bar": 0.2}}'
    )
    assert _parse(json_value) == EXAMPLE


@pytest.mark.parametrize(
    ("headers", "kind", "message"),
    [
        ([], "NotFound", "no ORCA data sent from the backend"),
        ([("wrong-header", "wrong-value")], "NotFound", "no ORCA data sent from the backend"),
        ([(HEADER, "BAD random-value")], "InvalidArgument", "unsupported ORCA header format: BAD"),
        (
            [(HEADER, "BADBAD random-value")],
            "InvalidArgument",
            "unsupported ORCA header format: BADBA",
        ),
        ([(HEADER, "")], "InvalidArgument", "unsupported ORCA header format: "),
        (
            [(HEADER, 'TEXT cpu_utilization:"0.7"')],
            "InvalidArgument",
            'unable to parse custom backend load metric value(cpu_utilization): "0.7"',
        ),
        (
            [(HEADER, f"TEXT cpu_utilization:{math.nan}")],
            "InvalidArgument",
            "custom backend load metric value(cpu_utilization) cannot be NaN.",
        ),
        (
            [(HEADER, f"TEXT cpu_utilization:{math.inf}")],
            "InvalidArgument",
            "custom backend load metric value(cpu_utilization) cannot be infinity.",
        ),
        (
            [(HEADER, "TEXT cpu_utilization:0.7,cpu_utilization:0.8")],
            "AlreadyExists",
            "endpoint-load-metrics contains duplicate metric: cpu_utilization",
        ),
        (
            [(HEADER, "TEXT cpu_utilization:0.7,unsupported_metric:0.8")],
            "InvalidArgument",
            "unsupported metric name: unsupported_metric",
        ),
        (
            [
                (
                    HEADER,
                    "TEXT named_metrics.foo:123,named_metrics.duplicate:123,named_metrics.duplicate:0.2",
                )
            ],
            "AlreadyExists",
            "endpoint-load-metrics contains duplicate metric: named_metrics.duplicate",
        ),
        ([(HEADER, "TEXT named_metrics.:123")], "InvalidArgument", "named metric key is empty."),
        (
            [(HEADER, "TEXT not-a-list-of-key-value-pairs")],
            "InvalidArgument",
            "metric values cannot be empty strings",
        ),
    ],
)
def test_envoy_vectors_that_fail(headers: list[tuple[str, str]], kind: str, message: str) -> None:
    with pytest.raises(OrcaError) as caught:
        parse_orca_headers(headers)
    assert (caught.value.kind, caught.value.message) == (kind, message)


@pytest.mark.parametrize(
    "value",
    [
        "JSON not-a-valid-json-string",
        'JSON {"cpu_utilization": 0.7, "unknown_field": 2}',
        'JSON {"cpu_utilization": "0.7"',
    ],
)
def test_envoy_json_vectors_that_fail(value: str) -> None:
    with pytest.raises(OrcaError, match="invalid JSON"):
        _parse(value)


# --- neuron's header ------------------------------------------------------------------------

LOAD = LoadReport(
    num_requests_waiting=3, num_requests_running=8, kv_cache_usage_perc=0.8125,
    application_utilization=1.375,
)  # fmt: skip


def _expected(report: OrcaLoadReport, load: LoadReport) -> None:
    assert report.application_utilization == load.application_utilization
    assert report.named_metrics == {
        "kv_cache_usage_perc": load.kv_cache_usage_perc,
        "num_requests_waiting": load.num_requests_waiting,
        "num_requests_running": load.num_requests_running,
    }
    assert report.cpu_utilization == report.mem_utilization == report.eps == 0.0


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize(
    "load",
    [
        LOAD,
        LoadReport(
            num_requests_waiting=0,
            num_requests_running=0,
            kv_cache_usage_perc=0.0,
            application_utilization=0.0,
        ),
        LoadReport(
            num_requests_waiting=64,
            num_requests_running=256,
            kv_cache_usage_perc=1.0,
            application_utilization=1e-05,
        ),
    ],
)
def test_the_header_value_parses_as_envoy_reads_it(fmt: str, load: LoadReport) -> None:
    value = orca_header_value(load, fmt)
    assert value.startswith("TEXT " if fmt == "text" else "JSON ")
    _expected(_parse(value), load)


def test_a_request_that_asks_gets_its_models_load_in_either_format() -> None:
    async def body() -> None:
        node = FakeNode(models=("a", "b"))
        node.loads["a"] = LOAD
        async with serving(node) as srv, h2_client(srv.url) as client:
            for fmt, prefix in (("text", "TEXT "), ("JSON", "JSON ")):
                r = await client.post(
                    "/v1/chat/completions",
                    json=chat_body(model="a"),
                    headers={"endpoint-load-metrics-format": fmt},
                )
                assert r.status_code == 200, r.text
                value = r.headers[HEADER]
                assert value.startswith(prefix)
                _expected(parse_orca_headers([(HEADER, value)]), LOAD)
            assert node.load_asked == ["a", "a"]

    run(body)


def test_no_header_unless_asked_for_in_a_known_format() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h1_client(srv.url) as client:
            r = await client.post("/v1/chat/completions", json=chat_body())
            assert r.status_code == 200 and HEADER not in r.headers
            headers = {"endpoint-load-metrics-format": "bin"}
            r = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert r.status_code == 200 and HEADER not in r.headers
        assert node.load_asked == []

    run(body)


def test_streams_errors_and_health_carry_it_with_the_nodes_load_when_no_model_is_known() -> None:
    async def body() -> None:
        node = FakeNode(models=("a",))
        node.node_load = LOAD
        asked = {"endpoint-load-metrics-format": "text"}
        async with serving(node) as srv, h2_client(srv.url) as client:
            stream_body = chat_body(model="a") | {"stream": True}
            async with client.stream(
                "POST", "/v1/chat/completions", json=stream_body, headers=asked
            ) as r:
                assert r.status_code == 200
                _expected(parse_orca_headers([(HEADER, r.headers[HEADER])]), LOAD)
                await r.aread()
            bad = await client.post("/v1/chat/completions", content=b"{", headers=asked)
            assert bad.status_code == 400
            _expected(parse_orca_headers([(HEADER, bad.headers[HEADER])]), LOAD)
            missing = await client.post(
                "/v1/chat/completions", json=chat_body(model="nope"), headers=asked
            )
            assert missing.status_code == 404
            health = await client.get("/health", headers=asked)
            _expected(parse_orca_headers([(HEADER, health.headers[HEADER])]), LOAD)
        # the stream named its model; the bad body none; "nope" is asked and not loaded
        assert node.load_asked == ["a", None, "nope", None]

    run(body)


def test_header_format_value_is_read_case_blind() -> None:
    async def body() -> None:
        node = FakeNode()
        async with serving(node) as srv, h1_client(srv.url) as client:
            r = await client.get("/health", headers={"endpoint-load-metrics-format": "Json"})
            assert r.headers[HEADER].startswith("JSON {")

    run(body)
