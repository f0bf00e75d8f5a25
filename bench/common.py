"""Helpers the serving benchmarks share: `coalesce serve` as a child process, its Prometheus counters,
percentiles. No torch here, so importing it is cheap."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"coalesce serving \S+ on (\S+):(\d+)")
# The control plane's step counters: overhead = 1 - d(forward) / d(loop).
COUNTERS = ("coalesce_steps_total", "coalesce_step_forward_seconds_total", "coalesce_step_loop_seconds_total")


def bench_auth() -> None:
    """A control plane refuses to start without tokens (docs/security.md). Give this run one of its own: the
    control planes it starts inherit the mapping, and its clients send the token (both through the
    environment, as a user's shell would pass them)."""
    token = secrets.token_urlsafe(24)
    os.environ["COALESCE_TOKEN"] = token
    os.environ["COALESCE_AUTH__TOKENS"] = json.dumps({hashlib.sha256(token.encode()).hexdigest(): "bench"})


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve(
    model: str, max_batch: int, metrics_port: int, env: dict[str, str] | None = None, dtype: str = "auto"
) -> Iterator[str]:
    """`coalesce serve --port 0 --model MODEL --dtype DTYPE` as a child process; yields its address, stops it
    with Ctrl-C (SIGINT), which drains in-flight requests and stops the workers."""
    cmd = [sys.executable, "-m", "clients.cli", "serve", "--port", "0", "--metrics-port", str(metrics_port)]
    cmd += ["--model", model, "--dtype", dtype]
    # The interactive pool runs 8 sequences by default (latency first); the bench asks for batches of 32.
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COALESCE_POOLS__INTERACTIVE__MAX_BATCH": str(max_batch)}
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found, address = threading.Event(), []

    def read() -> None:  # keep draining stdout so the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if (m := SERVING.search(line)) and not found.is_set():
                address.append(f"{m.group(1)}:{m.group(2)}")
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(180):
            raise RuntimeError("coalesce serve did not start:\n" + "".join(lines[-40:]))
        yield address[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scrape(metrics_port: int) -> dict[str, float] | None:
    """The step counters (summed over label sets, e.g. workers), or None when the endpoint or any is absent."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if name in COUNTERS:
            sums[name] = sums.get(name, 0.0) + float(rest.rsplit(" ", 1)[-1])
    return sums if len(sums) == len(COUNTERS) else None


def overhead(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    if before is None or after is None:
        return None
    loop = after["coalesce_step_loop_seconds_total"] - before["coalesce_step_loop_seconds_total"]
    forward = after["coalesce_step_forward_seconds_total"] - before["coalesce_step_forward_seconds_total"]
    return 1 - forward / loop if loop > 0 else None
