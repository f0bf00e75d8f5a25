"""Weight-only quantized linears (`--weights`, worker/quant_linear.py): the quantizers' error bounds, each
kernel against the dequantized weights it stands for, each mode's logits near dense, and `auto` choosing per
step. The dense float32 path against transformers is test_numerics.py (it loads with the default, dense)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.batch import PackedBatch, SeqSlice
from worker.loaded import ModelLoadError
from worker.loading import load_model
from worker.quant_linear import (
    INT4_GROUP,
    KERNEL_DTYPE,
    QuantLinear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
)
from worker.runner import ModelRunner

CPU, FP32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16


def test_int8_error_is_at_most_half_a_step() -> None:
    w = torch.randn(96, 64) * torch.logspace(-2, 1, 96)[:, None]  # rows of very different scales
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def test_int4_error_is_at_most_half_a_step_per_group() -> None:
    w = torch.randn(48, 4 * INT4_GROUP)
    codes, sz = quantize_int4(w)
    assert sz.shape == (4, 48, 2) and int(codes.min()) == 0 and int(codes.max()) == 15
    step = sz[..., 0].transpose(0, 1).repeat_interleave(INT4_GROUP, dim=1)
    assert ((dequantize_int4(codes, sz) - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_equals_its_dequantized_weights(kind: str, dtype: torch.dtype) -> None:
    """The kernels run in bfloat16 (KERNEL_DTYPE) whatever the model's dtype: the reference rounds the input
    and the scales as they do; the output keeps the model's dtype."""
    torch.manual_seed(0)
    w, bias, x = torch.randn(80, 128), torch.randn(80), torch.randn(5, 128)
    lin = QuantLinear(w.to(dtype), bias.to(dtype), kind)  # type: ignore[arg-type]
    if kind == "int8":
        q, scales = quantize_int8(w.to(dtype))
        deq = q.float() * scales.to(KERNEL_DTYPE).float()[:, None]
    else:
        codes, sz = quantize_int4(w.to(dtype))
        deq = dequantize_int4(codes, sz.to(KERNEL_DTYPE).float())
    want = F.linear(x.to(dtype).to(KERNEL_DTYPE).float(), deq, bias.to(dtype).float())
    got = lin(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


def test_int4_falls_back_to_int8_when_groups_or_rows_do_not_divide() -> None:
    assert QuantLinear(torch.randn(16, INT4_GROUP + 8), None, "int4").kind == "int8"
    assert QuantLinear(torch.randn(8, INT4_GROUP), None, "int4").kind == "int8"
    assert QuantLinear(torch.randn(16, INT4_GROUP), None, "int4").kind == "int4"


def _step(mode: str, dtype: torch.dtype = FP32) -> tuple[torch.Tensor, torch.Tensor]:
    """The builtin model's logits for a 40-token prefill, then a one-token decode step of that sequence."""
    runner = ModelRunner(load_model("builtin", CPU, dtype, weights=mode), 8, 16, CPU, dtype)  # type: ignore[arg-type]
    ids = torch.arange(3, 43)
    prefill = runner.forward(PackedBatch(ids, torch.arange(40), [SeqSlice(0, [0, 1, 2], 0, 40)]), all_logits=True)
    decode = runner.forward(PackedBatch(torch.tensor([7]), torch.tensor([40]), [SeqSlice(0, [0, 1, 2], 40, 1)]))
    return prefill, decode


@pytest.fixture(scope="module")
def dense() -> tuple[torch.Tensor, torch.Tensor]:
    return _step("dense")


@pytest.mark.parametrize(("mode", "tol"), [("int8", 0.05), ("int4", 0.4)])
def test_quantized_logits_stay_near_dense(mode: str, tol: float, dense: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Mean error relative to the logits' spread, on random weights (int8 about 0.02, int4 about 0.23: random
    Gaussian weights are hard on 4 bits). On a real model the bound is perplexity (bench/perplexity.py)."""
    for got, want in zip(_step(mode), dense, strict=True):
        err = (got - want).abs().mean() / want.std()
        assert 0 < err < tol, f"{mode}: mean error {float(err):.4f} of the logits' std"


def _one_token(mode: str) -> torch.Tensor:
    """Logits of a one-token prompt (a step of one token from an empty cache)."""
    runner = ModelRunner(load_model("builtin", CPU, FP32, weights=mode), 8, 16, CPU, FP32)  # type: ignore[arg-type]
    return runner.forward(PackedBatch(torch.tensor([5]), torch.tensor([0]), [SeqSlice(0, [0], 0, 1)]))


def test_auto_runs_int4_for_small_steps_and_dense_for_large(dense: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(_step("auto")[0], dense[0], atol=0, rtol=0)  # 40 tokens: dense
    one = _one_token("auto")
    torch.testing.assert_close(one, _one_token("int4"), atol=0, rtol=0)  # 1 token: int4
    assert not torch.equal(one, _one_token("dense"))


def test_bfloat16_quantized_runs(dense: tuple[torch.Tensor, torch.Tensor]) -> None:
    for got, want in zip(_step("int8", BF16), dense, strict=True):
        assert got.dtype == FP32 and (got - want).abs().mean() / want.std() < 0.1


def test_quantized_weights_are_cpu_only() -> None:
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model("builtin", torch.device("meta"), FP32, weights="int8")
