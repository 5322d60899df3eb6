"""Finished sequences' K/V kept for the next prompt that begins with the same tokens.

A chat's second turn re-sends the first turn and its answer; llama.cpp's slot cache and vLLM's prefix
caching skip prefilling them again, and so does the engine: a new sequence starts from a copy of the
longest prefix it shares with a kept sequence and prefills only the rest. Kept entries are evicted least
recently used first, to stay under the budget and whenever live sequences need the memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitspec.gpu_actor.kv_cache import KVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(tokens: Sequence[int], prompt: Sequence[int]) -> int:
    """How many slots of ``tokens``' K/V a new ``prompt`` can start from: their common prefix, but at least
    the prompt's last token is left to prefill, since its logits choose the first new token."""
    return min(common_prefix(tokens, prompt), len(prompt) - 1)


class PrefixCache:
    """Token sequences and the caches holding their K/V (``cache.length == len(tokens)``), under ``budget``
    bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep ``cache`` (the sequence no longer writes to it) for ``tokens``, evicting older entries to fit;
        a cache larger than the whole budget is not kept."""
        if cache.length != len(tokens):
            raise ValueError(f"a cache of length {cache.length} does not hold the K/V of {len(tokens)} tokens")
        if cache.nbytes > self.budget or not tokens:
            return
        key = tuple(tokens)
        self._entries.pop(key, None)
        self.shrink(self.budget - cache.nbytes)
        self._entries[key] = cache

    def lookup(self, prompt: Sequence[int]) -> tuple[KVCache | None, int]:
        """(a kept cache, how many of its slots this prompt can reuse: ``reusable``, where the cache's rings
        still hold the window before them, ``KVCache.resumable``)."""
        best, n = None, 0
        for tokens, cache in self._entries.items():
            m = reusable(tokens, prompt)
            if m > n and cache.resumable(m):
                best, n = tokens, m
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        self.hits += 1
        return self._entries[best], n

    def shrink(self, to_bytes: int) -> None:
        """Evict least recently used entries until the kept ones take at most ``to_bytes``."""
        while self._entries and self.nbytes > max(to_bytes, 0):
            self._entries.popitem(last=False)
