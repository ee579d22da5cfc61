"""Sampling, batched over the rows of one step, in vLLM's order:

1. logprobs, when a row asks for them: the model's own log-softmax, before any control below (vLLM's
   default `raw_logprobs`): the sampled token's, its rank, and the top-k alternatives;
2. the token set: `allowed_token_ids`, a grammar's mask, and the tokens banned until `min_tokens`;
3. `logit_bias`, then the repetition (prompt and output tokens), frequency and presence (output
   tokens) penalties;
4. greedy: the argmax of that; otherwise temperature -> min_p -> top-k -> top-p, then a draw with the
   row's generator.

A batch whose rows ask for none of 1-3 costs what plain sampling costs (no copy of the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-5  # below this, logits / T overflows float32: treated as greedy


@dataclass(frozen=True)
class SamplingSpec:
    """Per-row sampling settings; temperature 0 (or below MIN_TEMPERATURE) means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: and the top k

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with no logprobs and none of step 2-3's controls of its own: its token is the argmax of
        the logits row unless the row's other controls (a grammar, `banned`) apply."""
        return (
            self.greedy
            and self.logprobs is None
            and not (self.penalized or self.logit_bias or self.allowed_token_ids)
        )


@dataclass
class SampleRow:
    """One row of a step to sample: its settings and what its controls need to know."""

    spec: SamplingSpec = field(default_factory=SamplingSpec)
    generator: torch.Generator | None = None
    prompt: Sequence[int] = ()  # the repetition penalty counts these too
    outputs: Sequence[int] = ()  # tokens generated so far (the penalties)
    banned: Sequence[int] = ()  # never sampled this step (EOS and stop ids until min_tokens)
    mask: torch.Tensor | None = None  # bool [V]: the only tokens allowed (a grammar's), or None

    @property
    def controlled(self) -> bool:
        s = self.spec
        return bool(
            s.penalized or s.logit_bias or s.allowed_token_ids or self.banned or self.mask is not None
        )


@dataclass
class TokenLogprob:
    """A token's log-probability, its rank among the vocabulary (1 = most likely), and the top-k
    alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int = 1
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sampled:
    token: int
    logprob: TokenLogprob | None = None


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] already divided by temperature. Returns logits with masked tokens at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already cover top_p; the first token always stays
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits: [V] after temperature. Drops the tokens whose probability is under min_p x the top one's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_controls(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Steps 2-3 on one row's logits [V] (in place)."""
    spec, vocab = row.spec, logits.shape[-1]
    if spec.allowed_token_ids or row.mask is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        if spec.allowed_token_ids:
            keep[list(spec.allowed_token_ids)] = True
            if row.mask is not None:
                keep &= row.mask
        else:
            keep = row.mask
        logits.masked_fill_(~keep, float("-inf"))
    if row.banned:
        logits[list(row.banned)] = float("-inf")
    if spec.logit_bias:
        ids, bias = zip(*spec.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if spec.penalized:
        outputs = torch.as_tensor(list(row.outputs), dtype=torch.long, device=logits.device)
        if spec.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.as_tensor(list(row.prompt), dtype=torch.long, device=logits.device)] = True
            seen[outputs] = True
            p = spec.repetition_penalty
            logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits))
        if spec.frequency_penalty or spec.presence_penalty:
            counts = torch.bincount(outputs, minlength=vocab).to(logits.dtype)
            logits -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """The log-softmax of logits[rows] ([N, V]) at `tokens`, with their ranks and top `tops[i]`."""
    lp = torch.log_softmax(logits[list(rows)], dim=-1)
    chosen = torch.as_tensor(list(tokens), dtype=torch.long, device=lp.device)
    values = lp.gather(1, chosen[:, None])
    ranks = ((lp > values).sum(-1) + 1).tolist()
    values = values[:, 0].tolist()
    k = max(tops, default=0)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [
        TokenLogprob(t, v, r, list(zip(ti[:n], tv[:n], strict=True)))
        for t, v, r, ti, tv, n in zip(tokens, values, ranks, top_i, top_v, tops, strict=True)
    ]


