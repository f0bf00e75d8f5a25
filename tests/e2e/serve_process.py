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


class ServeProcess:
    """`coalesce serve --port 0 ...` as a child process; `.address` once it printed that it serves."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "clients.cli", "serve", "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("COALESCE_CONFIG", None)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        self.lines: list[str] = []
        self._found = threading.Event()
        self.address = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(timeout):
            self.stop()
            raise RuntimeError("coalesce serve did not start:\n" + "".join(self.lines[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = SERVING.search(line)
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
