"""The n-gram draft (``gpu_actor.lookup``): what it copies from the text, and how much of it it proposes."""

from __future__ import annotations

import random

import pytest

from splitspec.config import SpecConfig
from splitspec.gpu_actor.lookup import Lookup, find, replay
from splitspec.scheduler.cost import NgramStats


def _reference(history: list[int], n_max: int, n_min: int, limit: int) -> list[int]:
    """The rule spelled out: the longest tail first, its most recent earlier start, what follows it."""
    for n in range(min(n_max, len(history) - 1), n_min - 1, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                return history[start + n : start + n + limit]
    return []


def test_find_takes_the_longest_tail_at_its_latest_earlier_place():
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert find(history, 4, 2, 5) == [7, 8, 2, 3, 4]  # "2 3 4" last occurred before the tail at 6
    assert find(history, 4, 2, 1) == [7]
    assert find([5, 6, 7, 1, 6, 7, 2, 9, 7], 3, 1, 3) == [2, 9, 7]  # only "7" recurs: a 1-gram
    assert find([5, 6, 7, 1, 6, 7, 2, 9, 7], 3, 2, 3) == []  # ... which n_min = 2 refuses
    assert find([4], 4, 1, 3) == [] and find([4, 4], 4, 1, 3) == [4]


def test_find_matches_the_rule_on_random_texts():
    rng = random.Random(0)
    for _ in range(2000):
        history = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        n_max, n_min, limit = rng.randrange(1, 6), 1, rng.randrange(1, 8)
        n_min = rng.randrange(1, n_max + 1)
        assert find(history, n_max, n_min, limit) == _reference(history, n_max, n_min, limit)


def test_lookup_proposes_what_pays_under_the_verify_costs():
    flat = Lookup(4, 2, 8, lambda n: 10.0 + 0.5 * n)  # a token costs a twentieth of a pass
    steep = Lookup(4, 2, 8, lambda n: 10.0 * n)  # each token costs a whole pass
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3]
    proposal = flat.propose(history)  # even odds per token pay for several when tokens are cheap
    assert len(proposal) >= 3 and proposal == [4, 5, 6, 7, 8, 9, 10, 11][: len(proposal)]
    assert steep.propose(history) == []  # and never when each costs a pass
    for _ in range(40):  # every proposal rejected at its first token
        flat.record(8, 0)
    assert flat.reached[:2] == [40, 0] and flat.kept[0] == 0
    assert flat.propose(history) == []
    trusting = Lookup(4, 2, 8, lambda n: 10.0 + 2.0 * n)
    before = len(trusting.propose(history))
    for _ in range(40):
        trusting.record(8, 8)
    assert len(trusting.propose(history)) > before
    # in a pass that seven other sequences share, a token adds less to the check than it costs
    shared = Lookup(4, 2, 8, lambda n: 10.0 + 2.0 * n)
    assert len(shared.propose(history)) == before > 0 and shared.propose(history, others=7) == []


def test_lookup_keeps_to_the_sizes_it_is_given():
    """With CUDA graphs the engine allows powers of two only, so that few pass sizes get recorded."""
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3]
    free = Lookup(4, 2, 8, lambda n: 10.0 + 0.5 * n)
    sized = Lookup(4, 2, 8, lambda n: 10.0 + 0.5 * n, frozenset({1, 2, 4, 8}))
    assert len(free.propose(history)) == 3 and len(sized.propose(history)) in (2, 4)
    for _ in range(40):
        sized.record(8, 8)
    assert len(sized.propose(history)) == 8


def test_spec_config_checks_the_ngram_bounds():
    with pytest.raises(ValueError, match="ngram_min"):
        SpecConfig(mode="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="ngram_min"):
        SpecConfig(ngram_min=0)
    with pytest.raises(ValueError, match="draft_max"):
        SpecConfig(mode="ngram", draft_max=0)


def test_replay_counts_the_checks_a_greedy_text_takes():
    """Each check found f tokens and the text went on with the first a of them: the checks cover the text
    (Σ (a + 1) = its length less the first token), and a text that repeats its prompt keeps what it finds."""
    rng = random.Random(1)
    for _ in range(300):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        text = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        limit = rng.randrange(1, 9)
        counts = replay(prompt, text, 3, 1, limit)
        assert len(counts) == limit + 1 and all(len(row) == limit + 1 for row in counts)
        assert all(counts[f][a] == 0 for f in range(limit + 1) for a in range(f + 1, limit + 1))
        assert sum(c * (a + 1) for row in counts for a, c in enumerate(row)) == len(text) - 1
    prompt = list(range(10, 30))
    counts = replay(prompt, prompt[:2] + prompt[2:] * 2, 4, 2, 8)
    kept = sum(c * a for row in counts for a, c in enumerate(row))
    assert counts[0][0] == 2 and kept >= 30  # the first two roots find nothing; after them, the text repeats
    assert NgramStats.of(counts).checks == sum(map(sum, counts))
