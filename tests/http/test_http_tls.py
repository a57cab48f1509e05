"""TLS: with tls_cert and tls_key every address is HTTPS, ALPN offering h2 and http/1.1."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, make_config, run, serving, sse_events

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_negotiates_h2_by_alpn_and_still_speaks_http1(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)

    async def body() -> None:
        config = make_config(tls_cert=str(cert), tls_key=str(key))
        async with serving(FakeNode(), config) as srv:
            assert srv.bound[0].scheme == "https" and srv.url.startswith("https://127.0.0.1:")
            context = ssl.create_default_context(cafile=str(cert))
            async with httpx.AsyncClient(
                base_url=srv.url, http2=True, verify=context, timeout=10
            ) as h2:
                r = await h2.get("/health")
                assert (r.http_version, r.status_code) == ("HTTP/2", 200)
                r = await h2.post("/v1/chat/completions", json=chat_body(stream=True))
                assert sse_events(r.text)[-1] == "[DONE]"
            async with httpx.AsyncClient(base_url=srv.url, verify=context, timeout=10) as h1:
                r = await h1.get("/health")
                assert (r.http_version, r.status_code) == ("HTTP/1.1", 200)
            # cleartext on a TLS port is refused, not served
            async with httpx.AsyncClient(
                base_url=srv.url.replace("https", "http"), timeout=10
            ) as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get("/health")

    run(body)
