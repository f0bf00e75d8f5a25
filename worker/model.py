"""A Llama-family decoder (Llama, Qwen2, Mistral) in one file, gpt-fast style.

The forward pass runs on packed tokens ([T, hidden], no padding) and does attention through the paged KV
cache (see worker.attention). Module names are our own; worker.weights maps Hugging Face names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, KVStore, attend

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(slots=True)
class ModelConfig:
    """The parts of a Hugging Face `config.json` that the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 parameters, or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None  # None: full causal attention

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse (and check) a `config.json` dict; raises ValueError for what the model cannot run."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else f"<none; model_type={hf.get('model_type')!r}>"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        if hf.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=true")
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        max_pos = int(hf["max_position_embeddings"])
        theta, scaling = _parse_rope(hf)
        llama_bias = arch == "LlamaForCausalLM" and bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or llama_bias,
            o_bias=llama_bias,
            sliding_window=_parse_sliding_window(arch, hf, max_pos),
        )


def _parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and llama3 scaling, from either `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, params
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, llama3")


def _parse_sliding_window(arch: str, hf: dict[str, Any], max_pos: int) -> int | None:
    window = hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        # Qwen2 applies its window only to some layers, and only with use_sliding_window=true.
        if hf.get("use_sliding_window", False):
            raise ValueError("unsupported: Qwen2 with use_sliding_window=true")
        return None
    if arch == "MistralForCausalLM" and window is not None and int(window) < max_pos:
        return int(window)
    return None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, computed exactly as transformers does (plain, or llama3-scaled)."""
    dim = config.head_dim
    # On the CPU even under a meta-device context: meta arithmetic would import torch._refs (~1 s at start).
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for positions [0, length): [length, head_dim] each, in `dtype`.

    The angles are computed as transformers does (position * inv_freq in float32, then cos/sin, then the
    dtype), so a row gathered from here equals what it computes per step. The sin table's first half is
    negated, so that rotation is x * cos + swap_halves(x) * sin, one fewer op than negating x per layer.
    """
    freqs = torch.arange(length, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    half = inv_freq.shape[0]
    sin = angles.sin()
    sin[:, :half].neg_()
    return angles.cos().to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout of HF checkpoints: x [T, heads, head_dim]; cos/sin [T, 1, head_dim] from
    rope_tables (sin sign-folded). Equals x * cos + cat(-x2, x1) * sin."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel (one op instead of six); it accumulates in float32 for 16-bit inputs as
        # transformers does, and rounds once at the end instead of before the scale (bf16 only).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        # q, k and v in one matmul: fewer kernel launches per layer, which is what small decode steps pay for.
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[KVStore, KVStore],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(t, heads + 2 * kv_heads, self.head_dim)
        # q and k rotated together: one rotation per layer instead of two.
        qk = rotate(qkv[:, : heads + kv_heads], cos, sin)
        out = attend(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :], cache[0], cache[1], meta)
        return self.o(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        # SiLU then multiply in place: no tensor allocated for the product.
        return self.down(F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[KVStore, KVStore],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # Residuals added in place: x is this step's own activation (the embedding output's copy).
        x = x.add_(self.attn(self.attn_norm(x), cos, sin, cache, meta))
        return x.add_(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    """Embedding, decoder blocks, final norm and LM head (tied to the embedding when the config says so)."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self.head: nn.Module | None = None  # a quantized LM head, set by worker.quant_linear
        # Not in checkpoints: loaders that build on the meta device must set it again on the real device.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._rope = (torch.empty(0, device="cpu"), torch.empty(0, device="cpu"))  # built by rope() when used

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[tuple[KVStore, KVStore]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for packed tokens; writes their K/V into `caches`."""
        x = self.embed(token_ids)
        # RoPE rows gathered once per step for all layers, from tables grown as positions need them.
        cos, sin = self.rope(positions, x.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin rows of `positions`, [T, head_dim] each, in `dtype`. Tables built in float32
        (the CPU decode path asks for it) serve every dtype: rows rounded to `dtype` equal tables built in it."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._rope
        if cos.shape[0] < need or cos.device != positions.device or cos.dtype not in (dtype, torch.float32):
            # Powers of two up to max_position_embeddings: a few rebuilds per process, a small table.
            length = min(max(256, 1 << (need - 1).bit_length()), max(need, self.config.max_position_embeddings))
            cos, sin = self._rope = rope_tables(self.inv_freq.to(positions.device), length, dtype)
        return cos.index_select(0, positions).to(dtype), sin.index_select(0, positions).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
