"""Int8 and auto KV caches (docs/kv_cache.md): quantization error bounds, logits against `transformers` through
an int8 cache, the step that converts an auto cache (blocks written in the model's dtype and blocks written as
int8, read together), copy-on-write and prefix hits on int8 blocks, sizing, and the protocol's checks."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest_server import TEST_SETTINGS

from protos.coalesce.v1 import worker_pb2
from worker.engine import Engine, StepError
from worker.kv_cache import Int8Store, PlainStore, block_bytes
from worker.kv_quant import decode_scale, dequantize, quantize, rotation
from worker.loading import load_model
from worker.model import SUPPORTED_ARCHITECTURES
from worker.runner import ModelRunner

W = worker_pb2
CPU, FP32 = torch.device("cpu"), torch.float32
GREEDY = W.WorkerSampling(logprobs=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_error_is_at_most_half_a_step(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-3, 4, 48)[:, None, None]  # each vector gets its own scales
    x = torch.randn(48, 3, 64, generator=g) * magnitude
    x[5] = 0  # all-zero vectors
    x[7, 1, 9] = 3e4  # one outlier: only its own group of 32 channels gets a coarser step
    x = x.to(dtype)
    q, code = quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and code.shape == (48, 3, 2) and code.dtype == torch.uint8
    xg, s = x.float().view(48, 3, 2, 32), decode_scale(code)
    amax = xg.abs().amax(-1)
    ratio = (s / (amax / 127))[amax > 0]
    assert ratio.min() >= 1 - 1e-6 and ratio.max() <= 2 ** (1 / 8) + 1e-6  # rounded up (nothing clips), < 9 %
    err = (dequantize(q, code, torch.float32).view(48, 3, 2, 32) - xg).abs()
    assert (err <= s[..., None] * (0.5 + 1e-5)).all()
    assert (q[5] == 0).all() and (dequantize(q, code, dtype)[5] == 0).all()
    assert dequantize(q, code, dtype).dtype == dtype and dequantize(q, code, dtype).shape == x.shape
    outlier = s[7, 1, 0]
    assert s[7, 1, 1] < 1e-3 * outlier and s[7, 0].max() < 1e-3 * outlier and s[7, 2].max() < 1e-3 * outlier


def test_a_head_dim_that_is_not_a_multiple_of_32_gets_one_scale_per_vector() -> None:
    x = torch.randn(5, 2, 24)
    q, code = quantize(x)
    assert code.shape == (5, 2, 1) and (dequantize(q, code, torch.float32) - x).abs().max() < x.abs().max() / 200


@pytest.mark.parametrize("dim", [64, 32, 24])
def test_rotation_is_orthonormal_and_spreads_outlier_channels(dim: int) -> None:
    r = rotation(dim)
    torch.testing.assert_close(r @ r.T, torch.eye(dim), atol=1e-6, rtol=0)
    assert torch.equal(r, rotation(dim))  # the same matrix every time
    keys = torch.randn(256, dim, generator=torch.Generator().manual_seed(1))
    keys[:, 3] += 20  # one large channel, as keys have
    spread = keys @ r
    assert (keys.abs().amax(-1) / keys.norm(dim=-1)).mean() > 0.9  # the channel dominates every key...
    assert (spread.abs().amax(-1) / spread.norm(dim=-1)).mean() < 0.6  # ...and no longer after the rotation


def test_tiny_vectors_share_the_smallest_step() -> None:
    x = torch.randn(4, 64) * 1e-6
    q, code = quantize(x)
    assert (code == 0).all() and (dequantize(q, code, torch.float32) - x).abs().max() <= 2**-21


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_int8_cache_tracks_transformers(arch: str, hf: ModuleType, hf_checkpoint: Callable[..., Any]) -> None:
    """Mixed prefill chunks and decodes through an int8 cache: logits near transformers' (the model-dtype cache
    is within 1e-4, see test_numerics.py) and greedy picks that are its argmax almost everywhere."""
    path, hf_model = hf_checkpoint(arch)
    runner = ModelRunner(load_model(str(path), CPU, FP32), 400, 16, CPU, FP32, "int8")
    rng = random.Random(1)
    seqs = [hf.Seq(i, [rng.randrange(1100) for _ in range(30 + 17 * i)], 30 + 17 * i) for i in range(3)]
    hf.Driver(runner).run(seqs, 32, chunk=24)
    agree = total = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf_model(torch.tensor([s.tokens[:-1]])).logits[0]
        positions = sorted(s.logits)
        diff = (torch.stack([s.logits[p] for p in positions]) - ref[positions]).abs().max().item()
        assert diff < 0.1, f"seq {s.seq_id}: max logit diff {diff} (logits' std {ref.std().item():.2f})"
        picks = ref[s.prompt_len - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(s.tokens[s.prompt_len :], picks, strict=True))
        total += len(picks)
    assert agree >= 0.9 * total


def engine(kv: str, mb: int = 4) -> Engine:
    update = {"kv_cache_dtype": kv, "kv_cache_mb": mb}
    return Engine(ModelRunner.from_settings(TEST_SETTINGS.model_copy(update=update)))


def prompt(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(n * 7 + salt)
    return [rng.randrange(256) for _ in range(n)]


def work(seq_id: int, start: int, blocks: list[int], tokens: list[int] | None = None) -> worker_pb2.SequenceWork:
    """A decode (no tokens) or, with tokens, the first sight of a sequence."""
    if tokens is None:
        return W.SequenceWork(seq_id=seq_id, start_position=start, new_blocks=blocks, sample=True)
    return W.SequenceWork(
        seq_id=seq_id, token_ids=tokens, start_position=start, new_blocks=blocks, sampling=GREEDY, sample=True
    )


def run(e: Engine, steps: list[W.StepRequest]) -> list[dict[int, tuple[int, float]]]:
    """Each step's {seq_id: (token, logprob)}."""
    out = []
    for req in steps:
        resp = e.step(req)
        out.append({t.seq_id: (t.token.token_id, t.token.logprob) for t in resp.tokens})
    return out


