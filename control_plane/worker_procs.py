"""Worker child processes for `coalesce serve`: spawned (fork+exec, never a bare fork of a process that
holds gRPC state), restarted on the same port when one dies, stopped on shutdown."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from worker.config import WorkerSettings

log = logging.getLogger(__name__)
BAD_INPUT = 2  # `coalesce worker`'s exit status when its model cannot be loaded (it printed why)


class WorkerStartError(Exception):
    """A worker exited because its settings are wrong: restarting it would only fail again."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_command(settings: WorkerSettings, port: int) -> list[str]:
    flags = {
        "--model": settings.model,
        "--device": settings.device,
        "--dtype": settings.dtype,
        "--weights": settings.weights,
        "--kv-cache-mb": settings.kv_cache_mb,
        "--kv-cache-dtype": settings.kv_cache_dtype,
        "--block-size": settings.block_size,
        "--cache-dir": settings.cache_dir,
        "--host": settings.host,
        "--port": port,
        "--parent-pid": os.getpid(),
    }
    kernels = "--cpu-kernels" if settings.cpu_kernels else "--no-cpu-kernels"
    return [
        sys.executable,
        "-m",
        "clients.cli",
        "worker",
        *(str(part) for flag in flags.items() for part in flag),
        kernels,
    ]


@dataclass
class WorkerProcess:
    """One child worker on a fixed port, so a restart is found at the same address."""

    settings: WorkerSettings
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(worker_command(self.settings, self.port), stdout=subprocess.DEVNULL, env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> bool:
        """Restart a worker that died; True when it had to. Raises WorkerStartError when it exited for bad input."""
        if self.alive():
            return False
        code = self.proc.returncode if self.proc else None
        if code == BAD_INPUT:
            raise WorkerStartError(f"the worker on {self.address} could not load model {self.settings.model!r}")
        log.warning("worker %s exited (%s); restarting it", self.address, code)
        self.start()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn_workers(settings: WorkerSettings, count: int, env: dict[str, str] | None = None) -> list[WorkerProcess]:
    workers = [WorkerProcess(settings, free_port(settings.host), dict(env or {})) for _ in range(count)]
    for w in workers:
        w.start()
    return workers
