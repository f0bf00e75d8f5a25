"""Generations rebuilt from the store: another replica's running generation fed from its token log, and
a finished one replayed from its SUCCESS record. Reading only; taking over a dead owner's work is the
dedup layer's (control_plane.dedup), which calls `follow` and acts when the log goes quiet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from control_plane.errors import not_found, stored_error
from control_plane.generation import Generation, View
from dedup_service import LogSlice, Record, Store, StoreUnavailable
from protos.coalesce.v1 import common_pb2, inference_pb2

REPLAYED = inference_pb2.DEDUP_OUTCOME_REPLAYED
TAIL_S = 1.0  # longest wait for new entries; a log quiet this long makes the follower ask about its owner
LOG_WAIT_S = 0.02  # a log claimed a moment ago but not opened yet is polled this often


def apply_slice(gen: Generation, piece: LogSlice) -> None:
    """Append a log slice's entries to `gen`."""
    for entry in piece.entries:
        lp = common_pb2.TokenLogprob.FromString(entry.logprob) if entry.logprob else None
        gen.append(entry.token_id, entry.text, lp)


async def catch_up(store: Store, gen: Generation, source: str = "") -> None:
    """Read what the log (`source`, default the generation's own) has beyond the tokens `gen` holds."""
    while True:
        piece = await store.read(gen.tenant, source or gen.request_id, len(gen.token_ids))
        if piece is None or not piece.entries:
            return
        apply_slice(gen, piece)


async def follow(
    store: Store,
    gen: Generation,
    source: str,
    lease_s: float,
    clock: Callable[[], float],
    changed: Callable[[], None] = lambda: None,
) -> bool:
    """Feed `gen` from the log `source` until it finishes (True), or until the log has been quiet for TAIL_S
    (False: the caller asks whether its owner is still there, then follows again). `changed` is called after
    each change of `gen` (the journal writes what a request reading it logs under its own id)."""
    quiet_since = time.monotonic()
    while not gen.done:
        try:
            piece = await store.tail(gen.tenant, source, len(gen.token_ids), TAIL_S)
        except StoreUnavailable:
            await asyncio.sleep(TAIL_S)
            continue
        if piece is None:
            if time.monotonic() - quiet_since < lease_s and not gen.token_ids:
                await asyncio.sleep(LOG_WAIT_S)  # its owner claimed it a moment ago and opens the log now
                continue
            expired = not_found("the request's log expired", "LOG_EXPIRED")
            gen.finish(inference_pb2.FINISH_REASON_ERROR, clock(), expired)
            return True
        if piece.entries:
            apply_slice(gen, piece)
            quiet_since = time.monotonic()
            changed()
        if piece.finished:
            done = inference_pb2.GenerateResponse.FromString(piece.finish_info)
            gen.prompt_tokens = done.usage.prompt_tokens
            gen.cached_tokens = done.usage.cached_prompt_tokens
            error = stored_error(done.text) if done.finish_reason == inference_pb2.FINISH_REASON_ERROR else None
            gen.finish(done.finish_reason, clock(), error)
            changed()
        elif time.monotonic() - quiet_since >= TAIL_S:
            return False
    return True


def replay_view(record: Record, tenant: str) -> View:
    """A finished generation rebuilt from a SUCCESS record's stored result."""
    result = inference_pb2.GenerateResponse.FromString(record.result)
    gen = Generation(
        record.request_id,
        tenant,
        prompt_tokens=result.usage.prompt_tokens,
        cached_tokens=result.usage.cached_prompt_tokens,
    )
    if result.token_ids:
        gen.append(result.token_ids[0], result.text)
        for token in result.token_ids[1:]:
            gen.append(token, "")
    if result.logprobs:
        gen.logprobs = list(result.logprobs)
    gen.finish(result.finish_reason, time.monotonic())
    return View(record.request_id, gen, REPLAYED)
