"""`coalesce generate`: one generation from the command line, as text or as JSON lines for scripts (an error
then is one JSON object too: code, message, reason, field violations)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from clients.client import CoalesceClient
from clients.command_error import CommandError
from clients.types import Chunk, CoalesceError, GenerateOptions, Result, Usage, chat_messages, collect, tls_of
from protos.coalesce.v1 import common_pb2


def usage_json(usage: Usage | None) -> dict[str, int] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
    }


def logprobs_json(logprobs: list[common_pb2.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token_id": lp.token_id,
            "logprob": lp.logprob,
            "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in lp.top],
        }
        for lp in logprobs
    ]


def error_json(err: CoalesceError) -> dict[str, Any]:
    return {
        "type": "error",
        "code": err.code.name,
        "message": err.message,
        "reason": err.reason,
        "field_violations": [{"field": f, "description": d} for f, d in err.field_violations],
    }


def chunk_json(chunk: Chunk) -> dict[str, Any]:
    return {
        "type": "chunk",
        "request_id": chunk.request_id,
        "offset": chunk.offset,
        "token_ids": chunk.token_ids,
        "text": chunk.text,
        "finish_reason": chunk.finish_reason,
        "usage": usage_json(chunk.usage),
        "dedup_outcome": chunk.dedup_outcome,
        "queue_ms": chunk.queue_ms,
        "logprobs": logprobs_json(chunk.logprobs),
    }


def result_json(result: Result) -> dict[str, Any]:
    return {
        "type": "result",
        "request_id": result.request_id,
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": usage_json(result.usage),
        "dedup_outcome": result.dedup_outcome,
        "queue_ms": result.queue_ms,
        "logprobs": logprobs_json(result.logprobs),
    }


def describe(err: CoalesceError, address: str) -> str:
    """One line for stderr: `CODE: message`, saying plainly when nothing answers at the address."""
    message = " ".join(err.message.split())
    unreachable = ("failed to connect", "errors resolving", "dns resolution failed", "connection refused")
    if err.code == grpc.StatusCode.UNAVAILABLE and any(s in message.lower() for s in unreachable):
        message = f"cannot reach a Coalesce server at {address} (is it running?): {message}"
    return f"{err.code.name}: {message}"


def run(args: argparse.Namespace) -> None:
    options: GenerateOptions = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or (),
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
        "model": args.model,
        "pool": args.pool,
        "stream": args.stream,
        "idempotency_key": args.idempotency_key,
    }
    out = sys.stdout
    chunks: list[Chunk] = []
    prompt = args.prompt
    if args.chat:  # one user turn (after an optional system turn), rendered by the server's chat template
        turns = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
        prompt = chat_messages(turns)
    elif args.system:
        raise CommandError("--system needs --chat", 2)
    try:
        with CoalesceClient(args.address, args.token, tls=tls_of(args)) as client:
            for chunk in client.generate(prompt, timeout=args.timeout, **options):
                chunks.append(chunk)
                if not args.json:
                    out.write(chunk.text)
                    out.flush()
                elif args.stream:
                    print(json.dumps(chunk_json(chunk)), file=out, flush=True)
    except CoalesceError as err:
        if args.json:  # scripts read stdout: the error is one more JSON line there
            print(json.dumps(error_json(err)), file=out, flush=True)
            raise SystemExit(1) from None
        if chunks:
            print(file=out)  # end the partial text's line so the error is not glued to it
        raise CommandError(describe(err, args.address)) from None
    if args.json:
        print(json.dumps(result_json(collect(chunks))), file=out, flush=True)
    else:
        print(file=out, flush=True)
