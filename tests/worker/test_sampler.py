"""The sampler: greedy, truncation, logprobs, and counter-based noise that ignores batch composition."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.sampler import SamplingParams, check_params, sample, to_int64, truncation_mask, uniform_noise

U64 = (1 << 64) - 1


def splitmix_ref(z: int) -> int:
    """splitmix64's finalizer on Python ints: the reference the int64 tensor version must match bit for bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def noise_ref(seed: int, position: int, v: int) -> float:
    g = 0x9E3779B97F4A7C15
    row = splitmix_ref((splitmix_ref((seed + g) & U64) + position * g) & U64)
    z = splitmix_ref((row + (v + 1) * g) & U64)
    return ((z >> 11) + 0.5) * 2.0**-53


def logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_noise_matches_uint64_reference() -> None:
    seeds = [0, 1, 12345, (1 << 63) + 17, U64]
    positions = [0, 5, 1 << 20, 7, 300]
    got = uniform_noise(torch.tensor([to_int64(s) for s in seeds]), torch.tensor(positions), 40)
    for i, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        for v in (0, 1, 39):
            assert got[i, v].item() == noise_ref(s, p, v)
    assert got.min().item() > 0 and got.max().item() < 1


def test_greedy_is_argmax_and_top_k_one_is_greedy() -> None:
    x = logits(8, 50)
    greedy = sample(x, [SamplingParams()] * 8, list(range(8)))
    assert torch.equal(greedy.token_ids, x.argmax(dim=-1))
    top1 = sample(x, [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)], list(range(8)))
    assert torch.equal(top1.token_ids, greedy.token_ids)


def test_seeded_sampling_ignores_row_order_and_batch_size() -> None:
    x = logits(6, 64)
    params = [SamplingParams(temperature=1.0, seed=100 + i, top_p=0.9 if i % 2 else 1.0) for i in range(6)]
    positions = [3, 10, 10, 0, 99, 4]
    together = sample(x, params, positions).token_ids
    for i in range(6):
        alone = sample(x[i : i + 1], [params[i]], [positions[i]]).token_ids
        assert alone.item() == together[i].item()
    order = [5, 2, 0, 4, 1, 3]
    shuffled = sample(x[order], [params[i] for i in order], [positions[i] for i in order]).token_ids
    assert shuffled.tolist() == [together[i].item() for i in order]
    # Mixed with greedy rows and repeated: still the same.
    mixed = sample(torch.cat([x, x]), params + [SamplingParams()] * 6, positions * 2).token_ids
    assert mixed[:6].tolist() == together.tolist()


def test_different_seeds_and_positions_differ() -> None:
    x = torch.zeros(1, 1000)  # uniform: every token equally likely, the noise alone decides
    by_seed = {sample(x, [SamplingParams(temperature=1.0, seed=s)], [0]).token_ids.item() for s in range(20)}
    by_pos = {sample(x, [SamplingParams(temperature=1.0, seed=7)], [p]).token_ids.item() for p in range(20)}
    assert len(by_seed) > 15 and len(by_pos) > 15


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = probs.log().repeat(3000, 1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3000)]
    counts = torch.bincount(sample(x, params, [0] * 3000).token_ids, minlength=3).float() / 3000
    assert torch.allclose(counts, probs, atol=0.03)


def test_logprobs_match_log_softmax() -> None:
    x = logits(4, 30)
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=1, logprobs=5, top_k=3)]
    params += [SamplingParams(temperature=2.0, seed=2, logprobs=20), SamplingParams(logprobs=1)]
    out = sample(x, params, [0, 1, 2, 3])
    assert out.top_ids.shape == (4, 20) and out.top_logprobs.shape == (4, 20)
    for i, p in enumerate(params):
        ref = torch.log_softmax(x[i] / (p.temperature or 1.0), dim=-1)
        assert math.isclose(out.logprobs[i].item(), ref[out.token_ids[i]].item(), abs_tol=1e-5)
        values, ids = ref.sort(descending=True)
        assert torch.allclose(out.top_logprobs[i], values[:20], atol=1e-5)
        assert out.top_ids[i, :5].tolist() == ids[:5].tolist()
    assert sample(x, [SamplingParams()] * 4, [0] * 4).top_ids.shape == (4, 0)


def test_check_params() -> None:
    assert check_params(0.0, 0.0, 0, 0) is None
    assert check_params(1.0, 1.0, 5, 20) is None
    assert "temperature" in (check_params(-1.0, 1.0, 0, 0) or "")
    assert "temperature" in (check_params(math.nan, 1.0, 0, 0) or "")
    assert "top_p" in (check_params(1.0, 1.5, 0, 0) or "")
    assert "top_k" in (check_params(1.0, 1.0, -2, 0) or "")
    assert "logprobs" in (check_params(1.0, 1.0, 0, 21) or "")


def test_truncation_mask_basic() -> None:
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert truncation_mask(x, torch.tensor([2]), torch.tensor([1.0])).tolist() == [[True, False, True, False]]
    # Probabilities ~[0.64, 0.09, 0.24, 0.03]: 0.5 keeps one token, 0.7 keeps two.
    assert truncation_mask(x, torch.tensor([0]), torch.tensor([0.5])).tolist() == [[True, False, False, False]]
    assert truncation_mask(x, torch.tensor([0]), torch.tensor([0.7])).tolist() == [[True, False, True, False]]


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=12),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.0, 1.0),
    seed=st.integers(0, U64),
    position=st.integers(0, 10_000),
)
def test_truncation_never_picks_outside_the_allowed_set(
    values: list[float], temperature: float, top_k: int, top_p: float, seed: int, position: int
) -> None:
    x = torch.tensor([values], dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=to_int64(seed))
    token = int(sample(x, [params], [position]).token_ids.item())
    scaled = x[0] / torch.tensor(temperature, dtype=torch.float32)
    probs = scaled.softmax(dim=-1)
    better = scaled > scaled[token]  # tokens strictly more likely than the chosen one
    if top_k > 0:
        assert int(better.sum()) < top_k
    if 0 < top_p < 1:
        assert float(probs[better].sum()) < top_p + 1e-5


def test_temperature_scaling_applies_per_row_next_to_unscaled_rows() -> None:
    """Rows with temperature != 1 are scaled (and logprobs with them); greedy and temperature-1 rows, for which
    the sampler skips the division, are not."""
    x = logits(3, 80, seed=3)
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=9), SamplingParams(temperature=1.0, seed=9)]
    out = sample(x, params, [4, 4, 4])
    alone_hot = sample(x[1:2] / 0.5, [SamplingParams(temperature=1.0, seed=9)], [4])
    assert out.token_ids[0].item() == x[0].argmax().item()
    assert out.token_ids[1].item() == alone_hot.token_ids.item()
    torch.testing.assert_close(out.logprobs[1:2], alone_hot.logprobs)
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(x[0], dim=-1).max())
    assert out.token_ids[2].item() == sample(x[2:3], [params[2]], [4]).token_ids.item()
