"""The worker over real gRPC: Info, health, reflection, one session at a time, misuse ends only the session."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tokenizers
from conftest_server import Driver, StepSession, WorkerThread
from grpc_checks import check_standard_services
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from worker.server import SERVICE_NAME

W = worker_pb2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerThread]:
    server = WorkerThread()
    yield server
    server.close()


@pytest.fixture
def channel(worker: WorkerThread) -> Iterator[grpc.Channel]:
    with worker.channel() as ch:
        yield ch


def prompt(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(n * 7 + salt)
    return [rng.randrange(256) for _ in range(n)]


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"coalesce.v1.WorkerService", "grpc.health.v1.Health"} <= names
    check_standard_services(channel, SERVICE_NAME)


def test_info_carries_a_loadable_tokenizer(channel: grpc.Channel) -> None:
    info = worker_pb2_grpc.WorkerServiceStub(channel).Info(W.InfoRequest(), timeout=10)
    assert (info.model_name, info.vocab_size, info.block_size, info.bos_token_id) == ("builtin", 258, 16, 256)
    tokenizer = tokenizers.Tokenizer.from_str(info.tokenizer_json.decode())
    assert tokenizer.decode(tokenizer.encode("héllo").ids) == "héllo"


def test_seeded_generation_over_grpc_ignores_its_batch(channel: grpc.Channel) -> None:
    target = {1: (prompt(21), W.WorkerSampling(temperature=1.0, top_k=40, seed=2**64 - 3, logprobs=3))}
    with StepSession(channel) as session:
        alone = Driver(session.send, 16).generate(target, 12)[1]
    others = {10 + i: (prompt(5 + 9 * i, i), W.WorkerSampling(temperature=0.7, seed=i)) for i in range(6)}
    with StepSession(channel) as session:
        d = Driver(session.send, 16)
        resp = d.step([d.prefill(s, tokens, sampling) for s, (tokens, sampling) in (others | target).items()])
        first = next(t.token for t in resp.tokens if t.seq_id == 1)
        assert len(first.top) == 3 and first.logprob <= 0 and resp.num_tokens == sum(5 + 9 * i for i in range(6)) + 21
        assert [t.seq_id for t in resp.tokens] == [*others, 1]  # request order
    with StepSession(channel) as session:
        together = Driver(session.send, 16).generate(others | target, 12)
    assert together[1] == alone


def test_second_session_is_refused_while_one_is_active(channel: grpc.Channel) -> None:
    with StepSession(channel) as first:
        d = Driver(first.send, 16)
        d.step([d.prefill(1, prompt(4), W.WorkerSampling())])
        with StepSession(channel) as second, pytest.raises(grpc.RpcError) as err:
            second.send(W.StepRequest(step_id=1))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another scheduler session is active" in (err.value.details() or "")
        assert len(d.step([d.decode(1)]).tokens) == 1  # the first session is unaffected
    with StepSession(channel) as third:  # and once it ended, a new one is accepted, starting empty
        with pytest.raises(grpc.RpcError) as err:
            third.send(W.StepRequest(step_id=1, seqs=[W.SequenceWork(seq_id=1, start_position=5, sample=True)]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequence 1: unknown sequence" in (err.value.details() or "")


MISUSE = {
    "unknown sequence": (W.SequenceWork(seq_id=42, start_position=3, sample=True), "sequence 42: unknown sequence"),
    "block out of range": (
        W.SequenceWork(seq_id=43, token_ids=[1], new_blocks=[10**6], sampling=W.WorkerSampling(), sample=True),
        "sequence 43: block 1000000 out of range",
    ),
    "context overflow": (
        # A prefix-cache hit up to position 2044, then 8 new tokens: the last would be at 2051.
        W.SequenceWork(
            seq_id=44, token_ids=[1] * 8, start_position=2044, new_blocks=list(range(129)), sampling=W.WorkerSampling()
        ),
        "sequence 44: context overflow",
    ),
    "not enough blocks": (
        W.SequenceWork(seq_id=45, token_ids=[1] * 20, new_blocks=[0], sampling=W.WorkerSampling(), sample=True),
        "sequence 45: 1 blocks of 16 tokens cannot hold positions up to 19",
    ),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_aborts_the_session_and_the_next_one_works(channel: grpc.Channel, case: str) -> None:
    work, message = MISUSE[case]
    with StepSession(channel) as session:
        d = Driver(session.send, 16)
        d.step([d.prefill(1, prompt(3), W.WorkerSampling())])
        with pytest.raises(grpc.RpcError) as err:
            session.send(W.StepRequest(step_id=99, seqs=[work]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
    with StepSession(channel) as session:
        d = Driver(session.send, 16)
        assert len(d.step([d.prefill(1, prompt(3), W.WorkerSampling())]).tokens) == 1
        assert d.step([d.decode(1)]).tokens[0].seq_id == 1


def test_run_worker_prints_its_address_and_stops_on_sigterm() -> None:
    code = (
        "from worker.config import WorkerSettings; from worker.server import run_worker; "
        "run_worker(WorkerSettings(model='builtin', device='cpu', dtype='float32', port=0, kv_cache_mb=4))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("coalesce worker listening on 127.0.0.1:") and "model builtin, device cpu" in line
        assert "noise" in proc.stdout.readline()
        port = int(line.split()[4].rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert worker_pb2_grpc.WorkerServiceStub(ch).Info(W.InfoRequest(), timeout=10).model_name == "builtin"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
