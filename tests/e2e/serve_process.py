"""Start `coalesce serve` (or other coalesce commands) as real processes and find their addresses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"coalesce serving \S+ on (\S+):(\d+)")
CONTROL_PLANE = re.compile(r"coalesce control plane on (\S+):(\d+)")
WORKER = re.compile(r"coalesce worker listening on (\S+):(\d+)")
# The builtin model in float32: these tests compare outputs across batch shapes, which bf16 does not keep equal.
BUILTIN = ("--model", "builtin", "--dtype", "float32")


class CoalesceProcess:
    """`coalesce COMMAND --port 0 ...` as a child process; `.address` once it printed where it listens."""

    def __init__(
        self,
        command: str,
        *args: str,
        ready: re.Pattern[str],
        env: dict[str, str] | None = None,
        timeout: float = 120,
        unset: tuple[str, ...] = (),
    ) -> None:
        self.ready = ready
        cmd = [sys.executable, "-m", "clients.cli", command, "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for name in ("COALESCE_CONFIG", *unset):
            full_env.pop(name, None)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        self.lines: list[str] = []
        self._found = threading.Event()
        self.address = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(timeout):
            self.stop()
            raise RuntimeError(f"coalesce {command} did not start:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = self.ready.search(line)
            if match and not self._found.is_set():
                self.address = f"{match.group(1)}:{match.group(2)}"
                self._found.set()

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def wait_for_line(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if re.search(pattern, line):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines[-40:]))

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ServeProcess(CoalesceProcess):
    """`coalesce serve --port 0 ...`: control plane and spawned workers."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 120, unset: tuple[str, ...] = ()
    ) -> None:
        super().__init__("serve", *args, ready=SERVING, env=env, timeout=timeout, unset=unset)


def scrape(port: int) -> dict[str, float]:
    """Prometheus samples (name{labels} -> value) from a /metrics endpoint."""
    from urllib.request import urlopen

    samples: dict[str, float] = {}
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
    return samples
