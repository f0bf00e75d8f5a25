"""Full-precision tails of an int8 KV cache (worker/kv_cache.py, docs/kv_cache.md): a sequence's last, partial
block is read from bfloat16 tail rows. The kernel against SDPA over the mixed rows; the kernel against the torch
path and the int8 blocks left as they would be without tails, through prefill chunks that cross blocks, decodes
that cross a block boundary and a prefix hit; the newest positions near the float32 cache's numbers; the
protocol's checks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from protos.coalesce.v1 import worker_pb2
from worker.batch import PackedBatch, SeqSlice
from worker.engine import Engine, StepError
from worker.kernels import paged_attention
from worker.kv_cache import TAIL_BLOCKS, TAIL_DTYPE, Int8Store
from worker.kv_quant import dequantize, quantize
from worker.loading import load_model
from worker.runner import ModelRunner

W = worker_pb2
CPU, FP32 = torch.device("cpu"), torch.float32
BLOCK = 16
GREEDY = W.WorkerSampling(logprobs=1)


@pytest.mark.skipif(paged_attention._lib is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_adds_the_tail_rows_to_positions_from_tail_lo_on(window: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    seqs, max_blocks, heads, kv_heads, dim = 4, 4, 9, 3, 64
    num_blocks = seqs * max_blocks + seqs * TAIL_BLOCKS
    k = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    (kq, kc), (vq, vc) = quantize(k), quantize(v)
    tables = torch.arange(seqs * max_blocks).view(seqs, max_blocks)
    lengths = [9, 33, 50, 64]
    lo = [0, 32, 40, 64]  # a whole first block; a block's first position; a prefix hit's (40 > 32); no tail
    per = BLOCK // TAIL_BLOCKS
    k_tail = kq.view(num_blocks, -1).view(TAIL_DTYPE).view(-1, kv_heads, dim)
    v_tail = vq.view(num_blocks, -1).view(TAIL_DTYPE).view(-1, kv_heads, dim)
    rows = torch.zeros(seqs, BLOCK, dtype=torch.int64)
    keys, values = dequantize(kq, kc, FP32), dequantize(vq, vc, FP32)  # what the kernel should read ...
    for s in range(seqs):
        tail = [seqs * max_blocks + s * TAIL_BLOCKS + i for i in range(TAIL_BLOCKS)]
        rows[s] = torch.tensor([tail[o // per] * per + o % per for o in range(BLOCK)])
        for p in range(lo[s], lengths[s]):  # ... plus a bfloat16 residual from tail_lo on
            b, o = int(tables[s, p // BLOCK]), p % BLOCK
            k_res, v_res = (k[b, o] - keys[b, o]).to(TAIL_DTYPE), (v[b, o] - values[b, o]).to(TAIL_DTYPE)
            k_tail[rows[s, o]], v_tail[rows[s, o]] = k_res, v_res
            keys[b, o] += k_res.float()
            values[b, o] += v_res.float()
            assert (keys[b, o] - k[b, o]).abs().max() < 1e-4  # float32-like (int8 alone: ~1e-2)
    q = torch.randn(seqs, heads, dim, generator=gen)
    tails = paged_attention.Tails(k_tail, v_tail, torch.tensor(lo), rows.flatten())
    out = paged_attention.decode(q, kq, vq, tables.flatten(), torch.tensor(lengths), window, kc, vc, tails)
    for s, length in enumerate(lengths):
        first = max(0, length - window) if window else 0
        ks = keys[tables[s]].flatten(0, 1)[first:length].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vs = values[tables[s]].flatten(0, 1)[first:length].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[s][:, None], ks, vs)[:, 0]
        torch.testing.assert_close(out[s], want, atol=1e-5, rtol=0)


@pytest.mark.skipif(paged_attention._lib is None, reason="no C++ compiler on this machine")
def test_the_kernel_writes_the_residuals_torch_computes() -> None:
    gen = torch.Generator().manual_seed(4)
    rows, kv_heads, dim, blocks = 12, 3, 64, 8
    x = torch.randn(rows, kv_heads, dim, generator=gen) * torch.logspace(-3, 2, rows)[:, None, None]
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:rows]
    tail_rows = torch.tensor([-1, 0, 5, -1, 7, 1, 2, 3, -1, 4, 6, 8])
    data = torch.zeros(blocks * BLOCK, kv_heads, dim, dtype=torch.int8)
    codes = torch.zeros(blocks * BLOCK, kv_heads, 2, dtype=torch.uint8)
    tail = torch.zeros(9, kv_heads, dim, dtype=TAIL_DTYPE)
    paged_attention.quantize_write(x, slots, data, codes, tail_rows, tail)
    q, code = quantize(x)
    residual = (x - dequantize(q, code, FP32)).to(TAIL_DTYPE)
    taken = tail_rows >= 0
    assert torch.equal(data[slots], q) and torch.equal(codes[slots], code)
    torch.testing.assert_close(tail[tail_rows[taken]], residual[taken], atol=0, rtol=2**-7)  # <= 1 bf16 ulp
    assert (tail[tail_rows[taken]].float() - (x - dequantize(q, code, FP32))[taken]).abs().max() < 1e-4 * x.abs().max()


class Script:
    """Drives a ModelRunner like the engine does: sequence A fed in two prefill chunks that cross blocks, then
    decodes across a block boundary; B maps A's first two blocks and a copy of its third (a prefix hit that ends
    mid-block) and continues from there across a block boundary too. Tails sit at the top of the cache, as the
    scheduler may place them."""

    def __init__(self, runner: ModelRunner, tails: bool) -> None:
        self.runner = runner
        top, k = runner.num_blocks, TAIL_BLOCKS if tails else 0
        self.tail = {0: list(range(top - k, top)), 1: list(range(top - 2 * k, top - k))}

    def step(self, seqs: list[tuple[int, list[int], int, list[int]]]) -> torch.Tensor:
        """(seq, tokens, start, table) each; the logits of every token."""
        slices = [
            SeqSlice(i, table, start, len(tokens), self.tail[i], 0 if i == 0 else 35)
            for i, tokens, start, table in seqs
        ]
        ids = torch.tensor([t for _, tokens, _, _ in seqs for t in tokens])
        positions = torch.tensor([s + j for _, tokens, s, _ in seqs for j in range(len(tokens))])
        return self.runner.forward(PackedBatch(ids, positions, slices), all_logits=True)

    def run(self) -> list[torch.Tensor]:
        rng = random.Random(5)
        a = [rng.randrange(256) for _ in range(60)]
        b = [rng.randrange(256) for _ in range(8)]
        out = [self.step([(0, a[:20], 0, [0, 1])]), self.step([(0, a[20:37], 20, [0, 1, 2])])]
        self.runner.copy_blocks([(2, 5)])
        out.append(self.step([(0, a[37:38], 37, [0, 1, 2]), (1, b[:5], 35, [0, 1, 5])]))
        for p in range(38, 52):  # both cross into their fourth block, A at 48, B at 46
            out.append(self.step([(0, a[p : p + 1], p, [0, 1, 2, 3]), (1, b[p % 3 : p % 3 + 1], p + 2, [0, 1, 5, 6])]))
        return out


def runner(kv: str, kernels: bool = True) -> ModelRunner:
    return ModelRunner(load_model("builtin", CPU, FP32), 32, BLOCK, CPU, FP32, kv, kernels)  # type: ignore[arg-type]


def first_layer_blocks(r: ModelRunner) -> list[torch.Tensor]:
    """The first layer's int8 K and V blocks (later layers' K/V depend on what attention read before them)."""
    return [s.data[:7].clone() for s in r.cache.layers[0]]


@pytest.mark.skipif(paged_attention._lib is None, reason="no C++ compiler on this machine")
def test_kernel_and_torch_paths_read_tails_alike_and_leave_the_int8_blocks_as_without_tails() -> None:
    kernel, torch_path, plain = runner("int8"), runner("int8", kernels=False), runner("int8")
    got, want, untailed = Script(kernel, True).run(), Script(torch_path, True).run(), Script(plain, False).run()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=0)
    assert max((g - u).abs().max().item() for g, u in zip(got, untailed, strict=True)) > 1e-3  # tails were read
    for with_tails, without in zip(first_layer_blocks(kernel), first_layer_blocks(plain), strict=True):
        assert torch.equal(with_tails, without)  # prefix hits and copies see the same int8 blocks


def test_the_newest_positions_are_read_near_the_float32_cache() -> None:
    """Within a sequence's first block every position is corrected by its tail: its logits are the float32
    cache's up to float32 rounding, where int8 alone is off by about 1e-3 (mean absolute logit error)."""
    exact, tailed, plain = runner("model"), runner("int8"), runner("int8")
    tokens = [random.Random(2).randrange(256) for _ in range(15)]
    errors = {}
    for name, r, tail in (("tails", tailed, [30, 31]), ("int8", plain, [])):
        err = []
        for start, n in ((0, 10), (10, 1), (11, 1), (12, 3)):
            seq = SeqSlice(0, [7], start, n, tail)
            batch = PackedBatch(torch.tensor(tokens[start : start + n]), torch.arange(start, start + n), [seq])
            ref = exact.forward(batch, all_logits=True)
            err.append((r.forward(batch, all_logits=True) - ref).abs().mean().item())
        errors[name] = sum(err) / len(err)
    assert errors["tails"] < 1e-4 < errors["int8"], errors  # measured: 3.4e-6 and 2.2e-3


