"""`[kv_events]`: decoded, validated (naming the key), overridable from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_trio.config import config_from_mapping, load_config
from neuron_trio.errors import ConfigError

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_off_by_default_with_vllms_defaults() -> None:
    events = config_from_mapping({}, origin="t", environ={}).kv_events
    assert not events.enabled
    assert events.endpoint == "tcp://127.0.0.1:5557"  # vLLM's port, on loopback (issue 47)
    assert not events.allow_unauthenticated
    assert events.replay_endpoint == ""
    assert events.topic == "kv@{host}@{model}"


def test_enabled_from_the_file_and_the_environment() -> None:
    data = {"kv_events": {"enabled": True, "replay_endpoint": "tcp://127.0.0.1:5558"}}
    env = {"NEURON_KV_EVENTS_TOPIC": "kv@10.0.0.7@{model}"}
    events = config_from_mapping(data, origin="t", environ=env).kv_events
    assert events.enabled and events.replay_endpoint == "tcp://127.0.0.1:5558"
    assert events.topic == "kv@10.0.0.7@{model}"
    env = {"NEURON_KV_EVENTS_ENABLED": "true"}
    assert config_from_mapping({}, origin="t", environ=env).kv_events.enabled


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"endpoint": "5557"}, "kv_events.endpoint"),
        ({"endpoint": "tcp://*:70000"}, "kv_events.endpoint"),
        ({"endpoint": ""}, "kv_events.endpoint"),
        ({"replay_endpoint": "http://x:1"}, "kv_events.replay_endpoint"),
        ({"topic": "kv@{pod}@{model}"}, "kv_events.topic"),
        ({"topic": "kv@{0}"}, "kv_events.topic"),
        ({"replay_batches": 0}, "kv_events.replay_batches"),
        ({"colour": "red"}, "kv_events.colour"),
    ],
)
def test_bad_values_name_the_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"key {key}\b"):
        config_from_mapping({"kv_events": {"enabled": True, **table}}, origin="t", environ={})


def test_the_shipped_example_documents_every_key(tmp_path: Path) -> None:
    text = (DEPLOY / "neuron.toml").read_text()
    assert "[kv_events]" in text
    keys = ("enabled", "endpoint", "replay_endpoint", "topic", "replay_batches")
    for key in (*keys, "allow_unauthenticated"):
        assert f"\n{key} = " in text.split("[kv_events]")[1].split("\n[")[0], key
    key = tmp_path / "key"
    key.write_text("k\n")
    environ = {"NEURON_SERVER_API_KEY_FILE": str(key), "NEURON_SERVER_ADMIN_KEY_FILE": str(key)}
    assert not load_config(DEPLOY / "neuron.toml", environ=environ).kv_events.enabled
    environ["NEURON_KV_EVENTS_ENABLED"] = "true"  # and valid when turned on as shipped
    assert load_config(DEPLOY / "neuron.toml", environ=environ).kv_events.enabled


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("endpoint", "tcp://*:5557"),
        ("endpoint", "tcp://0.0.0.0:5557"),
        ("endpoint", "tcp://[::]:5557"),
        ("endpoint", "tcp://indexer.example:5557"),
        ("replay_endpoint", "tcp://*:5558"),
    ],
)
def test_a_wide_address_needs_allow_unauthenticated(key: str, value: str) -> None:
    """Issue 47: `tcp://*:5557` (the old default) published every tenant's prompt tokens on
    every interface, unauthenticated, though the HTTP listener was loopback-only."""
    table: dict[str, object] = {"enabled": True, key: value}
    with pytest.raises(ConfigError, match=rf"key kv_events\.{key}: .*allow_unauthenticated"):
        config_from_mapping({"kv_events": table}, origin="t", environ={})
    table["allow_unauthenticated"] = True
    events = config_from_mapping({"kv_events": table}, origin="t", environ={}).kv_events
    assert getattr(events, key) == value


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:9", "ipc:///x/y"]
)
def test_local_addresses_need_no_flag(endpoint: str) -> None:
    data = {"kv_events": {"enabled": True, "endpoint": endpoint}}
    assert config_from_mapping(data, origin="t", environ={}).kv_events.endpoint == endpoint
