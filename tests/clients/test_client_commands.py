"""`coalesce generate` and `coalesce batch` in-process (parsed by the real CLI parser) against the scripted
gRPC server: output for people and JSON lines for scripts, one-line errors, batch file validation."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from scripted_server import Script, expected, serve

from clients import batch_cmd, generate_cmd
from clients.cli import CommandError, build_parser, main

Server = Callable[..., Awaitable[str]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def exit_status(argv: list[str]) -> int:
    """Run the whole CLI (its error printing included) in a thread; its exit status."""
    with pytest.raises(SystemExit) as caught:
        await asyncio.to_thread(main, argv)
    return int(caught.value.code or 0)


async def test_generate_json_stream_is_one_object_per_line(
    grpc_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    address, svc = await serve(grpc_server, Script(break_after_chunks=2))  # resumed: invisible in the output
    argv = ["generate", "hi", "--address", address, "--stream", "--json", "--seed", "7", "--stop", "zz"]
    argv += ["--idempotency-key", "k1", "--token", "team-a", "--max-tokens", "8"]
    await asyncio.to_thread(generate_cmd.run, build_parser().parse_args(argv))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    chunks, final = lines[:-1], lines[-1]
    ids, text = expected()
    assert {c["type"] for c in chunks} == {"chunk"} and [c["offset"] for c in chunks] == [0, 2, 4, 6]
    assert [t for c in chunks for t in c["token_ids"]] == ids
    assert chunks[0]["dedup_outcome"] == "miss" and chunks[-1]["finish_reason"] == "length"
    assert final["type"] == "result" and (final["token_ids"], final["text"]) == (ids, text)
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "cached_prompt_tokens": 0}
    assert (final["request_id"], final["finish_reason"], final["dedup_outcome"]) == ("req-1", "length", "miss")
    call, request = svc.generate_calls[0], svc.requests["req-1"]
    assert (call.key_field, call.authorization) == ("k1", "Bearer team-a")
    assert request.sampling.seed == 7 and list(request.sampling.stop) == ["zz"] and request.stream
    assert svc.resume_calls == [("req-1", 4)]


@pytest.mark.parametrize("flags", [[], ["--stream"]])
async def test_generate_prints_text_and_a_newline(
    grpc_server: Server, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    address, _ = await serve(grpc_server)
    args = build_parser().parse_args(["generate", "hi", "--address", address, *flags])
    await asyncio.to_thread(generate_cmd.run, args)
    assert capsys.readouterr().out == expected()[1] + "\n"


async def test_generate_json_without_stream_is_one_result(
    grpc_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    address, svc = await serve(grpc_server)
    args = build_parser().parse_args(["generate", "hi", "--address", address, "--json", "--pool", "batch"])
    await asyncio.to_thread(generate_cmd.run, args)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["text"] == expected()[1]
    assert not svc.requests["req-1"].stream and svc.requests["req-1"].pool == 2


async def test_generate_errors_are_one_line(grpc_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    address, _ = await serve(grpc_server)
    assert await exit_status(["generate", "bad", "--address", address]) == 1
    assert capsys.readouterr().err == "coalesce generate: INVALID_ARGUMENT: prompt: must not be 'bad'\n"

    assert await exit_status(["generate", "hi", "--address", f"127.0.0.1:{closed_port()}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coalesce generate: UNAVAILABLE: cannot reach a Coalesce server at 127.0.0.1:")
    assert err.count("\n") == 1 and "Traceback" not in err


async def test_generate_json_errors_are_one_json_object(
    grpc_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = await serve(grpc_server)
    assert await exit_status(["generate", "bad", "--address", address, "--json"]) == 1
    out = capsys.readouterr()
    assert out.err == "" and json.loads(out.out) == {
        "type": "error",
        "code": "INVALID_ARGUMENT",
        "message": "prompt: must not be 'bad'",
        "reason": "BAD_PROMPT",
        "field_violations": [{"field": "text", "description": "must not be 'bad'"}],
    }


async def test_generate_flags_reach_the_request_and_the_address_comes_from_the_environment(
    grpc_server: Server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, svc = await serve(grpc_server)
    monkeypatch.setenv("COALESCE_ADDRESS", address)
    argv = ["generate", "hi", "--ignore-eos", "--logprobs", "3", "--timeout", "30", "--model", "scripted", "--json"]
    await asyncio.to_thread(generate_cmd.run, build_parser().parse_args(argv))
    request, call = svc.requests["req-1"], svc.generate_calls[0]
    assert request.sampling.ignore_eos and request.sampling.logprobs == 3 and request.model == "scripted"
    assert call.time_remaining is not None and 0 < call.time_remaining < 31
    assert json.loads(capsys.readouterr().out)["logprobs"] == []  # the scripted server sends none


async def test_batch_submits_and_waits_for_every_item(
    grpc_server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    address, svc = await serve(grpc_server)
    items = tmp_path / "items.jsonl"
    lines = [
        {"seq_id": "s1", "prompt": "x", "max_tokens": 2, "temperature": 0.5, "seed": 3},
        {"seq_id": "s2", "prompt": "fail"},
    ]
    items.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")

    base = ["batch", str(items), "--batch-id", "b1", "--address", address]
    assert await exit_status([*base, "--wait"]) == 1  # one item failed
    out, err = capsys.readouterr()
    results = [json.loads(line) for line in out.splitlines()]
    assert [(r["seq_id"], r["state"]) for r in results] == [("s1", "success"), ("s2", "failed")]
    assert results[0]["text"] == "x:0 x:1 " and results[0]["finish_reason"] == "length"
    assert results[1]["error"] == "worker lost"
    assert "batch b1: 2 queued, 0 skipped" in err and "1 of 2 items failed" in err
    assert results[0]["request_id"] == "b1/s1" and svc.batches["b1"]["s2"].error == "worker lost"

    await asyncio.to_thread(batch_cmd.run, build_parser().parse_args(base))
    assert capsys.readouterr().out == "batch b1: 1 queued, 1 skipped\n"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not valid JSON"),
        ('["a"]', "an item must be a JSON object"),
        ('{"seq_id": "b"}', "missing or empty 'prompt'"),
        ('{"seq_id": "b", "prompt": "p", "max_tokens": true}', "'max_tokens' must be int, not true"),
        ('{"seq_id": "b", "prompt": [1, "x"]}', "'prompt' must be a string or a list of token ids"),
        ('{"seq_id": "b", "prompt": "p", "temp": 1}', "unknown field(s) temp"),
        ('{"seq_id": "a", "prompt": "p"}', "seq_id 'a' appears twice"),
    ],
)
def test_batch_file_errors_name_the_line(line: str, problem: str) -> None:
    with pytest.raises(CommandError) as caught:
        batch_cmd.parse_items("items.jsonl", ['{"seq_id": "a", "prompt": "p"}', line])
    assert str(caught.value).startswith(f"items.jsonl:2: {problem}") and caught.value.status == 2


def test_batch_items_become_batch_pool_requests() -> None:
    (item,) = batch_cmd.parse_items("f", ['{"seq_id": "a", "prompt": [5, 6], "top_k": 4, "stop": ["."]}'])
    assert list(item.request.token_ids.ids) == [5, 6] and item.request.pool == 2
    assert item.request.sampling.top_k == 4 and list(item.request.sampling.stop) == ["."]
