"""A draft step as one CUDA graph: the 2-bit base's forward of a few tokens replayed with one launch.

On a GPU a draft step is bound by the host: hundreds of small kernels, each launched from Python
(benchmarks/README, "The GPU path on an H200"). A CUDA graph records them once and replays them with one
launch, but it bakes in every pointer and shape, so everything a step varies lives in static buffers that
the step's inputs are copied into: the tokens, their positions, the cache slots they land in and, per layer
type, the mask over the cache's whole buffer. Attention reads every slot of the cache and masks the ones
past the block, so its shapes do not depend on the cache's length, and K/V are written with an index
copy at the slots. Nothing in it reads a value back to the host.

``StaticDraft`` runs the same work eagerly on the CPU, where the tests hold it to
``SplitModel.forward(draft=True)``; on CUDA it captures on its first call and replays from then on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import PassStats, SplitModel, sdpa
from splitspec.gpu_actor.residual import NoResidual
from splitspec.models.spec import FULL, SLIDING


def _no_clock() -> float:
    return 0.0


class StaticDraft:
    """The draft's forward of ``n`` tokens into caches shaped like ``cache`` (the same buffers on CUDA,
    where the graph holds their addresses), from static buffers."""

    def __init__(self, model: SplitModel, cache: KVCache, n: int) -> None:
        device = model.device
        self.model, self.n = model, n
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.masks = {kind: torch.zeros(n, cache.max_seq, dtype=torch.bool, device=device) for kind in (FULL, SLIDING)}
        model._cover(torch.tensor([cache.max_seq - 1]))  # every position a slot of this cache can hold
        self.tables = dict(model._rope_tables)  # kept alive: a graph reads them where they were at capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None

    def __call__(
        self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """fp32 logits [n, vocab], as ``SplitModel.forward(tokens, cache, NoResidual(), positions, mask,
        draft=True)``: the tokens' K/V appended to ``cache``. The logits are this object's buffer on CUDA,
        overwritten by its next call."""
        model, n = self.model, self.n
        start = cache.reserve(n)
        positions = torch.arange(start, start + n) if positions is None else positions
        positions = positions.to(model.device)
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slots.copy_(torch.arange(start, start + n))
        for kind, m in model._masks(cache, start, positions, mask).items():
            self.masks[kind][:, : start + n].copy_(m)
            self.masks[kind][:, start + n :] = False
        if model.device.type != "cuda":
            self.logits = self._run(cache)
        elif self.graph is None:
            self._capture(cache)
        else:
            self.graph.replay()
        cache.commit(start, positions)
        return self.logits

    def _capture(self, cache: KVCache) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then record one run. Both
        write the block's K/V, as the replay would."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run(cache)

    def _run(self, cache: KVCache) -> Tensor:
        model = self.model
        rope = model._rope_rows(self.positions)
        h = model.embed[self.tokens]
        if model.spec.embed_scale != 1.0:
            h *= model._embed_scale

        def attend(layer: int, qkv: list[Tensor]) -> Tensor:
            kind = model.layers[layer].kind
            q, k, v = model._heads(layer, qkv, rope[kind])
            keys, values = cache.view(layer, cache.max_seq)
            keys.index_copy_(0, self.slots, k)
            values.index_copy_(0, self.slots, v)
            return sdpa(q, keys, values, self.masks[kind])

        model._layers(h, NoResidual(), PassStats(), attend, _no_clock)
        return model.logits(h, draft=True)
