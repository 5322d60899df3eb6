"""The verifier's K/V cache: one object per sequence, preallocated, written a block of new positions at a time.

One cache per sequence (not a ``seq`` dimension): sequences of a batch differ in length and roll back
independently after each check, and a per-sequence object keeps every slot index local to one sequence.

Slots are storage, not positions: K is stored after the rotary embedding, and each slot remembers the
position it was written for, so a draft tree whose nodes share positions (siblings) can sit in
consecutive slots and be masked by the caller's tree mask. After a check the accepted path is
compacted (``keep``) so that the verified prefix is contiguous again and later passes see it unmasked.

Layers of one head shape share one tensor; a model whose layer types have their own heads (Gemma 4's
global layers) has one tensor per shape. A sliding-window layer may keep a *ring* of its last slots
instead of all of them (``rings``): slot s lives at entry s mod ``ring``, and ``ring_slots`` says which slot
each entry holds, so that a pass attends over the entries it may see (``ring_mask``) and a rollback or a
compaction leaves the ring consistent. The ring holds the window plus ``slack`` slots: the most a check
writes before it is rolled back or compacted, which would otherwise overwrite slots still in the window.

A model with linear-attention layers (Qwen 3.5) keeps their recurrent state beside the K/V (``delta``),
which follows every rollback and compaction and cannot go back before the slot it last folded (``floor``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitspec.gpu_actor.delta_state import DeltaState


class KVCache:
    """K/V of every layer, ``[max_seq, n_kv, head_dim]`` each (``heads``: each layer's (n_kv, head_dim)), or
    ``[ring, n_kv, head_dim]`` for the layers ``rings`` marks, with ``window`` + ``slack`` entries; slots
    ``[0, length)`` are valid."""

    def __init__(
        self,
        heads: Sequence[tuple[int, int]],
        max_seq: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        rings: Sequence[bool] = (),
        window: int = 0,
        slack: int = 0,
        delta: DeltaState | None = None,
    ) -> None:
        rings = list(rings) or [False] * len(heads)
        if any(rings) and (window < 1 or slack < 1):
            raise ValueError(f"a ring holds a window and slack of at least one slot each, got {window} and {slack}")
        self.window = window
        self.ring = window + slack if any(rings) and window + slack < max_seq else 0  # a ring's entries; 0: none
        kinds = [(h, self.ring if r and self.ring else max_seq) for h, r in zip(heads, rings, strict=True)]
        shapes = list(dict.fromkeys(kinds))  # in order of first use: one shape, one stack
        self.stacks = [
            tuple(torch.zeros(sum(k == s for k in kinds), s[1], *s[0], dtype=dtype, device=device) for _ in "kv")
            for s in shapes
        ]
        self._rings = [slots < max_seq for _, slots in shapes]
        stack_of = [shapes.index(k) for k in kinds]
        self._ring_layers = [self._rings[s] for s in stack_of]
        self.positions = torch.zeros(max_seq, dtype=torch.long, device=device)
        self.ring_slots = torch.full((self.ring,), -1, dtype=torch.long, device=device)  # each entry's slot
        self._used = 0  # ring entries ever written: those a pass attends over
        # each layer's [slots, n_kv, head_dim] views, taken once: a pass slices them twice a layer
        views = [list(zip(k.unbind(0), v.unbind(0), strict=True)) for k, v in self.stacks]
        self._layers = [views[s].pop(0) for s in stack_of]
        self.max_seq = max_seq
        self.length = 0
        self.delta = delta

    @property
    def floor(self) -> int:
        """The shortest length the cache can roll back to: 0, or where its recurrent state sits."""
        return 0 if self.delta is None else self.delta.base

    @property
    def k(self) -> torch.Tensor:
        """Every layer's K, ``[layers, max_seq, n_kv, head_dim]``, where all have one shape and no ring."""
        return self._stack()[0]

    @property
    def v(self) -> torch.Tensor:
        return self._stack()[1]

    def _stack(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.stacks) > 1 or self.ring:
            raise ValueError("this cache's layers have several shapes or rings: read them a layer at a time")
        return self.stacks[0]

    def is_ring(self, layer: int) -> bool:
        return self._ring_layers[layer]

    @property
    def buffers(self) -> tuple[int, ...]:
        """The addresses of the cache's tensors: what a recorded graph that writes them is bound to."""
        delta = () if self.delta is None else self.delta.buffers
        return tuple(t.data_ptr() for pair in self.stacks for t in pair) + delta

    @property
    def nbytes(self) -> int:
        """Memory the cache holds (allocated for ``max_seq`` slots, or its rings, whatever its length)."""
        kv = sum(k.nbytes + v.nbytes for k, v in self.stacks) + self.positions.nbytes + self.ring_slots.nbytes
        return kv + (0 if self.delta is None else self.delta.nbytes)

    def load_prefix(self, other: KVCache, n: int) -> None:
        """Start from ``other``'s first ``n`` slots (a prefix another sequence already computed): a copy,
        so ``other`` stays usable by the next sequence that shares it (``resumable`` says whether its rings
        still hold the window before ``n``)."""
        if not 0 < n <= min(other.length, self.max_seq) or self.length or other.ring != self.ring:
            raise ValueError(f"cannot load {n} slots of a cache of length {other.length} into this one")
        if self.delta is not None:
            self.delta.load(other.delta, n)
        for mine, theirs, ring in zip(self.stacks, other.stacks, self._rings, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                if ring:  # entries holding slots past n are masked out by ring_slots
                    a.copy_(b)
                else:
                    a[:, :n] = b[:, :n]
        if self.ring:
            self.ring_slots.copy_(torch.where(other.ring_slots < n, other.ring_slots, -1))
            self._used = other._used
        self.positions[:n] = other.positions[:n]
        self.length = n

    def resumable(self, n: int) -> bool:
        """Whether a sequence can go on from this cache's first ``n`` slots: its rings (if any) still hold
        every slot a next position's window reaches, and its recurrent state (if any) is known there."""
        if self.delta is not None:
            return self.delta.resumable(n)
        if not self.ring:
            return True
        slots = torch.arange(max(0, n - self.window + 1), n, device=self.ring_slots.device)
        return bool((self.ring_slots[slots % self.ring] == slots).all())

    def reserve(self, n: int) -> int:
        """Where a block of ``n`` new slots starts; fails before a forward pass rather than inside it."""
        if self.length + n > self.max_seq:
            raise ValueError(
                f"the KV cache holds {self.max_seq} positions; {self.length} used + {n} new do not fit "
                "(raise EngineConfig.max_seq_len)"
            )
        return self.length

    def slots(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, n_kv, head_dim]`` of slots ``[start, start + n)`` of ``layer`` (not a ring's):
        contiguous views to write the new block into (a product can land there directly, ``out=``)."""
        k, v = self._layers[layer]
        return k[start : start + n], v[start : start + n]

    def view(self, layer: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``[0, stop)`` (of a ring layer: its entries so far, ``ring_mask``'s order)."""
        k, v = self._layers[layer]
        if self._ring_layers[layer]:
            return k[: self._used], v[: self._used]
        return k[:stop], v[:stop]

    def buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s whole K and V storage: every slot, or every entry of its ring."""
        return self._layers[layer]

    def ring_step_mask(self, start: int, ring_mask: torch.Tensor) -> torch.Tensor:
        """``ring_mask``'s [n, entries + n] for a pass that first writes its block into the ring and then
        attends over all of it (a recorded step, ``graphs.StaticStep``): [n, ring]. Raises where the block
        would overwrite an entry one of its rows sees."""
        n = ring_mask.shape[0]
        out = torch.zeros(n, self.ring, dtype=torch.bool, device=ring_mask.device)
        out[:, : self._used] = ring_mask[:, : self._used]
        entries = torch.arange(start, start + n, device=ring_mask.device) % self.ring
        if bool(out[:, entries].any()):
            raise RuntimeError(f"a block of {n} rows overwrites ring entries it sees: the ring of {self.ring} is short")
        out[:, entries] = ring_mask[:, self._used :]
        return out

    def ring_write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the block of slots ``[start, start + n)`` into ``layer``'s ring (its last ``ring`` rows). The
        entries hold no slot until ``commit``: a pass that fails after this leaves no slot claimed that
        another's K/V overwrote."""
        n = k.shape[0]
        take = min(n, self.ring)
        entries = torch.arange(start + n - take, start + n, device=k.device) % self.ring
        self.ring_slots[entries] = -1
        ring_k, ring_v = self._layers[layer]
        ring_k.index_copy_(0, entries, k[n - take :].to(ring_k.dtype))
        ring_v.index_copy_(0, entries, v[n - take :].to(ring_v.dtype))

    def ring_mask(self, start: int, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [n, start + n] over slots as a ring layer attends: [n, entries + n], its entries so far
        (each the slot ``ring_slots`` says, none where that is not a slot before ``start``), then the block's
        own rows. Raises where a row may see a slot its ring no longer holds."""
        held = self.ring_slots[: self._used]
        valid = (held >= 0) & (held < start)
        if not start:
            return torch.cat((torch.zeros(mask.shape[0], self._used, dtype=torch.bool, device=mask.device), mask), 1)
        covered = torch.zeros(start, dtype=torch.bool, device=mask.device)
        covered[held[valid]] = True
        if bool((mask[:, :start].any(0) & ~covered).any()):
            raise RuntimeError(
                f"a K/V ring of {self.ring} slots (window {self.window}) no longer holds a slot this pass sees: "
                "a check wrote more slots than the ring's slack"
            )
        old = mask[:, held.clamp(0, start - 1)] & valid
        return torch.cat((old, mask[:, start:]), dim=1)

    def commit(self, start: int, positions: torch.Tensor, final: bool = False) -> None:
        """Mark the block written at ``start`` valid (after every layer wrote it) and record its positions;
        ``final``: a chain no rollback will take back (a pass without a mask), which the recurrent state has
        folded in (``DeltaState.swap``)."""
        n = positions.shape[0]
        if final and self.delta is not None:
            self.delta.swap(start + n)
        self.positions[start : start + n] = positions
        self.length = start + n
        if self.ring:
            slots = torch.arange(max(start, start + n - self.ring), start + n, device=self.ring_slots.device)
            self.ring_slots[slots % self.ring] = slots
            self._used = max(self._used, min(self.ring, start + n))

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` slots; the rest is overwritten by the next block."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if self.delta is not None:
            self.delta.truncate(length)
        self.length = length

    def keep(self, start: int, offsets: Sequence[int]) -> None:
        """Keep only slots ``start + offsets[j]`` of the block at ``start`` and move them to ``start + j``.

        ``offsets`` must increase: then slot ``start + j`` is never read after it is overwritten, and one
        gather per tensor (a copy) moves the accepted path of a tree into place.
        """
        idx = torch.as_tensor(list(offsets), dtype=torch.long, device=self.positions.device) + start
        if idx.numel() and (bool((idx[1:] <= idx[:-1]).any()) or idx[0] < start or idx[-1] >= self.length):
            raise ValueError(f"offsets must increase inside the block [{start}, {self.length}), got {list(offsets)}")
        if self.ring and not bool((self.ring_slots[idx % self.ring] == idx).all()):
            raise RuntimeError(f"a K/V ring of {self.ring} slots no longer holds the block it keeps: {list(offsets)}")
        if self.delta is not None:
            self.delta.keep(start, idx.tolist())
        stop = start + idx.numel()
        moved = torch.arange(start, stop, device=idx.device)
        for pair, ring in zip(self.stacks, self._rings, strict=True):
            for t in pair:
                if ring:
                    t[:, moved % self.ring] = t[:, idx % self.ring]
                else:
                    t[:, start:stop] = t[:, idx]
        if self.ring:
            self.ring_slots[moved % self.ring] = moved
        self.positions[start:stop] = self.positions[idx]
        self.length = stop
