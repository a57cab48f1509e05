"""Model sources: local paths under model_dirs, the hub (a local stand-in server), errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from neuron_trio.config import config_from_mapping
from neuron_trio.errors import SourceError
from neuron_trio.service.sources import (
    check_cache_dir,
    parse_hub_source,
    resolve_hub,
    resolve_local,
    resolve_source,
)

from .hub_server import GGUF_BYTES, HubHandler


def _resolve_in_subprocess(
    source: str, env: dict[str, str], limits: str = "None"
) -> subprocess.CompletedProcess[str]:
    # huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE at import: a fresh process.
    code = textwrap.dedent(
        f"""
        from neuron_trio.config import config_from_mapping
        from neuron_trio.errors import SourceError
        from neuron_trio.service.sources import HubLimits, resolve_source
        config = config_from_mapping({{}}, origin="test", environ={{}})
        try:
            print(resolve_source({source!r}, config, limits={limits}))
        except SourceError as exc:
            print("SourceError:", exc)
        """
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60
    )


def test_hub_download_into_hf_home_then_offline(hub: str, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf")}
    done = _resolve_in_subprocess("hf:acme/tiny/tiny.Q4_0.gguf", env)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.read_bytes() == GGUF_BYTES
    assert path.is_relative_to(tmp_path / "hf" / "hub")
    assert ("GET", "/acme/tiny/resolve/main/tiny.Q4_0.gguf") in HubHandler.requests

    # Offline: served from the cache, the server is not asked again.
    HubHandler.requests.clear()
    done = _resolve_in_subprocess("hf:acme/tiny/tiny.Q4_0.gguf", {**env, "HF_HUB_OFFLINE": "1"})
    assert Path(done.stdout.strip().splitlines()[-1]) == path
    assert HubHandler.requests == []

    done = _resolve_in_subprocess("hf:acme/tiny/other.gguf", {**env, "HF_HUB_OFFLINE": "1"})
    assert "SourceError:" in done.stdout and "HF_HUB_OFFLINE" in done.stdout


def test_runtime_limits_are_checked_before_downloading(hub: str, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf")}
    source = "hf:acme/tiny/tiny.Q4_0.gguf"
    size = len(GGUF_BYTES)
    # A repo that is not allowed: the hub is not even asked.
    done = _resolve_in_subprocess(source, env, "HubLimits(('other/*',), 1 << 30)")
    assert "SourceError:" in done.stdout and "node.hf_allow_repos: other/*" in done.stdout
    assert not [p for _, p in HubHandler.requests if "/resolve/" in p]
    # Allowed, but larger than the cap: only a HEAD, no GET, nothing in the cache.
    done = _resolve_in_subprocess(source, env, f"HubLimits(('acme/*',), {size - 1})")
    assert "SourceError:" in done.stdout and f"is {size} bytes" in done.stdout, done.stdout
    file_requests = {m for m, path in HubHandler.requests if "/resolve/" in path}
    assert file_requests == {"HEAD"}, HubHandler.requests
    assert not list((tmp_path / "hf").rglob("*.gguf"))
    # Within the cap: downloaded.
    done = _resolve_in_subprocess(source, env, f"HubLimits(('acme/tiny',), {size})")
    assert Path(done.stdout.strip().splitlines()[-1]).read_bytes() == GGUF_BYTES


def test_hub_missing_file_is_a_source_error(hub: str, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf")}
    done = _resolve_in_subprocess("hf:acme/tiny/missing.gguf", env)
    assert "SourceError:" in done.stdout, done.stdout + done.stderr
    assert "missing.gguf" in done.stdout


def test_unwritable_cache_is_reported_before_any_download(hub: str, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where HF_HOME should be a directory")
    done = _resolve_in_subprocess(
        "hf:acme/tiny/tiny.Q4_0.gguf", {"HF_ENDPOINT": hub, "HF_HOME": str(blocker)}
    )
    assert "SourceError: hub cache directory" in done.stdout, done.stdout + done.stderr
    assert str(blocker / "hub") in done.stdout
    assert HubHandler.requests == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_cache_dir_named(tmp_path: Path) -> None:
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    try:
        with pytest.raises(SourceError, match=f"{cache} is not writable"):
            check_cache_dir(cache)
    finally:
        cache.chmod(0o700)


def test_cache_dir_under_a_file_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(SourceError, match="cannot be created"):
        check_cache_dir(tmp_path / "f" / "hub")


def test_parse_hub_source() -> None:
    hub = parse_hub_source("hf:acme/tiny@v1/sub/dir/m.gguf")
    assert (hub.repo_id, hub.revision, hub.filename) == ("acme/tiny", "v1", "sub/dir/m.gguf")
    for bad in ("hf:acme/m.gguf", "hf:acme/tiny/", "hf:acme/tiny/model.bin"):
        with pytest.raises(SourceError):
            parse_hub_source(bad)


def test_local_paths_must_lie_under_model_dirs(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    inside = models / "a.gguf"
    inside.write_bytes(GGUF_BYTES)
    outside = tmp_path / "b.gguf"
    outside.write_bytes(GGUF_BYTES)
    (models / "link.gguf").symlink_to(outside)

    assert resolve_local(str(inside), [models]) == inside.resolve()
    assert resolve_local("a.gguf", [tmp_path / "empty", models]) == inside.resolve()
    with pytest.raises(SourceError, match=r"outside the model directories .*models"):
        resolve_local(str(outside), [models])
    with pytest.raises(SourceError, match="outside the model directories"):
        resolve_local(str(models / "link.gguf"), [models])  # a symlink out is refused
    with pytest.raises(SourceError, match="outside"):
        resolve_local(str(models / ".." / "b.gguf"), [models])
    with pytest.raises(SourceError, match="no such file"):
        resolve_local(str(models / "nope.gguf"), [models])


def test_resolve_source_dispatch(tmp_path: Path) -> None:
    config = config_from_mapping(
        {"node": {"state_dir": str(tmp_path), "model_dirs": [str(tmp_path)]}},
        origin="test",
        environ={},
    )
    (tmp_path / "m.gguf").write_bytes(GGUF_BYTES)
    assert resolve_source(str(tmp_path / "m.gguf"), config) == (tmp_path / "m.gguf").resolve()
    with pytest.raises(SourceError, match="unknown built-in"):
        resolve_source("builtin:nope", config)


def test_hub_records_print_once_through_the_root_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from huggingface_hub import constants
    from huggingface_hub.utils import logging as hub_logging

    hub_logger = hub_logging.get_logger("huggingface_hub")
    if not hub_logger.handlers:  # as huggingface_hub sets itself up on import
        hub_logger.addHandler(logging.StreamHandler())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
        resolve_hub("hf:acme/tiny/absent.gguf")
    assert hub_logger.handlers == [] and hub_logger.propagate
