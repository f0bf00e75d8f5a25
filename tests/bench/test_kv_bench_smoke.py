"""bench/kv_quality.py and bench/kv_cache.py run end to end (`--quick`, builtin model) and print their tables.
Timing is never asserted; the load test's preemption counts are: the float32 cache preempts under that load,
the auto cache converts to int8 instead and preempts nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from session_env import stranger_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TEXT = "Paged attention keeps the KV cache in blocks; the scheduler decides who gets them. " * 12


def run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=stranger_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quality_quick_run(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"{name}: {TEXT}", encoding="utf-8")
    out = tmp_path / "report.md"
    docs = str(tmp_path / "*.txt")
    stdout = run(
        "bench/kv_quality.py", "--model", "builtin", "--quick", "--docs", docs, "--prompt-sets", "2", "--out", str(out)
    )
    assert "| cache | perplexity | vs model dtype | greedy tokens agreeing | per prompt set |" in stdout
    assert "| model dtype | " in stdout and "| int8 | " in stdout and "| int8 without tails | " in stdout
    assert re.search(r"\| int8 \| [\d.]+ \| [-+\d.]+ % \| [\d.]+ % \| [\d.]+ / [\d.]+ \| \d+/16 \|", stdout)
    assert "| perplexity vs model dtype |" in stdout and "| greedy tokens agreeing |" in stdout
    assert out.read_text().strip() == stdout.strip()


def test_quality_names_a_missing_document_set(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/kv_quality.py", "--model", "builtin", "--docs", str(tmp_path / "*.txt")],
        cwd=ROOT,
        env=stranger_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"no documents match {tmp_path}" in proc.stderr


def test_cache_quick_run_preempts_only_without_int8() -> None:
    stdout = run("bench/kv_cache.py", "--quick")
    for header in (
        "| model | KV cache | per token |",
        "| model-dtype cache tok/s (torch / kernels) | int8 cache tok/s (torch / kernels) |",
        "| conversion cost |",
    ):
        assert header in stdout
    for dtype in ("float32", "bfloat16"):  # decode speed, int8 against each model dtype's own cache
        pair = r"[\d,]+ / [\d,]+"
        assert re.search(rf"\| {dtype} \| 64 \| {pair} \| {pair} \| [\d.]+x \| [\d.]+x \|", stdout)
    int8 = r"int8 \(\+ a 2-block tail per sequence\)"  # capacity: tails included
    assert re.search(rf"\| builtin \| {int8} \| [\d.]+ KiB \| [\d,]+ \| [\d,]+ \| 1\.9\dx \| 3\.8\dx \|", stdout)
    load = {
        m.group(1): (int(m.group(2)), m.group(3))
        for m in re.finditer(r"\| builtin kv (\w+) \|.*?\| (\d+) \| (\w+) \|", stdout)
    }
    assert load["float32"][0] > 0 and load["float32"][1] == "float32"
    assert load["auto"] == (0, "int8")
    assert "Outputs of auto against float32:" in stdout
