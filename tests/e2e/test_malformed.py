"""Messages that do not parse (here: invalid UTF-8 in a string field) against a real `coalesce serve`: a unary
request ends with INVALID_ARGUMENT, and on a Session only that message is refused while the other streams
finish normally, each with its finish reason."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from serve_process import BUILTIN, ServeProcess

from protos.coalesce.v1 import inference_pb2
from tests.session_env import AUTH

pytestmark = pytest.mark.slow
# Field 1 (`text` of GenerateRequest, `stream_id` of SessionRequest), length 2, bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xff\xfe"


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "16")
    yield server
    server.stop()


def test_a_unary_request_that_does_not_parse_is_invalid_argument(serve: ServeProcess) -> None:
    with grpc.insecure_channel(serve.address) as channel:
        generate = channel.unary_stream(
            "/coalesce.v1.InferenceService/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(generate(BAD_UTF8, metadata=[AUTH], timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid coalesce.v1.GenerateRequest" in (err.value.details() or "")


def test_a_session_refuses_one_bad_message_and_finishes_its_streams(serve: ServeProcess) -> None:
    sent: queue.Queue[bytes | None] = queue.Queue()
    good = inference_pb2.SessionRequest(stream_id="a")
    good.generate.request.text = "keep going"
    good.generate.request.stream = True
    good.generate.request.sampling.max_tokens = 200
    good.generate.request.sampling.ignore_eos = True
    sent.put(good.SerializeToString())

    def requests() -> Iterator[bytes]:
        while (raw := sent.get()) is not None:
            yield raw

    with grpc.insecure_channel(serve.address) as channel:
        session = channel.stream_stream(
            "/coalesce.v1.InferenceService/Session",
            request_serializer=lambda raw: raw,
            response_deserializer=inference_pb2.SessionResponse.FromString,
        )
        tokens, errors, finish = 0, [], inference_pb2.FINISH_REASON_UNSPECIFIED
        first = threading.Event()
        for response in session(requests(), metadata=[AUTH], timeout=60):
            if response.HasField("error"):
                errors.append(response.error)
                sent.put(None)  # the caller is done sending; the running stream must still finish
            else:
                tokens += len(response.chunk.token_ids)
                finish = response.chunk.finish_reason or finish
                if not first.is_set():
                    first.set()
                    sent.put(BAD_UTF8)  # mid-stream
    assert [(e.code, e.reason) for e in errors] == [(grpc.StatusCode.INVALID_ARGUMENT.value[0], "MALFORMED_MESSAGE")]
    assert tokens == 200 and finish == inference_pb2.FINISH_REASON_LENGTH
