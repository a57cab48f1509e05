"""Chat templates cannot stall, exhaust memory or freeze the node (issue 25, finding 5).

Each hostile template below is refused by a bound before the costly call is made (so each
test is fast and allocates little); before the bounds, each made a value of 100 MB to 4 GB,
or looped until killed.
"""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import jinja2
import pytest

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.text.chat_probe import probe_chat_template
from neuron_trio.engine.text.template_sandbox import MAX_RENDER_CHARS, TemplateLimitError
from neuron_trio.engine.warm_up import warm_up
from neuron_trio.errors import ModelFileError, RequestError
from tests.engine.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_LOOP = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"

HOSTILE = {
    "repeat a string 4 GiB": "{{ 'x' * 4294967296 }}",
    "repeat a list": "{{ ([1] * 1000000000)|length }}",
    "a huge power": "{{ 10 ** 60000000 }}",
    "a huge product": "{% set n = 10 ** 5000 %}{{ n * n * n * n }}",
    "double with +": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}"
    ),
    "double with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
    ),
    "1 GiB a message": "{% for m in messages %}{% set x = 'x' * 1073741824 %}{% endfor %}",
    "many large values": (
        "{% set ns = namespace(a=[]) %}{% for i in range(100000) %}"
        "{% set ns.a = [ns.a, 'x' * 1000000] %}{% endfor %}"
    ),
    "center filter": "{{ 'x'|center(999999999) }}",
    "indent filter": "{{ ('a\\n' * 100000)|indent(1000) }}",
    "ljust method": "{{ 'x'.ljust(999999999) }}",
    "expandtabs method": "{{ ('\\t' * 1000).expandtabs(1000000) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "format nested width": "{{ '{:{w}}'.format(1, w=999999999) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "format filter width": "{{ '%999999999d'|format(1) }}",
    "replace method": "{{ ('x' * 100000).replace('', 'y' * 10000) }}",
    "replace filter": "{{ ('x' * 100000)|replace('', 'y' * 10000) }}",
    "join method": "{{ ('y' * 1000000).join(range(1000)|map('string')) }}",
    "join filter": "{{ range(1000)|join('y' * 1000000) }}",
    "tojson indent": "{{ messages|tojson(indent=1000000000) }}",
    "a deep macro": (
        "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}"
        "{% endmacro %}{{ d('x', 40) }}"
    ),
    "output": "{% for i in range(100000) %}{{ 'y' * 4000000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_refused_by_a_bound(name: str) -> None:
    template = ChatTemplate(HOSTILE[name])
    assert template.available, template.error  # compiles at once: nothing folded at load
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError, match=r"exceeded a limit|indent"):
            template.render(MESSAGES, time_limit_s=30.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_RENDER_CHARS * 4  # at most the budget (4-byte characters at worst)


def test_a_looping_template_stops_at_its_deadline() -> None:
    with pytest.raises(TemplateLimitError, match=r"did not render these messages within 0\.2 s"):
        ChatTemplate(NESTED_LOOP).render(MESSAGES, time_limit_s=0.2)


def test_a_constant_is_not_folded_at_compile_time() -> None:
    # jinja2 folds constant expressions when it compiles; an intercepted operator is not
    # folded, so this costs nothing at load and is refused at render (before: 100 MB at load).
    template = ChatTemplate("{{ 'x' * 100000000 }}")
    assert template.available
    with pytest.raises(TemplateLimitError):
        template.render(MESSAGES)


def test_the_probe_refuses_a_template_that_exceeds_a_bound() -> None:
    with pytest.raises(ModelFileError, match="the operator '\\*'"):
        probe_chat_template(ChatTemplate("{{ 'x' * 100000000 }}"), "big.gguf")


def test_a_template_source_beyond_its_bound_does_not_compile() -> None:
    template = ChatTemplate("{{ 'x' }}" * 100_000)
    assert not template.available and "characters" in (template.error or "")
    with pytest.raises(RequestError, match="does not compile"):
        template.render(MESSAGES)


def test_ordinary_templates_render_as_plain_jinja2_does() -> None:
    sources = [
        CHATML_TEMPLATE,
        "{{ bos_token }}{% for m in messages %}{{ m['role']|upper ~ ': ' ~ m['content']|trim }}"
        "{{ '\\n' * 2 }}{% endfor %}{{ '%-6s|%3d' % ('x', 7) }}{{ '{:>4}'.format(1) }}"
        "{{ messages|map(attribute='content')|join(', ') }}{{ 2 ** 10 }}{{ 'ab' * 3 }}"
        "{{ messages|tojson(indent=2) }}{{ 'a b'.replace(' ', '_') }}{{ 'x'|center(5) }}",
    ]
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = ChatTemplate.__init__.__globals__["_tojson"]
    for source in sources:
        expected = plain.from_string(source).render(
            messages=MESSAGES, add_generation_prompt=True, bos_token="<s>"
        )
        assert ChatTemplate(source, bos_token="<s>").render(MESSAGES) == expected


def test_warm_up_fails_the_load_when_the_template_loops_on_its_chat(tmp_path: Path) -> None:
    # Loops only on the warm-up's own chat: before, the warm-up hung until the deadman ended
    # the whole node (exit 70); now the load fails (422, or exit 69 for a default model).
    only_on_warm_up = (
        "{% if messages[-1]['content'] == 'Say hello.' %}"
        + NESTED_LOOP
        + "{% endif %}"
        + CHATML_TEMPLATE
    )
    engine = Engine.from_gguf(
        write_tiny_llama(tmp_path / "m.gguf", chat_template=only_on_warm_up),
        max_batch=2,
        context=64,
    )
    with pytest.raises(ModelFileError, match="the chat template failed the warm-up"):
        _warm_up_with_limit(engine, 0.2)


def _warm_up_with_limit(engine: Engine, seconds: float) -> None:
    """warm_up, with the template's render deadline at `seconds` (5 s by default)."""
    template = engine.chat_template
    original = template.render

    def render(*args: object, **kwargs: object) -> object:
        return original(*args, **{**kwargs, "time_limit_s": seconds})  # type: ignore[arg-type]

    template.render = render  # type: ignore[method-assign]
    warm_up(engine)


def test_renders_on_other_threads_have_their_own_budgets() -> None:
    # The budget is per thread: a render that spent most of one does not fail another's.
    template = ChatTemplate("{% for i in range(12) %}{% set x = 'y' * 4000000 %}{% endfor %}ok")
    errors: list[BaseException] = []

    def render() -> None:
        try:
            template.render(MESSAGES)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=render) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
