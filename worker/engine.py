"""The worker's executor: turns one StepRequest into one forward pass and one sampled token per sampling
sequence, keeping the little per-sequence state the protocol needs. It decides nothing: batching, block
allocation and prefix sharing are the control plane's.

Step protocol, as enforced here (all positions are absolute token positions in the sequence):
- `release` is applied first: released sequences are forgotten (unknown ids are ignored, so a release is
  idempotent); an id released and listed in `seqs` in the same step is a new sequence.
- The whole request is then validated before any state changes; the first problem raises StepError naming
  the sequence, and the engine is left exactly as before the request.
- First sight of a sequence: `sampling` must be set and `token_ids` non-empty. `start_position` may be > 0
  when the control plane maps a cached prefix (blocks shared with other sequences) into `new_blocks`;
  the worker trusts that those positions are already in the cache.
- Known sequence: `start_position` must equal the number of tokens already in its cache. Empty
  `token_ids` is a decode: the token sampled for it on the previous step is fed (there must be one: a
  step with `sample=true` since it was last fed). Non-empty `token_ids` are fed as given (a further prefill
  chunk); an unfed sampled token is then dropped.
- After `new_blocks` are appended, the table must cover every fed position (len * block_size > last
  position), every position must be < max_context, block ids < num_blocks, token ids < vocab size.
- `kv_to_int8` (only for an `auto` cache still in the model's dtype) converts the cache to int8 after the
  release, before the copies; block ids are checked against the cache as it will be for the forward pass: in
  an auto cache still in the model's dtype, a block id must be a multiple of kv_block_units.
- `tail_blocks` (first sight only, on an int8 cache, kv_tail_blocks of them, none in the block table): block ids
  the sequence holds as its full-precision tail (worker/kv_cache.py) until it is released.
- `copies` run before the forward pass, after validation.
- With `sample=true` the token sampled becomes the sequence's next input; its noise position is the
  number of tokens in the cache after this step (the position the token will take).
- A WorkerSampling seed of 0 means "unseeded": the engine picks a random seed on first sight.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protos.coalesce.v1 import common_pb2, worker_pb2
from worker.batch import PackedBatch, SeqSlice
from worker.runner import ModelRunner
from worker.sampler import SamplingParams, check_params, sample, to_int64


class StepError(Exception):
    """A StepRequest the protocol does not allow; the message names the sequence when there is one."""

    def __init__(self, seq_id: int | None, message: str) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id}: {message}" if seq_id is not None else message)


@dataclass(slots=True)
class SeqState:
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions [0, num_cached) are in the KV cache
    next_token: int | None = None  # sampled on the last step, not yet fed
    tail: list[int] = field(default_factory=list)  # its full-precision tail's blocks (worker/kv_cache.py)
    tail_from: int = 0  # the first position it computed itself (its start on first sight)


@dataclass(slots=True)
class _Planned:
    """One validated SequenceWork: what to feed and the state it leaves."""

    seq_id: int
    tokens: list[int]
    start: int
    block_table: list[int]
    params: SamplingParams
    sample: bool
    tail: list[int]
    tail_from: int


def _random_seed() -> int:
    return secrets.randbits(63) + 1


def kv_dtype_name(kv_dtype: str, dtype: torch.dtype) -> str:
    """What InfoResponse.kv_cache_dtype says: "int8", "auto", or the model's dtype (e.g. "bfloat16")."""
    return str(dtype).removeprefix("torch.") if kv_dtype == "model" else kv_dtype