def engine(kv: str) -> Engine:
    return Engine(runner(kv))


def first_sight(seq_id: int, blocks: list[int], tail: list[int], n: int = 20) -> W.SequenceWork:
    tokens = list(range(1, n + 1))
    return W.SequenceWork(
        seq_id=seq_id, token_ids=tokens, new_blocks=blocks, tail_blocks=tail, sampling=GREEDY, sample=True
    )


def test_protocol_checks_of_tail_blocks() -> None:
    model, int8, auto = engine("model"), engine("int8"), engine("auto")
    assert (model.info().kv_tail_blocks, int8.info().kv_tail_blocks, auto.info().kv_tail_blocks) == (0, 2, 2)
    cases = [
        (model, first_sight(1, [0, 1], [2, 3]), "need an int8 KV cache"),
        (auto, first_sight(1, [0, 4], [8, 12]), "need an int8 KV cache"),  # not converted yet
        (int8, first_sight(1, [0, 1], [2]), "1 tail_blocks given, a tail takes 2"),
        (int8, first_sight(1, [0, 1], [1, 2]), "tail block 1: also in its block table"),
        (int8, first_sight(1, [0, 1], [2, 99]), r"tail block 99: block 99 out of range \[0, 32\)"),
        (int8, first_sight(1, [0, 1], [2, 2]), "repeat a block"),
    ]
    for e, work, message in cases:
        with pytest.raises(StepError, match=message):
            e.step(W.StepRequest(step_id=1, seqs=[work]))
    assert not int8.seqs and not model.seqs
    int8.step(W.StepRequest(step_id=1, seqs=[first_sight(1, [0, 1], [2, 3])]))
    assert int8.seqs[1].tail == [2, 3] and int8.seqs[1].tail_from == 0
    again = W.SequenceWork(seq_id=1, start_position=20, tail_blocks=[4, 5], sample=True)
    with pytest.raises(StepError, match="on a sequence's first sight only"):
        int8.step(W.StepRequest(step_id=2, seqs=[again]))
    # The step that converts an auto cache may already give tails to the sequences it admits.
    auto.step(W.StepRequest(step_id=1, kv_to_int8=True, seqs=[first_sight(1, [0, 1], [2, 3])]))
    assert auto.seqs[1].tail == [2, 3]
    assert isinstance(auto.runner.cache.layers[0][0], Int8Store)
