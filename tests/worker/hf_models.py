"""Test helpers: small random checkpoints written by `transformers`, and a greedy driver that feeds our
runner through a toy block allocator (the engine's job in production)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from worker.batch import PackedBatch, SeqSlice
from worker.builtin import byte_tokenizer
from worker.runner import ModelRunner

COMMON: dict[str, Any] = {"vocab_size": 1100, "intermediate_size": 160, "initializer_range": 0.05}
# Odd head counts, GQA, and each architecture's own twist.
ARCH_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "LlamaForCausalLM": (
        transformers.LlamaConfig,
        {
            **COMMON,
            "hidden_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
            "eos_token_id": [2, 7],
            "bos_token_id": 1,
        },
    ),
    "Qwen2ForCausalLM": (
        transformers.Qwen2Config,
        {
            **COMMON,
            "hidden_size": 80,
            "num_hidden_layers": 2,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "eos_token_id": 3,
        },
    ),
    "MistralForCausalLM": (
        transformers.MistralConfig,
        {
            **COMMON,
            "hidden_size": 112,
            "num_hidden_layers": 2,
            "num_attention_heads": 7,
            "num_key_value_heads": 1,
            "head_dim": 24,  # not hidden / heads
            "max_position_embeddings": 1024,
            "sliding_window": 48,  # much shorter than the test prompts: the window matters
        },
    ),
}


def save_checkpoint(arch: str, path: Path, seed: int = 0, shard: bool = False, **overrides: Any) -> torch.nn.Module:
    """Write a random-init checkpoint (plus our byte tokenizer) to `path`; return the HF model, fp32 on CPU.
    `overrides` replace entries of the architecture's test config."""
    config_cls, kwargs = ARCH_CONFIGS[arch]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation="sdpa")
    with torch.no_grad():  # make norms and biases non-trivial: init leaves them at 1 and 0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(path, max_shard_size="200KB" if shard else "5GB")
    (path / "tokenizer.json").write_text(byte_tokenizer().to_str())
    return model


@dataclass
class Seq:
    """One sequence: its known tokens (prompt, then greedy picks), how many are in the cache, its blocks."""

    seq_id: int
    tokens: list[int]
    prompt_len: int
    fed: int = 0
    table: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> our logits there

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Driver:
    """Greedy decoding through the runner, with blocks handed out in shuffled order."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)

    def alloc(self) -> int:
        return self.free.pop()

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Feed `n` known tokens of each seq; a seq whose known tokens are all cached gets its argmax appended."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        bs = self.runner.block_size
        for seq, n in work:
            end = seq.fed + n
            assert n > 0 and end <= len(seq.tokens)
            while len(seq.table) * bs < end:
                seq.table.append(self.alloc())
            ids += seq.tokens[seq.fed : end]
            positions += range(seq.fed, end)
            slices.append(SeqSlice(seq.seq_id, list(seq.table), seq.fed, n))
        batch = PackedBatch(torch.tensor(ids), torch.tensor(positions), slices)
        logits = self.runner.forward(batch, all_logits=True)
        row = 0
        for seq, n in work:
            for i in range(n):
                seq.logits[seq.fed + i] = logits[row + i]
            seq.fed += n
            row += n
            if seq.fed == len(seq.tokens):
                seq.tokens.append(int(logits[row - 1].argmax()))

    def run(self, seqs: list[Seq], new_tokens: int = 32, chunk: int | None = None) -> None:
        """Step all unfinished seqs together (prefill chunks and decodes mixed) until each has `new_tokens`."""
        while True:
            work = []
            for s in seqs:
                if s.generated < new_tokens:
                    todo = len(s.tokens) - s.fed
                    work.append((s, min(todo, chunk) if chunk else todo))
            if not work:
                return
            self.step(work)


def check_against_hf(hf: torch.nn.Module, seq: Seq, new_tokens: int = 32, atol: float = 1e-4) -> None:
    """Our logits at every position we computed match HF's, and every greedy pick is HF's argmax."""
    assert seq.generated == new_tokens
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens[:-1]])).logits[0]
    positions = sorted(seq.logits)
    ours = torch.stack([seq.logits[p] for p in positions])
    diff = (ours - ref[positions]).abs().max().item()
    assert diff < atol, f"seq {seq.seq_id}: max logit diff {diff}"
    hf_picks = ref[seq.prompt_len - 1 :].argmax(-1).tolist()
    assert seq.tokens[seq.prompt_len :] == hf_picks, f"seq {seq.seq_id}: greedy continuation differs from HF"
