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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


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

    def length(self, available: int) -> int:
        """How many of ``available`` proposed tokens to verify: the k (of ``sizes``) with the most expected
        tokens per millisecond, (1 + Σ_{i<k} P(tokens 0..i accepted)) / verify_ms(k + 1); 0 where none pays."""
        best, best_rate, expected, chance = 0, 1.0 / self.verify_ms(1), 1.0, 1.0
        for i in range(min(available, self.draft_max)):
            chance *= (self.kept[i] + 1) / (self.reached[i] + 2)
            expected += chance
            rate = expected / self.verify_ms(i + 2)
            if rate > best_rate and (self.sizes is None or i + 1 in self.sizes):
                best, best_rate = i + 1, rate
        return best

    def propose(self, history: Sequence[int]) -> list[int]:
        """The draft for the check after ``history`` (the prompt, every emitted token, the root last)."""
        found = find(history, self.n_max, self.n_min, self.draft_max)
        return found[: self.length(len(found))]

    def record(self, proposed: int, accepted: int) -> None:
        """A check verified ``proposed`` tokens of a proposal and accepted the first ``accepted``."""
        for i in range(min(proposed, accepted + 1)):
            self.reached[i] += 1
            self.kept[i] += i < accepted
