"""Weight-only quantized linears (`--weights`, worker/quant_linear.py): the kernel for small steps and the
dequantized weights for large ones, each mode's logits near dense, and `auto` choosing per step (the kernel
itself: test_quant_matmul.py; the one-call decode step: test_decode_step.py). The dense float32 path against
transformers is test_numerics.py (it loads with the default, dense)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from worker.batch import PackedBatch, SeqSlice
from worker.kernels import quant_matmul
from worker.loaded import ModelLoadError
from worker.loading import load_model
from worker.quant_linear import AUTO_MAX_TOKENS, QUANT_MAX_TOKENS, QuantLinear, quantize_weights
from worker.runner import ModelRunner

CPU, FP32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_linear_runs_the_kernel_for_small_steps_and_dense_for_large(bits: int, dtype: torch.dtype) -> None:
    """Up to max_tokens rows: the kernel (int8 activations); above: the dequantized weight, exactly."""
    torch.manual_seed(0)
    w, bias = torch.randn(80, 128).to(dtype), torch.randn(80).to(dtype)
    lin = QuantLinear(w, bias, bits, max_tokens=4)  # type: ignore[arg-type]
    deq = quant_matmul.unpack(lin.packed)
    small, large = torch.randn(3, 128).to(dtype), torch.randn(9, 128).to(dtype)
    got = lin(small)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), quant_matmul.matmul(small, lin.packed, lin.bias32).float())
    want = F.linear(large, deq.to(dtype), bias)
    torch.testing.assert_close(lin(large), want, atol=0, rtol=0)


def test_a_linear_that_does_not_divide_into_groups_stays_dense() -> None:
    model: Any = load_model("builtin", CPU, FP32, weights="dense").model
    model.layers[0].attn.o = torch.nn.Linear(40, model.config.hidden_size)
    quantize_weights(model, "int4")
    assert isinstance(model.layers[0].attn.o, torch.nn.Linear)
    assert isinstance(model.layers[0].mlp.down, QuantLinear)


def _runner(mode: str, dtype: torch.dtype = FP32) -> ModelRunner:
    return ModelRunner(load_model("builtin", CPU, dtype, weights=mode), 8, 16, CPU, dtype)  # type: ignore[arg-type]


def _step(mode: str, dtype: torch.dtype = FP32) -> tuple[torch.Tensor, torch.Tensor]:
    """The builtin model's logits for a 40-token prefill, then a one-token decode step of that sequence."""
    runner = _runner(mode, dtype)
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


def _one_token(mode: str, dtype: torch.dtype = FP32) -> torch.Tensor:
    """Logits of a one-token prompt (a step of one token from an empty cache)."""
    batch = PackedBatch(torch.tensor([5]), torch.tensor([0]), [SeqSlice(0, [0], 0, 1)])
    return _runner(mode, dtype).forward(batch)


def test_auto_runs_int4_for_small_steps_and_dense_for_large() -> None:
    """In bfloat16 up to AUTO_MAX_TOKENS; in float32, whose dense matmuls are slower, up to QUANT_MAX_TOKENS."""
    models: list[Any] = [_runner("auto", dtype).model for dtype in (FP32, BF16)]
    qkv = [m.layers[0].attn.qkv for m in models]
    assert isinstance(qkv[0], QuantLinear) and isinstance(qkv[1], QuantLinear)
    assert qkv[0].max_tokens == QUANT_MAX_TOKENS and qkv[1].max_tokens == AUTO_MAX_TOKENS < 40
    torch.testing.assert_close(_step("auto", BF16)[0], _step("dense", BF16)[0], atol=0, rtol=0)  # 40: dense
    one = _one_token("auto", BF16)
    torch.testing.assert_close(one, _one_token("int4", BF16), atol=0, rtol=0)  # 1 token: int4
    assert not torch.equal(one, _one_token("dense", BF16))


def test_bfloat16_quantized_runs(dense: tuple[torch.Tensor, torch.Tensor]) -> None:
    for got, want in zip(_step("int8", BF16), dense, strict=True):
        assert got.dtype == FP32 and (got - want).abs().mean() / want.std() < 0.1


def test_quantized_weights_are_cpu_only() -> None:
    with pytest.raises(ModelLoadError, match="CPU only"):
        load_model("builtin", torch.device("meta"), FP32, weights="int8")
