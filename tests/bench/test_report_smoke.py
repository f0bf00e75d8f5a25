"""`coalesce bench report` runs end to end on the builtin model at the test suite's tiny setting and writes
report.md with every section, and its figures. Timing is never asserted (benchmarks print ratios)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_tiny_report_writes_markdown_and_figures(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "clients.cli", "bench", "report", "--tiny", "--model", "builtin", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (out / "report.md").read_text()
    for heading in ("## Ratios", "## Offered load", "## Interactive pool max_wait_ms", "## Prefill length-ratio rule",
                    "## Shared prefix", "## Chunked prefill", "## Dedup and replay", "## Tracing"):  # fmt: skip
        assert heading in text
    for ratio in ("one at a time", "streamed / not streamed", "identical /", "tracing on / off"):
        assert ratio in text
    assert "transformers continuous batching:" in text  # the greedy agreement line of each peer
    for png in ("throughput_vs_load", "latency_vs_load", "max_wait_tradeoff", "kv_and_batch_over_time"):
        path = out / f"{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png}.png)" in text
