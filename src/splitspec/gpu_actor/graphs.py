"""A forward step as CUDA graphs: a draft step as one graph, a verify pass as a graph per residual crossing.

On a GPU a step is bound by the host: hundreds of small kernels, each launched from Python
(benchmarks/README, "The GPU path on an H200"). A CUDA graph records them once and replays them with one
launch, but it bakes in every pointer and shape, so everything a step varies lives in static buffers that
the step's inputs are copied into: the tokens, their positions, the cache slots they land in and, per layer
type, the mask over the cache's whole buffer. Attention reads every slot of the cache and masks the ones
past the block, so its shapes do not depend on the cache's length, and K/V are written with an index
copy at the slots. A sliding layer's ring (``KVCache``) is written first at the block's entries, then read
whole under a mask over its entries (``KVCache.ring_step_mask``). A linear-attention layer (Qwen 3.5) reads
every pending entry its cache's ``DeltaState`` has room for, under a mask of the ones the rows descend from,
and writes its rows' entries with an index copy after them; a step is made for the room it finds, which its
caller grows first (``DeltaState.hold``). Nothing in a graph reads a value back to the host.

The verifier's pass cannot be one graph: at each group x' leaves for the CPU actors and y_r comes back.
Those crossings go through page-locked host buffers (``_Crossings``) and cut the pass into graphs: one up
to x' copied out, one for the base product (replayed right after the submit, so that it overlaps the CPU
actors' work), one from y_r copied in to the next group's x'. Between them the host does what no graph
can: it submits x' to the residual and gathers y_r, as ``SplitGroup.product`` does in an eager pass.

``StaticStep`` runs the same work eagerly on the CPU, crossings included, where the tests hold it to
``SplitModel.forward``; on CUDA it captures on its first call and replays from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from functools import partial

import torch
from torch import Tensor

from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import PassStats, Pending, SplitModel, add_chunks, gated, no_clock, sdpa, submit_chunks
from splitspec.gpu_actor.residual import NoResidual, Residual
from splitspec.models.spec import FULL, LINEAR, SLIDING

Action = Callable[[], None]  # host work between two graphs of a pass


class _Crossings:
    """The residual as a recorded pass meets it: ``submit`` copies x' into a host buffer and ``add_into``
    adds y_r from one, each behind a cut (``cut(action)``), where the host work of the crossing runs: at
    once in an eager pass; between two graphs when a pass is captured, then replayed."""

    max_tokens = None  # one x' a group here; the crossing sends it in the residual's own requests

    def __init__(self, residual: Residual, cut: Callable[[Action], None], pinned: bool) -> None:
        self.residual, self.cut, self._pinned = residual, cut, pinned
        self.stats = PassStats()  # the host's times of the pass under way
        self._buffers: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        self._pending: Pending = []

    def _buffer(self, kind: str, shape: tuple[int, ...]) -> Tensor:
        """A host buffer kept from pass to pass (a graph holds its address), page-locked on CUDA so that the
        copies are DMAs a graph can record. The first, eager pass allocates them all."""
        key = (kind, shape)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, pin_memory=self._pinned)
        return self._buffers[key]

    def submit(self, layer: int, group: str, x_rot: Tensor) -> None:
        staged = self._buffer("x", tuple(x_rot.shape))
        staged.copy_(x_rot, non_blocking=True)
        self.cut(partial(self._submit, layer, group, staged))

    def _submit(self, layer: int, group: str, staged: Tensor) -> None:
        if self._pinned:
            torch.cuda.current_stream().synchronize()  # x' copied out: the graph before this ends with it
        t0 = time.perf_counter()
        self._pending = submit_chunks(self.residual, layer, group, staged)
        self.stats.submit_s += time.perf_counter() - t0
        self.stats.round_trips += len(self._pending)

    def add_into(self, handle: None, out: Tensor) -> None:
        staged = self._buffer("y", tuple(out.shape))
        self.cut(partial(self._gather, staged))
        out.add_(staged.to(out.device, non_blocking=True))

    def _gather(self, staged: Tensor) -> None:
        t0 = time.perf_counter()
        staged.zero_()
        add_chunks(self.residual, self._pending, staged)
        self._pending = []
        self.stats.wait_s += time.perf_counter() - t0


class StaticStep:
    """The forward of ``n`` tokens into caches shaped like ``cache`` (the same buffers on CUDA, where the
    graphs hold their addresses), from static buffers: the draft's (``residual`` None: the base alone, the
    draft's head) or the verifier's with ``residual`` (the verifier's head)."""

    def __init__(self, model: SplitModel, cache: KVCache, n: int, residual: Residual | None = None) -> None:
        device = model.device
        self.model, self.n = model, n
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.entries = torch.zeros(n, dtype=torch.long, device=device)  # of a sliding layer's ring, if it has one
        widths = {FULL: cache.max_seq, SLIDING: cache.ring or cache.max_seq}
        self.masks = {kind: torch.zeros(n, width, dtype=torch.bool, device=device) for kind, width in widths.items()}
        # a linear-attention layer's: its rows' ancestors among the room for pending entries, then the rows',
        # and where the rows' own entries go (``DeltaState``)
        room = 0 if cache.delta is None else cache.delta.k.shape[1]
        self.delta_mask = torch.zeros(n, room + n, dtype=torch.bool, device=device)
        self.delta_at = torch.zeros(n, dtype=torch.long, device=device)
        model._cover(torch.tensor([cache.max_seq - 1]))  # every position a slot of this cache can hold
        self.tables = dict(model._rope_tables)  # kept alive: a graph reads them where they were at capture
        pinned = device.type == "cuda"
        self.crossings = None if residual is None else _Crossings(residual, self._cut, pinned)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.actions: list[Action] = []  # the host work after each graph but the last
        self._capturing, self._pool = False, None
        self.logits: Tensor | None = None

    def __call__(
        self,
        tokens: Tensor,
        cache: KVCache,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        stats: PassStats | None = None,
    ) -> Tensor:
        """fp32 logits [n, vocab], as ``SplitModel.forward(tokens, cache, residual or NoResidual(), positions,
        mask, stats, draft=residual is None)``: the tokens' K/V appended to ``cache``; ``stats`` gets the
        pass's total and its crossings' submit and wait times. The logits are this object's buffer on CUDA,
        overwritten by its next call."""
        model, n = self.model, self.n
        t_start = time.perf_counter()
        start = cache.reserve(n)
        positions = torch.arange(start, start + n) if positions is None else positions
        positions = positions.to(model.device)
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slots.copy_(torch.arange(start, start + n))
        for kind, m in model._masks(cache, start, positions, mask).items():
            if kind == FULL and cache.delta is not None:
                self._delta_mask(cache, start, m)
            if kind == SLIDING and cache.ring:
                self.entries.copy_(torch.arange(start, start + n) % cache.ring)
                self.masks[kind].copy_(cache.ring_step_mask(start, m))
                continue
            self.masks[kind][:, : start + n].copy_(m)
            self.masks[kind][:, start + n :] = False
        times = PassStats()
        if self.crossings is not None:
            self.crossings.stats = times
        if model.device.type != "cuda":
            self.logits = self._run(cache)
        else:
            if not self.graphs:
                self._capture(cache)
            for graph, action in zip(self.graphs, [*self.actions, None], strict=True):
                graph.replay()
                if action is not None:
                    action()
        cache.commit(start, positions)
        if mask is None and cache.delta is not None:  # a chain as final as a forward's without a mask
            cache.delta.settle(start + n)
        if stats is not None:
            if model.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            times.total_s = time.perf_counter() - t_start
            stats.add(times)
        return self.logits

    def _delta_mask(self, cache: KVCache, start: int, mask: Tensor) -> None:
        """``mask`` [n, start + n] as a linear-attention layer reads it here: over the whole room for pending
        entries (the slots from the state's base), then the rows; and where the rows' entries go."""
        base, room, n = cache.delta.base, self.delta_mask.shape[1] - self.n, self.n
        pending = start - base
        if pending + n > room:
            raise RuntimeError(f"a recorded step with room for {room} pending entries cannot take {pending} + {n}")
        self.delta_mask.zero_()
        self.delta_mask[:, :pending] = mask[:, base:start]
        self.delta_mask[:, room:] = mask[:, start:]
        self.delta_at.copy_(torch.arange(pending, pending + n))

    def _cut(self, action: Action) -> None:
        """A crossing: while capturing, end this graph, keep the host's work for the replay, begin the next;
        otherwise (an eager pass) do the work now."""
        if not self._capturing:
            action()
            return
        self.graphs[-1].capture_end()
        self.actions.append(action)
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)  # one pool: the graphs replay in the order they were recorded
        self.graphs.append(graph)

    def _capture(self, cache: KVCache) -> None:
        """Warm up with an eager pass on a side stream (Triton compiles, cuBLAS picks its kernels, the
        crossings allocate their host buffers), then record one pass. Both write the block's K/V, as a
        replay would; the recording runs nothing, so the call replays it after."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(cache)
            side.synchronize()
            self._pool = torch.cuda.graph_pool_handle()
            self._capturing = True
            try:
                self._begin()
                self.logits = self._run(cache)
                self.graphs[-1].capture_end()
            except BaseException:
                self._discard()
                raise
            finally:
                self._capturing = False
        torch.cuda.current_stream().wait_stream(side)

    def _discard(self) -> None:
        """After a recording that failed: end the graph left open (its stream would refuse all later work) and
        forget the pass's graphs, so that the next call records again rather than replay part of a pass."""
        if torch.cuda.is_current_stream_capturing():
            with suppress(RuntimeError):  # a capture the failure invalidated ends with an error of its own
                self.graphs[-1].capture_end()
        self.graphs, self.actions, self.logits = [], [], None

    def _run(self, cache: KVCache) -> Tensor:
        model = self.model
        rope = model._rope_rows(self.positions)
        h = model.embed[self.tokens]
        if model.spec.embed_scale != 1.0:
            h *= model._embed_scale

        def attend(layer: int, qkv: list[Tensor]) -> Tensor:
            kind = model.layers[layer].kind
            if kind == LINEAR:
                return mix(layer, qkv)
            qkv, gate = model._gate_split(qkv)
            q, k, v = model._heads(layer, qkv, rope[kind])
            keys, values = cache.buffer(layer)
            at = self.entries if cache.is_ring(layer) else self.slots
            keys.index_copy_(0, at, k.to(keys.dtype))
            values.index_copy_(0, at, v.to(values.dtype))
            return gated(sdpa(q, keys, values, self.masks[kind], model.spec.attn_softcap), gate)

        def mix(layer: int, outs: list[Tensor]) -> Tensor:
            lay, state = model.layers[layer], cache.delta
            x, z, b, a = outs
            j = lay.state_index
            stored = [t[j] for t in state.stored]  # k, u, G, x over the whole room
            out, *rows = model._mix_rows(lay, x, b, a, state.state[j], state.window[j], stored, self.delta_mask)
            for t, r in zip(stored, (*rows, x), strict=True):
                t.index_copy_(0, self.delta_at, r)
            return model._mixed(lay, out, z)

        residual = NoResidual() if self.crossings is None else self.crossings
        model._layers(h, residual, PassStats(), attend, no_clock)
        return model.logits(h, draft=self.crossings is None)
