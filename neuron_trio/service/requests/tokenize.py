"""`/tokenize` and `/detokenize` for a loaded model: clients count a prompt's tokens before
they send it (llama.cpp's and vLLM's endpoints of those names).

A text is tokenized as a completion's prompt is (BOS where the model wants it, unless
`add_special` is off); a chat as its chat request would be (the model's template, the tools
rendered as that request renders them), so the count is the one the request will cost. Only
the tokenizer and the template are touched, never the engine's sequences, so this runs beside
steps; a long text or any chat on a worker thread (as `prompt_intake` does), so that the event
loop never waits on a template or a megabyte of text.
"""

from __future__ import annotations

import trio

from neuron_trio.errors import ContextLengthError, RequestError
from neuron_trio.executor.api import ServingEngine
from neuron_trio.service.api import Tokenized, TokenizeJob, template_message
from neuron_trio.service.requests.prompt_intake import INLINE_ENCODE_CHARS, MAX_CHARS_PER_TOKEN

__all__ = ["detokenize_ids", "tokenize_job"]


def _encode(engine: ServingEngine, job: TokenizeJob) -> list[int]:
    if job.messages is not None:
        messages = [template_message(m) for m in job.messages]
        return engine.encode_prompt(engine.render_chat(messages, job.tools), chat=True)
    if job.add_special:
        return engine.encode_prompt(job.text or "", chat=False)
    return list(engine.tokenizer.encode(job.text or "", add_special_tokens=False))


async def tokenize_job(engine: ServingEngine, job: TokenizeJob, *, context: int) -> Tokenized:
    """`job`'s token ids (and each token's bytes with `with_pieces`). ContextLengthError (400)
    for a text far longer than `context` tokens could hold; RequestError (400) if the template
    refuses the messages."""
    size = len(job.text or "") + sum(len(m.content) for m in job.messages or ())
    param = "messages" if job.messages is not None else job.text_param
    if size > context * MAX_CHARS_PER_TOKEN:
        raise ContextLengthError(
            f"{param}: {size} characters, far more than the model's context of {context} "
            "tokens can hold",
            param=param,
        )

    def run() -> Tokenized:
        ids = _encode(engine, job)
        pieces: tuple[bytes, ...] = ()
        if job.with_pieces:
            tokenizer = engine.tokenizer
            pieces = tuple(tokenizer.ids_to_bytes([i], skip_special_tokens=False) for i in ids)
        return Tokenized(model=job.model or "", ids=tuple(ids), pieces=pieces, context=context)

    if size > INLINE_ENCODE_CHARS or job.messages is not None or job.tools:
        return await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    return run()


async def detokenize_ids(engine: ServingEngine, ids: tuple[int, ...]) -> str:
    """The text of `ids`, special tokens included (as llama.cpp and vLLM show them);
    RequestError (400) naming the first id outside the vocabulary."""
    tokenizer = engine.tokenizer
    vocab = tokenizer.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise RequestError(
                f"tokens[{i}]: {token} is not a token id of this model (0 .. {vocab - 1})",
                param=f"tokens[{i}]",
                code="invalid_value",
            )
    if len(ids) > INLINE_ENCODE_CHARS // 8:  # a long list: off the event loop
        return await trio.to_thread.run_sync(
            lambda: tokenizer.decode(ids, skip_special_tokens=False), abandon_on_cancel=True
        )
    return tokenizer.decode(ids, skip_special_tokens=False)
