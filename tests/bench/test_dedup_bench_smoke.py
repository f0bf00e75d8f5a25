"""`bench/dedup.py --quick` runs end to end and prints its tables. Timing is never asserted here
(benchmarks print ratios, tests never assert times): only the bench's shape is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from session_env import stranger_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_tables(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    cmd = [sys.executable, str(ROOT / "bench" / "dedup.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=stranger_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for header in (
        "| burst | worker steps | tokens computed | wall s | steps ratio | tokens ratio |",
        "| call | n | p50 ms | p99 ms | batch-buffer wait p50 ms |",
    ):
        assert header in proc.stdout
    for row in ("| distinct |", "| identical, keyless |", "| identical, one key |", "| replay (", "| fresh 1-token"):
        assert row in proc.stdout
    assert out.read_text().strip() == proc.stdout.strip()
