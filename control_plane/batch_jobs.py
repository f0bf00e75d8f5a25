"""Batch jobs (DESIGN §4.10): each item is keyed (tenant, batch_id, seq_id) like an idempotency key, so a
resubmission skips what succeeded (or still runs) and runs the rest, in the BATCH pool, nobody reading."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from control_plane.admission import build_spec
from control_plane.dedup import Deduper, request_fingerprint
from control_plane.dispatcher import GenerationSpec
from control_plane.errors import ApiError, invalid, not_found, store_down
from dedup_service import Outcome, Record, State, StoreUnavailable, batch_key
from protos.coalesce.v1 import inference_pb2

MAX_ITEMS = 10_000
MAX_ID = 128
WATCH_POLL_S = 0.2
STATES = {
    State.INIT: inference_pb2.ITEM_STATE_INIT,
    State.PROCESSING: inference_pb2.ITEM_STATE_PROCESSING,
    State.SUCCESS: inference_pb2.ITEM_STATE_SUCCESS,
    State.FAILED: inference_pb2.ITEM_STATE_FAILED,
}
ENDED = (inference_pb2.ITEM_STATE_SUCCESS, inference_pb2.ITEM_STATE_FAILED)


class BatchJobs:
    def __init__(self, deduper: Deduper) -> None:
        self.deduper = deduper

    async def submit(self, request: inference_pb2.SubmitBatchRequest, tenant: str) -> inference_pb2.SubmitBatchResponse:
        specs = self._validate(request, tenant)  # every item is checked before any runs
        queued = skipped = 0
        try:
            for item, (spec, claimed) in zip(request.items, specs, strict=True):
                if await self._claim(tenant, request.batch_id, item.seq_id, spec, claimed):
                    queued += 1
                else:
                    skipped += 1
        except StoreUnavailable as exc:
            raise store_down(exc) from None
        return inference_pb2.SubmitBatchResponse(batch_id=request.batch_id, queued=queued, skipped=skipped)

    def _validate(
        self, request: inference_pb2.SubmitBatchRequest, tenant: str
    ) -> list[tuple[GenerationSpec, inference_pb2.GenerateRequest]]:
        if not 0 < len(request.batch_id) <= MAX_ID:
            raise invalid("batch_id", f"must be 1 to {MAX_ID} characters")
        if not 0 < len(request.items) <= MAX_ITEMS:
            raise invalid("items", f"{len(request.items)} items; a batch has 1 to {MAX_ITEMS}")
        d = self.deduper.d
        assert d.tokenizer is not None and d.limits is not None
        seen: set[str] = set()
        specs = []
        for i, item in enumerate(request.items):
            if not 0 < len(item.seq_id) <= MAX_ID or item.seq_id in seen:
                raise invalid(f"items[{i}].seq_id", f"{item.seq_id!r} must be 1 to {MAX_ID} characters and unique")
            seen.add(item.seq_id)
            claimed = inference_pb2.GenerateRequest()
            claimed.CopyFrom(item.request)
            claimed.pool, claimed.stream = inference_pb2.POOL_BATCH, False
            claimed.request_id = claimed.request_id or uuid.uuid4().hex
            settings = self.deduper.settings
            specs.append(
                (build_spec(claimed, tenant, d.tokenizer, d.limits, settings, prefix=f"items[{i}].request."), claimed)
            )
        return specs

    async def _claim(
        self, tenant: str, batch_id: str, seq_id: str, spec: GenerationSpec, claimed: inference_pb2.GenerateRequest
    ) -> bool:
        """Run the item unless it succeeded or runs already; True when it was queued."""
        dd, store = self.deduper, self.deduper.store
        fp = request_fingerprint(spec, claimed, dd.d.info.model_name)
        for _ in range(2):
            res = await store.claim_item(
                tenant,
                batch_id,
                seq_id,
                dd.owner,
                fp,
                spec.request_id,
                dd.settings.lease_s,
                payload=claimed.SerializeToString(),
            )
            record = res.record
            if res.outcome is Outcome.REPLAY_ERROR:  # failed by its request last time: run it again
                await store.purge(tenant, batch_key(batch_id, seq_id))
                continue
            if res.outcome is Outcome.KEY_REUSED:
                raise ApiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"batch {batch_id!r} item {seq_id!r} was submitted before with another request",
                    "IDEMPOTENCY_KEY_REUSED",
                )
            if res.outcome is Outcome.CLAIMED and record is not None:
                view = dd.d.submit(spec)
                dd.replicator.own(view.gen, record.epoch, record.key, dd.replicated)
            elif res.outcome is Outcome.TAKEOVER and record is not None:
                view = await dd._take_over(record)
            else:
                return False  # SUCCESS or running
            view.gen.detached_ok = True
            view.gen.interest = 1
            return True
        return False

    async def items(self, batch_id: str, tenant: str) -> list[inference_pb2.BatchItemStatus]:
        if not batch_id:
            raise invalid("batch_id", "must not be empty")
        try:
            listed = await self.deduper.store.list_batch(tenant, batch_id)
        except StoreUnavailable as exc:
            raise store_down(exc) from None
        if not listed:
            raise not_found(f"batch {batch_id!r} is unknown or expired")
        return [item_status(item.seq_id, item.record) for item in listed]

    async def watch(self, batch_id: str, tenant: str) -> AsyncIterator[inference_pb2.BatchItemStatus]:
        """Every item's state first, then each change, until all have ended."""
        last: dict[str, bytes] = {}
        while True:
            items = await self.items(batch_id, tenant)
            for item in items:
                encoded = item.SerializeToString()
                if last.get(item.seq_id) != encoded:
                    last[item.seq_id] = encoded
                    yield item
            if all(item.state in ENDED for item in items):
                return
            await asyncio.sleep(WATCH_POLL_S)


def item_status(seq_id: str, record: Record | None) -> inference_pb2.BatchItemStatus:
    if record is None:  # released after a server-side failure or a cancel
        return inference_pb2.BatchItemStatus(
            seq_id=seq_id,
            state=inference_pb2.ITEM_STATE_FAILED,
            error="it did not complete; resubmit the batch to run it again",
        )
    status = inference_pb2.BatchItemStatus(seq_id=seq_id, state=STATES[record.state], request_id=record.request_id)
    if record.state == State.SUCCESS and record.result:
        result = inference_pb2.GenerateResponse.FromString(record.result)
        status.text, status.finish_reason = result.text, result.finish_reason
        status.token_ids.extend(result.token_ids)
        status.usage.CopyFrom(result.usage)
    elif record.state == State.FAILED:
        status.error = record.error
    return status
