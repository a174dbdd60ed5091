"""Sampling: logits transforms vectorised over the batch, seeded draws, and logprobs.

Every setting is a per-row tensor, so one step with rows of mixed settings costs a handful of
batched ops and no per-row Python beyond building the settings (and hashing the seed of rows
that carry one). A feature no row uses is skipped for the whole batch: no history tensors
without penalties, no sort without a random row that asks for top_k or top_p, no log_softmax
without a logprobs request.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from astrai.inference.constraints import TokenMask
    from astrai.inference.task import GenerationParams

_MASK64 = (1 << 64) - 1
# Below this temperature a row is greedy: the distribution is an argmax to float precision,
# and dividing by a vanishing temperature could overflow the logits.
MIN_TEMPERATURE = 1e-5
# A penalised logit is kept within this: far past certainty for its token, yet small enough
# that dividing by MIN_TEMPERATURE stays finite, so a tiny repetition_penalty cannot make an
# inf and then the NaN that breaks the draw.
MAX_LOGIT = 1e30


def _splitmix64(x: int) -> int:
    """Scramble a 64-bit integer so nearby inputs (seeds, steps) give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) behind a seeded request's draw number `step` (tokens so far).

    Depending on nothing but (seed, step) makes a seeded request reproducible across batch
    compositions, batch positions and preemption with recompute; the top 53 bits of a
    splitmix64 hash are a uniform double, so no generator object is needed per row.
    """
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 11) * 2.0**-53


@dataclass
class TokenOccurrences:
    """Token ids seen by some rows, flattened: row `rows[i]` saw token `ids[i]` once."""

    rows: Tensor  # [N] int64
    ids: Tensor  # [N] int64

    @classmethod
    def build(
        cls, token_lists: Sequence[Sequence[int]], device: torch.device | str
    ) -> TokenOccurrences:
        lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
        ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
        return cls(rows.to(device), ids.to(device))

    def flat_index(self, vocab_size: int) -> Tensor:
        """Positions in the flattened [B * V] logits, one per occurrence."""
        return self.rows * vocab_size + self.ids

    @property
    def index(self) -> tuple[Tensor, Tensor]:
        """The occurrences as an index of [B, V] logits."""
        return self.rows, self.ids


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step as tensors, built once per step.

    A field is None when no row uses its feature, so strategies skip it for the whole batch.
    Greedy rows (temperature below MIN_TEMPERATURE, or top_k 1, which keeps only the argmax)
    hold neutral filter values, so the argmax of the processed logits is their argmax after
    penalties, biases, allowed tokens and masks.
    """

    all_greedy: bool
    top_k_max: int
    logprobs: list[int | None]  # per row: None, or how many alternatives besides the chosen
    # [B] bool, the greedy rows where greedy and random rows mix (else None: all_greedy says)
    greedy: Tensor | None = None
    temperature: Tensor | None = None  # [B] float32, 1 for greedy rows
    top_k: Tensor | None = None  # [B] int64, 0 = off
    top_p: Tensor | None = None  # [B] float32, 1 = off
    min_p: Tensor | None = None  # [B] float32, 0 = off
    repetition_penalty: Tensor | None = None  # [B] float32, 1 = off
    prompt_and_output: TokenOccurrences | None = None  # what repetition_penalty looks at
    presence_penalty: Tensor | None = None  # [B] float32, set (maybe all 0) when output is
    frequency_penalty: Tensor | None = None  # [B] float32, set (maybe all 0) when output is
    output: TokenOccurrences | None = None  # what presence and frequency penalties look at
    logit_bias: TokenOccurrences | None = None  # the biased tokens of every row
    logit_bias_values: Tensor | None = None  # [N] float32, the bias of each of them
    allowed: TokenOccurrences | None = None  # the tokens rows with allowed_token_ids may sample
    allowed_rows: Tensor | None = None  # [R] int64, the rows with allowed_token_ids
    banned: TokenOccurrences | None = None  # stop tokens of rows short of their min_tokens
    mask: TokenMask | None = None  # the constrained rows' grammar masks
    forced_rows: Tensor | None = None  # [F] int64, rows whose thinking budget forces their token
    forced_ids: Tensor | None = None  # [F] int64, the token each of them must take
    seeded_rows: Tensor | None = None  # [S] int64, random rows with a seed
    seeded_uniforms: Tensor | None = None  # [S] float32, seeded_uniform(seed, len(output_ids))

    @classmethod
    def build(
        cls,
        params: Sequence[GenerationParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        device: torch.device | str,
        stop_token_ids: Sequence[Collection[int]] | None = None,
        mask: TokenMask | None = None,
    ) -> SamplingBatch:
        """stop_token_ids: per row, what min_tokens bans (the task's, EOS included; default
        each row's params.stop_token_ids); mask: the step's grammar masks of its rows."""

        if mask is None and all(map(_raw_argmax, params)):
            return cls(all_greedy=True, top_k_max=0, logprobs=[p.logprobs for p in params])

        def per_row(values: list, neutral: float, dtype=torch.float32) -> Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [_greedy(p) for p in params]
        settings = list(zip(params, greedy, strict=True))
        temperature = [1.0 if g else p.temperature for p, g in settings]
        top_k = [0 if g else p.top_k for p, g in settings]
        top_p = [1.0 if g else p.top_p for p, g in settings]
        min_p = [0.0 if g else p.min_p for p, g in settings]

        repetition = [p.repetition_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition_penalty = per_row(repetition, 1.0)
        prompt_and_output = None
        if repetition_penalty is not None:
            prompt_and_output = TokenOccurrences.build(
                [
                    [*prompt, *output] if r != 1.0 else []
                    for prompt, output, r in zip(prompt_ids, output_ids, repetition, strict=True)
                ],
                device,
            )
        uses_counts = [pr != 0.0 or fr != 0.0 for pr, fr in zip(presence, frequency, strict=True)]
        output = presence_penalty = frequency_penalty = None
        if any(uses_counts):
            output = TokenOccurrences.build(
                [ids if u else [] for ids, u in zip(output_ids, uses_counts, strict=True)], device
            )
            presence_penalty = torch.tensor(presence, device=device)
            frequency_penalty = torch.tensor(frequency, device=device)

        logit_bias = logit_bias_values = None
        if any(p.logit_bias for p in params):
            biases = [p.logit_bias or {} for p in params]
            logit_bias = TokenOccurrences.build([list(b) for b in biases], device)
            logit_bias_values = torch.tensor(
                [v for b in biases for v in b.values()], dtype=torch.float32, device=device
            )
        allowed = allowed_rows = None
        if any(p.allowed_token_ids for p in params):
            allowed = TokenOccurrences.build([p.allowed_token_ids for p in params], device)
            rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
            allowed_rows = torch.tensor(rows, dtype=torch.long, device=device)
        banned = None
        if stop_token_ids is None:
            stop_token_ids = [p.stop_token_ids for p in params]
        short = [len(ids) < p.min_tokens for p, ids in zip(params, output_ids, strict=True)]
        if any(short):
            banned = TokenOccurrences.build(
                [sorted(s) if b else [] for s, b in zip(stop_token_ids, short, strict=True)],
                device,
            )

        forced = [
            p.thinking_budget and p.thinking_budget.forced_token(ids)
            for p, ids in zip(params, output_ids, strict=True)
        ]
        forced_rows = [i for i, token in enumerate(forced) if token is not None]

        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        uniforms = [seeded_uniform(params[i].seed, len(output_ids[i])) for i in seeded]
        return cls(
            greedy=torch.tensor(greedy, device=device) if any(greedy) and not all(greedy) else None,
            all_greedy=all(greedy),
            temperature=per_row(temperature, 1.0),
            top_k=per_row(top_k, 0, torch.long),
            top_k_max=max(top_k, default=0),
            top_p=per_row(top_p, 1.0),
            min_p=per_row(min_p, 0.0),
            repetition_penalty=repetition_penalty,
            prompt_and_output=prompt_and_output,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            output=output,
            logit_bias=logit_bias,
            logit_bias_values=logit_bias_values,
            allowed=allowed,
            allowed_rows=allowed_rows,
            banned=banned,
            mask=mask,
            forced_rows=torch.tensor(forced_rows, device=device) if forced_rows else None,
            forced_ids=torch.tensor([forced[i] for i in forced_rows], device=device)
            if forced_rows
            else None,
            seeded_rows=torch.tensor(seeded, dtype=torch.long, device=device) if seeded else None,
            seeded_uniforms=torch.tensor(uniforms, device=device) if seeded else None,
            logprobs=[p.logprobs for p in params],
        )


def _greedy(params: GenerationParams) -> bool:
    """Whether a row takes its argmax: temperature below MIN_TEMPERATURE, or top_k 1."""
    return params.temperature < MIN_TEMPERATURE or params.top_k == 1


def _raw_argmax(params: GenerationParams) -> bool:
    """Whether a row's token is the argmax of its raw logits: greedy, with no penalty, bias,
    allowed set, min_tokens or thinking budget to change them first (a grammar mask is the
    step's, not the row's)."""
    return (
        _greedy(params)
        and params.repetition_penalty == 1.0
        and params.presence_penalty == params.frequency_penalty == 0.0
        and not params.logit_bias
        and not params.allowed_token_ids
        and params.min_tokens == 0
        and params.thinking_budget is None
    )


class BaseSamplingStrategy(ABC):
    """One logits transform, applied to the whole batch at once with per-row values."""

    @abstractmethod
    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """[B, V] float32 logits -> [B, V]; a row whose setting is neutral comes back unchanged."""


class PenaltyStrategy(BaseSamplingStrategy):
    """Repetition (HF: prompt and output tokens) and presence/frequency (OpenAI: output only).

    Repetition divides a seen token's positive logit by the penalty and multiplies a negative
    one, so a penalty > 1 always makes it less likely; presence subtracts a constant from every
    token already generated, frequency subtracts per occurrence.
    """

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.prompt_and_output is None and batch.output is None:
            return logits
        # Only the seen tokens change: gather and scatter them instead of passing over [B, V].
        vocab_size = logits.shape[-1]
        logits = logits.clone()
        flat = logits.view(-1)
        if batch.repetition_penalty is not None and batch.prompt_and_output is not None:
            index = batch.prompt_and_output.flat_index(vocab_size)
            seen = flat[index]
            penalty = batch.repetition_penalty[batch.prompt_and_output.rows]
            # Repeats of a token write the same value, so duplicates in index are harmless.
            penalised = torch.where(seen > 0, seen / penalty, seen * penalty)
            flat[index] = penalised.clamp(-MAX_LOGIT, MAX_LOGIT)
        if batch.output is not None:
            assert batch.frequency_penalty is not None and batch.presence_penalty is not None
            index, counts = batch.output.flat_index(vocab_size).unique(return_counts=True)
            rows = index // vocab_size
            flat[index] = (
                flat[index] - batch.frequency_penalty[rows] * counts - batch.presence_penalty[rows]
            )
        return logits


class LogitBiasStrategy(BaseSamplingStrategy):
    """OpenAI's logit_bias: each row's biases added to its tokens' logits."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.logit_bias is None:
            return logits
        return logits.index_put(batch.logit_bias.index, batch.logit_bias_values, accumulate=True)


class AllowedTokensStrategy(BaseSamplingStrategy):
    """vLLM's allowed_token_ids: a row that names them samples among them alone."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.allowed is None:
            return logits
        kept = logits[batch.allowed.index]
        limited = logits.index_fill(0, batch.allowed_rows, float("-inf"))
        limited[batch.allowed.index] = kept
        return limited


class MinTokensStrategy(BaseSamplingStrategy):
    """vLLM's min_tokens: a row's stop tokens (EOS, stop_token_ids) are banned until it has
    generated that many tokens."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.banned is None:
            return logits
        return logits.index_put(batch.banned.index, logits.new_tensor(float("-inf")))


class ConstraintMaskStrategy(BaseSamplingStrategy):
    """The constrained rows' grammar masks: every token the grammar forbids goes to -inf.

    After the penalties and biases, before temperature and the filters, so each filter keeps
    tokens among the allowed ones (constraints.py says more).
    """

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.mask is None:
            return logits
        return batch.mask.apply(logits.clone())


class ForcedTokenStrategy(BaseSamplingStrategy):
    """A spent thinking budget: the row's next token is the one it forces, whatever the model
    and the other strategies make of it."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.forced_rows is None:
            return logits
        forced = logits.index_fill(0, batch.forced_rows, float("-inf"))
        forced[batch.forced_rows, batch.forced_ids] = 0.0
        return forced


class TemperatureStrategy(BaseSamplingStrategy):
    """Divides each row's logits by its temperature (greedy rows carry 1)."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.temperature is None:
            return logits
        return logits / batch.temperature[:, None]


class TopKStrategy(BaseSamplingStrategy):
    """Keeps each row's k largest logits (ties with the k-th are kept, as in HF)."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.top_k is None:
            return logits
        k_max = min(batch.top_k_max, logits.shape[-1])
        # Only the k_max largest are needed for every row's k-th value: a partial sort.
        top = logits.topk(k_max, dim=-1).values  # [B, k_max]
        k = batch.top_k.clamp(1, k_max)
        kth = top.gather(1, (k - 1)[:, None])
        kth = kth.masked_fill((batch.top_k == 0)[:, None], float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))


NUCLEUS_CANDIDATES = 256


def _nucleus_threshold(sorted_probs: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """The least probability in each row's nucleus, and whether the given ones held all of it.

    sorted_probs [R, K] are a row's K largest probabilities, largest first, K <= V.
    """
    cumulative = sorted_probs.cumsum(dim=-1)
    # A token is in the nucleus while the more likely ones before it fall short of top_p; the
    # most likely token always is, even for a top_p that float32 rounds to 0.
    size = ((cumulative - sorted_probs) < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_probs.gather(1, size - 1), cumulative[:, -1] >= top_p[:, 0]


class TopPStrategy(BaseSamplingStrategy):
    """Keeps each row's nucleus: the fewest most likely tokens whose probability is >= top_p.

    Tokens tied with the nucleus's least likely one are kept too, so the set does not depend
    on how a sort orders ties. The nucleus is looked for among the NUCLEUS_CANDIDATES most
    likely tokens first (a partial sort); only rows whose nucleus is larger sort their vocab.
    """

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.top_p is None:
            return logits
        top_p = batch.top_p[:, None]
        probs = logits.softmax(dim=-1)
        candidates = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1).values
        threshold, complete = _nucleus_threshold(candidates, top_p)
        # Rows with top_p 1 are exempt: rounding can make the running sum reach 1 early.
        exempt = top_p >= 1.0
        larger = (~complete & ~exempt[:, 0]).nonzero()[:, 0]
        if larger.numel():
            full = probs[larger].sort(dim=-1, descending=True).values
            threshold[larger] = _nucleus_threshold(full, top_p[larger])[0]
        threshold = threshold.masked_fill(exempt, 0.0)
        return logits.masked_fill(probs < threshold, float("-inf"))


class MinPStrategy(BaseSamplingStrategy):
    """Keeps the tokens whose probability is at least min_p times the row's top probability."""

    def apply(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.min_p is None:
            return logits
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, float("-inf"))


class SamplingPipeline:
    """The strategies a step's logits go through, in order, before the draw."""

    def __init__(self, strategies: list[BaseSamplingStrategy] | None = None) -> None:
        if strategies is None:
            strategies = [
                PenaltyStrategy(),
                LogitBiasStrategy(),
                AllowedTokensStrategy(),
                MinTokensStrategy(),
                ConstraintMaskStrategy(),
                ForcedTokenStrategy(),
                TemperatureStrategy(),
                TopKStrategy(),
                TopPStrategy(),
                MinPStrategy(),
            ]
        self.strategies = strategies

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        for strategy in self.strategies:
            logits = strategy.apply(logits, batch)
        return logits


@dataclass
class SampleOutput:
    """One step's draw: a token per row, and logprobs when some row asked for them.

    logprobs holds the chosen token's logprob for every row that asked (others hold NaN);
    top_logprobs holds, per row, its k most likely (token_id, logprob) pairs, most likely
    first, [] for rows that asked for none; it is None when no row asked for alternatives.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def argmax_rows(logits: Tensor) -> Tensor:
    """Each row's argmax [B] (int64) of float32 logits [B, V], as torch.argmax picks it: the
    first of equal maxima, a NaN above any number. On the CPU through NumPy, whose argmax of a
    large vocabulary's row is many times faster than torch's (benchmarks/README.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def _draw(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """Inverse-CDF sampling: each row's first token whose cumulative probability passes u.

    One uniform per row (a seeded row's own, the others from the global RNG) keeps seeded
    draws cheap and independent of the batch. Filtered tokens add nothing to the running sum,
    so they can never be the first to pass it; rounding the float32 sum moves any token's
    chance by at most 2**-25.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    uniform = torch.rand(total.shape, device=probs.device)
    if batch.seeded_rows is not None:
        uniform[batch.seeded_rows, 0] = batch.seeded_uniforms
    # Below the total, so the search always lands on a token of non-zero probability.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _logprobs(
    logits: Tensor, token_ids: Tensor, requested: list[int | None]
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Logprobs under the raw model distribution for the rows that asked, as OpenAI reports."""
    rows = [i for i, k in enumerate(requested) if k is not None]
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids.index_select(0, index)[:, None])[:, 0].tolist()
    per_row = [float("nan")] * len(requested)
    for row, value in zip(rows, chosen, strict=True):
        per_row[row] = value
    k_max = max(requested[row] for row in rows)
    if k_max == 0:
        return per_row, None
    top_values, top_ids = logprobs.topk(k_max, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in requested]
    for r, row in enumerate(rows):
        k = requested[row]
        top[row] = list(zip(top_ids[r][:k], top_values[r][:k], strict=True))
    return per_row, top


def sample(
    logits: Tensor, batch: SamplingBatch, pipeline: SamplingPipeline | None = None
) -> SampleOutput:
    """Draws the next token of every row from [B, V] logits.

    Greedy rows take the argmax after penalties; random rows draw from the softmax of the
    processed logits. Logprobs, when asked for, are of the raw logits. The logits are not
    modified.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(batch.logprobs), (
        "a row of logits per request"
    )
    logits = logits.float()
    processed = (pipeline or _DEFAULT_PIPELINE)(logits, batch)
    if batch.all_greedy:
        token_ids = argmax_rows(processed)
    else:
        token_ids = _draw(processed.softmax(dim=-1), batch)
        if batch.greedy is not None:
            token_ids = torch.where(batch.greedy, argmax_rows(processed), token_ids)
    logprobs = top_logprobs = None
    if any(k is not None for k in batch.logprobs):
        logprobs, top_logprobs = _logprobs(logits, token_ids, batch.logprobs)
    return SampleOutput(token_ids.tolist(), logprobs, top_logprobs)


_DEFAULT_PIPELINE = SamplingPipeline()
