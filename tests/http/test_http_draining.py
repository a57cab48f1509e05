"""While the node drains, every route that starts new work is refused (503 `draining`) by the
route table, before its body is read: generations, the Responses API and model loads; reads
go on."""

from __future__ import annotations

from tests.http.fake_node import FakeNode
from tests.http.http_harness import h2_client, run, serving


def test_new_work_is_refused_before_its_body_is_parsed_and_reads_go_on() -> None:
    async def body() -> None:
        node = FakeNode()
        node.draining = True
        async with serving(node) as srv, h2_client(srv.url) as client:
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"):
                r = await client.post(path, content=b"{not json")  # never parsed: a 503
                assert r.status_code == 503, path
                assert r.json()["error"]["code"] == "draining"
                assert int(r.headers["retry-after"]) >= 1
            assert not node.jobs and not node.loaded
            assert (await client.get("/v1/models")).status_code == 200
            assert (await client.get("/v1/responses/resp_unknown")).status_code == 404

    run(body)
