"""The quantized matmul kernel (worker/kernels/quant_matmul.cpp): the formats' error bounds, the integer
arithmetic against torch on the same int8 activations, its fused prologues and residual add, bad input, and the
portable and AVX2 builds against this machine's."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import build, quant_matmul
from worker.kernels.quant_matmul import GROUP, pack, unpack

pytestmark = pytest.mark.skipif(not quant_matmul.available(), reason="no C++ compiler: the kernel is not built")


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different scales, and a shifted row: the int4 minimum matters.
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    w[0] += 0.3
    return w


def int8_activations(y: torch.Tensor) -> torch.Tensor:
    """y as the kernel sees it: per group of 32, round-half-even(y * 127 / max|y|) * max|y| / 127."""
    g = y.float().reshape(y.shape[0], -1, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127)).reshape(y.shape)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_error_is_about_half_a_step(bits: int) -> None:
    w = weights(48, 4 * GROUP)
    p = pack(w, bits)  # type: ignore[arg-type]
    step = p.d.float().repeat_interleave(GROUP, dim=1)
    err = (unpack(p) - w).abs()
    # half a step, plus what rounding the scale (and the int4 minimum) to float16 moved the grid by
    assert (err <= step * 0.5 + step * 15 * 2**-11 + w.abs() * 2**-10 + 1e-6).all()
    if bits == 4:
        codes = torch.cat([p.codes & 0x0F, p.codes >> 4], dim=-1)
        assert int(codes.min()) == 0 and int(codes.max()) == 15
    else:
        assert int(p.codes.abs().max()) == 127


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [96, 128])  # an odd and an even number of groups
@pytest.mark.parametrize("m", [1, 3, 4, 9])  # below, at and across the kernel's 4-row tiles
def test_kernel_is_exact_given_its_int8_activations(bits: int, k: int, m: int) -> None:
    w, x, bias = weights(40, k), torch.randn(m, k), torch.randn(40)
    x[0, :GROUP] = 0  # an all-zero group
    p = pack(w, bits)  # type: ignore[arg-type]
    want = F.linear(int8_activations(x).double(), unpack(p).double(), bias.double()).float()
    got = quant_matmul.matmul(x, p, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_error_against_float_weights_is_small(bits: int) -> None:
    """What the int8 activations cost, on top of the weights' own rounding."""
    w, x = weights(64, 256), torch.randn(4, 256)
    p = pack(w, bits)  # type: ignore[arg-type]
    want = x @ unpack(p).T
    err = (quant_matmul.matmul(x, p) - want).norm() / want.norm()
    assert err < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_prologues_and_residual_match_torch(bits: int) -> None:
    torch.manual_seed(1)
    k, n = 128, 48
    p = pack(weights(n, k), bits)  # type: ignore[arg-type]
    x, norm, gated, base = torch.randn(3, k), torch.rand(k) + 0.5, torch.randn(3, 2 * k), torch.randn(3, n)
    normed = quant_matmul.matmul(x, p, prologue="rms_norm", norm=norm, eps=1e-5)
    torch.testing.assert_close(normed, quant_matmul.matmul(F.rms_norm(x, (k,), norm, 1e-5), p), atol=1e-4, rtol=0)
    silu = quant_matmul.matmul(gated, p, prologue="silu_gate")
    want = quant_matmul.matmul(F.silu(gated[:, :k]) * gated[:, k:], p)
    torch.testing.assert_close(silu, want, atol=1e-4, rtol=0)
    out = base.clone()
    assert quant_matmul.matmul(x, p, out=out) is out
    torch.testing.assert_close(out, base + quant_matmul.matmul(x, p), atol=1e-6, rtol=0)


def test_bfloat16_in_and_out() -> None:
    p, x = pack(weights(40, 128), 4), torch.randn(2, 128)
    got = quant_matmul.matmul(x.bfloat16(), p)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, quant_matmul.matmul(x.bfloat16().float(), p).bfloat16())
    base = torch.randn(2, 40).bfloat16()
    out = quant_matmul.matmul(x.bfloat16(), p, out=base.clone())
    torch.testing.assert_close(out.float(), base.float() + got.float(), atol=0.02, rtol=0.01)


def test_bad_input_is_a_clear_error() -> None:
    """The kernel reads and writes raw memory: a wrong shape, dtype or layout is refused before it runs."""
    p, x = pack(weights(40, 128), 8), torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"x must be a CPU float32 or bfloat16 \[M, 128\]"):
        quant_matmul.matmul(torch.randn(2, 96), p)
    with pytest.raises(ValueError, match=r"\[M, 256\]"):
        quant_matmul.matmul(x, p, prologue="silu_gate")
    with pytest.raises(ValueError, match=r"rms_norm needs norm: a contiguous CPU float32 \[128\]"):
        quant_matmul.matmul(x, p, prologue="rms_norm")
    with pytest.raises(ValueError, match=r"rms_norm needs norm"):
        quant_matmul.matmul(x, p, prologue="rms_norm", norm=torch.ones(256)[::2])  # strided
    with pytest.raises(ValueError, match=r"bias must be a contiguous CPU float32 \[40\]"):
        quant_matmul.matmul(x, p, torch.ones(39))
    with pytest.raises(ValueError, match=r"out must be a contiguous CPU torch.float32 \[2, 40\]"):
        quant_matmul.matmul(x, p, out=torch.zeros(2, 40, dtype=torch.bfloat16))
    assert not quant_matmul.supports(torch.randn(8, 40))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_builds_equal_this_machines(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same file built for a plain x86-64 (the scalar loops) and for Haswell (AVX2's maddubs, no VNNI) gives
    what this machine's build gives."""
    if arch == "haswell" and "avx2" not in build._cpu_flags().split():
        pytest.skip("this CPU cannot run an AVX2 build")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    source = Path(quant_matmul.__file__).with_name("quant_matmul.cpp")
    flags = [f for f in build.FLAGS if not f.startswith("-march")] + [f"-march={arch}"]
    target = tmp_path / f"{arch}.so"
    build._compile("g++", source, target, flags)
    x, bias = torch.randn(5, 96), torch.randn(40)
    for bits in (4, 8):
        p = pack(weights(40, 96), bits)
        vectorized = quant_matmul.matmul(x, p, bias)
        monkeypatch.setattr(quant_matmul, "_lib", ctypes.CDLL(str(target)))
        other = quant_matmul.matmul(x, p, bias)
        monkeypatch.undo()
        torch.testing.assert_close(other, vectorized, atol=1e-5, rtol=1e-5)
