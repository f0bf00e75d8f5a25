"""The one-call decode step (worker/quant_decode.py) against the model's own forward over the same
quantized weights, on each architecture, and the steps it leaves to that forward.

The two paths differ only in rounding: the decode step keeps the residual stream in float32 and fuses the
norms, so an int8 activation can land one step apart; the logits agree closely, not bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.hf_models import Driver, Seq, save_checkpoint
from worker import quant_decode
from worker.batch import PackedBatch, SeqSlice
from worker.kernels import decode_step
from worker.loading import load_model
from worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="no C++ compiler: the kernels are not built")
CPU, FP32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16

# The test configs with every linear's input a multiple of 32 (quant_matmul.GROUP), so every linear quantizes.
SHAPES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"hidden_size": 96},  # 3 groups: an odd count; GQA; llama3 RoPE
    "Qwen2ForCausalLM": {"hidden_size": 64, "num_attention_heads": 4},  # q/k/v biases; tied head
    "MistralForCausalLM": {"hidden_size": 96, "num_attention_heads": 4, "head_dim": 24},  # sliding window 48
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(request.param, path, **SHAPES[request.param])
    return path


def runner(spec: str | Path, weights: str, dtype: torch.dtype = FP32, **kw: Any) -> ModelRunner:
    loaded = load_model(str(spec), CPU, dtype, weights=weights)  # type: ignore[arg-type]
    return ModelRunner(loaded, 64, 16, CPU, dtype, **kw)


class Counting:
    """Wraps a runner's decode step, counting the steps it ran."""

    def __init__(self, inner: quant_decode.DecodeStep) -> None:
        self.inner, self.calls = inner, 0

    def takes(self, n: int, meta: Any) -> bool:
        return self.inner.takes(n, meta)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args)


def compared(a: Seq, b: Seq) -> tuple[torch.Tensor, torch.Tensor]:
    """Both runs' logits at the positions whose inputs agree (a greedy pick apart ends the comparison)."""
    same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), len(a.tokens))
    positions = [p for p in sorted(a.logits) if p < same]
    assert len(positions) > a.prompt_len // 2
    return torch.stack([a.logits[p] for p in positions]), torch.stack([b.logits[p] for p in positions])


def greedy(r: ModelRunner, fast: bool) -> list[Seq]:
    """Six sequences of different lengths (more than the kernel's tile of 4 rows), chunked prefills mixed with
    decodes, 24 new tokens each."""
    lengths = [5, 37, 70, 12, 3, 20]
    seqs = [Seq(i, [(7 * i + 3 * j) % 200 + 3 for j in range(n)], n) for i, n in enumerate(lengths)]
    saved = r.decode_step
    r.decode_step = saved if fast else None
    try:
        Driver(r, seed=1).run(seqs, new_tokens=24, chunk=32)
    finally:
        r.decode_step = saved
    return seqs


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_decode_step_matches_the_forward(checkpoint: Path, weights: str) -> None:
    r = runner(checkpoint, weights)
    assert r.decode_step is not None
    count = Counting(r.decode_step)
    r.decode_step = count  # type: ignore[assignment]
    fast = greedy(r, fast=True)
    assert count.calls >= 20  # the steps where all six decode
    slow = greedy(r, fast=False)
    for a, b in zip(fast, slow, strict=True):
        ours, ref = compared(a, b)
        err = (ours - ref).abs().mean() / ref.std()
        assert err < 0.02, f"seq {a.seq_id}: mean logit error {float(err):.4f} of their std"


def test_decode_step_in_bfloat16_stays_near_the_forward(checkpoint: Path) -> None:
    r = runner(checkpoint, "int4", BF16)
    fast, slow = greedy(r, fast=True), greedy(r, fast=False)
    for a, b in zip(fast, slow, strict=True):
        ours, ref = compared(a, b)
        assert (ours - ref).abs().mean() / ref.std() < 0.1


def step_of(r: ModelRunner, seqs: list[SeqSlice]) -> tuple[bool, torch.Tensor]:
    """Whether the decode step took this step (its metadata built as the runner builds it), and the logits."""
    count = Counting(r.decode_step)  # type: ignore[arg-type]
    saved, r.decode_step = r.decode_step, count  # type: ignore[assignment]
    ids = torch.tensor([5 + i for s in seqs for i in range(s.num_tokens)])
    positions = torch.tensor([p for s in seqs for p in range(s.start, s.start + s.num_tokens)])
    try:
        logits = r.forward(PackedBatch(ids, positions, seqs))
    finally:
        r.decode_step = saved
    return count.calls == 1, logits