def converting_script(u: int) -> list[W.StepRequest]:
    """Two sequences in the model's dtype for two steps, then the step that converts (block ids for an auto cache
    with u units per model-dtype block; u = 1 gives the same script for a model-dtype cache)."""
    a, b = prompt(40), prompt(21, salt=1)
    return [
        W.StepRequest(step_id=1, seqs=[work(1, 0, [0, u, 2 * u], a), work(2, 0, [3 * u, 4 * u], b)]),
        W.StepRequest(step_id=2, seqs=[work(1, 40, []), work(2, 21, [])]),
        # Seqs 1 and 2 read blocks written in the model's dtype (converted now) and write int8; seq 3 maps seq 1's
        # first two blocks (a prefix hit) and a copy of its partial third one, and continues into unit u + 1,
        # which was part of a model-dtype block until this step.
        W.StepRequest(
            step_id=3,
            kv_to_int8=u > 1,
            copies=[W.BlockCopy(src=2 * u, dst=5 * u)],
            seqs=[work(1, 41, []), work(2, 22, []), work(3, 40, [0, u, 5 * u, u + 1 if u > 1 else 6], prompt(9))],
        ),
        W.StepRequest(step_id=4, seqs=[work(1, 42, []), work(2, 23, []), work(3, 49, [])]),
    ]


