"""POST /v1/models with hostile files over the real Node (issue 25, findings 2, 5, 10): a 422
naming the problem and never the file's absolute path; the models already loaded serve on.

Real loads of tiny models (tests/engine/tiny_gguf.py): a second or two each.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from tests.engine.tiny_gguf import (
    CHATML_TEMPLATE,
    write_tiny_llama,
    write_with_vocab,
    write_with_weights,
)
from tests.http.http_harness import run
from tests.http.real_node import bare_node

LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


def test_hostile_files_are_422_and_the_loaded_model_serves_on(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_llama(models / "good.gguf")

    def narrow(w: dict[str, np.ndarray]) -> None:
        w["blk.0.ffn_up.weight"] = np.ascontiguousarray(w["blk.0.ffn_up.weight"][:, :32])

    write_with_weights(models / "ffn.gguf", narrow)
    write_with_vocab(models / "merge.gguf", lambda t, y, m: m.append("<|endoftext|> <|endoftext|>"))
    write_with_vocab(models / "long.gguf", lambda t, y, m: (t.append("a" * 1025), y.append(1)))
    write_with_vocab(models / "dup.gguf", lambda t, y, m: (t.append(t[200]), y.append(1)))
    write_tiny_llama(models / "ctx.gguf", context_length=1)
    write_tiny_llama(models / "big.gguf", chat_template="{{ 'x' * 4294967296 }}")
    chat = {"model": "good", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def body() -> None:
        async with bare_node(models) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/models", json={"name": "good", "source": "good.gguf"})
            assert r.status_code == 201, r.text
            cases = {
                "ffn.gguf": "blk.0.ffn_up.weight has shape [128, 32]",
                "merge.gguf": "'<|endoftext|><|endoftext|>', which is not a token",
                "long.gguf": "1025 bytes long",
                "dup.gguf": "tokens 200 and 288",
                "ctx.gguf": "context_length = 1",
                "big.gguf": "the operator '*' would make a value of 4294967296 characters",
            }
            for source, problem in cases.items():
                r = await http.post("/v1/models", json={"name": "bad", "source": source})
                assert r.status_code == 422, (source, r.text)
                message = r.json()["error"]["message"]
                assert problem in message, (source, message)
                assert str(tmp_path) not in message, message
                r = await http.post("/v1/chat/completions", json=chat)
                assert r.status_code == 200, r.text
            names = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
            assert names == ["good"]

    run(body, timeout=300)


def test_a_template_that_loops_on_four_messages_fails_that_request_alone(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    template = "{% if messages|length == 4 %}" + LOOP + "{% endif %}" + CHATML_TEMPLATE
    write_tiny_llama(models / "loop4.gguf", chat_template=template)

    def chat(n: int) -> dict[str, object]:
        messages = [{"role": "user", "content": f"m{i}"} for i in range(n)]
        return {"model": "m", "messages": messages, "max_tokens": 2}

    async def body() -> None:
        async with bare_node(models) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/models", json={"name": "m", "source": "loop4.gguf"})
            assert r.status_code == 201, r.text  # the probe's 3-message chat renders
            r = await http.post("/v1/chat/completions", json=chat(4))
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "chat_template_limit"
            assert "did not render these messages within" in r.json()["error"]["message"]
            r = await http.post("/v1/chat/completions", json=chat(3))
            assert r.status_code == 200, r.text

    run(body, timeout=300)


def test_a_load_time_error_names_the_source_not_the_resolved_path(tmp_path: Path) -> None:
    # An error raised while building (after the header checks) used to carry the absolute
    # path, e.g. "/srv/models/x.gguf: tensor blk.0.ffn_up.weight has shape ...".
    from neuron_trio.config import NeuronConfig, NodeConfig, ServerConfig
    from neuron_trio.errors import ModelFileError
    from neuron_trio.service.node import Node
    from tests.http.http_harness import serving_node

    models = tmp_path / "models"
    models.mkdir()
    write_tiny_llama(models / "m.gguf")

    def factory(spec: object, path: Path, devices: object, *, failpoints: object) -> object:
        raise ModelFileError(f"{path}: tensor blk.0.ffn_up.weight has the wrong shape")

    config = NeuronConfig(
        server=ServerConfig(listen=["127.0.0.1:0"], drain_timeout_s=2.0),
        node=NodeConfig(state_dir=str(tmp_path), model_dirs=[str(models)]),
        default_models=[],
    )

    async def body() -> None:
        node = Node(config, executor_factory=factory)
        async with serving_node(node, config) as url, httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/v1/models", json={"name": "m", "source": "m.gguf"})
            assert r.status_code == 422, r.text
            message = r.json()["error"]["message"]
            assert "m.gguf: tensor blk.0.ffn_up.weight" in message
            assert str(tmp_path) not in message

    run(body, timeout=120)
