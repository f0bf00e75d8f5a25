"""Scale-out as the Helm chart deploys it, run locally with exactly the containers' commands (rendered from
helm/coalesce): two control planes and two workers sharing one redis-server, the workers found through a
name server the test controls (as a headless Service would list them). Each control plane comes to own one
worker; requests are spread over both; kill -9 one control plane: its worker moves to the other and every
keyed stream completes exactly (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from serve_process import CONTROL_PLANE, WORKER, CoalesceProcess

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError
from control_plane.worker_procs import free_port
from tests.deploy.chart_render import coalesce_commands, config_yaml, render
from tests.dns_server import NameServer

pytestmark = pytest.mark.slow
NAME = "workers.coalesce.test"
HOSTS = ["127.0.0.2", "127.0.0.3"]  # a worker pod each; all of 127.0.0.0/8 is this machine
STREAMS = 8
GREEDY = {"max_tokens": 150, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture
def deployment(redis_server: object, tmp_path: Path) -> Iterator[tuple[list[CoalesceProcess], list[CoalesceProcess]]]:
    docs = render()
    commands, config = coalesce_commands(docs), tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_yaml(docs)))
    port, dns = free_port(), NameServer({NAME: HOSTS})

    def argv(container: str) -> list[str]:  # the container's command, with this machine's config path
        command = commands[container][1:]
        return [str(config) if arg == "/etc/coalesce/config.yaml" else arg for arg in command]

    # What the chart's values, Secrets and Services would give each pod, as environment over config.yaml.
    env = {
        "COALESCE_STORE": redis_server.url,  # type: ignore[attr-defined]
        "COALESCE_WORKER_DNS": f"{NAME}:{port}",
        "COALESCE_WORKER_DNS_SERVER": dns.address,
        "COALESCE_INTERNAL_TOKEN": "internal-secret",
        "COALESCE_AUTH__TOKENS_FILE": "",  # the test's token (COALESCE_AUTH__TOKENS) instead of a Secret
        "COALESCE_LEASE_S": "2",
        "COALESCE_WORKER__MODEL": "builtin",
        "COALESCE_WORKER__DTYPE": "float32",
        "COALESCE_WORKER__KV_CACHE_MB": "32",
    }
    workers: list[CoalesceProcess] = []
    planes: list[CoalesceProcess] = []
    try:
        for host in HOSTS:
            worker_env = {**env, "COALESCE_WORKER__HOST": host}
            workers.append(CoalesceProcess(argv("worker")[0], *argv("worker")[1:], "--port", str(port),
                                           ready=WORKER, env=worker_env))  # fmt: skip
        for _ in range(2):
            plane_env = {**env, "COALESCE_METRICS_PORT": str(free_port())}
            planes.append(CoalesceProcess(argv("control-plane")[0], *argv("control-plane")[1:], ready=CONTROL_PLANE,
                                          env=plane_env))  # fmt: skip
        yield planes, workers
    finally:
        for p in [*planes, *workers]:
            p.stop()
        dns.close()


def _workers_of(address: str) -> int:
    with CoalesceClient(address, retry=NO_RETRY) as client:
        return int(client.model_info().workers)


def _until(check: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.2)


def test_two_control_planes_share_two_workers_and_take_over_a_dead_ones(
    deployment: tuple[list[CoalesceProcess], list[CoalesceProcess]],
) -> None:
    (a, b), _ = deployment
    _until(lambda: _workers_of(a.address) == 1 and _workers_of(b.address) == 1)  # one worker each
    with CoalesceClient(b.address) as client:
        references = [client.generate(f"stream {i}", **GREEDY).result().token_ids for i in range(STREAMS)]  # type: ignore[arg-type]

    async def run() -> list[list[int]]:
        clients = [AsyncCoalesceClient(a.address, retry=NO_RETRY), AsyncCoalesceClient(b.address, retry=NO_RETRY)]
        survivor = AsyncCoalesceClient(b.address)
        started = [asyncio.Event() for _ in range(STREAMS)]

        async def stream(i: int) -> list[int]:
            gen = clients[i % 2].generate(f"stream {i}", idempotency_key=f"scale-{i}", stream=True, **GREEDY)  # type: ignore[arg-type]
            tokens: list[int] = []
            try:
                async for chunk in gen:
                    tokens += chunk.token_ids
                    if len(tokens) >= 5:
                        started[i].set()
            except CoalesceError:  # its control plane died: resume on the survivor, as a load balancer would
                assert gen.request_id is not None
                rest = await survivor.resume(gen.request_id, len(tokens)).result()
                tokens += rest.token_ids
            return tokens

        tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        os.kill(a.proc.pid, signal.SIGKILL)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 180))
        finally:
            for c in [*clients, survivor]:
                await c.close()

    assert asyncio.run(run()) == references  # every keyed stream exactly, half of them through a takeover
    _until(lambda: _workers_of(b.address) == 2)  # the dead control plane's worker moved to the survivor
