"""`bench/soak.py` for 20 s: real processes, every kind of event that fits, and the summary's zero counts
(lost and duplicated tokens, leaked KV blocks, unexpected errors). Timing is never asserted here. The
storm's keyless streams coalesce as real callers' would (a coalesced request resumes on any replica)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from session_env import stranger_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--seconds", "20", "--interval", "3",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=stranger_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    zeros = ("lost_tokens", "duplicated_tokens", "mismatched_requests", "offset_gaps", "leaked_kv_blocks")
    assert {k: summary[k] for k in zeros} == dict.fromkeys(zeros, 0)
    assert summary["errors_unexpected"] == {} and summary["checks_failed"] == [] and summary["passed"]
    assert summary["served"]["good"] > 0 and len(summary["events"]) >= 3
    assert all(e["ok"] for e in summary["events"])
    assert set(summary["kv_blocks_used_after_drain"]) == {"a", "b"}
    assert set(summary["peak_rss_mib"]) == {"redis", "a/worker", "a/control-plane", "b/worker", "b/control-plane"}
    for line in ("Lost tokens:                0", "Duplicated tokens:          0", "Leaked KV blocks:           0",
                 "Errors, unexpected:         none", "RESULT: PASS"):  # fmt: skip
        assert line in proc.stdout
