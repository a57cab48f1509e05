"""A prompt's own logprobs (`SamplingParams.prompt_logprobs`): what `/v1/completions` shows
before the completion's with `echo` and `logprobs`, as OpenAI's legacy API and vLLM do.

The logits at position p predict the token at p + 1, so a prefill chunk over positions
`start .. end - 1` gives the logprobs of the prompt's tokens `start + 1 .. end` (those that
exist). A sequence that wants them is prefilled from its first token (no cached prefix: a
cached block has no logits) in a forward that keeps every row's logits (`batch.run_plan`);
its list grows chunk by chunk and goes out with its first sampled token. The first prompt
token has nothing before it: its entry carries logprob 0.0, which the wire shows as null.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neuron_trio.engine.sequence import Sequence
from neuron_trio.engine.types import TokenLogprob

__all__ = ["ROWS_AT_ONCE", "collect_prompt_logprobs", "start_prompt_logprobs"]

ROWS_AT_ONCE = 32  # rows turned into logprobs together: a 152k vocabulary's rows are 600 KB


def start_prompt_logprobs(seq: Sequence, token_text: Callable[[int], str]) -> None:
    """Open `seq`'s list with its first prompt token (no logprob: nothing precedes it)."""
    first = seq.prompt_ids[0]
    seq.prompt_logprobs = [TokenLogprob(first, token_text(first), 0.0)]


def collect_prompt_logprobs(
    seq: Sequence, start: int, rows: torch.Tensor, token_text: Callable[[int], str]
) -> None:
    """Append to `seq.prompt_logprobs` the entries that `rows` (the float32 logits `[n, V]` of
    positions `start .. start + n - 1`) give and the list lacks (a prefill computed again
    after a preemption appends nothing twice)."""
    have = seq.prompt_logprobs
    assert have is not None
    top = max(0, seq.params.top_logprobs)
    # row r predicts position start + r + 1; only prompt positions, only those not yet held
    first_row = len(have) - start - 1
    assert first_row >= 0, "a chunk's rows were never collected"  # never: no cached prefix
    last_row = min(rows.shape[0], seq.num_prompt - start - 1)
    for at in range(first_row, last_row, ROWS_AT_ONCE):
        stop = min(at + ROWS_AT_ONCE, last_row)
        logprobs = torch.log_softmax(rows[at:stop].float(), dim=-1)
        targets = seq.prompt_ids[start + at + 1 : start + stop + 1]
        index = torch.tensor(targets, device=logprobs.device)[:, None]
        picked = logprobs.gather(1, index)[:, 0].tolist()
        tops: list[list[float]] = [[] for _ in targets]
        top_ids: list[list[int]] = [[] for _ in targets]
        if top:
            values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
            tops, top_ids = values.tolist(), indices.tolist()
        for token, value, best, best_ids in zip(targets, picked, tops, top_ids, strict=True):
            alternatives = tuple((t, token_text(t), v) for t, v in zip(best_ids, best, strict=True))
            have.append(TokenLogprob(token, token_text(token), value, alternatives))
