"""Loading a model: the built-in one, or a Hugging Face checkpoint directory (config.json, safetensors,
tokenizer.json, optional generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from worker.model import ModelConfig, Transformer, rope_inv_freq


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    name: str
    architecture: str
    tokenizer_json: bytes
    eos_token_ids: list[int]
    bos_token_id: int | None  # None when the model has none


def load_model(spec: str, device: torch.device, dtype: torch.dtype, builtin_seed: int = 0) -> LoadedModel:
    """`spec` is "builtin" or a checkpoint directory."""
    if spec == "builtin":
        from worker.builtin import build_builtin  # late: builtin imports LoadedModel from here

        return build_builtin(builtin_seed, device, dtype)
    path = Path(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path} (use 'builtin' or a checkpoint directory)")
    hf = _read_json(path / "config.json")
    config = ModelConfig.from_hf(hf)
    tokenizer_json = read_tokenizer(path / "tokenizer.json")
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos = list(dict.fromkeys(_ids(hf.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
    bos = _ids(hf.get("bos_token_id")) or _ids(gen.get("bos_token_id"))
    state = map_hf_state(config, _read_safetensors(path, device, dtype))
    return LoadedModel(
        model=build_model(config, state, device),
        config=config,
        name=path.resolve().name,
        architecture=config.architecture,
        tokenizer_json=tokenizer_json,
        eos_token_ids=eos,
        bos_token_id=bos[0] if bos else None,
    )


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """A Transformer holding exactly the given tensors (built on the meta device: no throwaway init)."""
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(config).to(device)  # a non-persistent buffer: not in `state`
    return model.eval().requires_grad_(False)


def read_tokenizer(path: Path) -> bytes:
    """tokenizer.json bytes, checked by loading them with `tokenizers`."""
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    data = path.read_bytes()
    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
    return data


def map_hf_state(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to our modules', fusing q/k/v and gate/up."""

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return hf.pop(name)

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "mlp_norm.weight"] = take(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            out[dst + f"attn.qkv.{kind}"] = torch.cat([take(src + f"self_attn.{x}_proj.{kind}") for x in "qkv"])
        out[dst + "attn.o.weight"] = take(src + "self_attn.o_proj.weight")
        if config.o_bias:
            out[dst + "attn.o.bias"] = take(src + "self_attn.o_proj.bias")
        gate_up = [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
        out[dst + "mlp.gate_up.weight"] = torch.cat(gate_up)
        out[dst + "mlp.down.weight"] = take(src + "mlp.down_proj.weight")
    lm_head = hf.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
    if not config.tie_word_embeddings:
        if lm_head is None:
            raise ValueError("checkpoint is missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
        out["lm_head.weight"] = lm_head
    unexpected = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    return out


def _read_safetensors(path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint shard not found: {file}")
        state.update({k: t.to(dtype) for k, t in load_file(file, device=str(device)).items()})
    return state


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    """A token id field that may be null, an int, or a list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
