"""GGUF checkpoints: every supported quantization type against the gguf package's numpy dequantization, a
small Llama made by transformers and converted to GGUF loads to transformers' logits, the tokenizer from GGUF
metadata, the conversion cache (reused, corrupt entries rebuilt), and one clear error per bad file."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, quants
from gguf_files import Q, llama_to_gguf, write_gguf

from worker.batch import PackedBatch, SeqSlice
from worker.dequant import SUPPORTED, dequantize
from worker.gguf_cache import MANIFEST, cached_checkpoint
from worker.gguf_file import open_gguf
from worker.loaded import LoadedModel, ModelLoadError
from worker.loading import load_model
from worker.runner import ModelRunner

CPU, FP32 = torch.device("cpu"), torch.float32
ROOT = Path(__file__).resolve().parents[2]
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def test_supported_types_are_the_ones_tested() -> None:
    assert sorted(SUPPORTED) == sorted(t.name for t in TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_numpy_reference(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    """A tensor written with `gguf`, read back through GGUFReader, dequantized by torch, equals gguf's numpy."""
    values = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    path = write_gguf(tmp_path / "t.gguf", {"token_embd.weight": (values, qtype)})
    tensor = open_gguf(path).reader.tensors[0]
    assert tensor.tensor_type == qtype
    ours = dequantize(tensor.data, qtype, (6, 512))
    reference = quants.dequantize(tensor.data, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (6, 512)
    np.testing.assert_array_equal(ours.numpy(), reference.reshape(6, 512))
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):  # the quantizable types also stay near the written values
        tol = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2}[qtype]
        assert np.abs(ours.numpy() - values).max() <= tol * np.abs(values).max()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A random transformers Llama (untied LM head) and its float32 GGUF conversion."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model = model.float().eval()
    return model, llama_to_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_tiny_llama_gguf_has_transformers_logits(
    hf: ModuleType, tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    """Through the conversion (q/k permutation undone) and our paged runner: logits within 1e-4, greedy equal."""
    model, path = tiny_llama
    loaded = load_model(str(path), CPU, FP32, cache_dir=tmp_path, log=io.StringIO())
    assert (loaded.name, loaded.architecture, loaded.eos_token_ids, loaded.bos_token_id) == (
        "tiny-llama", "LlamaForCausalLM", [257], 256,
    )  # fmt: skip
    runner = ModelRunner(loaded, num_blocks=64, block_size=16, device=CPU, dtype=FP32)
    seqs = [hf.Seq(i, [(7 * i + 3 * j) % 300 for j in range(n)], n) for i, n in enumerate([5, 40, 17])]
    hf.Driver(runner).run(seqs, new_tokens=8)
    for s in seqs:
        hf.check_against_hf(model, s, new_tokens=8)


def test_tiny_qwen2_gguf_has_transformers_logits(hf: ModuleType, tmp_path: Path) -> None:
    """qwen2: q/k/v biases, tied embeddings, no q/k permutation."""
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**{**TINY_LLAMA, "tie_word_embeddings": True, "use_sliding_window": False})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model = model.float().eval()
    path = llama_to_gguf(model, tmp_path / "tiny-qwen2.gguf")
    loaded = load_model(str(path), CPU, FP32, cache_dir=tmp_path, log=io.StringIO())
    assert loaded.architecture == "Qwen2ForCausalLM" and loaded.config.qkv_bias and loaded.config.tie_word_embeddings
    seqs = [hf.Seq(i, [(5 * i + 11 * j) % 300 for j in range(n)], n) for i, n in enumerate([9, 33])]
    hf.Driver(ModelRunner(loaded, num_blocks=32, block_size=16, device=CPU, dtype=FP32)).run(seqs, new_tokens=8)
    for s in seqs:
        hf.check_against_hf(model, s, new_tokens=8)