class Engine:
    """Owns a ModelRunner and the sequences of the current session. Thread-safe: one step at a time."""

    def __init__(
        self,
        runner: ModelRunner,
        clock: Callable[[], float] = time.perf_counter,
        seed_source: Callable[[], int] = _random_seed,
    ) -> None:
        self.runner = runner
        self.vocab_size = int(runner.loaded.config.vocab_size)
        self.clock = clock
        self.seed_source = seed_source
        self.seqs: dict[int, SeqState] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every sequence (a new scheduler session); the cache contents become meaningless (an auto
        cache returns to the model's dtype)."""
        with self._lock:
            self.seqs.clear()
            self.runner.cache.reset()

    def info(self) -> worker_pb2.InfoResponse:
        r, loaded = self.runner, self.runner.loaded
        return worker_pb2.InfoResponse(
            model_name=loaded.name,
            architecture=loaded.architecture,
            vocab_size=self.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            max_context=r.max_context,
            block_size=r.block_size,
            num_blocks=r.num_blocks,
            dtype=str(r.dtype).removeprefix("torch."),
            device=str(r.device),
            tokenizer_json=loaded.tokenizer_json,
            bos_token_id=-1 if loaded.bos_token_id is None else loaded.bos_token_id,
            chat_template=loaded.chat_template,
            special_tokens=loaded.special_tokens,
            kv_cache_dtype=kv_dtype_name(r.cache.kv_dtype, r.dtype),
            kv_block_units=r.cache.units,
            kv_tail_blocks=r.cache.tail_blocks,
        )

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        with self._lock:
            return self._step(req)

    def _step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        t0 = self.clock()
        cache = self.runner.cache
        if req.kv_to_int8 and not cache.can_switch:
            what = "has already converted" if cache.int8 else f"is {kv_dtype_name(cache.kv_dtype, cache.dtype)}"
            raise StepError(None, f"kv_to_int8 needs an auto KV cache in the model's dtype; this one {what}")
        div = 1 if req.kv_to_int8 else cache.block_div
        released = set(req.release)
        int8 = cache.int8 or req.kv_to_int8
        plan = [self._plan(work, released, div, int8) for work in self._unique(req)]
        pairs = [(c.src, c.dst) for c in req.copies]
        for src, dst in pairs:
            problem = self._bad_block(src, div) or self._bad_block(dst, div)
            if problem:
                raise StepError(None, f"block copy {src} -> {dst}: {problem}")

        # Valid: from here on state changes.
        for seq_id in released:
            self.seqs.pop(seq_id, None)
        if req.kv_to_int8:
            self.runner.kv_to_int8()
        if pairs:
            self.runner.copy_blocks(pairs)
        resp = worker_pb2.StepResponse(step_id=req.step_id)
        if plan:
            t1 = self.clock()
            self._run(plan, resp)
            resp.forward_ms = (self.clock() - t1) * 1000
        resp.num_tokens = sum(len(p.tokens) for p in plan)
        resp.step_ms = (self.clock() - t0) * 1000
        return resp

    @staticmethod
    def _unique(req: worker_pb2.StepRequest) -> list[worker_pb2.SequenceWork]:
        seen: set[int] = set()
        for work in req.seqs:
            if work.seq_id in seen:
                raise StepError(work.seq_id, "listed twice in one step")
            seen.add(work.seq_id)
        return list(req.seqs)

    def _bad_block(self, block: int, div: int) -> str | None:
        """Why `block` cannot be used this step (None: it can); `div` is the cache's block_div for the step."""
        if block >= self.runner.num_blocks:
            return f"block {block} out of range [0, {self.runner.num_blocks})"
        if block % div:
            return f"block {block} is not a multiple of {div} (the auto KV cache holds the model's dtype)"
        return None

    def _plan(self, work: worker_pb2.SequenceWork, released: set[int], div: int, int8: bool) -> _Planned:
        seq_id = work.seq_id
        state = None if seq_id in released else self.seqs.get(seq_id)
        tokens = list(work.token_ids)
        tail = list(work.tail_blocks)
        if state is None:
            if not work.HasField("sampling"):
                raise StepError(seq_id, "unknown sequence: first sight needs sampling params")
            if not tokens:
                raise StepError(seq_id, "unknown sequence: a decode (no token_ids) for a sequence never prefilled")
            params = self._params(seq_id, work.sampling)
            table: list[int] = []
            tail_from = work.start_position
        else:
            if tail:
                raise StepError(seq_id, "tail_blocks are given on a sequence's first sight only")
            params, table, tail, tail_from = state.params, state.block_table, state.tail, state.tail_from
            if work.start_position != state.num_cached:
                raise StepError(
                    seq_id, f"start_position {work.start_position} != {state.num_cached} tokens already cached"
                )
            if not tokens:
                if state.next_token is None:
                    raise StepError(seq_id, "decode without a sampled token (the last step did not sample it)")
                tokens = [state.next_token]
        start, end = work.start_position, work.start_position + len(tokens)
        block_size = self.runner.block_size
        for b in work.new_blocks:
            problem = self._bad_block(b, div)
            if problem:
                raise StepError(seq_id, problem)
        table = table + list(work.new_blocks)
        if work.tail_blocks:
            self._check_tail(seq_id, tail, table, div, int8)
        if end > self.runner.max_context:
            raise StepError(seq_id, f"context overflow: position {end - 1} >= max context {self.runner.max_context}")
        if len(table) * block_size < end:
            raise StepError(seq_id, f"{len(table)} blocks of {block_size} tokens cannot hold positions up to {end - 1}")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise StepError(seq_id, f"token id {bad} out of vocab range [0, {self.vocab_size})")
        return _Planned(seq_id, tokens, start, table, params, work.sample, tail, tail_from)

    def _check_tail(self, seq_id: int, tail: list[int], table: list[int], div: int, int8: bool) -> None:
        want = self.runner.cache.tail_blocks
        if not int8 or not want:
            raise StepError(seq_id, "tail_blocks need an int8 KV cache with kv_tail_blocks > 0")
        if len(tail) != want:
            raise StepError(seq_id, f"{len(tail)} tail_blocks given, a tail takes {want}")
        for b in tail:
            problem = self._bad_block(b, div) or ("also in its block table" if b in table else None)
            if problem:
                raise StepError(seq_id, f"tail block {b}: {problem}")
        if len(set(tail)) != len(tail):
            raise StepError(seq_id, f"tail blocks {tail} repeat a block")

    def _params(self, seq_id: int, s: worker_pb2.WorkerSampling) -> SamplingParams:
        problem = check_params(s.temperature, s.top_p, s.top_k, s.logprobs)
        if problem is not None:
            raise StepError(seq_id, f"bad sampling params: {problem}")
        seed = to_int64(s.seed) if s.seed else self.seed_source()
        return SamplingParams(s.temperature, s.top_p or 1.0, s.top_k, seed, s.logprobs)

    def _run(self, plan: list[_Planned], resp: worker_pb2.StepResponse) -> None:
        device = self.runner.device
        token_ids = [t for p in plan for t in p.tokens]
        positions = [p.start + i for p in plan for i in range(len(p.tokens))]
        slices = [SeqSlice(p.seq_id, p.block_table, p.start, len(p.tokens), p.tail, p.tail_from) for p in plan]
        batch = PackedBatch(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            slices,
        )
        logits = self.runner.forward(batch)
        rows = [i for i, p in enumerate(plan) if p.sample]
        sampled: list[int] = []
        if rows:
            picked = [plan[i] for i in rows]
            if len(rows) < len(plan):  # else every row samples: no copy of the [N, vocab] logits
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            out = sample(
                logits,
                [p.params for p in picked],
                [p.start + len(p.tokens) for p in picked],
            )
            sampled = out.token_ids.tolist()
            chosen, top_ids, top_lps = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
            for j, p in enumerate(picked):
                n = p.params.logprobs
                pairs = zip(top_ids[j][:n], top_lps[j][:n], strict=True)
                top = [common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in pairs]
                token = common_pb2.TokenLogprob(token_id=sampled[j], logprob=chosen[j], top=top)
                resp.tokens.append(worker_pb2.SampledToken(seq_id=p.seq_id, token=token))
        next_tokens = dict(zip((plan[i].seq_id for i in rows), sampled, strict=True))
        for p in plan:
            state = self.seqs.get(p.seq_id)
            if state is None:
                state = self.seqs[p.seq_id] = SeqState(p.params, tail=p.tail, tail_from=p.tail_from)
            state.block_table = p.block_table
            state.num_cached = p.start + len(p.tokens)
            state.next_token = next_tokens.get(p.seq_id)
