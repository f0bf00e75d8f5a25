"""Reading a GGUF checkpoint (llama.cpp's format) with the `gguf` package: its metadata as a Hugging Face
config, its tensors dequantized under Hugging Face names, and its tokenizer and chat template.

llama.cpp's converter permutes the rows of Llama's q and k projections (to interleave RoPE pairs); `hf_tensors`
undoes it, so the tensors are those of the original checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader, GGUFValueType
from tokenizers import Tokenizer

from worker.dequant import dequantize
from worker.gguf_tokenizer import GGUFVocab, build_tokenizer
from worker.loaded import ModelLoadError

# GGUF architecture -> (Hugging Face architecture, whether q/k rows were permuted by the converter).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}  # fmt: skip


@dataclass
class GGUFCheckpoint:
    path: Path
    reader: GGUFReader
    arch: str

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {problem}")


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Read the header and tensor index (the data stays memory-mapped); raises ModelLoadError."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "c")  # copy-on-write: writable arrays, nothing written back
    except Exception as e:
        if "magic" in str(e).lower():
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic number)") from None
        size = path.stat().st_size
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({size} bytes; reading stopped: {e})") from None
    field = reader.fields.get("general.architecture")
    if field is None or field.types != [GGUFValueType.STRING]:
        raise ModelLoadError(f"{path}: metadata key 'general.architecture' is missing")
    arch = str(field.contents())
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unknown architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    return GGUFCheckpoint(path, reader, arch)


def hf_config(ck: GGUFCheckpoint) -> dict[str, Any]:
    """The model's Hugging Face config.json, from `<arch>.*` metadata."""
    a = ck.arch
    hf_arch, _ = ARCHITECTURES[a]
    if ck.get(f"{a}.expert_count", 0):
        raise ck.fail("mixture-of-experts models are not supported")
    scaling = ck.get(f"{a}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in ck.reader.tensors):
        raise ck.fail(f"RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}) is not supported")
    heads = ck.need(f"{a}.attention.head_count")
    kv_heads = ck.get(f"{a}.attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ck.fail("per-layer head counts are not supported")
    hidden = int(ck.need(f"{a}.embedding_length"))
    tokens = ck.need("tokenizer.ggml.tokens")
    # End of sequence, and the end-of-turn / end-of-message tokens chat models stop at.
    ends = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [i for key in ends if (i := ck.get(f"tokenizer.ggml.{key}")) is not None]
    config = {
        "architectures": [hf_arch],
        "model_type": a,
        "vocab_size": int(ck.get(f"{a}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(ck.need(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(ck.need(f"{a}.block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(ck.get(f"{a}.attention.key_length", ck.get(f"{a}.rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(ck.need(f"{a}.context_length")),
        "rms_norm_eps": float(ck.need(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(ck.get(f"{a}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": not any(t.name == "output.weight" for t in ck.reader.tensors),
        "bos_token_id": ck.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(i) for i in eos)),
    }
    if a == "qwen2":
        config["use_sliding_window"] = False
    return config


def hf_tensors(
    ck: GGUFCheckpoint, config: dict[str, Any], dtype: torch.dtype, progress: Callable[[int, int], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor, dequantized to `dtype`, under its Hugging Face name; `progress(done, total)` after each."""
    _, permuted = ARCHITECTURES[ck.arch]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = ck.reader.tensors
    for done, t in enumerate(tensors, 1):
        name, kind = _hf_name(ck, t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        try:
            value = dequantize(t.data, t.tensor_type, shape)
        except ValueError as e:
            raise ck.fail(f"tensor {t.name}: {e}") from None
        if permuted and kind in heads:
            value = _unpermute(value, heads[kind])
        yield name, value.to(dtype)
        progress(done, len(tensors))


def _hf_name(ck: GGUFCheckpoint, name: str) -> tuple[str, str]:
    if (m := LAYER_NAME.fullmatch(name)) and m.group(2) in LAYER_TENSORS:
        layer, kind, suffix = m.groups()
        return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}", kind
    base, _, suffix = name.rpartition(".")
    if base in TOP_TENSORS:
        return f"{TOP_TENSORS[base]}.{suffix}", base
    raise ck.fail(f"unexpected tensor {name!r} for architecture {ck.arch!r}")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows [0, 2, 4, .., 1, 3, 5, ..] back to the half-split order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tokenizer(ck: GGUFCheckpoint) -> Tokenizer:
    vocab = GGUFVocab(
        model=str(ck.need("tokenizer.ggml.model")),
        pre=str(ck.get("tokenizer.ggml.pre", "default")),
        tokens=ck.need("tokenizer.ggml.tokens"),
        merges=ck.get("tokenizer.ggml.merges", []),
        token_types=ck.get("tokenizer.ggml.token_type", []),
        add_bos=bool(ck.get("tokenizer.ggml.add_bos_token", False)),
        bos_id=ck.get("tokenizer.ggml.bos_token_id"),
    )
    try:
        return build_tokenizer(vocab)
    except ValueError as e:
        raise ck.fail(str(e)) from None


def chat_template(ck: GGUFCheckpoint) -> tuple[str, dict[str, str]]:
    """`tokenizer.chat_template` ("" when none) and the special token strings (bos_token, eos_token, ...)."""
    tokens = ck.need("tokenizer.ggml.tokens")
    special = {
        name: str(tokens[i])
        for name, key in SPECIAL_IDS.items()
        if (i := ck.get(f"tokenizer.ggml.{key}")) is not None and 0 <= i < len(tokens)
    }
    return str(ck.get("tokenizer.chat_template", "")), special
