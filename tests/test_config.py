"""Config: every error names the file and the key (or the line); overrides from the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from neuron_trio.config import (
    BUILTIN_MODEL_SOURCE,
    config_from_mapping,
    load_config,
    parse_listen,
)
from neuron_trio.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neuron.toml"
    path.write_text(text)
    return path


def _error(path: Path, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ or {})
    assert info.value.exit_code == 78
    return str(info.value)


def test_builtin_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    config = load_config(None, environ={})
    assert config.server.listen == ["127.0.0.1:8080"]
    assert [m.source for m in config.default_models] == [BUILTIN_MODEL_SOURCE]
    assert config.node.state_dir == str(tmp_path / "neuron")
    assert config.node.model_dirs == [str(tmp_path / "neuron" / "models")]
    assert config.source_path == "<built-in default>"


def test_full_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [server]
        listen = ["0.0.0.0:8080", "[::1]:9090"]
        allow_unauthenticated = true
        drain_timeout_s = 5
        [node]
        state_dir = "/srv/neuron"
        [tp]
        step_timeout_s = 2.5
        [[default_models]]
        name = "m"
        source = "hf:org/repo/file.gguf"
        tp = 2
        devices = [0, 1]
        dtype = "float32"
        """,
    )
    config = load_config(path, environ={})
    assert config.server.drain_timeout_s == 5.0 and config.watchdog.step_timeout_s == 2.5
    assert config.node.model_dirs == ["/srv/neuron/models"]
    assert config.default_models[0].devices == [0, 1]
    assert config.source_path == str(path)


@pytest.mark.parametrize(
    ("text", "key", "detail"),
    [
        ("bogus = 1", "bogus", "unknown key"),
        ("source_path = 'x'", "source_path", "unknown key"),
        ("[server]\nlisten_on = ['a:1']", "server.listen_on", "unknown key"),
        (
            "[[default_models]]\nname='a'\nsource='b'\nflavour=1",
            "default_models[0].flavour",
            "unknown key",
        ),
        ("[server]\nmax_body_bytes = 'big'", "server.max_body_bytes", "Expected `int`, got `str`"),
        ("[tp]\nstep_timeout_s = true", "tp.step_timeout_s", "Expected `float`, got `bool`"),
        ("server = 3", "server", "Expected `object`, got `int`"),
        ("[server]\nmax_body_bytes = 0", "server.max_body_bytes", ">= 1"),
        ("[tp]\nabort_deadline_s = -1", "tp.abort_deadline_s", "> 0"),
        ("[server]\nlisten = ['nohost']", "server.listen[0]", "HOST:PORT"),
        ("[server]\nlisten = ['h:70000']", "server.listen[0]", "HOST:PORT"),
        ("[server]\nlisten = []", "server.listen", "at least one"),
        ("[server]\ntls_cert = '/nonexistent'", "server.tls_cert", "together"),
        (
            "[[default_models]]\nname='a'\nsource='b'\ndtype='int3'",
            "default_models[0].dtype",
            "Invalid enum value 'int3'",
        ),
        ("[[default_models]]\nname='a b'\nsource='b'", "default_models[0].name", "matching regex"),
        (
            "[[default_models]]\nname='a'\nsource='b'\n[[default_models]]\nname='a'\nsource='c'",
            "default_models[1].name",
            "duplicate",
        ),
        (
            "[[default_models]]\nname='a'\nsource='b'\ntp=2\ndevices=[0]",
            "default_models[0].devices",
            "tp = 2",
        ),
    ],
)
def test_errors_name_file_and_key(tmp_path: Path, text: str, key: str, detail: str) -> None:
    message = _error(_write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'neuron.toml'}: key {key}:"), message
    assert detail in message


def test_invalid_toml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nlisten = ["a:1"]\nmax_queue = \n')
    message = _error(path)
    assert message.startswith(f"{path}: invalid TOML")
    assert "line 3" in message


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    assert _error(missing).startswith(f"{missing}: cannot read")
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe")
    assert "not UTF-8" in _error(binary)


