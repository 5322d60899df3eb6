"""What a prefill costs on each path, measured on this machine, and the choice between them.

The split path (CPU actors) pays its fixed cost once per ``prefill_chunk``-token forward and a per-token
cost that grows with the CPU residual's compute; the device path (``DeviceResidual``) pays a transfer and
dequantization per group once per forward and a small per-token GEMM cost on the device. Each is timed on
one layer's groups (times the layers) at a few token counts and read between them, so the choice follows
the machine and its load, not a constant. Both pay the lm_head once a prompt (the chunks before the last have
no head: ``SplitModel.prefill``), so it does not sway the choice, but it is in each estimate.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from splitspec.gpu_actor.model import PassStats, SplitModel, device_clock
from splitspec.gpu_actor.residual import DeviceResidual, Residual


@dataclass(frozen=True)
class MeasuredCost:
    """Seconds of one forward pass of a prefill path, timed at a few token counts and read between them on
    straight lines (beyond the largest, along the last one). A single fixed + per-token line does not fit:
    the 2-bit base product changes kernel with the token count, and the device path pays its transfer and
    dequantization whatever the count, so a line fitted on long forwards misjudges a one-token one (a chat's
    next turn after its reused prefix) by an order of magnitude."""

    points: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, samples: Sequence[tuple[int, float]]) -> MeasuredCost:
        """From (tokens, seconds) at two or more sizes; the seconds are made non-decreasing in the tokens:
        timing noise must not make a path look cheaper the longer the prompt."""
        if len({t for t, _ in samples}) < 2 or min(t for t, _ in samples) < 1:
            raise ValueError(f"a prefill cost needs timings at two or more token counts >= 1, got {samples}")
        points, most = [], 0.0
        for tokens, seconds in sorted(samples):
            most = max(most, seconds)
            if points and points[-1][0] == tokens:
                points[-1] = (tokens, most)
            else:
                points.append((tokens, most))
        return cls(tuple(points))

    def __call__(self, tokens: int) -> float:
        """Seconds of a forward of ``tokens``, on the line through the two timed sizes around it (the
        smallest two below them, the largest two above)."""
        pairs = list(itertools.pairwise(self.points))
        (t0, s0), (t1, s1) = next((pair for pair in pairs if tokens <= pair[1][0]), pairs[-1])
        return max(0.0, s0 + (tokens - t0) * (s1 - s0) / (t1 - t0))


@dataclass(frozen=True)
class PrefillCosts:
    """The two prefill paths' measured layer costs: ``split`` per forward of at most ``prefill_chunk``
    tokens through the CPU actors, ``device`` per forward through ``DeviceResidual`` (any length); and
    ``head_s``, the final norm and lm_head on the prompt's last position, once a prompt on either path."""

    split: MeasuredCost
    device: MeasuredCost
    head_s: float = 0.0

    def estimate(self, tokens: int, chunk: int) -> dict[str, float]:
        """Seconds of each path for a prompt of ``tokens``: the split path in forwards of ``chunk`` tokens."""
        full, rest = divmod(tokens, chunk)
        return {
            "split": full * self.split(chunk) + (self.split(rest) if rest else 0.0) + self.head_s,
            "device": self.device(tokens) + self.head_s,
        }


def choose_prefill(tokens: int, costs: PrefillCosts, chunk: int) -> str:
    """The cheaper path for a prompt of ``tokens``; a tie stays on "split", which moves nothing."""
    estimate = costs.estimate(tokens, chunk)
    return "device" if estimate["device"] < estimate["split"] else "split"


def _best_seconds(device: torch.device, work: Callable[[], object], reps: int, budget_s: float = 0.02) -> float:
    """Best wall-clock seconds of ``work`` over at least ``reps`` runs, and for short work more, until
    ``budget_s`` of runs (at most 8 × ``reps``): a layer's one-token pass takes a tenth of a millisecond, and
    three of them could all meet one descheduling on a busy machine. Waits for the device (CUDA runs
    asynchronously)."""
    clock = device_clock(device)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < reps or (spent < budget_s and runs < 8 * reps):
        start = clock()
        work()
        took = clock() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


def time_layer(model: SplitModel, residual: Residual, layer: int, tokens: int, reps: int = 3) -> float:
    """Seconds for ``layer``'s four groups on random inputs of ``tokens`` rows, with the residual from
    ``residual``: what a prefill path repeats per layer. Attention and norms cost the same on both paths
    for the same tokens, so they are left out."""
    groups = model.layers[layer].groups.values()
    xs = [torch.randn(tokens, g.rotate_in.width, device=model.device) for g in groups]

    def run() -> None:
        for g, x in zip(groups, xs, strict=True):
            g(x, residual, PassStats(), time.perf_counter)

    return _best_seconds(model.device, run, reps)


def time_head(model: SplitModel, reps: int = 3) -> float:
    """Seconds of the final norm and the verifier's lm_head (``EngineConfig.head``'s precision) on one
    position (a prefill keeps only the last): once a prompt, whichever the path."""
    h = torch.randn(1, model.spec.hidden, device=model.device)
    return _best_seconds(model.device, lambda: model.logits(h), reps)


def layer_classes(n_layers: int, kind: Callable[[int], Hashable]) -> dict[int, int]:
    """{first layer of each kind: how many layers are of that kind}: layers alike to a path (all of them
    to the CPU actors; resident or streamed to ``DeviceResidual``) are timed once and counted."""
    firsts: dict[Hashable, int] = {}
    counts: dict[int, int] = {}
    for layer in range(n_layers):
        first = firsts.setdefault(kind(layer), layer)
        counts[first] = counts.get(first, 0) + 1
    return counts


def measure_cost(model: SplitModel, residual: Residual, layers: dict[int, int], sizes: Sequence[int]) -> MeasuredCost:
    """One forward's cost through ``residual`` at ``sizes`` tokens, from the ``layer_classes`` timings
    (after one untimed pass, which pays any first-call compilation)."""
    for layer in layers:
        time_layer(model, residual, layer, sizes[0], reps=1)
    return MeasuredCost.of(
        [(n, sum(count * time_layer(model, residual, layer, n) for layer, count in layers.items())) for n in sizes]
    )


def measure_prefill_costs(model: SplitModel, split: Residual, device: DeviceResidual, chunk: int) -> PrefillCosts:
    """Each path timed at the sizes of its own forwards, on this machine, with its current load, and the
    head's cost once a prompt: what ``choose_prefill`` compares. The split path's forwards carry at
    most ``chunk`` tokens (timed at 1, an eighth of ``chunk`` and ``chunk``, a chunk of 1 at 2 as well: a cost
    needs two sizes); the device path's the whole prompt (timed there and at four chunks too): a prompt
    reused up to its last token prefills one."""
    n_layers = len(model.layers)
    split_sizes = sorted({1, max(1, chunk // 8), max(2, chunk)})
    device_sizes = (*split_sizes, 4 * chunk)

    def shape(layer: int) -> Hashable:  # layer types with heads of their own cost their own (Gemma 4)
        return model.layers[layer].heads

    return PrefillCosts(
        split=measure_cost(model, split, layer_classes(n_layers, shape), split_sizes),
        device=measure_cost(
            model, device, layer_classes(n_layers, lambda i: (device.is_resident(i), shape(i))), device_sizes
        ),
        head_s=time_head(model),
    )
