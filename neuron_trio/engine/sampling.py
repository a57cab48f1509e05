"""Picking the next token of each sequence in a batch from the model's logits.

Per row, in this order (as vLLM and transformers do): `logit_bias` (OpenAI's: added to the
logits of the tokens it names, greedy rows included), repetition penalty (over prompt and
output, multiplicative as in transformers), then presence and frequency penalties (over the
output, additive as OpenAI defines them), then temperature, top-k, top-p, min-p, and one draw
from what is left. Temperature 0 is greedy: argmax of the penalised logits, no randomness.

Logprobs are those of the model's raw distribution (log-softmax of the logits before any
penalty or filter), as OpenAI reports them.

Each sequence draws from its own `torch.Generator`, one draw per step, seeded from
`SamplingParams.seed` (or from the OS when there is none): the same seed gives the same tokens
whatever else shares the batch.

Fast path: a batch whose rows are all greedy, without penalties or logprobs, is one argmax.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neuron_trio.engine.types import SamplingParams, TokenLogprob

# Below this temperature a row is greedy (vLLM's threshold): dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the row's params ask for logprobs


class SamplingState:
    """What one sequence's sampling remembers between steps: its generator and the tokens seen.

    `Sampler.sample` records each token it picks (`append`); call `append` yourself only for a
    token that did not come from `sample`.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.prompt_ids = tuple(int(t) for t in prompt_ids)
        self.output_ids: list[int] = []
        self.output_counts: dict[int, int] = {}
        # any integer is a seed (OpenAI puts no range on it); torch takes 64 bits
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self._generators: dict[torch.device, torch.Generator] = {}
        self._prompt_unique: dict[torch.device, torch.Tensor] = {}
        self._bias: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # structured output: the grammar the tokens must follow (engine.text.structured.grammar.GrammarState)
        self.grammar: Any = None

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )

    @property
    def needs_slow_path(self) -> bool:
        return not self.greedy or self.has_penalties or self.params.logprobs

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def apply_logit_bias(self, row: torch.Tensor) -> None:
        """Add, in place, `params.logit_bias` to the logits `row` [V] (ids checked against the
        vocabulary when the request was validated)."""
        cached = self._bias.get(row.device)
        if cached is None:
            pairs = self.params.logit_bias
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=row.device)
            values = torch.tensor([b for _, b in pairs], dtype=row.dtype, device=row.device)
            cached = self._bias[row.device] = (ids, values)
        row.index_add_(0, cached[0], cached[1].to(row.dtype))

    def apply_penalties(self, row: torch.Tensor) -> None:
        """Penalise, in place, the logits `row` [V] of this sequence."""
        p = self.params
        device = row.device
        vocab = row.shape[-1]
        if p.repetition_penalty != 1.0:
            prompt = self._prompt_unique.get(device)
            if prompt is None:
                prompt = torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.int64)
                prompt = prompt[prompt < vocab].to(device)
                self._prompt_unique[device] = prompt
            if self.output_counts:
                out = torch.tensor(list(self.output_counts), dtype=torch.int64, device=device)
                seen = torch.unique(torch.cat([prompt, out[out < vocab]]))
            else:
                seen = prompt
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and self.output_counts:
            ids = [t for t in self.output_counts if t < vocab]
            idx = torch.tensor(ids, dtype=torch.int64, device=device)
            counts = torch.tensor(
                [self.output_counts[t] for t in ids], dtype=row.dtype, device=device
            )
            row[idx] -= counts * p.frequency_penalty + p.presence_penalty


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax (its first on ties; a NaN wins, as in torch). On the CPU through
    numpy: torch's argmax took ~350 us for 8 rows of 49152 logits, numpy's ~35 us."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return x.argmax(dim=-1).tolist()  # type: ignore[no-any-return]


