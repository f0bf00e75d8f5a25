"""Sampling of one token per sequence from last-position logits.

Randomness is counter-based: the uniform noise for vocab entry v of the token at absolute position p of a
sequence with seed s is a hash of (s, p, v), computed with integer ops on int64 tensors. A token is then
chosen by Gumbel-max (argmax of scaled logits + Gumbel noise), which samples exactly from the softmax. So a
seeded sequence gets the same tokens whatever else shares its batch and whatever row it sits in, and a
takeover that re-runs it elsewhere continues it exactly. No global RNG is ever touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20

_U64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _U64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def to_int64(seed: int) -> int:
    """A uint64 seed (as on the wire) as the int64 the sampler works with."""
    return _signed(seed)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (copies the sign bit); masking the top n bits makes it logical.
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    # splitmix64's finalizer; int64 multiplication wraps modulo 2^64 in torch, as in C on uint64.
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [N, vocab] in (0, 1): entry (i, v) depends only on (seeds[i], positions[i], v)."""
    row = _mix(_mix(seeds + _GOLDEN) + positions * _GOLDEN)
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    bits = _shr(_mix(row[:, None] + ids[None, :] * _GOLDEN), 11)  # the top 53 bits: a float64 mantissa
    return (bits.to(torch.float64) + 0.5) * 2.0**-53


@dataclass(slots=True)
class SamplingParams:
    """One sequence's sampling parameters, already validated."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int = 0  # any int; uint64 seeds keep their bits (see to_int64)
    logprobs: int = 0  # top alternatives to return, 0..MAX_LOGPROBS

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_params(temperature: float, top_p: float, top_k: int, logprobs: int) -> str | None:
    """Why these wire parameters are invalid, or None when they are fine."""
    if not math.isfinite(temperature) or temperature < 0:
        return f"temperature must be a finite number >= 0, got {temperature}"
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        return f"top_p must be in (0, 1] (0 means off), got {top_p}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 means off), got {top_k}"
    if not 0 <= logprobs <= MAX_LOGPROBS:
        return f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}"
    return None


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: the chosen tokens' logprobs
    top_ids: torch.Tensor  # [N, K] int64, K = the largest `logprobs` asked for; most likely first
    top_logprobs: torch.Tensor  # [N, K] float32


def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [N, V]: the tokens that top-k (0 = off) and top-p (>= 1 = off) keep; the best token always stays."""
    vocab = scaled.shape[-1]
    # A stable sort puts the lowest id first among equal logits, so top_k=1 keeps exactly argmax's token.
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p; top_p >= 1 skips the test so rounding in the
    # cumulative sum can never drop the tail.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> SampleResult:
    """Choose one token per row of float32 `logits` [N, V].

    `positions[i]` is the absolute position the chosen token will take in its sequence (the number of tokens
    before it): the noise depends on it and the seed only. Logprobs are log_softmax of the temperature-scaled
    logits before truncation (temperature 1 for greedy rows).
    """
    n, vocab = logits.shape
    device = logits.device
    logits = logits.float()
    scaled = logits
    if any(not p.greedy and p.temperature != 1.0 for p in params):
        # Skipped when every scale is 1 (greedy, or temperature 1): a pass over [N, vocab] saved.
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]

    token_ids = scaled.argmax(dim=-1)  # right for greedy rows; sampled rows are overwritten below
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        # One op set for every sampling row; per-row parameters ride along as tensors.
        idx = torch.tensor(rows, dtype=torch.int64, device=device)
        sub = scaled.index_select(0, idx)
        picked = [params[i] for i in rows]
        top_k = torch.tensor([p.top_k for p in picked], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p if p.top_p > 0 else 1.0 for p in picked], dtype=torch.float32, device=device)
        seeds = torch.tensor([p.seed for p in picked], dtype=torch.int64, device=device)
        pos = torch.tensor([positions[i] for i in rows], dtype=torch.int64, device=device)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, pos, vocab)))
        scores = sub.double() + gumbel
        if bool(((top_k > 0) | (top_p < 1)).any()):
            scores = scores.masked_fill(~truncation_mask(sub, top_k, top_p), -math.inf)
        token_ids = token_ids.index_copy(0, idx, scores.argmax(dim=-1))

    logp = torch.log_softmax(scaled, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)
    k = min(max((p.logprobs for p in params), default=0), vocab)
    if k > 0:
        top_logprobs, top_ids = logp.topk(k, dim=-1)
    else:
        top_logprobs = logp.new_zeros((n, 0))
        top_ids = token_ids.new_zeros((n, 0))
    return SampleResult(token_ids, chosen, top_ids, top_logprobs)
