"""`bench/redis_sizing.py --quick` runs end to end and prints its tables. Sizes are not asserted beyond their
shape: they depend on the Redis version and allocator."""

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
    cmd = [sys.executable, str(ROOT / "bench" / "redis_sizing.py"), "--quick", "--requests", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=stranger_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 128 |") or line.startswith("| 512 |")]
    assert len(rows) == 4  # two shapes, with and without a key
    for row in rows:
        cells = row.strip("|").split("|")
        # Every request leaves a request index entry, token log meta and a token log behind.
        assert all(float(c) > 0 for c in cells[4:7]), row
    keyed = [r for r in rows if "| yes |" in r]
    assert all(float(r.strip("|").split("|")[3]) > 0 for r in keyed)  # the idempotency record
    assert "Per output token" in proc.stdout
    assert out.read_text().strip() == proc.stdout.strip()