class Sampler:
    """Samples a batch. `token_text(id)` gives the text shown in logprobs (the tokenizer's
    `token_text`); without it the text is empty."""

    def __init__(self, token_text: Callable[[int], str] | None = None) -> None:
        self.token_text = token_text

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingState],
        raw_logits: torch.Tensor | None = None,
    ) -> list[SampleResult]:
        """One token for each row of `logits` [B, V] (float32), recorded in its state.

        With structured output, `logits` has the tokens a grammar forbids at -inf (before
        penalties and filters) and `raw_logits` is the model's own: logprobs are those.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
        if any(s.params.logit_bias for s in rows):
            # logprobs stay those of the model's own distribution (as with penalties and masks)
            raw_logits = logits if raw_logits is None else raw_logits
            logits = logits.clone()
            for i, state in enumerate(rows):
                if state.params.logit_bias:
                    state.apply_logit_bias(logits[i])
        masked = raw_logits is not None
        raw = logits if raw_logits is None else raw_logits
        if not any(s.needs_slow_path for s in rows):
            ids = argmax_rows(logits)
            for state, token in zip(rows, ids, strict=True):
                state.append(token)
            return [SampleResult(token) for token in ids]

        logits = logits.float()
        raw = raw.float()
        work = logits.clone() if any(s.has_penalties for s in rows) and not masked else logits
        for i, state in enumerate(rows):
            if state.has_penalties:
                state.apply_penalties(work[i])

        chosen: list[int] = [0] * len(rows)
        greedy = [i for i, s in enumerate(rows) if s.greedy]
        if greedy:
            picks = argmax_rows(work[greedy])
            for i, token in zip(greedy, picks, strict=True):
                chosen[i] = token
        sampled = [i for i, s in enumerate(rows) if not s.greedy]
        if sampled:
            probs = self._filtered_probs(work[sampled], [rows[i].params for i in sampled])
            # One uniform draw per row from the row's own generator (the same seed gives the
            # same tokens whatever shares the batch), then the inverse of the cumulative
            # distribution: token i is picked with probability p_i. One random number per row
            # is far cheaper than a vocabulary of them (torch.multinomial, exponential races).
            device = probs.device
            u = torch.cat(
                [torch.rand(1, generator=rows[i].generator(device), device=device) for i in sampled]
            )
            cdf = probs.cumsum(dim=-1)
            # right=True: the first token whose cdf exceeds u * total, never one of probability 0
            picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
            vocab = probs.shape[-1]
            for j, token in enumerate(picks):
                if token >= vocab:  # u * total rounded up to total: the last likely token
                    picks[j] = int(cdf[j].argmax().item())
            for i, token in zip(sampled, picks, strict=True):
                chosen[i] = token

        logprobs = self._logprobs(raw, chosen, rows)
        for state, token in zip(rows, chosen, strict=True):
            state.append(token)
        return [SampleResult(t, lp) for t, lp in zip(chosen, logprobs, strict=True)]

    @staticmethod
    def _filtered_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p on logits `x` [b, V]; probabilities [b, V]."""
        device = x.device
        b, vocab = x.shape
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=device)
        x = x / temps[:, None]
        neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=device)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]  # 2: never cuts
        use_top_k = any(k < vocab for k in top_k)
        use_top_p = any(p < 1.0 for p in top_p)
        if use_top_k and not use_top_p:
            # no sort needed: the k-th best value of each row is the cut (ties stay in); rows
            # without top-k get a cut of -inf (their neighbours' k never widens to the vocabulary)
            on = [i for i in range(b) if top_k[i] < vocab]
            ks = torch.tensor([top_k[i] for i in on], device=device)
            kth = x[on].topk(int(ks.max()), dim=-1).values.gather(1, ks[:, None] - 1)
            cut = torch.full((b, 1), float("-inf"), dtype=x.dtype, device=device)
            cut[on] = kth
            x = x.masked_fill(x < cut, neg_inf)
        elif use_top_p:
            need = [i for i in range(b) if top_k[i] < vocab or top_p[i] < 1.0]
            sub_k = [top_k[i] for i in need]
            sub_p = [top_p[i] for i in need]
            sub = x[need]
            remove = _top_k_top_p_candidates(sub, sub_k, sub_p)
            if remove is None:
                remove = _top_k_top_p_sorted(sub, sub_k, sub_p)
            x = x.clone()
            x[need] = sub.masked_fill(remove, neg_inf)
        probs = x.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            mp = torch.tensor(min_p, dtype=x.dtype, device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * mp[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
            renorm = probs / probs.sum(dim=-1, keepdim=True)
            probs = torch.where(mp[:, None] > 0, renorm, probs)  # rows without min_p: as they were
        return probs

    def _logprobs(
        self, raw: torch.Tensor, chosen: list[int], rows: Sequence[SamplingState]
    ) -> list[TokenLogprob | None]:
        """Logprobs of the raw distribution, for the rows that ask, in one batched pass."""
        out: list[TokenLogprob | None] = [None] * len(rows)
        want = [i for i, s in enumerate(rows) if s.params.logprobs]
        if not want:
            return out
        logprobs = torch.log_softmax(raw[want], dim=-1)
        ids = torch.tensor([chosen[i] for i in want], device=raw.device)
        picked = logprobs.gather(1, ids[:, None])[:, 0].tolist()
        vocab = raw.shape[-1]
        counts = [min(max(rows[i].params.top_logprobs, 0), vocab) for i in want]
        n = max(counts)
        top_values: list[list[float]] = [[] for _ in want]
        top_ids: list[list[int]] = [[] for _ in want]
        if n:
            values, indices = logprobs.topk(n, dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        text = self.token_text or (lambda _i: "")
        for j, i in enumerate(want):
            k = counts[j]
            top = tuple(
                (t, text(t), v) for t, v in zip(top_ids[j][:k], top_values[j][:k], strict=True)
            )
            out[i] = TokenLogprob(chosen[i], text(chosen[i]), picked[j], top)
        return out


# Top-p looks at this many best tokens first; a full sort only if they are not enough.
TOP_P_CANDIDATES = 512


def _top_k_top_p_sorted(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Which tokens top-k then top-p remove from logits `x` [b, V] (True: removed)."""
    b, vocab = x.shape
    device = x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=device).expand(b, vocab)
    ks = torch.tensor(top_k, device=device)
    remove_sorted = positions >= ks[:, None]
    probs_sorted = sorted_x.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
    better = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass of the tokens before each
    ps = torch.tensor(top_p, dtype=x.dtype, device=device)
    cut = better >= ps[:, None]
    cut[:, 0] = False  # the best token always stays
    remove_sorted |= cut
    return torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)


def _top_k_top_p_candidates(
    x: torch.Tensor, top_k: list[int], top_p: list[float]
) -> torch.Tensor | None:
    """The same as `_top_k_top_p_sorted`, from the best TOP_P_CANDIDATES tokens of each row
    only (a partial top-k instead of a sort of the whole vocabulary). None when that is not
    enough: a row keeps all of its top_k > TOP_P_CANDIDATES, or its best candidates do not
    reach its top_p mass."""
    b, vocab = x.shape
    n = min(vocab, TOP_P_CANDIDATES)
    if n == vocab or any(n < k < vocab for k in top_k):
        return None
    device = x.device
    vals, idx = x.topk(n, dim=-1)  # best first
    ks = torch.tensor(top_k, device=device)
    k_on = ks < vocab
    in_k = torch.arange(n, device=device).expand(b, n) < ks[:, None]
    vals = vals.masked_fill(~in_k, float("-inf"))
    # each row's normaliser: over its top-k when on (all inside the candidates), else the row
    norm = torch.where(k_on, vals.logsumexp(dim=-1), x.logsumexp(dim=-1))
    probs = (vals - norm[:, None]).exp()
    ps = torch.tensor(top_p, dtype=x.dtype, device=device)
    # where top-k is off, the candidates must hold top_p's mass, so every other token is cut
    enough = k_on | (probs.sum(dim=-1) >= ps)
    if not bool(enough.all()):
        return None
    better = probs.cumsum(dim=-1) - probs
    cut = better >= ps[:, None]
    cut[:, 0] = False
    keep = in_k & ~cut
    remove = torch.ones_like(x, dtype=torch.bool)
    return remove.scatter(1, idx, ~keep)
