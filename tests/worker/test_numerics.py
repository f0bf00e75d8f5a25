"""Numerics against Hugging Face `transformers` (fp32, CPU): per-position logits within 1e-4 and identical
greedy continuations, for every supported architecture, through the paged cache under mixed batches,
chunked prefill, shared prefix blocks and copy-on-write. Plus loading errors and the builtin model."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from worker.batch import PackedBatch, SeqSlice
from worker.builtin import BOS_ID, EOS_ID, byte_tokenizer
from worker.loaded import ModelLoadError
from worker.loading import load_model
from worker.model import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.runner import ModelRunner

CPU, FP32 = torch.device("cpu"), torch.float32
BLOCK_SIZE = 16


class Case:
    """One architecture: the HF reference model and our runner over the same checkpoint."""

    def __init__(self, hf: ModuleType, path: Path, hf_model: Any) -> None:
        self.hf, self.hf_model = hf, hf_model
        self.loaded = load_model(str(path), CPU, FP32)
        self.runner = ModelRunner(self.loaded, num_blocks=400, block_size=BLOCK_SIZE, device=CPU, dtype=FP32)
        self.rng = random.Random(0)

    def seq(self, seq_id: int, prompt_len: int) -> Any:
        vocab = self.loaded.config.vocab_size
        return self.hf.Seq(seq_id, [self.rng.randrange(vocab) for _ in range(prompt_len)], prompt_len)

    def driver(self) -> Any:
        return self.hf.Driver(self.runner, seed=self.rng.randrange(1 << 30))

    def check(self, *seqs: Any) -> None:
        for s in seqs:
            self.hf.check_against_hf(self.hf_model, s)


@pytest.fixture(scope="module", params=SUPPORTED_ARCHITECTURES)
def case(request: pytest.FixtureRequest, hf: ModuleType, hf_checkpoint: Any) -> Case:
    # Llama's checkpoint is sharded, so the sharded loading path runs too.
    path, hf_model = hf_checkpoint(request.param, shard=request.param == "LlamaForCausalLM")
    return Case(hf, path, hf_model)


def test_config_and_metadata(case: Case) -> None:
    cfg, loaded = case.loaded.config, case.loaded
    assert loaded.architecture == cfg.architecture
    hf_cfg = case.hf_model.config
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf_cfg.num_attention_heads,
        hf_cfg.num_key_value_heads,
        head_dim,
    )
    assert cfg.sliding_window == (48 if cfg.architecture == "MistralForCausalLM" else None)
    expected_eos = {"LlamaForCausalLM": [2, 7], "Qwen2ForCausalLM": [3], "MistralForCausalLM": [2]}
    assert loaded.eos_token_ids == expected_eos[cfg.architecture]
    assert loaded.tokenizer_json == byte_tokenizer().to_str().encode()


def test_single_sequence(case: Case) -> None:
    s = case.seq(0, 50)
    case.driver().run([s])
    case.check(s)


def test_mixed_batch(case: Case) -> None:
    """8 prompts of 1..300 tokens: half prefilled, then one step mixing their decodes with the rest's prefills."""
    seqs = [case.seq(i, n) for i, n in enumerate([1, 300, 17, 64, 2, 130, 255, 33])]
    driver = case.driver()
    driver.step([(s, s.prompt_len) for s in seqs[:4]])
    driver.step([(s, 1) for s in seqs[:4]] + [(s, s.prompt_len) for s in seqs[4:]])
    driver.run(seqs)
    case.check(*seqs)


def test_chunked_prefill(case: Case) -> None:
    """Prefill in chunks of 7 tokens, next to a sequence that is decoding."""
    chunked, other = case.seq(0, 75), case.seq(1, 20)
    case.driver().run([chunked, other], chunk=7)
    case.check(chunked, other)


def test_shared_prefix_blocks(case: Case) -> None:
    """The second sequence starts with the first's full blocks and feeds only the rest of its prompt."""
    a = case.seq(0, 40)
    driver = case.driver()
    driver.step([(a, a.prompt_len)])
    shared = 2 * BLOCK_SIZE
    b = case.seq(1, 55)
    b.tokens[:shared] = a.tokens[:shared]
    b.table, b.fed = a.table[:2], shared
    driver.run([a, b])
    assert b.table[:2] == a.table[:2]
    assert min(b.logits) == shared
    case.check(a, b)


def test_copy_on_write(case: Case) -> None:
    """Fork a sequence whose last block is partly filled: copy that block, then each continues differently."""
    a = case.seq(0, 40)
    driver = case.driver()
    driver.step([(a, a.prompt_len)])  # also appends a's first greedy pick (not yet cached)
    b = case.hf.Seq(1, a.tokens[:40] + [(a.tokens[40] + 1 + i) % 1000 for i in range(6)], prompt_len=46)
    b.table, b.fed = [*a.table[:2], driver.alloc()], 40
    case.runner.copy_blocks([(a.table[2], b.table[2])])
    driver.run([a, b])
    assert a.table[2] != b.table[2]
    case.check(a, b)


