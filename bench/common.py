"""Helpers the benchmarks (and the tests' fixtures) share: `coalesce serve` as a child process, its Prometheus
counters, percentiles, a redis-server on a free port. No torch here, so importing it is cheap."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"coalesce serving \S+ on (\S+):(\d+)")
# The control plane's step counters: overhead = 1 - d(forward) / d(loop).
COUNTERS = ("coalesce_steps_total", "coalesce_step_forward_seconds_total", "coalesce_step_loop_seconds_total")


def bench_token() -> None:
    """Unless the environment already configures tokens: one random bearer token for this run, known to the
    servers the bench spawns (COALESCE_AUTH__TOKENS, inherited) and sent by its clients (COALESCE_TOKEN). A
    standalone `coalesce control-plane` refuses to start with auth on and no tokens (docs/security.md)."""
    if "COALESCE_AUTH__TOKENS" in os.environ or "COALESCE_TOKEN" in os.environ:
        return
    token = secrets.token_urlsafe(24)
    os.environ["COALESCE_TOKEN"] = token
    os.environ["COALESCE_AUTH__TOKENS"] = json.dumps({hashlib.sha256(token.encode()).hexdigest(): "bench"})


def interrupt(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C (SIGINT), which lets a server drain and stop its children; kill -9 if it takes over 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
        interrupt(proc)


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


# --- redis-server on a free port (the dedup bench and the tests' fixtures) -------------------------------


@dataclass(frozen=True)
class RedisTls:
    """PEM files for a TLS-only redis-server: its certificate and key, and the CA that signed it (and the
    clients' certificates, when `auth_clients`)."""

    ca: Path
    cert: Path
    key: Path
    auth_clients: bool = False


class RedisServer:
    """A redis-server child process on a free port, with nothing persisted.

    `extra_args` go to redis-server as they are (e.g. "--maxmemory", "2mb"); with `tls` it listens with TLS
    only, and `url` is a rediss:// URL (without the CA: a test adds its `ssl_*` options)."""

    def __init__(self, tmp: Path, extra_args: Sequence[str] = (), tls: RedisTls | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run the README's test command, which installs it")
        self.port = free_port()
        self.tls = tls
        self._args = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)]
        if tls is None:
            self.url = f"redis://127.0.0.1:{self.port}/0"
            self._args += ["--port", str(self.port)]
        else:
            self.url = f"rediss://127.0.0.1:{self.port}/0"
            self._args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls.cert)]
            self._args += ["--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca)]
            self._args += ["--tls-auth-clients", "yes" if tls.auth_clients else "no"]
        self._args += list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def client(self) -> redis.Redis:
        """A plain synchronous client (trusting the test CA, presenting its client certificate under TLS)."""
        if self.tls is None:
            return redis.Redis(port=self.port)
        return redis.Redis(
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.tls.ca),
            ssl_certfile=str(self.tls.cert),
            ssl_keyfile=str(self.tls.key),
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {self._args}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server() -> Iterator[str]:
    """A RedisServer in a temporary directory for the length of a `with`; yields its URL."""
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            yield server.url
        finally:
            server.stop()
