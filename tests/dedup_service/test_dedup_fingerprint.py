"""The fingerprint: stable, sensitive to what changes the output, blind to what does not."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedup_service import fingerprint

SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": 16, "logprobs": 0}


def fp(**changes: object) -> str:
    args: dict = {"tenant": "t", "model": "m", "token_ids": [1, 2, 3], "sampling": SAMPLING}
    args.update(changes)
    return fingerprint(**args)


def test_stable_hex_sha256() -> None:
    value = fp()
    assert value == fp() and len(value) == 64 and int(value, 16) >= 0
    assert value == fingerprint("t", "m", (1, 2, 3), dict(reversed(SAMPLING.items())))  # key order is irrelevant
    # Pinned: stored records hold fingerprints, so an encoding change must be deliberate (bump VERSION).
    assert value == "af5d243f60bfaba6fac49e12443ffd9a1b3ef2256fb5ba4e4ddfbed02fda1a20"


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "u"},
        {"model": "m2"},
        {"token_ids": [1, 2]},
        {"token_ids": [3, 2, 1]},
        {"sampling": {**SAMPLING, "seed": 7}},
        {"sampling": {**SAMPLING, "temperature": 0.5}},
        {"sampling": {**SAMPLING, "logprobs": 2}},
        {"stop": ["\n"]},
        {"stop_token_ids": [2]},
    ],
)
def test_what_changes_the_output_changes_the_fingerprint(change: dict) -> None:
    assert fp(**change) != fp()


@given(st.lists(st.text(max_size=8), max_size=6), st.lists(st.integers(0, 1000), max_size=6), st.randoms())
def test_stops_are_sets(stop: list[str], stop_ids: list[int], rnd: random.Random) -> None:
    shuffled, shuffled_ids = stop * 2, list(stop_ids)
    rnd.shuffle(shuffled)
    rnd.shuffle(shuffled_ids)
    assert fp(stop=stop, stop_token_ids=stop_ids) == fp(stop=shuffled, stop_token_ids=shuffled_ids)


def test_nan_is_refused() -> None:
    with pytest.raises(ValueError):
        fp(sampling={**SAMPLING, "temperature": float("nan")})
