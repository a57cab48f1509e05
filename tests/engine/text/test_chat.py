"""Chat templates: sandboxed rendering, parity with transformers, end-of-turn tokens."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from neuron_trio.engine.text.chat import ChatTemplate, end_of_turn_ids
from neuron_trio.errors import RequestError

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3? ünï 😀\n\nmultiple lines"},
    ],
    [{"role": "user", "content": ""}],
]


def test_chatml_render() -> None:
    t = ChatTemplate(CHATML, bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_developer_role_is_system() -> None:
    t = ChatTemplate(CHATML, bos_token="", eos_token="")
    out = t.render([{"role": "developer", "content": "be brief"}])
    assert out.startswith("<|im_start|>system\nbe brief")


def test_special_tokens_helpers_and_trim_blocks() -> None:
    src = (
        "{{ bos_token }}{% for m in messages %}\n"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "{{ m | tojson }}|{{ strftime_now('%Y') }}\n"
        "{% endfor %}{{ eos_token }}"
    )
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    out = t.render([{"role": "user", "content": "é<b>"}])
    year = str(datetime.datetime.now().year)
    # trim_blocks drops the newline after a block tag; tojson keeps non-ASCII and "<" as is
    assert out == f'<s>{{"role": "user", "content": "é<b>"}}|{year}\n</s>'
    with pytest.raises(RequestError, match="no tools here") as err:
        t.render([{"role": "tool", "content": "x"}])
    assert err.value.param == "messages"


def test_tools_and_documents_are_none_as_in_transformers() -> None:
    t = ChatTemplate(
        "{{ tools is none }} {{ documents is none }} {{ extra }}",
        bos_token="",
        eos_token="",
        extra_context={"extra": "x"},
    )
    assert t.render([]) == "True True x"


def test_sandbox_blocks_attribute_escapes() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token="", eos_token="")
    with pytest.raises(RequestError):
        t.render([{"role": "user", "content": "x"}])
    # the sandbox is immutable: a template cannot change the caller's messages
    t = ChatTemplate("{{ messages.append(1) }}", bos_token="", eos_token="")
    with pytest.raises(RequestError):
        t.render([{"role": "user", "content": "x"}])


def test_no_template_is_a_request_error_naming_messages() -> None:
    t = ChatTemplate(None, bos_token="", eos_token="")
    assert not t.available
    with pytest.raises(RequestError, match="no chat template") as err:
        t.render([{"role": "user", "content": "x"}])
    assert err.value.param == "messages"
    broken = ChatTemplate("{% for %}", bos_token="", eos_token="")
    assert broken.error is not None
    with pytest.raises(RequestError, match="does not compile"):
        broken.render([])


class _FakeTokenizer:
    def __init__(self, vocab: dict[str, int], eos: int | None, special: set[int]):
        self.vocab = vocab
        self.eos_id = eos
        self.special_ids = frozenset(special)

    def token_to_id(self, text: str) -> int | None:
        return self.vocab.get(text)


def test_end_of_turn_ids() -> None:
    tok = _FakeTokenizer({"<|eot_id|>": 7, "<|end_of_text|>": 3, "<end_of_turn>": 9}, 3, {3, 7})
    # <end_of_turn> is in the vocabulary but not a special token: plain text, not an end
    assert end_of_turn_ids(tok) == {3, 7}
    assert end_of_turn_ids(_FakeTokenizer({}, None, set())) == set()


@pytest.fixture(scope="module")
def builtin_path() -> Path:
    from neuron_trio.engine.gguf.builtin import builtin_model_path

    return builtin_model_path()


@pytest.mark.slow
def test_builtin_template_matches_transformers(builtin_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from neuron_trio.engine.gguf.file import GGUFFile
    from neuron_trio.engine.text.tokenizer import Tokenizer

    with GGUFFile(builtin_path) as gf:
        tok = Tokenizer.from_metadata(gf.metadata)
    hf = transformers.AutoTokenizer.from_pretrained(
        str(builtin_path.parent), gguf_file=builtin_path.name
    )
    assert tok.chat_template is not None
    t = ChatTemplate(tok.chat_template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    for messages in CONVERSATIONS:
        ours = t.render(messages, add_generation_prompt=True)
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        # and the token ids transformers would feed the model
        assert tok.encode(ours, add_special_tokens=False) == hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    assert "You are a helpful AI assistant named SmolLM" in t.render(CONVERSATIONS[0])
    assert end_of_turn_ids(tok) == {2, 0}  # <|im_end|> (EOS) and <|endoftext|>