def test_the_converting_step_reads_blocks_written_in_the_model_dtype_and_in_int8() -> None:
    auto, model = engine("auto"), engine("model")
    u = auto.info().kv_block_units
    assert u == 4  # float32: one model-dtype block is four int8 blocks
    script = converting_script(u)
    got = run(auto, script[:2])
    before = [store.data[:2].clone() for layer in auto.runner.cache.layers for store in layer]
    got += run(auto, script[2:])
    after = [store for layer in auto.runner.cache.layers for store in layer]
    assert auto.runner.cache.int8 and all(isinstance(s, Int8Store) for s in after)
    for old, store in zip(before, after, strict=True):  # converted in place: block b's K/V are now unit b's
        assert isinstance(store, Int8Store)
        q, code = quantize(old.float() @ store.rotation)
        assert torch.equal(store.data[0 : 2 * u : u], q) and torch.equal(store.scales[0 : 2 * u : u], code)
    want = run(model, converting_script(1))
    assert got[:2] == want[:2]  # until the conversion, exactly the model-dtype cache's numbers
    for g, w in zip(got[2:], want[2:], strict=True):
        assert g.keys() == w.keys() == {1, 2, 3}
        for seq_id, (token, logprob) in g.items():
            assert token == w[seq_id][0] and logprob == pytest.approx(w[seq_id][1], abs=0.02)


def test_copy_on_write_and_prefix_hits_of_int8_blocks_reproduce_the_original() -> None:
    e = engine("int8")
    a = prompt(40)
    (first,) = run(e, [W.StepRequest(step_id=1, seqs=[work(1, 0, [0, 1, 2], a)])])
    # Seq 2 shares blocks 0 and 1 and gets a copy of block 2 (positions 32..39), then feeds seq 1's next token:
    # the same decode as seq 1's in the same step, over the same int8 K/V and scales.
    token = first[1][0]
    (both,) = run(
        e,
        [
            W.StepRequest(
                step_id=2,
                copies=[W.BlockCopy(src=2, dst=3)],
                seqs=[work(1, 40, []), work(2, 40, [0, 1, 3], [token])],
            )
        ],
    )
    assert both[1] == both[2]
    k = e.runner.cache.layers[0][0]
    assert isinstance(k, Int8Store)
    assert torch.equal(k.data[3, :8], k.data[2, :8]) and torch.equal(k.scales[3, :8], k.scales[2, :8])


def test_protocol_checks_and_session_reset() -> None:
    model, auto = engine("model"), engine("auto")
    with pytest.raises(StepError, match="kv_to_int8 needs an auto KV cache"):
        model.step(W.StepRequest(step_id=1, kv_to_int8=True))
    with pytest.raises(StepError, match="block 6 is not a multiple of 4"):
        auto.step(W.StepRequest(step_id=1, seqs=[work(1, 0, [0, 6], prompt(20))]))
    with pytest.raises(StepError, match="block copy 0 -> 2"):
        auto.step(W.StepRequest(step_id=1, copies=[W.BlockCopy(src=0, dst=2)]))
    assert not auto.runner.cache.int8 and not auto.seqs  # rejected requests change nothing
    auto.step(W.StepRequest(step_id=1, kv_to_int8=True, seqs=[work(1, 0, [0, 6], prompt(20))]))  # any id after it
    with pytest.raises(StepError, match="has already converted"):
        auto.step(W.StepRequest(step_id=2, kv_to_int8=True))
    auto.reset()  # a new session: the model's dtype again, on a cache zeroed of int8 bytes
    assert not auto.runner.cache.int8 and all(isinstance(s, PlainStore) for s in auto.runner.cache.layers[0])
    (out,) = run(auto, [W.StepRequest(step_id=1, seqs=[work(1, 0, [0, 4], prompt(20))])])
    assert all(torch.isfinite(torch.tensor(lp)) for _, lp in out.values())


@pytest.mark.parametrize(("kv", "units"), [("model", 1), ("int8", 1), ("auto", 4)])
def test_info_and_sizing(kv: str, units: int) -> None:
    e = engine(kv, mb=4)
    info, config = e.info(), e.runner.loaded.config
    expected = {"model": "float32", "int8": "int8", "auto": "auto"}[kv]
    assert (info.kv_cache_dtype, info.kv_block_units, info.dtype) == (expected, units, "float32")
    per_block = block_bytes(config, 16, FP32, "model" if kv == "model" else "int8")
    assert info.num_blocks == 4 * 2**20 // per_block // units * units
    if kv != "model":  # per token and KV head: 32 int8 values and a one-byte scale, against 32 float32 values
        assert per_block * 128 == block_bytes(config, 16, FP32) * 33
