"""The engine in process, over the real builtin model: step protocol, determinism, and misuse."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
import tokenizers
from conftest_server import TEST_SETTINGS, Driver

from protos.coalesce.v1 import worker_pb2
from worker.engine import Engine, StepError
from worker.runner import ModelRunner

W = worker_pb2
GREEDY = W.WorkerSampling()


def seeded(seed: int, **kw: float) -> worker_pb2.WorkerSampling:
    return W.WorkerSampling(temperature=kw.pop("temperature", 0.8), seed=seed, **kw)  # type: ignore[arg-type]


def prompt(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(n * 1000 + salt)
    return [rng.randrange(256) for _ in range(n)]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner.from_settings(TEST_SETTINGS)


@pytest.fixture
def engine(runner: ModelRunner) -> Iterator[Engine]:
    yield Engine(runner)


def driver(engine: Engine) -> Driver:
    return Driver(engine.step, engine.runner.block_size)


def test_info(engine: Engine) -> None:
    info = engine.info()
    assert (info.model_name, info.architecture, info.vocab_size) == ("builtin", "LlamaForCausalLM", 258)
    assert (info.block_size, info.num_blocks) == (16, engine.runner.num_blocks) and info.num_blocks > 64
    assert (info.dtype, info.device, info.max_context) == ("float32", "cpu", 2048)
    assert list(info.eos_token_ids) == [257] and info.bos_token_id == 256
    assert tokenizers.Tokenizer.from_str(info.tokenizer_json.decode()).decode([104, 105]) == "hi"


def test_seeded_sequence_ignores_its_batch(engine: Engine) -> None:
    """32 sampled tokens of one seeded sequence: alone, then among 16 others with mixed prompt lengths."""
    target = {7: (prompt(37), seeded(1234, top_p=0.95))}
    alone = driver(engine).generate(target, 32)[7]

    engine.reset()
    others: dict[int, tuple[list[int], worker_pb2.WorkerSampling]] = {}
    for i in range(16):
        sampling = GREEDY if i % 4 == 0 else seeded(i + 1, top_k=50) if i % 4 == 1 else seeded(0 if i % 4 == 2 else i)
        others[100 + i] = (prompt(3 + 13 * i, salt=i), sampling)
    mixed = dict(itertools.islice(others.items(), 8)) | target | dict(itertools.islice(others.items(), 8, None))
    together = driver(engine).generate(mixed, 32)
    assert together[7] == alone
    assert len({tuple(t) for t in together.values()}) > 10  # the others really are different sequences


def test_chunked_prefill_prefix_sharing_and_copies_match_one_shot(engine: Engine) -> None:
    tokens = prompt(40)
    d = driver(engine)
    first = d.step([d.prefill(1, tokens, GREEDY)]).tokens[0].token
    ref = [first.token_id] + [d.step([d.decode(1)]).tokens[0].token.token_id for _ in range(4)]

    # The same prompt in three chunks: only the last one samples.
    d.step([d.prefill(2, tokens[:16], GREEDY, sample=False)])
    d.step([d.prefill(2, tokens[16:32], sample=False)])
    chunked = d.step([d.prefill(2, tokens[32:])]).tokens[0].token
    assert chunked.token_id == first.token_id and chunked.logprob == pytest.approx(first.logprob, abs=1e-4)

    # A new sequence reusing seq 1's two full blocks (a prefix-cache hit) starts at position 32.
    shared = d.tables[1][:2]
    work = W.SequenceWork(
        seq_id=3, token_ids=tokens[32:], start_position=32, new_blocks=[*shared, 200], sampling=GREEDY, sample=True
    )
    assert d.step([work]).tokens[0].token.token_id == ref[0]

    # Copy-on-write: seq 4 takes seq 1's partly filled third block as a copy and continues from there.
    table = d.tables[1]
    resp = d.step(
        [
            W.SequenceWork(
                seq_id=4, token_ids=[ref[0]], start_position=40, new_blocks=[*table[:2], 201], sampling=GREEDY
            )
        ],
        copies=[W.BlockCopy(src=table[2], dst=201)],
    )
    assert resp.num_tokens == 1 and not resp.tokens  # sample=false: nothing sampled
    work = W.SequenceWork(seq_id=4, token_ids=[ref[1]], start_position=41, sample=True)
    assert d.step([work]).tokens[0].token.token_id == ref[2]


def test_release_empty_steps_and_unseeded_seeds(runner: ModelRunner) -> None:
    ticks = itertools.count()
    engine = Engine(runner, clock=lambda: float(next(ticks)), seed_source=lambda: 99)
    d = driver(engine)
    resp = d.step([d.prefill(1, prompt(5), seeded(0)), d.prefill(2, prompt(5), seeded(99))])
    assert resp.tokens[0].token.token_id == resp.tokens[1].token.token_id  # seed 0 got 99 from seed_source
    assert resp.step_ms == 3000 and resp.forward_ms == 1000 and resp.num_tokens == 10  # the injected clock
    empty = d.step([], release=[2, 12345], copies=[W.BlockCopy(src=0, dst=9)])
    assert (empty.num_tokens, len(empty.tokens), empty.step_id) == (0, 0, d.step_id)
    assert set(engine.seqs) == {1}
    with pytest.raises(StepError, match="sequence 2: unknown sequence"):
        engine.step(W.StepRequest(seqs=[W.SequenceWork(seq_id=2, start_position=5, sample=True)]))
    # Released and listed again in the same step: a new sequence.
    again = W.SequenceWork(seq_id=1, token_ids=prompt(3), new_blocks=[20], sampling=GREEDY, sample=True)
    assert len(engine.step(W.StepRequest(seqs=[again], release=[1])).tokens) == 1
    assert engine.seqs[1].num_cached == 3


def _misuse(engine: Engine) -> dict[str, tuple[worker_pb2.StepRequest, str]]:
    """Bad requests against a session holding seq 1 (6 tokens cached, a sampled token) and seq 2 (no token)."""
    max_ctx, nb = engine.runner.max_context, engine.runner.num_blocks

    def req(*works: worker_pb2.SequenceWork, **fields: object) -> worker_pb2.StepRequest:
        return W.StepRequest(step_id=9, seqs=works, **fields)  # type: ignore[arg-type]

    def new(
        tokens: tuple[int, ...] = (1, 2), blocks: tuple[int, ...] = (30,), sampling: worker_pb2.WorkerSampling = GREEDY
    ) -> worker_pb2.SequenceWork:
        return W.SequenceWork(seq_id=5, token_ids=tokens, new_blocks=blocks, sampling=sampling, sample=True)

    return {
        "no sampling on first sight": (req(W.SequenceWork(seq_id=5, token_ids=[1], new_blocks=[30])), "sequence 5"),
        "decode of a never seen seq": (req(W.SequenceWork(seq_id=5, sampling=GREEDY)), "sequence 5: unknown"),
        "block out of range": (req(new(blocks=(nb,))), "sequence 5: block"),
        "not enough blocks": (req(new((1,) * 17)), "sequence 5: 1 block"),
        "context overflow": (
            req(W.SequenceWork(seq_id=1, start_position=6, token_ids=[1] * (max_ctx - 5))),
            "sequence 1: context overflow",
        ),
        "wrong start position": (req(W.SequenceWork(seq_id=1, start_position=5)), "sequence 1: start_position 5"),
        "decode without a sampled token": (req(W.SequenceWork(seq_id=2, start_position=6)), "sequence 2: decode"),
        "duplicate": (req(W.SequenceWork(seq_id=1, start_position=6), W.SequenceWork(seq_id=1)), "sequence 1: listed"),
        "token out of vocab": (req(new((1, 258))), "sequence 5: token id"),
        "bad sampling": (
            req(new(sampling=W.WorkerSampling(top_p=1.5))),
            "sequence 5: bad sampling params: top_p",
        ),
        "bad copy": (req(copies=[W.BlockCopy(src=0, dst=nb)]), "block copy"),
        "decode of a released seq": (
            req(W.SequenceWork(seq_id=1, start_position=6), release=[1]),
            "sequence 1: unknown",
        ),
    }


def test_misuse_names_the_sequence_and_changes_nothing(engine: Engine) -> None:
    d = driver(engine)
    d.step([d.prefill(1, prompt(6), GREEDY), d.prefill(2, prompt(6), GREEDY, sample=False)])
    before = {k: (list(v.block_table), v.num_cached, v.next_token) for k, v in engine.seqs.items()}
    for name, (req, message) in _misuse(engine).items():
        # A valid sequence listed first must not be run or recorded either.
        good = W.SequenceWork(seq_id=50, token_ids=[1], new_blocks=[40], sampling=GREEDY, sample=True)
        req.seqs.insert(0, good)
        with pytest.raises(StepError, match=message):
            engine.step(req)
        after = {k: (list(v.block_table), v.num_cached, v.next_token) for k, v in engine.seqs.items()}
        assert after == before, name
    assert len(d.step([d.decode(1)]).tokens) == 1  # and the session goes on
