"""Drafts copied from the sequence's own text (prompt lookup, n-gram speculation): no draft model at all.

Where an answer repeats what came before (editing code, quoting a document, rewriting a paragraph), the
tokens that followed the last n tokens where they last occurred are a draft that costs nothing to make.
The check verifies them as a chain, as it verifies the 2-bit base's: greedy acceptance keeps the
verifier's argmax, and the sampled walk treats them as the deterministic proposals it already takes
(``tree.accept_sampled``), so the text is the verifier's either way. This is what speculation can gain on
a machine where a draft forward is not free (a CPU engine): the verify pass of a few more tokens costs
little more than one.

A wrong draft still costs its tokens' share of the verify pass, so each check proposes only as many tokens
as pay: ``Lookup`` counts how often the i-th proposed token was accepted given the ones before it, and
proposes the k that maximises the expected tokens per second under the engine's measured verify costs.
``replay`` measures the same acceptance over a verifier's text ahead of time, for the cost model to weigh
this draft against the 2-bit base's (``splitspec fit-tree``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitspec.scheduler.cost import best_length


def find(history: Sequence[int], n_max: int, n_min: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the most recent earlier occurrence of the last n tokens of
    ``history``, for the longest n from ``n_max`` down to ``n_min`` that occurs; [] where none does.
    Vectorised: a check must not spend on its draft what the draft saves it."""
    h = np.asarray(history, dtype=np.int64)
    ends = np.flatnonzero(h[:-1] == h[-1])  # where an earlier occurrence may end: on the last token
    for n in range(min(n_max, h.size - 1), n_min - 1, -1):
        at = ends[ends >= n - 1]
        match = np.ones(at.size, dtype=bool)
        for j in range(1, n):
            match &= h[at - j] == h[-1 - j]
        if match.any():
            start = int(at[match][-1]) + 1
            return h[start : start + limit].tolist()
    return []


@dataclass
class Lookup:
    """Proposes each check's draft from the history and learns, from the checks, how much of it to trust.

    ``reached[i]`` counts the checks whose proposal's token i (from 0) was verified with all before it
    accepted, ``kept[i]`` those where it was accepted too; the chance of token i given its predecessors is
    (kept + 1) / (reached + 2), so a position never tried counts as even odds."""

    n_max: int
    n_min: int
    draft_max: int
    verify_ms: Callable[[int], float]  # a verify pass of n tokens
    sizes: frozenset[int] | None = None  # the draft lengths allowed (None: any up to draft_max)
    reached: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0] * self.draft_max
        self.kept = [0] * self.draft_max

    def length(self, available: int, others: int = 0) -> int:
        """How many of ``available`` proposed tokens to verify in a check beside ``others`` sequences
        (``cost.best_length`` under the chances so far)."""
        n = min(available, self.draft_max)
        chances = [(k + 1) / (r + 2) for k, r in zip(self.kept[:n], self.reached[:n], strict=True)]
        return best_length(chances, self.verify_ms, self.sizes, others)

    def propose(self, history: Sequence[int], others: int = 0) -> list[int]:
        """The draft for the check after ``history`` (the prompt, every emitted token, the root last), which
        ``others`` sequences share."""
        found = find(history, self.n_max, self.n_min, self.draft_max)
        return found[: self.length(len(found), others)]

    def record(self, proposed: int, accepted: int) -> None:
        """A check verified ``proposed`` tokens of a proposal and accepted the first ``accepted``."""
        for i in range(min(proposed, accepted + 1)):
            self.reached[i] += 1
            self.kept[i] += i < accepted


def replay(prompt: Sequence[int], text: Sequence[int], n_max: int, n_min: int, limit: int) -> list[list[int]]:
    """Greedy checks over the verifier's greedy ``text`` after ``prompt``, each proposing every token
    ``find`` finds (up to ``limit``): ``counts[found][accepted]`` of them (``cost.NgramStats``). Greedy
    acceptance emits the verifier's tokens whatever is drafted, so the text is the one any check would see."""
    counts = [[0] * (limit + 1) for _ in range(limit + 1)]
    history, t = [*prompt, *text], 0  # text[t] is the check's root
    while t < len(text) - 1:
        root = len(prompt) + t
        found = find(history[: root + 1], n_max, n_min, limit)
        run = 0
        # the text must hold the check's bonus token too: the last check keeps at most what is left less one
        while run < len(found) and root + 2 + run < len(history) and found[run] == history[root + 1 + run]:
            run += 1
        counts[len(found)][run] += 1
        t += run + 1
    return counts