def test_env_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "[tp]\nabort_deadline_s = 60\n")
    config = load_config(
        path,
        environ={
            "NEURON_TP_ABORT_DEADLINE_S": "7",
            "NEURON_SERVER_LISTEN": "0.0.0.0:1, 127.0.0.1:2",
            "NEURON_SERVER_ALLOW_UNAUTHENTICATED": "true",
            "NEURON_NODE_STATE_DIR": "123",
            "NEURON_NODE_MODEL_DIRS": '["/a", "/b"]',
            "NEURON_SERVER_MAX_QUEUE": "0",
            "NEURON_FAILPOINTS": "engine.step=hang",  # not a config key: ignored here
            "NEURON_LOG_LEVEL": "debug",
        },
    )
    assert config.watchdog.abort_deadline_s == 7.0
    assert config.server.listen == ["0.0.0.0:1", "127.0.0.1:2"]
    assert config.node.state_dir == "123"
    assert config.node.model_dirs == ["/a", "/b"]
    assert config.server.max_queue == 0


def test_env_override_errors_name_the_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, "")
    message = _error(path, {"NEURON_TP_ABORT_DEADLINE_S": "soon"})
    assert "tp.abort_deadline_s (from NEURON_TP_ABORT_DEADLINE_S)" in message
    assert "NEURON_TP_NOPE" in _error(path, {"NEURON_TP_NOPE": "1"})


def test_config_from_mapping_is_not_changed(tmp_path: Path) -> None:
    data = {"tp": {"step_timeout_s": 3}}
    config_from_mapping(data, origin="x", environ={"NEURON_TP_STEP_TIMEOUT_S": "4"})
    assert data == {"tp": {"step_timeout_s": 3}}


def test_parse_listen() -> None:
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_listen("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match=re.escape("'x:0'")):
        parse_listen("x:0")


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_trio import cli

    good = _write(tmp_path, "[tp]\nstep_timeout_s = 5\n")
    assert cli.main(["check-config", "--config", str(good)]) == 0
    broken = tmp_path / "broken.toml"
    broken.write_text("[server]\nlisten = [\n")
    assert cli.main(["check-config", "--config", str(broken)]) == 78
    err = capsys.readouterr().err
    assert f"{broken}: invalid TOML" in err and "line " in err
    assert cli.main(["check-config", "--config", str(tmp_path / "missing.toml")]) == 78


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "[::]:8080", "10.1.2.3:80", "node7:8080"])
def test_an_exposed_listener_needs_a_key_or_an_explicit_opt_out(
    tmp_path: Path, listen: str
) -> None:
    path = _write(tmp_path, f'[server]\nlisten = ["127.0.0.1:1", "{listen}"]\n')
    message = _error(path, {})
    assert "server.listen" in message and listen in message and "api_key_file" in message
    key = tmp_path / "key"
    key.write_text("k\n")
    with_key = _write(tmp_path, f'[server]\nlisten = ["{listen}"]\napi_key_file = "{key}"\n')
    assert load_config(with_key, environ={}).server.listen == [listen]
    opt_out = _write(tmp_path, f'[server]\nlisten = ["{listen}"]\nallow_unauthenticated = true\n')
    assert load_config(opt_out, environ={}).server.allow_unauthenticated


@pytest.mark.parametrize("listen", ["127.0.0.1:8080", "127.8.9.1:1", "[::1]:8080", "localhost:1"])
def test_loopback_listeners_need_no_key(tmp_path: Path, listen: str) -> None:
    path = _write(tmp_path, f'[server]\nlisten = ["{listen}"]\n')
    assert load_config(path, environ={}).server.listen == [listen]


def test_admin_key_file_must_exist_and_models_are_capped(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nadmin_key_file = "/nonexistent/admin"\n')
    assert "server.admin_key_file" in _error(path, {})
    models = "".join(f'[[default_models]]\nname = "m{i}"\nsource = "x"\n' for i in range(3))
    path = _write(tmp_path, "[node]\nmax_models = 2\n" + models)
    assert "node.max_models = 2" in _error(path, {})
