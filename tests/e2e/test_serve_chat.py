"""Chat on SmolLM2 through `coalesce serve` as a real process (float32): concurrent greedy chat equals
transformers token for token, chat in Session and batch items, a shared system prompt is a prefix hit, a chat
request dedups with the text it renders to, bad conversations name the field, and the two chat commands."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from serve_process import ROOT, ServeProcess

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError, chat_messages
from protos.coalesce.v1 import inference_pb2

pytestmark = pytest.mark.slow
ENV = {"COALESCE_POOLS__INTERACTIVE__MAX_BATCH": "16", "COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "20"}
# Questions whose answers run past 32 tokens, so every comparison covers all 32.
QUESTIONS = [
    "Explain how photosynthesis works.",
    "Write a short poem about the ocean.",
    "Describe the water cycle in detail.",
    "What are the benefits of regular exercise?",
    "Tell me a story about a brave knight.",
    "How does a computer processor work?",
    "Give me some tips for learning a new language.",
    "Why is the sky blue? Explain in detail.",
]
SYSTEM = (
    "You are a patient teacher. You answer in full sentences, you always explain the reasoning behind an answer, "
    "and you finish with one short question that checks whether the student understood."
)


@pytest.fixture(scope="module")
def serve(smollm2_cache: Path) -> Iterator[ServeProcess]:
    args = ["--model", "smollm2", "--dtype", "float32", "--cache-dir", str(smollm2_cache), "--kv-cache-mb", "64"]
    server = ServeProcess(*args, env=ENV)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


def test_model_info_says_dtype_and_chat(serve: ServeProcess) -> None:
    with CoalesceClient(serve.address) as client:
        info = client.model_info()
    assert (info.model, info.dtype, info.has_chat_template, list(info.eos_token_ids)) == (
        "smollm2",
        "float32",
        True,
        [2],
    )
    assert any("coalesce serving smollm2" in line and "float32" in line for line in serve.lines)


def test_concurrent_greedy_chat_equals_transformers(serve: ServeProcess, smollm2_hf: tuple[Any, Any]) -> None:
    async def ours() -> list[list[int]]:
        async with AsyncCoalesceClient(serve.address) as client:
            gens = [client.chat([("user", q)], max_tokens=32).result() for q in QUESTIONS]
            return [r.token_ids for r in await asyncio.gather(*gens)]

    tokens = asyncio.run(ours())
    tokenizer, model = smollm2_hf
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in QUESTIONS
    ]
    width = max(len(p) for p in prompts)  # one left-padded batch: 32 steps instead of 8 x 32
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2
        )
    for question, got, row in zip(QUESTIONS, tokens, out[:, width:].tolist(), strict=True):
        assert got == row[: len(got)] and len(got) == 32, question


def test_chat_in_a_session_and_in_a_batch(serve: ServeProcess) -> None:
    turns = chat_messages([("user", "What is the capital of France?")])
    with CoalesceClient(serve.address) as client:
        with client.session() as session:
            reply = session.start(turns, max_tokens=16).result()
        assert "Paris" in reply.text and reply.finish_reason == "stop" and reply.token_ids[-1] == 2
        item = inference_pb2.GenerateRequest(messages=turns, sampling=inference_pb2.SamplingParams(max_tokens=16))
        client.submit_batch("chat-batch", [("only", item)])
        final = {s.seq_id: s for s in client.watch_batch("chat-batch")}
    assert final["only"].state == inference_pb2.ITEM_STATE_SUCCESS and final["only"].text == reply.text


def test_shared_system_prompt_is_a_prefix_hit(serve: ServeProcess, smollm2_hf: tuple[Any, Any]) -> None:
    tokenizer, _ = smollm2_hf
    convs = [[("system", SYSTEM), ("user", q)] for q in ("What is rain?", "What is snow?")]
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in conv], add_generation_prompt=True, return_dict=False
        )
        for conv in convs
    ]
    common = next(i for i, (a, b) in enumerate(zip(*rendered, strict=False)) if a != b)
    with CoalesceClient(serve.address) as client:
        client.chat(convs[0], max_tokens=2).result()
        second = client.chat(convs[1], max_tokens=2).result()
    assert second.usage is not None and second.usage.prompt_tokens == len(rendered[1])
    assert common >= 32 and second.usage.cached_prompt_tokens == common // 16 * 16


def test_chat_request_dedups_with_the_text_it_renders_to(serve: ServeProcess, smollm2_hf: tuple[Any, Any]) -> None:
    """Fingerprints are taken on the rendered ids: a conversation and its rendered text are the same request."""
    tokenizer, _ = smollm2_hf
    conv = [("user", "Count slowly from one to fifty.")]
    text = tokenizer.apply_chat_template([{"role": "user", "content": conv[0][1]}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip

    async def run() -> list[Any]:
        async with AsyncCoalesceClient(serve.address, retry=NO_RETRY) as client:
            gens = [client.chat(conv, max_tokens=48, ignore_eos=True).result() for _ in range(3)]
            gens.append(client.generate(text, max_tokens=48, ignore_eos=True).result())
            return list(await asyncio.gather(*gens))

    results = asyncio.run(run())
    assert sorted(r.dedup_outcome for r in results) == ["coalesced"] * 3 + ["miss"]
    assert len({tuple(r.token_ids) for r in results}) == 1


@pytest.mark.parametrize(
    ("turns", "field"),
    [([], "messages.messages"), ([("user", "hi"), ("wizard", "boo")], "messages.messages[1].role")],
)
def test_bad_conversations_name_the_field(serve: ServeProcess, turns: list[tuple[str, str]], field: str) -> None:
    with CoalesceClient(serve.address, retry=NO_RETRY) as client, pytest.raises(CoalesceError) as err:
        client.chat(turns, max_tokens=4).result()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.message.startswith(field + ":")


def test_generate_chat_command(serve: ServeProcess) -> None:
    cmd = [sys.executable, "-m", "clients.cli", "generate", "--chat", "What is the capital of France?"]
    out = subprocess.run([*cmd, "--address", serve.address, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert "Paris" in result["text"] and result["finish_reason"] == "stop"


def test_chat_command_is_multi_turn_and_ctrl_c_cancels_only_the_reply(serve: ServeProcess) -> None:
    cmd = [sys.executable, "-m", "clients.cli", "chat", "--address", serve.address, "--max-tokens", "400"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("Write a long story about a dragon.\n")
        proc.stdin.flush()
        seen = ""
        deadline = time.monotonic() + 60
        while "model> " not in seen or len(seen.split("model> ", 1)[1]) < 20:  # the reply is streaming
            assert time.monotonic() < deadline, seen
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen += os.read(proc.stdout.fileno(), 4096).decode()
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("What is the capital of France?\nAnd of Germany?\n")
        proc.stdin.close()  # Ctrl-D after the last turn
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    transcript = seen + rest
    assert transcript.startswith("chatting with smollm2 (float32)")
    assert "[cancelled]" in transcript and "Traceback" not in transcript
    replies = transcript.split("[cancelled]", 1)[1].split("model> ")[1:]
    assert "Paris" in replies[0] and "Berlin" in replies[1]  # the second turn saw the first
