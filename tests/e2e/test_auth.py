"""Authentication against real `coalesce serve` / `coalesce control-plane` processes: bearer tokens map to
tenants, every RPC refuses a call without a valid token, tenants never see each other's requests, the local
token of `coalesce serve`, and a control plane with no tokens configured refusing to start."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from serve_process import BUILTIN, ROOT, ServeProcess

from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.slow
TOKENS = {"alpha-secret": "team-a", "beta-secret": "team-b"}


def _digests(tokens: dict[str, str]) -> str:
    return json.dumps({hashlib.sha256(t.encode()).hexdigest(): tenant for t, tenant in tokens.items()})


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "32", env={"COALESCE_AUTH__TOKENS": _digests(TOKENS)})
    yield server
    server.stop()


def _rpcs(stub: inference_pb2_grpc.InferenceServiceStub) -> dict[str, object]:
    prompt = inference_pb2.GenerateRequest(text="hi", sampling=inference_pb2.SamplingParams(max_tokens=2))
    return {
        "Generate": lambda md: list(stub.Generate(prompt, metadata=md, timeout=10)),
        "Session": lambda md: list(stub.Session(iter([]), metadata=md, timeout=10)),
        "Resume": lambda md: list(stub.Resume(inference_pb2.ResumeRequest(request_id="x"), metadata=md, timeout=10)),
        "Cancel": lambda md: stub.Cancel(inference_pb2.CancelRequest(request_id="x"), metadata=md, timeout=10),
        "GetModelInfo": lambda md: stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), metadata=md, timeout=10),
        "GetBatch": lambda md: stub.GetBatch(inference_pb2.GetBatchRequest(batch_id="b"), metadata=md, timeout=10),
    }


def test_every_rpc_refuses_a_call_without_a_valid_token(serve: ServeProcess) -> None:
    with grpc.insecure_channel(serve.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        bad = {
            "none": (),
            "basic": (("authorization", "Basic YWxhZGRpbjpvcGVuc2VzYW1l"),),
            "wrong": (("authorization", "Bearer not-a-token"),),
        }
        for name, call in _rpcs(stub).items():
            for why, metadata in bad.items():
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)  # type: ignore[operator]
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, why, err.value.details())
        info = stub.GetModelInfo(
            inference_pb2.GetModelInfoRequest(), metadata=(("authorization", "Bearer beta-secret"),)
        )
        assert info.model == "builtin"


def test_a_tenant_never_sees_another_tenants_request(serve: ServeProcess) -> None:
    with (
        CoalesceClient(serve.address, "alpha-secret", retry=NO_RETRY) as alice,
        CoalesceClient(serve.address, "beta-secret", retry=NO_RETRY) as bob,
    ):
        gen = alice.generate("a private conversation", max_tokens=64, ignore_eos=True, stream=True)
        first = next(iter(gen))
        assert gen.request_id is not None
        for attempt in (lambda: bob.resume(gen.request_id, 0).result(), lambda: bob.cancel(gen.request_id)):
            with pytest.raises(CoalesceError) as err:
                attempt()
            assert err.value.code == grpc.StatusCode.NOT_FOUND  # never "it exists, but not yours"
        rest = alice.resume(gen.request_id, len(first.token_ids)).result()
        assert len(first.token_ids) + len(rest.token_ids) == 64 and rest.finish_reason == "length"


def test_serve_with_no_tokens_configured_accepts_its_local_token(tmp_path: Path) -> None:
    server = ServeProcess(
        *BUILTIN, "--kv-cache-mb", "16", env={"XDG_CONFIG_HOME": str(tmp_path)},
        unset=("COALESCE_AUTH__TOKENS", "COALESCE_TOKEN"),
    )  # fmt: skip
    try:
        token_file = tmp_path / "coalesce" / "local-token"
        assert server.wait_for_line(r"auth: accepting the local token in") and token_file.is_file()
        assert token_file.stat().st_mode & 0o077 == 0  # readable by this user only
        with CoalesceClient(server.address, token_file.read_text().strip(), retry=NO_RETRY) as client:
            assert client.generate("hello", max_tokens=3, ignore_eos=True).result().token_ids
        with CoalesceClient(server.address, "guess", retry=NO_RETRY) as client, pytest.raises(CoalesceError) as err:
            client.model_info()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_a_control_plane_with_no_tokens_configured_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COALESCE_AUTH__TOKENS"}
    cmd = [sys.executable, "-m", "clients.cli", "control-plane", "--port", "0", "--worker", "127.0.0.1:1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "coalesce control-plane: auth is on but no tokens are configured: set auth.tokens_file or auth.tokens "
        "(docs/security.md), or auth.disabled: true"
    ]


def test_two_tenants_may_use_the_same_request_id_at_once(serve: ServeProcess) -> None:
    with (
        CoalesceClient(serve.address, "alpha-secret", retry=NO_RETRY) as alice,
        CoalesceClient(serve.address, "beta-secret", retry=NO_RETRY) as bob,
    ):
        mine = alice.generate("alice's words", request_id="shared-id", max_tokens=40, ignore_eos=True, stream=True)
        first = next(iter(mine))
        theirs = bob.generate("bob's words", request_id="shared-id", max_tokens=8, ignore_eos=True).result()
        assert theirs.request_id == "shared-id" and len(theirs.token_ids) == 8
        rest = alice.resume("shared-id", len(first.token_ids)).result()
        assert len(first.token_ids) + len(rest.token_ids) == 40  # alice's own generation, not bob's
        assert bob.resume("shared-id", 0).result().token_ids == theirs.token_ids
