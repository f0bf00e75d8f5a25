"""Batch jobs: each item is keyed (tenant, batch_id, seq_id) like an idempotency key, so a
resubmission skips what succeeded (or still runs) and runs the rest, in the BATCH pool, nobody reading."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from control_plane.admission import Admission
from control_plane.dedup import Dedup
from control_plane.errors import invalid, not_found, store_down
from control_plane.request import Request
from dedup_service import Record, State, Store, StoreUnavailable, batch_key
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
    def __init__(self, admission: Admission, dedup: Dedup, store: Store) -> None:
        self.admission = admission
        self.dedup = dedup
        self.store = store

    async def submit(self, request: inference_pb2.SubmitBatchRequest, tenant: str) -> inference_pb2.SubmitBatchResponse:
        requests = self._validate(request, tenant)  # every item is checked before any runs
        try:
            ran = [
                await self.dedup.run_item(admitted, request.batch_id, item.seq_id)
                for item, admitted in zip(request.items, requests, strict=True)
            ]
        except StoreUnavailable as exc:
            raise store_down(exc) from None
        queued = sum(ran)
        return inference_pb2.SubmitBatchResponse(batch_id=request.batch_id, queued=queued, skipped=len(ran) - queued)

    def _validate(self, request: inference_pb2.SubmitBatchRequest, tenant: str) -> list[Request]:
        if not 0 < len(request.batch_id) <= MAX_ID:
            raise invalid("batch_id", f"must be 1 to {MAX_ID} characters")
        if not 0 < len(request.items) <= MAX_ITEMS:
            raise invalid("items", f"{len(request.items)} items; a batch has 1 to {MAX_ITEMS}")
        seen: set[str] = set()
        admitted = []
        for i, item in enumerate(request.items):
            if not 0 < len(item.seq_id) <= MAX_ID or item.seq_id in seen:
                raise invalid(f"items[{i}].seq_id", f"{item.seq_id!r} must be 1 to {MAX_ID} characters and unique")
            seen.add(item.seq_id)
            claimed = inference_pb2.GenerateRequest()
            claimed.CopyFrom(item.request)
            claimed.pool, claimed.stream = inference_pb2.POOL_BATCH, False
            key = batch_key(request.batch_id, item.seq_id)  # the item's record; its payload is what re-runs
            admitted.append(self.admission.admit(claimed, tenant, key=key, prefix=f"items[{i}].request."))
        return admitted

    async def items(self, batch_id: str, tenant: str) -> list[inference_pb2.BatchItemStatus]:
        if not batch_id:
            raise invalid("batch_id", "must not be empty")
        try:
            listed = await self.store.list_batch(tenant, batch_id)
        except StoreUnavailable as exc:
            raise store_down(exc) from None
        if not listed:
            raise not_found(f"batch {batch_id!r} is unknown or expired", "BATCH_NOT_FOUND")
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
