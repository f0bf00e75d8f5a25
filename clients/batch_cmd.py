"""`coalesce batch FILE --batch-id ID [--wait]`: submit a JSON-lines batch job, optionally wait for it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from clients.client import ITEM_ENDED, CoalesceClient
from clients.command_error import CommandError
from clients.generate_cmd import describe, usage_json
from clients.types import CoalesceError, Usage, build_request, tls_of
from protos.coalesce.v1 import inference_pb2

# Item fields and the JSON types they accept (bool is excluded from numbers: True is not a max_tokens).
NUMBER = (int, float)
FIELDS: dict[str, tuple[type, ...]] = {
    "seq_id": (str,),
    "prompt": (str, list),
    "max_tokens": (int,),
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": (int,),
    "seed": (int,),
    "stop": (list,),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
}


def _check(obj: Any, seen: set[str]) -> str | None:
    """What is wrong with line n's item, or None."""
    if not isinstance(obj, dict):
        return "an item must be a JSON object"
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        return f"unknown field(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})"
    for name in ("seq_id", "prompt"):
        if not obj.get(name):
            return f"missing or empty {name!r}"
    for name, value in obj.items():
        types = FIELDS[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{name!r} must be {' or '.join(t.__name__ for t in types)}, not {json.dumps(value)}"
    prompt = obj["prompt"]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "'prompt' must be a string or a list of token ids"
    if obj["seq_id"] in seen:
        return f"seq_id {obj['seq_id']!r} appears twice"
    return None


def parse_items(path: str, lines: Iterable[str]) -> list[inference_pb2.BatchItem]:
    items: list[inference_pb2.BatchItem] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CommandError(f"{path}:{n}: not valid JSON ({exc.msg})", 2) from None
        problem = _check(obj, seen)
        if problem:
            raise CommandError(f"{path}:{n}: {problem}", 2)
        seen.add(obj["seq_id"])
        options = {k: v for k, v in obj.items() if k not in ("seq_id", "prompt")}
        request = build_request(obj["prompt"], pool="batch", stream=False, **options)
        items.append(inference_pb2.BatchItem(seq_id=obj["seq_id"], request=request))
    if not items:
        raise CommandError(f"{path}: no items", 2)
    return items


def item_json(item: inference_pb2.BatchItemStatus) -> dict[str, Any]:
    usage = Usage(item.usage.prompt_tokens, item.usage.completion_tokens, item.usage.cached_prompt_tokens)
    finish = inference_pb2.FinishReason.Name(item.finish_reason).removeprefix("FINISH_REASON_").lower()
    return {
        "seq_id": item.seq_id,
        "state": inference_pb2.ItemState.Name(item.state).removeprefix("ITEM_STATE_").lower(),
        "request_id": item.request_id,
        "text": item.text,
        "token_ids": list(item.token_ids),
        "finish_reason": None if item.finish_reason == 0 else finish,
        "usage": usage_json(usage) if item.HasField("usage") else None,
        "error": item.error or None,
    }


def run(args: argparse.Namespace) -> None:
    try:
        with open(args.file, encoding="utf-8") as f:
            items = parse_items(args.file, f)
    except OSError as exc:
        raise CommandError(f"cannot read {args.file}: {exc.strerror}", 2) from None
    try:
        with CoalesceClient(args.address, args.token, tls=tls_of(args)) as client:
            submitted = client.submit_batch(args.batch_id, items)
            # With --wait stdout is only JSON lines; the summary goes to stderr.
            summary = f"batch {submitted.batch_id}: {submitted.queued} queued, {submitted.skipped} skipped"
            print(summary, file=sys.stderr if args.wait else sys.stdout, flush=True)
            if not args.wait:
                return
            latest = {item.seq_id: item for item in client.watch_batch(args.batch_id)}
    except CoalesceError as err:
        raise CommandError(describe(err, args.address)) from None
    ours = [latest.get(item.seq_id) for item in items]
    if any(status is None or status.state not in ITEM_ENDED for status in ours):
        raise CommandError("the watch ended before every item had ended; run the same command again")
    for status in sorted(latest.values(), key=lambda s: s.seq_id):
        print(json.dumps(item_json(status)), flush=True)
    failed = sum(s.state == inference_pb2.ITEM_STATE_FAILED for s in latest.values())
    if failed:
        raise CommandError(f"{failed} of {len(latest)} items failed; resubmit the same --batch-id to rerun them")
