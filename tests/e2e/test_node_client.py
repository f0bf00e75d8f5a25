"""Conformance from another language: a Node.js client built from the .proto files alone (@grpc/grpc-js +
@grpc/proto-loader, pinned in package.json) runs every streaming RPC and the error cases against a real
`coalesce serve`; tests/e2e/node_client.js prints what it saw, asserted here (docs/api.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google.rpc
import pytest
from serve_process import BUILTIN, ServeProcess

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
LONG = 2000


@pytest.fixture(scope="module")
def seen() -> Iterator[dict[str, Any]]:
    node = shutil.which("node")
    assert node, "node is missing: scripts/install.sh dev needs Node.js 20"
    assert (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `npm ci` (scripts/install.sh dev)"
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "64", env={"COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "5"})
    try:
        googleapis = Path(next(iter(google.rpc.__path__))).parents[1]  # holds google/rpc/*.proto
        cmd = [node, str(ROOT / "tests" / "e2e" / "node_client.js"), server.address, str(ROOT / "protos"),
               str(googleapis)]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        yield json.loads(out.stdout)
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def test_model_info_and_its_limits(seen: dict[str, Any]) -> None:
    info = seen["model_info"]
    assert info["model"] == "builtin" and info["max_context"] == 2048
    assert info["limits"]["max_request_bytes"] == 4 * 1024 * 1024 and info["limits"]["max_logprobs"] == 20


def test_generate_streams_contiguous_chunks(seen: dict[str, Any]) -> None:
    g = seen["generate"]
    assert g["error"] is None and len(g["tokens"]) == 8
    assert g["offsets"] == [sum(g["sizes"][:i]) for i in range(len(g["sizes"]))]
    assert g["finish_reason"] == "FINISH_REASON_LENGTH" and g["usage"]["completion_tokens"] == 8
    assert g["dedup_outcome"] == "DEDUP_OUTCOME_MISS" and g["logprobs"] == 0


def test_session_interleaves_and_refuses_misuse_with_details(seen: dict[str, Any]) -> None:
    s = seen["session"]
    assert [g["tokens"] for g in s["generations"]] == s["alone"]
    assert {g["finish_reason"] for g in s["generations"]} == {"FINISH_REASON_LENGTH"}
    assert s["long"]["finish_reason"] == "FINISH_REASON_CANCELLED" and s["long"]["tokens"] < LONG
    dup = s["duplicate"]
    assert (dup["code"], dup["reason"], dup["continues"]) == (6, "STREAM_ID_IN_USE", True)  # ALREADY_EXISTS
    assert s["invalid"]["code"] == 3 and s["invalid"]["reason"] == "INVALID_FIELD"
    assert s["invalid"]["violations"] == [["generate.request.sampling.top_k", "-1 is negative"]]
    assert (s["unknown_cancel"]["code"], s["unknown_cancel"]["reason"]) == (5, "STREAM_NOT_FOUND")  # NOT_FOUND
    assert s["empty_id"]["violations"] == [["stream_id", "must not be empty"]]


def test_resume_after_a_dropped_stream_is_exact(seen: dict[str, Any]) -> None:
    r = seen["resume"]
    assert r["error"] is None and r["first_offset"] == len(r["received"])
    assert r["received"] + r["rest"] == r["whole"] and len(r["whole"]) == 30


def test_cancel_then_resume_returns_the_logged_tokens(seen: dict[str, Any]) -> None:
    c = seen["cancel"]
    assert c["cancelled"] is True and c["again"] is False
    assert c["stream_finish"] == "FINISH_REASON_CANCELLED" and 0 < c["streamed"] < LONG
    assert c["resumed_equal"] and c["resumed_finish"] == "FINISH_REASON_CANCELLED"
    assert c["resumed_completion_tokens"] == c["streamed"]


def test_errors_carry_codes_reasons_and_field_violations(seen: dict[str, Any]) -> None:
    e = seen["errors"]
    assert e["invalid"]["code"] == "INVALID_ARGUMENT" and e["invalid"]["reason"] == "INVALID_FIELD"
    assert [f for f, _ in e["invalid"]["violations"]] == ["sampling.temperature"]
    assert e["context"]["reason"] == "CONTEXT_LENGTH_EXCEEDED"
    assert [f for f, _ in e["context"]["violations"]] == ["sampling.max_tokens"]
    assert (e["unknown_resume"]["code"], e["unknown_resume"]["reason"]) == ("NOT_FOUND", "REQUEST_NOT_FOUND")
    assert e["unknown_cancel"]["code"] == "NOT_FOUND"
    assert (e["beyond_end"]["code"], e["beyond_end"]["reason"]) == ("OUT_OF_RANGE", "OFFSET_OUT_OF_RANGE")
    assert e["key_mismatch"]["reason"] == "IDEMPOTENCY_KEY_MISMATCH"
    assert e["deadline"]["code"] == "DEADLINE_EXCEEDED"
    assert e["after_deadline"]["finish_reason"] == "FINISH_REASON_CANCELLED" and e["after_deadline"]["tokens"] < LONG
