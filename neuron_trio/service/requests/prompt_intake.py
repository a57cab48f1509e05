"""A request's prompt made ready for the engine as it arrives, before it waits anywhere.

`prepare_job_prompt` bounds the prompt's size, compiles its constraint on the model's compile
thread, then has the engine template, tokenize and check it in one pass (`engine.prepare`): on
the trio thread when that is quick, on a worker thread when it is not. A bad request gets its
400 (RequestError) here, before it takes a place in the queue; the `PreparedPrompt` it yields
is what `engine.add` takes, unchecked again.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from neuron_trio.config import ModelConfig
from neuron_trio.errors import ContextLengthError
from neuron_trio.executor.api import PreparedPrompt, ServingEngine
from neuron_trio.service.api import GenerationJob, template_message
from neuron_trio.service.requests.grammar_compiles import GrammarCompiles

INLINE_ENCODE_CHARS = 8192  # longer prompts are tokenized on a worker thread (chats: all)
# No tokenizer packs more characters than this into one token on average, so a prompt with
# more than context x this many characters cannot fit: refused before it is rendered.
MAX_CHARS_PER_TOKEN = 64


async def prepare_job_prompt(
    engine: ServingEngine,
    job: GenerationJob,
    spec: ModelConfig,
    compiles: Callable[[], GrammarCompiles],
) -> PreparedPrompt:
    """`job`'s prompt, checked, with the model's `default_max_tokens` (`spec`) where the
    client gave no max_tokens; RequestError (400) if it cannot run.

    Tokenizing touches only the tokenizer and template (never the engine's state), so it
    may run beside a step. Small prompts run on the trio thread (microseconds); long
    ones on a worker thread, so that /health never waits behind a 1 MB prompt. `compiles()`
    gives the model's grammar compiles (made on the first constraint).
    """
    size = len(job.prompt or "") + sum(len(m.content) for m in job.messages or ())
    if size > spec.context * MAX_CHARS_PER_TOKEN:
        raise ContextLengthError(
            f"the prompt has {size} characters, far more than model {spec.name!r}'s "
            f"context of {spec.context} tokens can hold",
            param="messages" if job.messages is not None else "prompt",
        )

    def prepare() -> PreparedPrompt:
        return engine.prepare(
            job.params,
            text=job.prompt,
            messages=None if job.messages is None else [template_message(m) for m in job.messages],
            ids=job.prompt_ids,
            template_kwargs=dict(job.template_kwargs),
            default_max_tokens=spec.default_max_tokens,
        )

    if job.params.constraint is not None:
        # an invalid schema's 400 first; compiled on the model's compile thread
        # (grammar_compiles) and cached for `add`
        await compiles().compile(job.params.constraint, job.tenant)
    # Tools are rendered into the prompt as JSON of any size. A chat template is the
    # model file's code: it renders on a thread, under its own deadline and size
    # bounds (engine/text/template_sandbox.py), never on the event loop.
    if size > INLINE_ENCODE_CHARS or job.messages is not None or job.params.tools:
        return await trio.to_thread.run_sync(prepare, abandon_on_cancel=True)
    return prepare()