def target_probs(processed: torch.Tensor, spec: SamplingSpec, gen: torch.Generator | None) -> torch.Tensor:
    """Step 4's distribution of a non-greedy row (its controls applied already), on `gen`'s device."""
    scaled = apply_min_p(processed / spec.temperature, spec.min_p)
    probs = apply_top_k_top_p(scaled, spec.top_k, spec.top_p).softmax(-1)
    if gen is not None and gen.device != probs.device:  # seeded generators are CPU generators
        probs = probs.to(gen.device)
    return probs


def controlled_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Steps 2-3 on the rows that ask for them (a copy), or `logits` itself when none does."""
    controlled = [i for i, r in enumerate(rows) if r.controlled]
    if not controlled:
        return logits
    processed = logits.clone()
    for i in controlled:
        apply_controls(processed[i], rows[i])
    return processed


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value (the first of equal ones; a NaN counts as the largest), as
    `argmax(-1)` gives it. A float32 CPU tensor goes through NumPy: ~4 us a decode step against ATen's ~20."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
    """logits: [N, V] float32, one row per SampleRow. Returns one Sampled per row."""
    processed = controlled_logits(logits, rows)
    greedy = argmax_rows(processed)
    tokens = []
    for i, row in enumerate(rows):
        spec, gen = row.spec, row.generator
        if spec.greedy:
            tokens.append(greedy[i])
            continue
        probs = target_probs(processed[i], spec, gen)
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    out = [Sampled(t) for t in tokens]
    wanted = [i for i, r in enumerate(rows) if r.spec.logprobs is not None]
    if wanted:
        found = token_logprobs(
            logits, wanted, [tokens[i] for i in wanted], [rows[i].spec.logprobs or 0 for i in wanted]
        )
        for i, lp in zip(wanted, found, strict=True):
            out[i].logprob = lp
    return out


def speculative_sample(
    logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[int]
) -> list[Sampled]:
    """Verify `drafts` (k proposed tokens, a deterministic proposal such as n-gram lookup) against the
    target's logits [k + 1, V] at the k + 1 positions they were computed at (row j: the distribution of
    the token after j drafts; `rows[j]` its controls, with the drafts before it counted as outputs).

    Returns the accepted drafts and one more token (the target's at the first rejection, or a bonus
    token after all k): 1 .. k + 1 tokens. Greedy rows accept a draft while it is the argmax, so the
    output is the non-speculative greedy output. Sampled rows accept draft d with probability p(d) and
    on a rejection draw from p with d removed (renormalised): speculative sampling's rule for a proposal
    that puts all its mass on d, which leaves every emitted token distributed as p."""
    k = len(drafts)
    processed = controlled_logits(logits, rows)
    spec, gen = rows[0].spec, rows[0].generator
    tokens: list[int] = []
    if spec.greedy:
        best = argmax_rows(processed)
        for j in range(k + 1):
            tokens.append(best[j])
            if j == k or best[j] != drafts[j]:
                break
    else:
        for j in range(k + 1):
            probs = target_probs(processed[j], spec, gen)
            if j < k:
                u = float(torch.rand((), generator=gen, device=probs.device))
                if u < float(probs[drafts[j]]):
                    tokens.append(drafts[j])
                    continue
                probs = probs.clone()
                probs[drafts[j]] = 0.0
                if float(probs.sum()) <= 0.0:  # p(d) was 1 up to rounding: d is all there is
                    tokens.append(drafts[j])
                    continue
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
            break
    out = [Sampled(t) for t in tokens]
    if spec.logprobs is not None:
        found = token_logprobs(logits, range(len(tokens)), tokens, [spec.logprobs] * len(tokens))
        for sampled, lp in zip(out, found, strict=True):
            sampled.logprob = lp
    return out
