"""Loading a Hugging Face checkpoint directory: config.json, safetensors (single or sharded), tokenizer.json,
and optionally generation_config.json, tokenizer_config.json and chat_template.jinja."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from worker.loaded import LoadedModel, ModelLoadError, build_model
from worker.model import ModelConfig

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_hf_dir(path: Path, device: torch.device, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    """The checkpoint in `path`; raises ModelLoadError naming the file and the problem."""
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    hf = read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf(hf)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {_reason(e)}") from None
    tokenizer_json = read_tokenizer(path / "tokenizer.json")
    gen_path = path / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    eos = list(dict.fromkeys(_ids(hf.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
    bos = _ids(hf.get("bos_token_id")) or _ids(gen.get("bos_token_id"))
    template, special = read_chat_template(path)
    try:
        state = map_hf_state(config, _read_safetensors(path, device, dtype))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return LoadedModel(
        model=build_model(config, state, device),
        config=config,
        name=name or path.resolve().name,
        architecture=config.architecture,
        tokenizer_json=tokenizer_json,
        eos_token_ids=eos,
        bos_token_id=bos[0] if bos else None,
        chat_template=template,
        special_tokens=special,
    )


def read_tokenizer(path: Path) -> bytes:
    """tokenizer.json bytes, checked by loading them with `tokenizers`."""
    if not path.is_file():
        raise ModelLoadError(f"tokenizer file not found: {path}")
    data = path.read_bytes()
    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:
        raise ModelLoadError(f"{path} is not a valid tokenizer.json: {e}") from None
    return data


def read_chat_template(path: Path) -> tuple[str, dict[str, str]]:
    """The chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`; "" when none) and
    the special token strings of tokenizer_config.json."""
    config_path = path / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    special = {k: s for k in SPECIAL_TOKEN_NAMES if (s := _token_text(config.get(k)))}
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), special
    template = config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or ""
    if not isinstance(template, str):
        raise ModelLoadError(f"{config_path}: chat_template is neither a string nor a list of named templates")
    return template, special


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
        weight_map = read_json(index).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"checkpoint shard not found: {file}")
        try:
            tensors = load_file(file, device=str(device))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from None
        state.update({k: t.to(dtype) for k, t in tensors.items()})
    return state


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    """A token id field that may be null, an int, or a list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with its `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _reason(e: Exception) -> str:
    return f"missing field {e}" if isinstance(e, KeyError) else str(e)
