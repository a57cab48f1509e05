"""POST /v1/models over the real Node: a file neuron cannot use is a 422 naming the problem.

No default model and no real load: each file is refused while its header is read, before any
weight is touched, so these tests are fast. Files are written by tests/engine/hostile_gguf.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.engine.hostile_gguf import kv_str, llama_kvs, llama_tensors, raw_gguf
from tests.http.http_harness import run
from tests.http.real_node import bare_node


def test_hostile_files_are_422_naming_the_problem_not_the_resolved_path(tmp_path: Path) -> None:
    models = tmp_path / "models"
    hidden = tmp_path / "elsewhere-secret"
    models.mkdir()
    hidden.mkdir()
    raw_gguf(hidden / "target-name.gguf", llama_kvs(blocks=3_000_000), llama_tensors())
    # A symlink inside the model directory whose target lies under it too (allowed), by a
    # name that must not be echoed back.
    inside = models / "sub-secret"
    inside.mkdir()
    os.replace(hidden / "target-name.gguf", inside / "target-name.gguf")
    (models / "blocks.gguf").symlink_to(inside / "target-name.gguf")
    raw_gguf(models / "zero-heads.gguf", llama_kvs(heads=0), llama_tensors())
    (models / "empty.gguf").write_bytes(b"")

    async def body() -> None:
        async with bare_node(models) as url, httpx.AsyncClient(base_url=url) as http:
            cases = {
                "blocks.gguf": "block_count",
                "zero-heads.gguf": "head_count",
                "empty.gguf": "not a GGUF file",
            }
            for source, problem in cases.items():
                r = await http.post("/v1/models", json={"name": "m", "source": source})
                assert r.status_code == 422, r.text
                error = r.json()["error"]
                assert error["code"] == "invalid_model_file"
                assert problem in error["message"] and source in error["message"]
                assert "secret" not in error["message"] and str(tmp_path) not in error["message"]
            assert (await http.get("/v1/models")).json()["data"] == []

    run(body)


def test_runtime_hub_loads_are_limited_to_the_allowed_repos(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()

    async def body() -> None:
        async with (
            bare_node(models, hf_allow_repos=["trusted/*"]) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            spec = {"name": "m", "source": "hf:someone/evil/x.gguf"}
            r = await http.post("/v1/models", json=spec)
            assert r.status_code == 400
            message = r.json()["error"]["message"]
            assert "someone/evil" in message and "node.hf_allow_repos: trusted/*" in message

    run(body)


def test_a_cpu_model_beyond_memavailable_is_507_with_the_numbers(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    raw_gguf(models / "tiny.gguf", llama_kvs(), llama_tensors())
    spec = {"name": "m", "source": "tiny.gguf", "devices": "cpu"}

    async def body() -> None:
        async with (
            bare_node(models, host_memory=1 << 30) as url,
            httpx.AsyncClient(base_url=url) as http,
        ):
            # a KV cache of 4 GiB for 1 GiB available (max_batch x context would be capped at
            # the tiny model's own context)
            big = {**spec, "kv_cache_mb": 4096}
            r = await http.post("/v1/models", json=big)
            assert r.status_code == 507, r.text
            message = r.json()["error"]["message"]
            assert "host memory" in message and "1.00 GiB available (MemAvailable)" in message
            assert (await http.get("/v1/models")).json()["data"] == []

    run(body)


def test_a_chat_template_that_loops_is_422_at_load(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    loop = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    kvs = [*llama_kvs(), kv_str("tokenizer.chat_template", loop)]
    raw_gguf(models / "loop.gguf", kvs, llama_tensors())

    async def body() -> None:
        async with bare_node(models) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/models", json={"name": "m", "source": "loop.gguf"})
            assert r.status_code == 422, r.text
            assert "chat template did not render" in r.json()["error"]["message"]

    run(body)
