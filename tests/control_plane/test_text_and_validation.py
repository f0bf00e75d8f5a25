"""Detokenization (UTF-8 safety, stop strings) and request validation: pure code, no sockets."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from control_plane.admission import idempotency_key, longest_token_bytes
from control_plane.detokenize import IncrementalText
from control_plane.errors import ApiError
from control_plane.validation import Limits, resolve_max_tokens, validate_generate
from protos.coalesce.v1 import inference_pb2

LIMITS = Limits(model_name="builtin", vocab_size=258, max_context=2048, default_max_tokens=256, max_stop_strings=4)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _stream(tok: Tokenizer, ids: list[int], stops: list[str]) -> tuple[list[str], IncrementalText]:
    text = IncrementalText(tok, stops)
    deltas = [text.push(t) for t in ids]
    deltas.append(text.flush())
    return deltas, text


def test_deltas_are_whole_characters_and_add_up(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("héllo 世界 🙂!").ids
    deltas, _ = _stream(byte_tokenizer, ids, [])
    assert "".join(deltas) == "héllo 世界 🙂!"
    for d in deltas:
        d.encode("utf-8")  # never a lone surrogate or split character
    assert len(ids) > len("héllo 世界 🙂!")  # multi-byte characters really spanned several tokens


def test_invalid_bytes_become_replacement_characters(byte_tokenizer: Tokenizer) -> None:
    lead = byte_tokenizer.token_to_id("Ã")  # a lone 0xC3 lead byte
    assert lead is not None
    ids = [*byte_tokenizer.encode("ab").ids, lead]
    deltas, _ = _stream(byte_tokenizer, ids, [])
    assert "".join(deltas) == "ab\ufffd"


def test_stop_string_spanning_tokens_cuts_the_text(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode("one two STOP three").ids
    deltas, text = _stream(byte_tokenizer, ids, ["STOP", "zzz"])
    assert "".join(deltas) == "one two "
    assert text.stopped
    assert all("S" not in d for d in deltas)  # the held-back prefix of the stop never leaked


def test_earliest_stop_wins(byte_tokenizer: Tokenizer) -> None:
    deltas, _ = _stream(byte_tokenizer, byte_tokenizer.encode("xx ab cd").ids, ["cd", "ab"])
    assert "".join(deltas) == "xx "


def _request(**sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(text="hi", sampling=inference_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (inference_pb2.GenerateRequest(), "prompt"),
        (inference_pb2.GenerateRequest(text=""), "text"),
        (inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[1, 999])), "token_ids.ids[1]"),
        (_request(temperature=-0.5), "sampling.temperature"),
        (_request(top_p=1.5), "sampling.top_p"),
        (_request(top_k=-1), "sampling.top_k"),
        (_request(max_tokens=-3), "sampling.max_tokens"),
        (_request(logprobs=21), "sampling.logprobs"),
        (_request(stop=["a", "b", "c", "d", "e"]), "sampling.stop"),
        (_request(stop=[""]), "sampling.stop[0]"),
        (_request(stop_token_ids=[300]), "sampling.stop_token_ids[0]"),
        (inference_pb2.GenerateRequest(text="x", pool=7), "pool"),  # type: ignore[arg-type]
        (inference_pb2.GenerateRequest(text="x", request_id="bad id!"), "request_id"),
        (inference_pb2.GenerateRequest(text="x", model="gpt-9"), "model"),
    ],
)
def test_each_bad_field_is_named(request_: inference_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(ApiError) as err:
        validate_generate(request_, LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.message
    assert any(f == field for f, _ in err.value.violations)


def test_every_violation_is_reported_at_once() -> None:
    with pytest.raises(ApiError) as err:
        validate_generate(_request(temperature=-1, top_k=-1), LIMITS)
    assert [f for f, _ in err.value.violations] == ["sampling.temperature", "sampling.top_k"]


def test_context_overflow_names_both_numbers() -> None:
    with pytest.raises(ApiError) as err:
        resolve_max_tokens(2000, 100, LIMITS)
    assert "2000" in err.value.message and "100" in err.value.message and "2048" in err.value.message
    assert resolve_max_tokens(2000, 0, LIMITS) == 48  # the default is capped by the context
    assert resolve_max_tokens(10, 0, LIMITS) == 256
    with pytest.raises(ApiError, match="context is 2048"):
        resolve_max_tokens(2048, 0, LIMITS)


def test_status_carries_google_rpc_details() -> None:
    from google.rpc import error_details_pb2, status_pb2

    with pytest.raises(ApiError) as err:
        validate_generate(_request(top_k=-1), LIMITS)
    status = err.value.to_status()
    proto = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    bad = error_details_pb2.BadRequest()
    assert proto.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.top_k"


def test_a_huge_stop_token_id_list_is_refused_before_anything_is_kept() -> None:
    req = inference_pb2.GenerateRequest(text="x")
    req.sampling.stop_token_ids.extend([1] * 1_000_000)
    with pytest.raises(ApiError) as err:
        validate_generate(req, LIMITS)
    assert err.value.violations == [("sampling.stop_token_ids", "1000000 stop token ids; at most 64")]


def test_the_payload_kept_with_a_key_drops_unknown_fields(byte_tokenizer: Tokenizer) -> None:
    from google.protobuf.unknown_fields import UnknownFieldSet

    from control_plane.admission import Admission
    from control_plane.config import load_settings

    known = inference_pb2.GenerateRequest(text="hello").SerializeToString()
    unknown_field = b"\xfa\x06" + bytes([0x80, 0x80, 0x01]) + b"u" * 16384  # field 111, 16 KiB of junk
    req = inference_pb2.GenerateRequest.FromString(known + unknown_field)
    admitted = Admission(byte_tokenizer, LIMITS, load_settings()).admit(req, "t", key="k1")
    kept = inference_pb2.GenerateRequest.FromString(admitted.payload)
    assert kept.text == "hello" and kept.request_id == admitted.request_id
    assert len(admitted.payload) < 100 and len(UnknownFieldSet(kept)) == 0
    assert len(UnknownFieldSet(req)) == 1  # the caller's message really carried it


def test_a_prompt_longer_than_the_context_can_hold_is_refused_by_its_bytes(byte_tokenizer: Tokenizer) -> None:
    assert longest_token_bytes(byte_tokenizer) == 2  # the byte-level alphabet: 1 or 2 UTF-8 bytes per token
    limits = dataclasses.replace(LIMITS, max_token_bytes=2)
    assert limits.max_prompt_bytes == 4096
    validate_generate(inference_pb2.GenerateRequest(text="é" * 2048), limits)  # 4096 bytes: may fit
    with pytest.raises(ApiError) as err:
        validate_generate(inference_pb2.GenerateRequest(text="x" * 4097), limits, prefix="generate.request.")
    assert err.value.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert err.value.violations == [
        ("generate.request.text", "4097 bytes; at most 4096 bytes can fit the model's context of 2048 tokens")
    ]


@pytest.mark.parametrize(
    ("field", "header", "prefix", "where", "reason"),
    [
        ("a", "b", "", "idempotency_key", "IDEMPOTENCY_KEY_MISMATCH"),
        ("k" * 257, None, "generate.request.", "generate.request.idempotency_key", "INVALID_FIELD"),
        ("", "k" * 257, "", "x-idempotency-key", "INVALID_FIELD"),
        ("batch/x/y", None, "", "idempotency_key", "INVALID_FIELD"),
    ],
)
def test_idempotency_key_errors_name_where_the_key_came_from(
    field: str, header: str | None, prefix: str, where: str, reason: str
) -> None:
    request = inference_pb2.GenerateRequest(text="hi", idempotency_key=field)
    metadata = [("x-idempotency-key", header)] if header is not None else []
    with pytest.raises(ApiError) as err:
        idempotency_key(request, metadata, prefix)
    assert [f for f, _ in err.value.violations] == [where] and err.value.reason == reason


def test_idempotency_key_from_the_field_or_the_header_when_they_agree() -> None:
    keyed = inference_pb2.GenerateRequest(text="hi", idempotency_key="k")
    assert idempotency_key(keyed, [("x-idempotency-key", "k")]) == "k"
    assert idempotency_key(keyed, []) == "k"
    assert idempotency_key(inference_pb2.GenerateRequest(text="hi"), [("x-idempotency-key", "h")]) == "h"
