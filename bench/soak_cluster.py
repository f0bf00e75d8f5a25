"""The soak's processes (bench/soak.py): a redis-server whose persistence is chosen at each start, and two
replicas, each a `coalesce control-plane` driving its own `coalesce worker`, that can be killed with SIGKILL
and started again as a supervisor would. Every process's resident memory is sampled for its peak."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import urllib.request
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from bench.common import ROOT, free_port

CONTROL_PLANE = re.compile(r"coalesce control plane on (\S+):(\d+)")
WORKER = re.compile(r"coalesce worker listening on (\S+):(\d+)")
START_TIMEOUT_S = 180.0  # a cold start on a loaded 2-core machine imports torch in tens of seconds
KV_USED = "coalesce_kv_blocks_used"
# What the soak counts in a control plane's log (control_plane/worker_link.py, replication.py, dedup.py).
CONTROL_PLANE_LOG = {
    "connected": r"worker \S+ connected",
    "lost": r"worker \S+ lost",
    "claimed again": r"claimed again at epoch",
    "keyless continued": r"was lost; continued here at epoch",
    "fenced": r"another replica owns it now",
}


STARTED: list[Child] = []  # every child process started, for `kill_leftovers`


class Child:
    """One child process: started again on demand, its output kept (the last lines, for diagnosis), and the
    lines matching each `watch` pattern counted over every start."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str], ready: re.Pattern[str] | None,
                 watch: dict[str, str] | None = None) -> None:  # fmt: skip
        self.role = role
        self.argv = argv
        self.env = env
        self.ready = ready
        self.watch = {name: re.compile(pattern) for name, pattern in (watch or {}).items()}
        self.seen: Counter[str] = Counter()
        self.last: dict[str, str] = {}  # the last line matching each watch pattern
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: deque[str] = deque(maxlen=400)
        self.address = ""
        self.starts = 0
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    async def start(self) -> str:
        """Start it; with a ready pattern, wait for the line naming its address."""
        found: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=1 << 20,
            start_new_session=True,  # signals meant for the bench (Ctrl-C, a CI timeout) are not theirs: it stops them
        )
        self.starts += 1
        STARTED.append(self)
        self._reader = asyncio.create_task(self._read(self.proc, found))
        if self.ready is None:
            return ""
        try:
            self.address = await asyncio.wait_for(asyncio.shield(found), START_TIMEOUT_S)
        except (TimeoutError, EOFError):
            await self.kill()
            raise RuntimeError(f"{self.role} did not start:\n" + "".join(list(self.lines)[-40:])) from None
        return self.address

    async def _read(self, proc: asyncio.subprocess.Process, found: asyncio.Future[str]) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:  # keep draining, so the child never blocks on a full pipe
            line = raw.decode(errors="replace")
            self.lines.append(line)
            for name, pattern in self.watch.items():
                if pattern.search(line):
                    self.seen[name] += 1
                    self.last[name] = line
            if self.ready is not None and not found.done() and (m := self.ready.search(line)):
                found.set_result(f"{m.group(1)}:{m.group(2)}")
        if not found.done():  # it exited before saying where it listens
            found.set_exception(EOFError())
            if self.ready is None:
                found.exception()  # nobody waits for it

    async def kill(self) -> None:
        """kill -9: no drain, no cleanup, as a crash or an OOM kill."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def stop(self, timeout: float = 30) -> bool:
        """Ctrl-C (SIGINT) at the end of the soak; kill -9 if it does not stop in time. False when it had to."""
        stopped = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                stopped = False
        await self.kill()
        return stopped


def kill_leftovers() -> int:
    """kill -9 every child still running (the soak ended without stopping them); how many there were."""
    left = [c.proc for c in STARTED if c.proc is not None and c.proc.returncode is None]
    for proc in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    return len(left)


def coalesce_argv(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "clients.cli", command, *args]


class Replica:
    """A control plane and its own worker. The worker keeps its port across restarts (a supervisor restarts it
    in place); the control plane binds a new port each start, so its address changes and is tracked here."""

    def __init__(self, name: str, store: str, env: dict[str, str], worker_args: list[str]) -> None:
        self.name = name
        self.store = store
        self.worker_port = free_port()
        argv = coalesce_argv("worker", "--port", str(self.worker_port), *worker_args)
        self.worker = Child(f"{name}/worker", argv, env, WORKER)
        self.cp = Child(f"{name}/control-plane", [], env, CONTROL_PLANE, CONTROL_PLANE_LOG)
        self.metrics_port = 0
        self.up = False  # the control plane answers at `address`

    @property
    def address(self) -> str:
        return self.cp.address

    async def start_worker(self) -> None:
        await self.worker.start()

    async def start_control_plane(self) -> str:
        self.metrics_port = free_port()
        self.cp.argv = coalesce_argv(
            "control-plane", "--port", "0", "--worker", f"127.0.0.1:{self.worker_port}", "--store", self.store,
            "--metrics-port", str(self.metrics_port),
        )  # fmt: skip
        address = await self.cp.start()  # printed once its worker is connected
        self.up = True
        return address

    async def restart_worker(self) -> None:
        """kill -9 the worker and start it again on its port. Its control plane finds out at its next step
        (an idle one is not reading the worker's stream), and reconnects."""
        await self.worker.kill()
        await self.worker.start()

    async def reconnected(self, connected: int, timeout: float = 60) -> None:
        """Wait until the control plane has connected to its worker more than `connected` times."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.cp.seen["connected"] <= connected:
            if loop.time() > deadline:
                raise RuntimeError(f"{self.name}: the control plane did not reconnect to its restarted worker")
            await asyncio.sleep(0.1)

    async def restart_control_plane(self) -> str:
        """kill -9 the control plane and start a new one (new port) on the same worker."""
        old = self.address
        self.up = False
        await self.cp.kill()
        new = await self.start_control_plane()
        return f"{old} -> {new}"

    def kv_blocks_used(self) -> float | None:
        """The KV-blocks-in-use gauge summed over workers, or None when /metrics does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as page:
                text = page.read().decode()
        except OSError:
            return None
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(KV_USED + "{"))

    def children(self) -> list[Child]:
        return [self.worker, self.cp]

    async def stop(self) -> list[str]:
        """Stop both; the roles that did not stop on SIGINT."""
        return [c.role for c in (self.cp, self.worker) if not await c.stop()]


