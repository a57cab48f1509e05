"""Issue 47: the grammar cache is shared only within one scope (a tenant, or the tenants of
one prefix-cache group). A hit answers in microseconds where a compile takes milliseconds to
seconds, so a cache shared by all told a tenant that another had sent the same schema.

Fails on the code before: `Constraint` had no scope and the cache was keyed by the schema
alone (a second tenant's identical schema was a hit), and `compile_lark` by its text alone."""

from __future__ import annotations

from pathlib import Path

from neuron_trio.engine.text.structured.grammar_cache import GrammarCache
from neuron_trio.engine.types import Constraint
from tests.engine.text.char_vocab import PERSON, char_compiler
from tests.http.fake_node import FakeNode
from tests.http.http_harness import chat_body, h2_client, run, serving
from tests.http.tenant_keys import auth_headers, tenants_config


class _CountingCache(GrammarCache):
    """Counts the compiles: each miss ends in one `put`."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0
        self.owners: list[str | None] = []

    def put(self, key: object, value: object, weight: int, *, owner: str | None = None) -> None:
        self.puts += 1
        self.owners.append(owner)
        super().put(key, value, weight, owner=owner)


def test_an_identical_schema_of_another_scope_compiles_again() -> None:
    compiler = char_compiler()
    compiler.cache = cache = _CountingCache()
    alpha, beta = b"tenant:alpha", b"tenant:beta"
    compiler.compile(Constraint("json", schema=PERSON, scope=alpha))
    compiler.compile(Constraint("json", schema=PERSON, scope=alpha))
    assert cache.puts == 1  # the same scope: a hit
    assert not compiler.is_cached(Constraint("json", schema=PERSON, scope=beta))
    compiler.compile(Constraint("json", schema=PERSON, scope=beta))
    assert cache.puts == 2  # another scope: a miss, compiled again
    assert len(cache) == 2  # one node-wide cache holds both, under its one bound


def test_lark_grammars_are_scoped_too() -> None:
    compiler = char_compiler()
    compiler.cache = cache = _CountingCache()
    lark = 'start: "{" "}"\n'
    compiler.scoped(b"root-a").compile_lark(lark)
    compiler.scoped(b"root-a").compile_lark(lark)
    assert cache.puts == 1
    compiler.scoped(b"root-b", "beta").compile_lark(lark)
    assert cache.puts == 2
    assert cache.owners == [None, "beta"]  # charged to the sequence's tenant


def _schema_body() -> dict[str, object]:
    schema = {"name": "person", "schema": {"type": "object"}}
    return chat_body(response_format={"type": "json_schema", "json_schema": schema})


def test_a_jobs_constraint_is_scoped_by_its_tenant_or_group(tmp_path: Path) -> None:
    """alpha's two keys share alpha's grammars, beta and gamma share their prefix-cache
    group's; alpha and beta never share."""
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path)
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for key in ("alpha-1", "alpha-2", "beta-1", "gamma-1"):
                r = await client.post(
                    "/v1/chat/completions", json=_schema_body(), headers=auth_headers(key)
                )
                assert r.status_code == 200

    run(body)
    scopes = []
    for job in node.jobs:
        assert job.params.constraint is not None
        assert job.params.constraint.scope == job.cache_salt  # one identity: the salt
        assert job.params.constraint.owner == job.tenant  # charged to the tenant's share
        scopes.append(job.params.constraint.scope)
    a1, a2, beta, gamma = scopes
    assert a1 == a2 and beta == gamma
    assert [job.tenant for job in node.jobs] == ["alpha", "alpha", "beta", "gamma"]
    assert a1 != beta and None not in {a1, beta}


def test_with_isolation_off_every_tenant_shares_grammars(tmp_path: Path) -> None:
    node = FakeNode()

    async def body() -> None:
        config = tenants_config(tmp_path, prefix_cache_isolation="none")
        async with serving(node, config) as srv, h2_client(srv.url) as client:
            for key in ("alpha-1", "beta-1"):
                r = await client.post(
                    "/v1/chat/completions", json=_schema_body(), headers=auth_headers(key)
                )
                assert r.status_code == 200

    run(body)
    assert [job.params.constraint.scope for job in node.jobs] == [None, None]  # type: ignore[union-attr]
