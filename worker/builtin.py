"""The built-in default model: a small random Llama and a byte-level tokenizer, made from a seed.

Its output is noise: the weights are random (the same seed gives the same weights on any machine), so it is
only good for tests and for running the service end to end with nothing else installed. The default model
is SmolLM2 (see worker/loading.py); `--model` also takes a GGUF file or a Hugging Face checkpoint directory.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from worker.loaded import LoadedModel, build_model, meta_transformer
from worker.model import ModelConfig

BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 256, 257  # after the 256 byte tokens, whose ids are their byte values

# A Hugging Face-style config.json of ~3M parameters: big enough that batching pays off on a CPU.
BUILTIN_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 258,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
INIT_STD = 0.02


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Tokenizer:
    """One token per byte (id = byte value) plus BOS/EOS: any UTF-8 text round-trips."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    assert tokenizer.token_to_id(BOS) == BOS_ID and tokenizer.token_to_id(EOS) == EOS_ID
    return tokenizer


def random_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights drawn on the CPU from a seeded generator, in a fixed order: norms 1, the rest N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {name: t.shape for name, t in meta_transformer(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=generator) * INIT_STD
    return state


def build_builtin(seed: int, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    config = ModelConfig.from_hf(BUILTIN_CONFIG)
    state = {name: t.to(device=device, dtype=dtype) for name, t in random_state(config, seed).items()}
    return LoadedModel(
        model=build_model(config, state, device),
        config=config,
        name="builtin",
        architecture=config.architecture,
        tokenizer_json=byte_tokenizer().to_str().encode(),
        eos_token_ids=[EOS_ID],
        bos_token_id=BOS_ID,
    )
