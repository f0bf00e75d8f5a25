"""A `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE, llama.cpp's "gpt2"
tokenizer model), built to give the same ids as transformers' own GGUF tokenizer.

The vocabulary and merges are stored as strings in GPT-2's byte alphabet; token types mark control tokens
(special) and user-defined ones (matched whole but not special); `tokenizer.ggml.pre` names the split regex the
merges were learned with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from worker.builtin import bytes_to_unicode

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex; any other value splits with GPT-2's regex (ByteLevel's own).
SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` fields a byte-level BPE tokenizer is built from."""

    model: str
    pre: str
    tokens: Sequence[str]
    merges: Sequence[str]
    token_types: Sequence[int]
    add_bos: bool
    bos_id: int | None


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """Raises ValueError for a tokenizer model other than byte-level BPE, or missing merges."""
    if vocab.model != "gpt2":
        raise ValueError(f"unsupported tokenizer model {vocab.model!r} (supported: gpt2, i.e. byte-level BPE)")
    if not vocab.merges:
        raise ValueError("tokenizer.ggml.merges is missing")
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()

    def in_alphabet(token: str) -> str:
        # A token written with characters outside the byte alphabet is respelled from its UTF-8 bytes.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    ids = {in_alphabet(token): i for i, token in enumerate(vocab.tokens)}
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in vocab.merges)]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    split = SPLITS.get(vocab.pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    types = list(vocab.token_types) or [0] * len(vocab.tokens)
    # A "control" token spelled outside the byte alphabet is a converter's mislabel: adding it would grow the vocab.
    control = [t for t, k in zip(vocab.tokens, types, strict=False) if k == CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(vocab.tokens, types, strict=False) if k == USER_DEFINED and t in ids]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    if vocab.add_bos and vocab.bos_id is not None:
        bos = vocab.tokens[vocab.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    return tokenizer
