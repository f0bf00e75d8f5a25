"""bench/perplexity.py runs end to end (`--quick`, builtin model, two small documents) and prints one row per
weights mode. Its figures are not asserted beyond being finite and the baseline's own delta being 0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TEXT = "Weights in eight or four bits read faster than in sixteen, and should predict about as well. " * 6


def test_perplexity_quick_run(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"{name}: {TEXT}", encoding="utf-8")
    cmd = [sys.executable, "bench/perplexity.py", "--model", "builtin", "--quick", "--docs", str(tmp_path / "*.txt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| weights | perplexity | vs dense | goal | seconds |" in proc.stdout
    rows = dict(re.findall(r"^\| (dense|int8|int4) \| ([0-9.]+) \|", proc.stdout, re.M))
    assert set(rows) == {"dense", "int8", "int4"} and all(float(v) > 1 for v in rows.values())
    assert re.search(r"^\| dense \| [0-9.]+ \| \+0\.00% \|", proc.stdout, re.M)


def test_perplexity_names_a_missing_document_set(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/perplexity.py", "--model", "builtin", "--docs", str(tmp_path / "*.txt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no documents match" in proc.stderr
