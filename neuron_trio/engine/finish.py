"""When a sequence stops, and why: the finish rules applied to each sampled token.

In order: a stop token (the request's, or end of turn / end of text unless `ignore_eos`) ends
it with "stop" and flushes the held-back text; a stop string completed by the text ends it
with "stop"; a constrained sequence whose grammar is complete ends with "stop", and one whose
grammar engine gave up ends with "error" (never going on unconstrained); `max_tokens` ends it
with "length" (or "stop" when the flushed tail completes a stop string). Tool calls are
parsed out of the text last, after a thinking model's thinking is set apart from its answer:
a "stop" with calls becomes "tool_calls".
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any

from neuron_trio.engine.sequence import Sequence
from neuron_trio.engine.types import SequenceEvent


def is_stop_token(
    seq: Sequence, token: int, *, end_of_turn_ids: Set[int], eos_ids: Set[int]
) -> bool:
    """Whether `token` ends `seq`: one of its stop tokens, else (unless `ignore_eos`) the end
    of a turn for a chat, the end of text for a raw completion."""
    if token in seq.params.stop_token_ids:
        return True
    if seq.params.ignore_eos:
        return False
    return token in (end_of_turn_ids if seq.chat else eos_ids)


def token_event(
    seq: Sequence,
    result: Any,  # the sampler's: token_id, logprob
    *,
    end_of_turn_ids: Set[int],
    eos_ids: Set[int],
    begin_call: Callable[[Sequence, Any], Any] | None = None,
) -> SequenceEvent:
    """The event of the token `result` sampled for `seq`, appended to its output, with the
    finish rules applied (`is_stop_token`, `apply_finish_rules`)."""
    token = int(result.token_id)
    seq.output_ids.append(token)
    params = seq.params
    event = SequenceEvent(
        seq_id=seq.group_id or seq.seq_id,
        index=seq.index,
        token_ids=[token],
        logprobs=[result.logprob] if params.logprobs and result.logprob is not None else None,
        prompt_tokens=seq.num_prompt,
        completion_tokens=seq.num_output,
    )
    stop = is_stop_token(seq, token, end_of_turn_ids=end_of_turn_ids, eos_ids=eos_ids)
    apply_finish_rules(seq, token, event, stop=stop, begin_call=begin_call)
    return event


def apply_finish_rules(
    seq: Sequence,
    token: int,
    event: SequenceEvent,
    *,
    stop: bool,
    begin_call: Callable[[Sequence, Any], Any] | None = None,
) -> None:
    """Fill `event`'s text, finish reason, error and tool calls for `token`, just appended
    to `seq` (`stop`: it is a stop token, `is_stop_token`).

    `begin_call(seq, start)`: the grammar for the rest of an `auto` tool call, once the
    sequence's call watcher sees a call's marker; it constrains the call from then on."""
    grammar = seq.sampling.grammar
    if stop:
        event.text = seq.text.finish()
        event.finish_reason = "stop"
    else:
        event.text, stopped = seq.text.push(token)
        if stopped:
            event.finish_reason = "stop"
        elif grammar is not None and grammar.finished:
            event.text += seq.text.finish()  # complete: only an end of turn could follow
            event.finish_reason = "stop"
        elif grammar is not None and grammar.error:
            # the grammar engine gave up (a resource limit): never go on unconstrained
            event.finish_reason = "error"
            event.error = f"structured output: {grammar.error}"
        elif seq.num_output >= (seq.params.max_tokens or 0):  # resolved by `Engine.add`
            event.text += seq.text.finish()
            # the held-back tail may still complete a stop string as the text is flushed
            event.finish_reason = "stop" if seq.text.stopped else "length"
    final = event.finish_reason is not None
    # the thinking is apart from the answer; an auto call is watched for in the answer only
    answering = seq.reasoning is None or seq.reasoning.answering
    if seq.reasoning is not None:
        event.reasoning, event.text = seq.reasoning.push(event.text, final=final)
    if seq.tool_calls is not None:
        watcher = seq.tool_calls.watcher
        if (
            watcher is not None
            and begin_call is not None
            and answering
            and not final
            and (start := watcher.push(token)) is not None
        ):
            seq.sampling.grammar = begin_call(seq, start)
        cut = event.finish_reason == "length"  # a call cut by max_tokens: no markup leaks
        event.text, calls = seq.tool_calls.push(event.text, final=final, cut=cut)
        event.tool_calls = calls or None
        if event.finish_reason == "stop" and seq.tool_calls.calls:
            event.finish_reason = "tool_calls"