class Redis:
    """redis-server on a fixed port. `persistent` runs write an AOF in the current data directory, which the
    next persistent start loads; a start without persistence gets an empty directory and writes nothing."""

    def __init__(self, base: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (the README's test command installs it)")
        self.exe = exe
        self.base = base
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dirs = 0
        self.dir = self._new_dir()
        self.persistent = False
        self.child = Child("redis", [], {}, None)

    def _new_dir(self) -> Path:
        self.dirs += 1
        path = self.base / f"redis-{self.dirs}"
        path.mkdir()
        return path

    async def start(self, persistent: bool, keep_data: bool) -> None:
        if not keep_data:
            self.dir = self._new_dir()
        self.persistent = persistent
        self.child.argv = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                           "--save", "", "--appendonly", "yes" if persistent else "no",
                           "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]  # fmt: skip
        await self.child.start()
        await self._until(lambda info: int(info.get("loading", 1)) == 0, "loaded its data")

    async def kill(self) -> None:
        await self.child.kill()

    async def arm_persistence(self) -> None:
        """Turn the AOF on in a running server (CONFIG SET rewrites what it holds into a new AOF first)."""
        if self.persistent:
            return
        client = aioredis.Redis(port=self.port)
        try:
            await client.config_set("appendonly", "yes")
        finally:
            await client.aclose()
        self.persistent = True
        await self._until(
            lambda i: (
                int(i.get("aof_enabled", 0)) == 1
                and int(i.get("aof_rewrite_in_progress", 1)) == 0
                and int(i.get("aof_rewrite_scheduled", 1)) == 0
            ),
            "written its AOF",
        )

    async def _until(self, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30) -> None:
        client = aioredis.Redis(port=self.port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                try:
                    info = await client.info("persistence")
                    if done(info):
                        return
                except (redis_errors.ConnectionError, redis_errors.BusyLoadingError):
                    pass
                if loop.time() > deadline or self.child.pid is None:
                    raise RuntimeError(f"redis-server on port {self.port} has not {what}")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def stop(self) -> None:
        await self.child.stop(timeout=10)


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssPeaks:
    """The highest VmRSS seen per role (over every restart of that role)."""

    def __init__(self) -> None:
        self.peak_kib: dict[str, int] = {}

    def sample(self, children: list[Child]) -> None:
        for child in children:
            if child.pid is not None:
                self.peak_kib[child.role] = max(self.peak_kib.get(child.role, 0), rss_kib(child.pid))

    async def run(self, children: list[Child], period_s: float = 0.5) -> None:
        while True:
            self.sample(children)
            await asyncio.sleep(period_s)
