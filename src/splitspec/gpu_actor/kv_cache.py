"""The verifier's K/V cache: one object per sequence, preallocated, written a block of new positions at a time.

One cache per sequence (not a ``seq`` dimension): sequences of a batch differ in length and roll back
independently after each check, and a per-sequence object keeps every slot index local to one sequence.

Slots are storage, not positions: K is stored after the rotary embedding, and each slot remembers the
position it was written for, so a draft tree whose nodes share positions (siblings) can sit in
consecutive slots and be masked by the caller's tree mask. After a check the accepted path is
compacted (``keep``) so that the verified prefix is contiguous again and later passes see it unmasked.

Layers of one head shape share one tensor; a model whose layer types have their own heads (Gemma 4's
global layers) has one tensor per shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """K/V of every layer, ``[max_seq, n_kv, head_dim]`` each (``heads``: each layer's (n_kv, head_dim));
    slots ``[0, length)`` are valid."""

    def __init__(
        self,
        heads: Sequence[tuple[int, int]],
        max_seq: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shapes = list(dict.fromkeys(heads))  # in order of first use: one shape, one stack
        self.stacks = []
        for shape in shapes:
            size = (sum(h == shape for h in heads), max_seq, *shape)
            self.stacks.append(
                (torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device))
            )
        self.positions = torch.zeros(max_seq, dtype=torch.long, device=device)
        # each layer's [max_seq, n_kv, head_dim] views, taken once: a pass slices them twice a layer
        views = [list(zip(k.unbind(0), v.unbind(0), strict=True)) for k, v in self.stacks]
        self._layers = [views[shapes.index(h)].pop(0) for h in heads]
        self.max_seq = max_seq
        self.length = 0

    @property
    def k(self) -> torch.Tensor:
        """Every layer's K, ``[layers, max_seq, n_kv, head_dim]``, where all have one shape."""
        return self._stack()[0]

    @property
    def v(self) -> torch.Tensor:
        return self._stack()[1]

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.stacks) > 1:
            raise ValueError("this cache's layers have several head shapes: read them a layer at a time (view)")
        return self.stacks[0]

    @property
    def buffers(self) -> tuple[int, ...]:
        """The addresses of the cache's tensors: what a recorded graph that writes them is bound to."""
        return tuple(t.data_ptr() for pair in self.stacks for t in pair)

    @property
    def nbytes(self) -> int:
        """Memory the cache holds (allocated for ``max_seq`` slots, whatever its length)."""
        return sum(k.nbytes + v.nbytes for k, v in self.stacks) + self.positions.nbytes

    def load_prefix(self, other: KVCache, n: int) -> None:
        """Start from ``other``'s first ``n`` slots (a prefix another sequence already computed): a copy,
        so ``other`` stays usable by the next sequence that shares it."""
        if not 0 < n <= min(other.length, self.max_seq) or self.length:
            raise ValueError(f"cannot load {n} slots of a cache of length {other.length} into this one")
        for mine, theirs in zip(self.stacks, other.stacks, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a[:, :n] = b[:, :n]
        self.positions[:n] = other.positions[:n]
        self.length = n

    def reserve(self, n: int) -> int:
        """Where a block of ``n`` new slots starts; fails before a forward pass rather than inside it."""
        if self.length + n > self.max_seq:
            raise ValueError(
                f"the KV cache holds {self.max_seq} positions; {self.length} used + {n} new do not fit "
                "(raise EngineConfig.max_seq_len)"
            )
        return self.length

    def slots(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, n_kv, head_dim]`` of slots ``[start, start + n)`` of ``layer``: contiguous views to
        write the new block into (a product can land there directly, ``out=``, with no copy after it)."""
        k, v = self._layers[layer]
        return k[start : start + n], v[start : start + n]

    def view(self, layer: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``[0, stop)``: views, no copy."""
        k, v = self._layers[layer]
        return k[:stop], v[:stop]

    def commit(self, start: int, positions: torch.Tensor) -> None:
        """Mark the block written at ``start`` valid (after every layer wrote it) and record its positions."""
        n = positions.shape[0]
        self.positions[start : start + n] = positions
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` slots; the rest is overwritten by the next block."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        """Keep only slots ``start + offsets[j]`` of the block at ``start`` and move them to ``start + j``.

        ``offsets`` must increase: then slot ``start + j`` is never read after it is overwritten, and one
        gather per tensor (a copy) moves the accepted path of a tree into place.
        """
        idx = torch.as_tensor(list(offsets), dtype=torch.long, device=self.positions.device) + start
        if idx.numel() and (bool((idx[1:] <= idx[:-1]).any()) or idx[0] < start or idx[-1] >= self.length):
            raise ValueError(f"offsets must increase inside the block [{start}, {self.length}), got {list(offsets)}")
        stop = start + idx.numel()
        for pair in self.stacks:
            for t in pair:
                t[:, start:stop] = t[:, idx]
        self.positions[start:stop] = self.positions[idx]
        self.length = stop
