"""Batched token sampling: one ``[B, V]`` logits tensor, per-row parameters, one call per step.

The last pipeline stage calls :func:`sample_batch` once per forward pass with the logits of
every request in the batch. The steps follow vLLM's sampler:

1. ``min_tokens``: the stop ids (EOS and ``stop_token_ids``) are masked until the request
   has produced that many tokens;
2. ``logit_bias`` is added;
3. penalties: repetition (over prompt and output, divides positive logits and multiplies
   negative ones, as HF/vLLM do), frequency (``- f * count``) and presence (``- p``) over
   the output tokens;
4. log-probabilities are taken from the *raw* logits (vLLM's default ``raw_logprobs``);
5. ``temperature``; rows with temperature 0 are greedy;
6. ``top_k``, ``top_p`` and ``min_p`` filters;
7. one draw per row from its own generator, seeded by ``(seed, step)``, so a request's
   tokens depend only on its seed and never on its batch neighbours or its placement.

Stop *strings* are matched on the detokenized text by the front end (request level), and
stop token ids end the request in the scheduler like EOS.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coral.runtime.protocol import SamplingParams, TopLogprob

__all__ = ["Sampled", "sample_batch", "step_seed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampled:
    """One row's draw: the token, its log-probability and the top alternatives (if asked)."""

    token: int
    logprob: float = 0.0
    top: tuple[TopLogprob, ...] = ()


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a request's ``step``-th token (independent of batch and placement)."""
    return (seed * 1_000_003 + zlib.crc32(f"step{step}".encode())) % (2**62)


def _penalties(x: Any, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]]) -> Any:
    """Apply repetition / frequency / presence penalties to the rows that ask for them (in place)."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
    if not rows:
        return x
    vocab = x.shape[1]
    for i in rows:
        p, hist = params[i], histories[i]
        if not hist:
            continue
        ids = torch.tensor([t for t in hist if 0 <= t < vocab], dtype=torch.long, device=x.device)
        out_ids = ids[min(p.prompt_len, len(ids)) :]
        row = x[i]
        if p.repetition_penalty != 1.0 and len(ids):
            seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            seen[ids] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        if (p.frequency_penalty or p.presence_penalty) and len(out_ids):
            counts = torch.zeros(vocab, dtype=row.dtype, device=x.device)
            counts.scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=row.dtype))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return x


GREEDY_BELOW = 1e-5  # a temperature at or below this samples greedily


def sample_batch(
    logits: Any,
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    histories: Sequence[Sequence[int]] | None = None,
) -> list[Sampled]:
    """Sample the next token of every row.

    Args:
        logits: ``[B, V]`` float tensor (any device; computed in float32).
        params: each row's sampling parameters.
        steps: each row's output index (0 = the first generated token); seeds the draw and
            gates ``min_tokens``.
        histories: each row's prompt followed by its output tokens so far (needed only by
            rows with a penalty; ``params.prompt_len`` splits the two). None = no history.

    Returns:
        One :class:`Sampled` per row, in order.

    Raises:
        ValueError: if the lengths of ``params``, ``steps`` and ``logits`` disagree.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(steps) != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} need one row per params ({len(params)}) and step ({len(steps)})")
    if not params:
        return []
    raw = logits.float()
    x = _biased(raw.clone(), params, steps)
    if histories is not None:
        x = _penalties(x, params, histories)

    want_lp = any(p.logprobs >= 0 for p in params)
    logp = torch.log_softmax(raw, dim=-1) if want_lp else None

    tokens = torch.argmax(x, dim=-1)
    # from the params, not the tensor: reading the temperatures back costs a device sync per row
    rand_rows = [i for i, p in enumerate(params) if p.temperature > GREEDY_BELOW]
    if rand_rows:
        probs = _filtered_probs(x, params, rand_rows)
        for j, i in enumerate(rand_rows):
            g = torch.Generator().manual_seed(step_seed(params[i].seed, steps[i]))
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=g).item())
    return _with_logprobs(tokens.tolist(), params, logp)


def _biased(x: Any, params: Sequence[SamplingParams], steps: Sequence[int]) -> Any:
    """`x` with each row's stop tokens masked while it is short of `min_tokens`, and its `logit_bias` added (in place)."""
    vocab = x.shape[1]
    for i, p in enumerate(params):
        if p.min_tokens and steps[i] < p.min_tokens and p.stop_ids:
            ids = [t for t in p.stop_ids if 0 <= t < vocab]
            if ids:
                x[i, ids] = float("-inf")
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias if 0 <= t < vocab]
            if ids:
                x[i, ids] += torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab], device=x.device)
    return x


def _filtered_probs(x: Any, params: Sequence[SamplingParams], rand_rows: list[int]) -> Any:
    """The sampled rows' probabilities (on the CPU) after temperature, top-k, top-p and min-p."""
    neg = float("-inf")
    vocab = x.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=x.device)
    rows_ids = torch.tensor(rand_rows, device=x.device)
    y = x[rows_ids] / temps[rows_ids].unsqueeze(1)
    top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rand_rows], device=x.device)
    top_p = torch.tensor([params[i].top_p for i in rand_rows], device=x.device)
    min_p = torch.tensor([params[i].min_p for i in rand_rows], device=x.device)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        srt, order = torch.sort(y, dim=-1, descending=True)
        rank = torch.arange(vocab, device=x.device).unsqueeze(0)
        drop = rank >= top_k.unsqueeze(1)
        probs_sorted = torch.softmax(srt.masked_fill(drop, neg), dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        drop |= before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        y = y.scatter(1, order, srt.masked_fill(drop, neg))
    probs = torch.softmax(y, dim=-1)
    if bool((min_p > 0).any()):
        cut = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < cut, torch.zeros_like(probs), probs)
    return probs.cpu()


def _with_logprobs(toks: list[int], params: Sequence[SamplingParams], logp: Any) -> list[Sampled]:
    """One `Sampled` per row: the token, and its log-probability and top alternatives when the row asks."""
    out: list[Sampled] = []
    for i, p in enumerate(params):
        if p.logprobs < 0 or logp is None:
            out.append(Sampled(token=int(toks[i])))
            continue
        row = logp[i]
        top: tuple[TopLogprob, ...] = ()
        if p.logprobs > 0:
            vals, top_ids = torch.topk(row, min(p.logprobs, row.shape[0]))
            top = tuple(TopLogprob(token=int(t), logprob=float(v)) for t, v in zip(top_ids.tolist(), vals.tolist(), strict=True))
        out.append(Sampled(token=int(toks[i]), logprob=float(row[toks[i]]), top=top))
    return out
