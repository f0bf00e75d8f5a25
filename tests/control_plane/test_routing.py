"""Worker choice: merge_weight × prefix_match_fraction − normalized_load, ties to lowest load then index."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.config import PoolsSettings, SchedulerSettings
from control_plane.routing import choose_worker
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence


@dataclass
class Fake:
    matched: int
    busy: float

    def prefix_match(self, prompt_ids: list[int], tenant: str) -> int:
        return self.matched

    def load(self) -> float:
        return self.busy


def test_prefix_match_beats_a_little_load() -> None:
    prompt = list(range(100))
    workers = [Fake(0, 0.1), Fake(80, 0.5)]
    assert choose_worker(workers, prompt, "t", merge_weight=1.0) == 1  # 0.8 - 0.5 > -0.1
    assert choose_worker(workers, prompt, "t", merge_weight=0.0) == 0  # load alone


def test_ties_go_to_lowest_load_then_lowest_index() -> None:
    prompt = list(range(10))
    assert choose_worker([Fake(5, 0.5), Fake(0, 0.0)], prompt, "t", merge_weight=1.0) == 1
    assert choose_worker([Fake(0, 0.2), Fake(0, 0.2)], prompt, "t", merge_weight=1.0) == 0


def test_real_schedulers_are_read_not_mutated() -> None:
    pools, settings = PoolsSettings(), SchedulerSettings()
    now = [0.0]
    warm = Scheduler(64, 16, pools, settings, 2048, lambda: now[0])
    cold = Scheduler(64, 16, pools, settings, 2048, lambda: now[0])
    prompt = list(range(1, 65))
    seq = Sequence(1, "r1", "t", "interactive", [*prompt, 99], max_tokens=4)
    warm.add(seq)
    now[0] = 1.0  # past the interactive batch buffer's max_wait
    plan = warm.schedule()
    assert plan is not None
    warm.complete(plan, {1: 3})
    before = (warm.bm.queries, warm.bm.hits, [b.ref for b in warm.bm.blocks], list(warm.bm.lru))
    assert choose_worker([cold, warm], [*prompt, 7, 8], "t", merge_weight=1.0) == 1
    assert choose_worker([cold, warm], [*prompt, 7, 8], "other-tenant", merge_weight=1.0) == 0
    assert (warm.bm.queries, warm.bm.hits, [b.ref for b in warm.bm.blocks], list(warm.bm.lru)) == before
