"""An engine on a tiny family's real tokenizer and template whose model writes a script: the
test decides exactly what is proposed, the grammar what may be taken (tool calls, reasoning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from neuron_trio.engine.engine import Engine
from neuron_trio.engine.text.chat import ChatTemplate
from neuron_trio.engine.types import SamplingParams, SequenceEvent


def engine_for(path: Path, template: str | None = None) -> Engine:
    engine = Engine.from_gguf(
        path, dtype="float32", device=torch.device("cpu"), max_batch=2, context=256
    )
    if template is not None:
        engine.chat_template = ChatTemplate(template)
    return engine


def script(engine: Engine, text: str) -> list[int]:
    """Make the model propose `text`, token by token, then the end of the turn. Each step's
    logits favour the next scripted token; when the grammar refuses it, the model prefers to
    end (the end of the turn, then `]`, `}`, `"`), else takes the first allowed token."""
    tok = engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    eos = tok.eos_id
    assert eos is not None
    prefer = {eos: 10.0}
    for char, value in (("]", 5.0), ("}", 4.0), ('"', 3.0)):
        prefer[tok.token_bytes.index(char.encode())] = value
    steps = {"n": 0}
    original = engine.runner.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        logits = torch.zeros_like(out)
        for token, value in prefer.items():
            logits[:, token] = value
        i = steps["n"]
        logits[:, ids[i] if i < len(ids) else eos] = 50.0
        steps["n"] += 1
        return logits

    engine.runner.forward = forward  # type: ignore[method-assign]
    return ids


def generate(
    engine: Engine, params: SamplingParams, template_kwargs: dict[str, Any] | None = None
) -> list[SequenceEvent]:
    """The events of one chat ("hello") with `params`, every step run."""
    # the tools are not rendered: their listing would not fit the tiny context
    messages = [{"role": "user", "content": "hello"}]
    prompt = engine.encode_prompt(engine.render_chat(messages, (), template_kwargs), chat=True)
    seq_id = engine.add(prompt, params, chat=True)
    events: list[SequenceEvent] = []
    while engine.has_work:
        events += [e for e in engine.step() if e.seq_id == seq_id]
    return events