def test_quantized_gguf_equals_transformers_gguf_loading(
    tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    """The same Q8_0 file through transformers' own GGUF loader: the same logits."""
    model, _ = tiny_llama
    path = llama_to_gguf(model, tmp_path / "tiny-q8.gguf", Q.Q8_0)
    ours = load_model(str(path), CPU, FP32, cache_dir=tmp_path, log=io.StringIO())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=FP32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 42, 7, 7, 3]])
    with torch.no_grad():
        ref = theirs(ids).logits[0]
    runner_logits = _logits(ours, ids[0].tolist())
    assert (runner_logits - ref).abs().max().item() < 1e-4


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded, num_blocks=4, block_size=16, device=CPU, dtype=FP32)
    batch = PackedBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(0, [0], 0, len(ids))])
    return runner.forward(batch, all_logits=True)


def test_tokenizer_from_metadata_matches_transformers(tiny_llama: tuple[torch.nn.Module, Path]) -> None:
    from tokenizers import Tokenizer

    _, path = tiny_llama
    ours = Tokenizer.from_str(
        load_model(str(path), CPU, FP32, cache_dir=path.parent, log=io.StringIO()).tokenizer_json.decode()
    )
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["the theme", "<|bos|>the<|eos|> x", "  spaced \t out\n", "ünï ✓"]:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text


def test_conversion_is_cached_and_a_corrupt_entry_is_rebuilt(
    tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    _, path = tiny_llama
    log = io.StringIO()
    entry = cached_checkpoint(path, FP32, tmp_path, log)
    assert "dequantizing tiny-llama.gguf" in log.getvalue() and "converted" in log.getvalue()
    assert {p.name for p in entry.iterdir()} >= {"model.safetensors", "tokenizer.json", "config.json", MANIFEST}
    log = io.StringIO()
    assert cached_checkpoint(path, FP32, tmp_path, log) == entry and log.getvalue() == ""  # reused, silently
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100] + bytes(100))  # same size, different bytes
    log = io.StringIO()
    assert cached_checkpoint(path, FP32, tmp_path, log) == entry
    assert "is corrupt (model.safetensors does not match its checksum); rebuilding it" in log.getvalue()
    (entry / "tokenizer.json").unlink()
    log = io.StringIO()
    cached_checkpoint(path, FP32, tmp_path, log)
    assert "tokenizer.json is missing" in log.getvalue()
    assert cached_checkpoint(path, torch.bfloat16, tmp_path, io.StringIO()) != entry  # keyed by dtype too


def test_bad_files_give_one_clear_error(tmp_path: Path, tiny_llama: tuple[torch.nn.Module, Path]) -> None:
    _, good = tiny_llama
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    values = np.zeros((2, 256), dtype=np.float32)
    unknown = write_gguf(tmp_path / "gpt2.gguf", {"token_embd.weight": (values, Q.F32)}, arch="gpt2")
    q5k = write_gguf(tmp_path / "q5k.gguf", {"token_embd.weight": (values, Q.Q5_K)})
    cases = [
        (truncated, "truncated or corrupt GGUF file"),
        (unknown, "unknown architecture 'gpt2' (supported: llama, qwen2)"),
        (q5k, "tensor token_embd.weight: unsupported quantization type Q5_K (supported: F32, F16, BF16, Q8_0"),
        (tmp_path / "missing.gguf", "GGUF file not found"),
    ]
    for path, problem in cases:
        with pytest.raises(ModelLoadError) as err:
            load_model(str(path), CPU, FP32, cache_dir=tmp_path / "cache", log=io.StringIO())
        assert str(path) in str(err.value) and problem in str(err.value)
        assert "\n" not in str(err.value)
    # The command line says it in one line on stderr, exit status 2, no traceback.
    cmd = [sys.executable, "-m", "clients.cli", "worker", "--model", str(q5k), "--cache-dir", str(tmp_path / "c")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"coalesce worker: {q5k}: tensor token_embd.weight")


def test_an_unexpected_tensor_is_named(tmp_path: Path) -> None:
    values = np.zeros((2, 64), dtype=np.float32)
    odd = write_gguf(tmp_path / "odd.gguf", {"blk.0.attn_qkv.weight": (values, Q.F32)})
    with pytest.raises(ModelLoadError, match=r"odd\.gguf: unexpected tensor 'blk\.0\.attn_qkv\.weight'"):
        load_model(str(odd), CPU, FP32, cache_dir=tmp_path, log=io.StringIO())
