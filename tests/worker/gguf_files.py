"""Test helpers: GGUF files written with the `gguf` package's writer: single tensors of each quantization
type, and small Llamas made by `transformers`, converted as llama.cpp's converter does (q/k rows permuted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from worker.builtin import bytes_to_unicode

Q = GGMLQuantizationType
# K-quants have no quantizer in the gguf package: their blocks are random bytes with small float16 scales.
SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def quantized(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`values` (float32 [rows, cols]) in `qtype`, as the writer takes it (raw bytes for quantized types)."""
    if qtype not in SCALE_OFFSETS:
        return quants.quantize(values, qtype)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, size=(rows * cols // block_values, block_bytes), dtype=np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=len(raw)).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def byte_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 256 byte tokens, BOS/EOS (control), two merges, unused fillers."""
    chars = bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + ["<|bos|>", "<|eos|>", "Ġt", "he"]
    types = [1] * 256 + [3, 3, 1, 1]
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types += [5] * (size - len(types))
    return tokens, types, ["Ġ t", "h e"]


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    arch: str = "llama",
    config: dict[str, Any] | None = None,
    vocab_size: int = 300,
    chat_template: str | None = None,
) -> Path:
    """A GGUF file with `arch.*` metadata from `config` (HF names), a byte vocabulary and these tensors."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, arch)
    c = config or {}
    writer.add_context_length(c.get("max_position_embeddings", 256))
    writer.add_embedding_length(c.get("hidden_size", 64))
    writer.add_block_count(c.get("num_hidden_layers", 0))
    writer.add_feed_forward_length(c.get("intermediate_size", 128))
    writer.add_head_count(c.get("num_attention_heads", 2))
    writer.add_head_count_kv(c.get("num_key_value_heads", 2))
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(c.get("rope_theta", 10000.0))
    writer.add_vocab_size(vocab_size)
    tokens, types, merges = byte_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, (values, qtype) in tensors.items():
        data = quantized(values, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)  # the shape comes from the (byte) array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, interleave the two RoPE halves of the rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_to_gguf(model: torch.nn.Module, path: Path, qtype: GGMLQuantizationType = Q.F32) -> Path:
    """A transformers LlamaForCausalLM (or Qwen2ForCausalLM) as a GGUF file: 2-D weights in `qtype`, norms and
    biases in F32. Llama's q/k rows are permuted as llama.cpp's converter does; Qwen2's are not."""
    cfg: Any = model.config
    arch = "qwen2" if cfg.model_type == "qwen2" else "llama"
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} if arch == "llama" else {}
    tensors = {}
    for name, t in model.state_dict().items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            kind = LAYER_NAMES[module]
            gguf_name = f"blk.{layer}.{kind}.{suffix}"
            if kind in heads:
                w = _permute(w, heads[kind])
        tensors[gguf_name] = (w, qtype if w.ndim == 2 else Q.F32)
    hf = cfg.to_dict()
    hf["rope_theta"] = cfg.rope_parameters["rope_theta"]
    return write_gguf(path, tensors, arch, hf, vocab_size=cfg.vocab_size)