def test_last_token_logits(case: Case) -> None:
    """forward() without all_logits gives each sequence's last row, in order (the same step, run twice)."""
    seqs = [case.seq(i, n) for i, n in enumerate([5, 1, 23])]
    tables = [[10 + 3 * i, 11 + 3 * i] for i in range(3)]
    ids = torch.tensor([t for s in seqs for t in s.tokens])
    positions = torch.tensor([p for s in seqs for p in range(s.prompt_len)])
    slices = [SeqSlice(i, tables[i], 0, s.prompt_len) for i, s in enumerate(seqs)]
    batch = PackedBatch(ids, positions, slices)
    every = case.runner.forward(batch, all_logits=True)
    last = case.runner.forward(batch)
    assert every.dtype == last.dtype == torch.float32
    # Not bit-equal: the LM head's matmul over 3 rows and over 29 may sum in different orders.
    torch.testing.assert_close(last, every[torch.tensor([4, 5, 28])], atol=1e-5, rtol=0)
    empty = PackedBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [])
    assert case.runner.forward(empty).shape == (0, case.loaded.config.vocab_size)


def test_bad_batch_shape_is_an_error(case: Case) -> None:
    batch = PackedBatch(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), [SeqSlice(0, [0], 0, 2)])
    with pytest.raises(ValueError, match="seqs say 2"):
        case.runner.forward(batch)
    too_few_blocks = PackedBatch(torch.arange(20), torch.arange(20), [SeqSlice(0, [0], 0, 20)])
    with pytest.raises(ValueError, match="needs 20 positions"):
        case.runner.forward(too_few_blocks)


def test_unsupported_architecture(tmp_path: Path) -> None:
    hf_cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        ModelConfig.from_hf(hf_cfg)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path), CPU, FP32)


def test_unsupported_sliding_window_and_rope(hf: ModuleType) -> None:
    _, qwen = hf.ARCH_CONFIGS["Qwen2ForCausalLM"]
    base = {"architectures": ["Qwen2ForCausalLM"], **qwen}
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 32})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_files_are_clear(tmp_path: Path, hf_checkpoint: Any) -> None:
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"), CPU, FP32)
    with pytest.raises(ModelLoadError, match=re.escape("config.json")):
        load_model(str(tmp_path), CPU, FP32)
    src, _ = hf_checkpoint("Qwen2ForCausalLM")
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match=re.escape("tokenizer.json")):
        load_model(str(tmp_path), CPU, FP32)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=re.escape("not a valid tokenizer.json")):
        load_model(str(tmp_path), CPU, FP32)
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    with pytest.raises(ModelLoadError, match=re.escape("model.safetensors")):
        load_model(str(tmp_path), CPU, FP32)


def builtin_logits(seed: int) -> torch.Tensor:
    runner = ModelRunner(load_model("builtin", CPU, FP32, builtin_seed=seed), 8, BLOCK_SIZE, CPU, FP32)
    tokens = torch.tensor([BOS_ID, *b"deterministic"])
    return runner.forward(PackedBatch(tokens, torch.arange(len(tokens)), [SeqSlice(0, [3, 5], 0, len(tokens))]))


def test_builtin_is_deterministic() -> None:
    loaded = load_model("builtin", CPU, FP32)
    assert (loaded.name, loaded.architecture) == ("builtin", "LlamaForCausalLM")
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (BOS_ID, [EOS_ID])
    assert 2_000_000 < sum(p.numel() for p in loaded.model.parameters()) < 10_000_000
    first = builtin_logits(seed=0)
    assert torch.equal(first, builtin_logits(seed=0))
    assert not torch.equal(first, builtin_logits(seed=1))


def test_builtin_tokenizer_round_trips_utf8() -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(load_model("builtin", CPU, FP32).tokenizer_json.decode())
    text = "Hello, wörld! 你好，世界 🚀👩‍👩‍👧 tabs\tand\nnewlines  "
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|bos|>hi<|eos|>").ids == [BOS_ID, *b"hi", EOS_ID]


def test_from_settings_sizes_the_cache() -> None:
    from worker.config import WorkerSettings
    from worker.kv_cache import block_bytes

    settings = WorkerSettings(model="builtin", device="cpu", dtype="float32", kv_cache_mb=4, block_size=16)
    runner = ModelRunner.from_settings(settings)
    assert (runner.device, runner.dtype, runner.max_context) == (CPU, FP32, 2048)
    per_block = 2 * 4 * 16 * 2 * 32 * 4  # K and V, 4 layers, 16 tokens, 2 KV heads of 32, float32
    assert block_bytes(runner.loaded.config, 16, FP32) == per_block
    assert runner.num_blocks == 4 * 2**20 // per_block == len(runner.cache.layers[0][0].data)


def test_bfloat16_close_to_float32() -> None:
    """A mixed step (a prefill and a decode over cache rows left at zero) in bfloat16 stays near float32."""

    def run(dtype: torch.dtype) -> torch.Tensor:
        runner = ModelRunner(load_model("builtin", CPU, dtype), 8, BLOCK_SIZE, CPU, dtype)
        seqs = [SeqSlice(0, [1, 2], 0, 20), SeqSlice(1, [3], 4, 1)]
        return runner.forward(PackedBatch(torch.arange(21), torch.tensor([*range(20), 4]), seqs))

    low, high = run(torch.bfloat16), run(FP32)
    assert low.dtype == torch.float32 and low.shape == (2, 258)
    torch.testing.assert_close(low, high, atol=0.05, rtol=0)
