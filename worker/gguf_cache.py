"""GGUF checkpoints converted once into a Hugging Face checkpoint directory under the cache directory.

An entry is keyed by the GGUF file's SHA-256 and the weights' dtype, and holds config.json,
generation_config.json, tokenizer.json, tokenizer_config.json (chat template, special tokens) and
model.safetensors, plus MANIFEST.json with every file's SHA-256, written last. An entry whose manifest does not
match its files (a crash mid-write, a truncated or edited file) is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import save_file

from worker.gguf_file import chat_template, gguf_tokenizer, hf_config, hf_tensors, open_gguf
from worker.loaded import ModelLoadError

FORMAT = 1  # bump when the layout of an entry changes: old entries are then simply not found
MANIFEST = "MANIFEST.json"


def cached_checkpoint(gguf: Path, dtype: torch.dtype, cache_dir: Path, log: TextIO = sys.stderr) -> Path:
    """The converted checkpoint directory of `gguf` in `dtype`, converting it first when needed."""
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    root = cache_dir / "gguf"
    digest = file_digest(gguf, root / "digests.json")
    entry = root / f"{digest[:32]}-{str(dtype).removeprefix('torch.')}-v{FORMAT}"
    if entry.is_dir():
        problem = check_entry(entry)
        if problem is None:
            return entry
        print(f"coalesce: cache entry {entry} is corrupt ({problem}); rebuilding it", file=log, flush=True)
        shutil.rmtree(entry, ignore_errors=True)
    convert(gguf, entry, dtype, log)
    return entry


def convert(gguf: Path, entry: Path, dtype: torch.dtype, log: TextIO = sys.stderr) -> None:
    """Dequantize `gguf` into the directory `entry` (written beside it, then renamed into place)."""
    started = time.perf_counter()
    ck = open_gguf(gguf)
    config = hf_config(ck)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        state = dict(hf_tensors(ck, config, dtype, _progress(f"coalesce: dequantizing {gguf.name}", log)))
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        template, special = chat_template(ck)
        _write_json(tmp / "config.json", {**config, "torch_dtype": str(dtype).removeprefix("torch.")})
        _write_json(tmp / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id")})
        _write_json(tmp / "tokenizer_config.json", {"chat_template": template, **special})
        (tmp / "tokenizer.json").write_text(gguf_tokenizer(ck).to_str())
        files = sorted(p.name for p in tmp.iterdir())
        _write_json(tmp / MANIFEST, {"source": str(gguf), "files": {n: _sha256(tmp / n) for n in files}})
        try:
            tmp.rename(entry)
        except OSError:  # another worker finished the same conversion first: keep its entry
            if check_entry(entry) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.perf_counter() - started
    print(f"coalesce: converted {gguf.name} in {took:.1f} s; cached in {entry}", file=log, flush=True)


def check_entry(entry: Path) -> str | None:
    """None when every file matches the manifest; else what is wrong."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, digest in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


def file_digest(path: Path, memo: Path) -> str:
    """SHA-256 of a file, remembered by (path, size, mtime) so that an unchanged multi-GB file is hashed once."""
    stat = path.stat()
    key, stamp = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
    try:
        known: dict[str, Any] = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return str(entry["sha256"])
    digest = _sha256(path)
    known[key] = {"stamp": stamp, "sha256": digest}
    memo.parent.mkdir(parents=True, exist_ok=True)
    _write_json(memo, known)
    return digest


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json(path: Path, data: Any) -> None:
    """Written beside, then renamed: a reader never sees half a file."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    tmp.replace(path)


def _progress(label: str, out: TextIO) -> Callable[[int, int], None]:
    """Progress on one rewritten line on a terminal; on anything else a line at each quarter."""
    tty = out.isatty()
    shown = -1

    def update(done: int, total: int) -> None:
        nonlocal shown
        percent = 100 * done // total
        if tty:
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total} tensors ({percent}%)", end=end, file=out, flush=True)
        elif percent // 25 > shown:
            shown = percent // 25
            print(f"{label}: {done}/{total} tensors ({percent}%)", file=out, flush=True)

    return update
