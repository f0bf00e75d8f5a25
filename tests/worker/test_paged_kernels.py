"""The CPU kernels of worker/kernels/: decode attention read straight from the paged cache against SDPA over the
gathered blocks, for each cache dtype, head size, GQA ratio and sliding window; int8 writes against
kv_quant.quantize; the torch fallback against transformers; and the build's fallback without a compiler."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import build, paged_attention
from worker.kv_cache import KVCache
from worker.kv_quant import dequantize, quantize
from worker.loading import load_model
from worker.model import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.runner import ModelRunner

CPU, FP32 = torch.device("cpu"), torch.float32
BLOCK = 16

pytestmark = pytest.mark.skipif(paged_attention._lib is None, reason="no C++ compiler on this machine")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: list[int], window: int | None
) -> torch.Tensor:
    """Float32 SDPA of each sequence's query over its gathered positions (k, v: [blocks, BLOCK, KV, D] floats)."""
    heads, kv_heads = q.shape[1], k.shape[2]
    out = []
    for s, length in enumerate(lengths):
        lo = max(0, length - window) if window else 0
        keys = k[tables[s]].flatten(0, 1)[lo:length].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = v[tables[s]].flatten(0, 1)[lo:length].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[s].float()[:, None], keys, values)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 32), (4, 4, 128), (6, 2, 24)])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_sdpa_over_the_gathered_blocks(
    cache: str, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(dim * heads)
    seqs, max_blocks = 5, 8
    num_blocks = seqs * max_blocks + 3
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    # Scattered, shuffled block tables; lengths from a single token to a full table, and one mid-block.
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)
    lengths = [1, 17, 40, 100, max_blocks * BLOCK]
    q_dtype = torch.float32 if cache == "float32" else torch.bfloat16
    q = torch.randn(seqs, heads, dim, generator=gen).to(q_dtype)
    if cache == "int8":
        (kq, kc), (vq, vc) = quantize(k), quantize(v)
        out = paged_attention.decode(q, kq, vq, tables.flatten(), torch.tensor(lengths), window, kc, vc)
        k, v = dequantize(kq, kc, FP32), dequantize(vq, vc, FP32)
    else:
        k, v = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
        out = paged_attention.decode(q, k, v, tables.flatten(), torch.tensor(lengths), window)
    assert out.dtype == q_dtype and out.shape == q.shape
    expected = reference(q, k.float(), v.float(), tables, lengths, window)
    tolerance = 1e-5 if cache == "float32" else 1e-2  # bfloat16 outputs: one rounding of values below 4
    torch.testing.assert_close(out.float(), expected.to(q_dtype).float(), atol=tolerance, rtol=0)


@pytest.mark.parametrize("dim", [64, 24])
def test_int8_writes_equal_quantize(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    rows, kv_heads = 70, 3
    x = torch.randn(rows, kv_heads, dim, generator=gen) * torch.logspace(-6, 3, rows)[:, None, None]
    x[3] = 0  # an all-zero vector: code 0, values 0
    x[5, 1, 7] = 1e4  # an outlier channel
    q, code = quantize(x)
    slots = torch.randperm(200, generator=gen)[:rows]
    data = torch.zeros(200, kv_heads, dim, dtype=torch.int8)
    codes = torch.zeros(200, kv_heads, code.shape[-1], dtype=torch.uint8)
    paged_attention.quantize_write(x, slots, data, codes)
    assert torch.equal(codes[slots], code)
    assert torch.equal(data[slots], q)
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[slots] = False
    assert not data[untouched].any() and not codes[untouched].any()


def test_supports_only_what_the_kernels_read() -> None:
    assert paged_attention.supports(torch.zeros(2, BLOCK, 1, 64))
    assert paged_attention.supports(torch.zeros(2, BLOCK, 1, 64, dtype=torch.int8))
    assert not paged_attention.supports(torch.zeros(2, BLOCK, 1, 64, dtype=torch.float16))
    assert not paged_attention.supports(torch.zeros(2, BLOCK, 1, 128)[..., ::2])
    config = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 64,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "max_position_embeddings": 64,
        }
    )
    assert all(k.kernel and v.kernel for k, v in KVCache(config, 4, BLOCK, CPU, FP32, "int8").layers)
    assert not any(k.kernel or v.kernel for k, v in KVCache(config, 4, BLOCK, CPU, FP32, kernels=False).layers)


def test_without_a_compiler_the_kernels_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build.load.__wrapped__("paged_attention") is None


def test_an_unwritable_cache_directory_turns_the_kernels_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # its "coalesce/kernels" cannot be created
    assert build.load.__wrapped__("paged_attention") is None


def test_a_fresh_cache_directory_builds_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.load.__wrapped__("paged_attention") is not None
    assert len(list((tmp_path / "coalesce" / "kernels").glob("paged_attention-*.so"))) == 1


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_torch_path_tracks_transformers_too(arch: str, hf: ModuleType, hf_checkpoint: Any) -> None:
    """test_numerics.py checks the default (kernel) path; this the torch ops that `cpu_kernels=false` and CUDA
    run, on a mixed batch of decodes and prefill chunks."""
    path, hf_model = hf_checkpoint(arch)
    runner = ModelRunner(load_model(str(path), CPU, FP32), 400, BLOCK, CPU, FP32, kernels=False)
    rng = random.Random(3)
    seqs = [hf.Seq(i, [rng.randrange(1000) for _ in range(n)], n) for i, n in enumerate([1, 70, 33, 130])]
    hf.Driver(runner).run(seqs, 8, chunk=24)
    for s in seqs:
        hf.check_against_hf(hf_model, s, new_tokens=8)