def test_what_the_decode_step_leaves_to_the_forward() -> None:
    r = runner("builtin", "int4")
    assert r.decode_step is not None
    prefill = SeqSlice(0, [0, 1], 0, 20)
    assert not step_of(r, [prefill])[0]
    assert step_of(r, [SeqSlice(0, [0, 1], 20, 1)])[0]
    assert not step_of(r, [SeqSlice(0, [0, 1], 21, 1), SeqSlice(1, [2], 0, 3)])[0]  # a prefill in the step
    r2 = runner("builtin", "auto", BF16)
    assert r2.decode_step is not None
    many = [SeqSlice(i, [i], 0, 1) for i in range(r2.decode_step.max_tokens + 1)]
    assert not step_of(r2, many)[0]  # above auto's int4 steps: dense
    assert step_of(r2, many[:-1])[0]


def test_a_block_beyond_the_cache_is_an_error_not_a_write() -> None:
    r = runner("builtin", "int4")
    r.forward(PackedBatch(torch.arange(3, 23), torch.arange(20), [SeqSlice(0, [0, 2], 0, 20)]))
    with pytest.raises(IndexError, match="beyond the KV cache's 64 blocks"):
        step_of(r, [SeqSlice(0, [0, 64], 20, 1)])
    assert step_of(r, [SeqSlice(0, [0, 2], 20, 1)])[0]  # and the runner goes on


def test_no_decode_step_where_it_cannot_run() -> None:
    assert runner("builtin", "dense").decode_step is None
    assert runner("builtin", "int4", kernels=False).decode_step is None


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_decode_step_over_an_int8_cache_matches_the_forward(checkpoint: Path, weights: str) -> None:
    r = runner(checkpoint, weights, kv_dtype="int8")
    assert r.decode_step is not None
    count = Counting(r.decode_step)
    r.decode_step = count  # type: ignore[assignment]
    fast = greedy(r, fast=True)
    assert count.calls >= 20
    for a, b in zip(fast, greedy(r, fast=False), strict=True):
        ours, ref = compared(a, b)
        assert (ours - ref).abs().mean() / ref.std() < 0.02


def decode_with_tails(r: ModelRunner, fast: bool) -> torch.Tensor:
    """Two sequences with full-precision tails (worker/kv_cache.py) prefilled, then 20 decode steps."""
    saved = r.decode_step
    r.decode_step = saved if fast else None
    tables, tails = [[0, 1, 2], [3, 4, 5]], [[40, 41], [42, 43]]
    try:
        starts = [21, 9]
        seqs = [SeqSlice(i, tables[i], 0, n, tails[i]) for i, n in enumerate(starts)]
        ids = torch.cat([torch.arange(3, 3 + n) for n in starts])
        r.forward(PackedBatch(ids, torch.cat([torch.arange(n) for n in starts]), seqs))
        out = []
        for step in range(20):
            seqs = [SeqSlice(i, tables[i], n + step, 1, tails[i]) for i, n in enumerate(starts)]
            positions = torch.tensor([n + step for n in starts])
            out.append(r.forward(PackedBatch(torch.tensor([7 + step, 9 + step]), positions, seqs)))
        return torch.stack(out)
    finally:
        r.decode_step = saved


def test_decode_step_reads_and_writes_full_precision_tails() -> None:
    r = runner("builtin", "int4", kv_dtype="int8")
    assert r.cache.tail_blocks == 2
    count = Counting(r.decode_step)  # type: ignore[arg-type]
    r.decode_step = count  # type: ignore[assignment]
    fast = decode_with_tails(r, fast=True)
    assert count.calls == 20
    slow = decode_with_tails(r, fast=False)
    assert (fast - slow).abs().mean() / slow.std() < 0.02


def test_an_auto_cache_keeps_the_decode_step_once_int8() -> None:
    r = runner("builtin", "int4", kv_dtype="auto")
    assert r.decode_step is not None
    r.forward(PackedBatch(torch.arange(3, 23), torch.arange(20), [SeqSlice(0, [0, 2], 0, 20)]))
    assert step_of(r, [SeqSlice(0, [0, 2], 20, 1)])[0]
    r.kv_to_int8()
    took, after = step_of(r, [SeqSlice(0, [0, 2], 20, 1)])
    assert took  # the decode step now reads and writes the int8 stores
    saved, r.decode_step = r.decode_step, None
    try:
        forward = r.forward(PackedBatch(torch.tensor([5]), torch.tensor([20]), [SeqSlice(0, [0, 2], 20, 1)]))
    finally:
        r.decode_step = saved
    assert (after - forward).abs().mean() / forward.std() < 0.02
