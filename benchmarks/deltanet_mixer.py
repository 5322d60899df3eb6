"""Qwen 3.5's linear-attention mixer at its 27B shape on one core: what a layer's gated delta rule costs per
pass, next to what reading that layer's 2-bit projections costs.

    .venv/bin/python benchmarks/deltanet_mixer.py [--reps 7]

The engine runs the rule in closed form over a pass's ancestor mask (``gpu_actor/delta_rule.py``), so a
tree is checked in one pass; this measures that math alone, in the engine's order, on random inputs of the
real dimensions (16 q/k heads and 48 value heads of 128, a convolution over 4 inputs; fp32, one thread):

- ``check``: a verify pass of n rows (a chain's mask, the tree's worst case) over the ``FOLD_AFTER`` / 2
  verified entries a check finds pending on average;
- ``fold``: ``FOLD_AFTER`` verified entries folded into the state, what ``DeltaState.keep`` does once that
  many slots are verified; ``decode_token`` = check(1) + fold / ``FOLD_AFTER``, a token's mixer cost
  without speculation, against ``fold_each_check``: a check of one row from the state alone, then its
  entry folded in (what folding at every ``keep`` would cost a token);
- ``draft_level``: a draft level of n rows over the 16 entries drafted before it;
- ``prompt_chunk``: a prompt's 256 rows in blocks of ``CHAIN_BLOCK``, each folded before the next.

Subnormal floats are flushed to zero, as the engine's passes set it (``--subnormals`` keeps them: a head
that decays fast shrinks its state through them, and the CPU's float units take far longer on them).
Reference, measured in the same run: the layer's projections (in_proj_qkv, _z, _b, _a and out_proj: 116 M
weights at 2 bits plus an fp16 scale per 128) read at a one-thread read rate (``scheduler.probe``), what
the 2-bit base product of that layer costs at least on the same core. Writes
``benchmarks/results/deltanet_mixer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from splitspec.gpu_actor.delta_rule import conv_window, fold, mix_rows, subnormals_flushed
from splitspec.gpu_actor.delta_state import FOLD_AFTER
from splitspec.gpu_actor.model import CHAIN_BLOCK
from splitspec.models.spec import DeltaNet
from splitspec.scheduler.probe import read_bandwidth

NET = DeltaNet(n_k=16, n_v=48, k_dim=128, v_dim=128, conv=4)  # Qwen 3.5 27B's
HIDDEN = 5120
RESULTS = Path(__file__).parent / "results" / "deltanet_mixer.json"


class Layer:
    """One layer's mixer parameters and state, random, at ``NET``'s shape."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.conv = torch.randn(NET.conv_dim, NET.conv) * 0.3
        self.neg_a = -torch.rand(NET.n_v) * 4
        self.dt_bias = torch.randn(NET.n_v)
        self.state = torch.randn(NET.n_v, NET.k_dim, NET.v_dim) * 0.1
        self.window = torch.randn(NET.conv - 1, NET.conv_dim)

        self.rows = torch.randn(256, NET.conv_dim), torch.randn(256, NET.n_v), torch.randn(256, NET.n_v)

    def rule(self, n: int, state: torch.Tensor, window: torch.Tensor, pending: list[torch.Tensor], anc):
        """The rows' (out, k, u, G) as the engine computes them (``delta_rule.mix_rows``), on the layer's random
        projections' outputs (x: in_proj_qkv's, b and a: in_proj_b's and in_proj_a's), and x."""
        x, b, a = (t[:n] for t in self.rows)
        return *mix_rows(NET, self.conv, self.neg_a, self.dt_bias, x, b, a, state, window, pending, anc), x

    @staticmethod
    def empty() -> list[torch.Tensor]:
        """No pending entries: (k, u, G, x) of none."""
        shapes = [(0, NET.n_v, NET.k_dim), (0, NET.n_v, NET.v_dim), (0, NET.n_v), (0, NET.conv_dim)]
        return [torch.zeros(s) for s in shapes]


def causal(n: int, before: int = 0) -> torch.Tensor:
    return torch.ones(n, before + n, dtype=torch.bool).tril(before)


def check(layer: Layer, pending: list[torch.Tensor], n: int) -> None:
    layer.rule(n, layer.state, layer.window, pending, causal(n, pending[0].shape[0]))


def fold_in(layer: Layer, entries: list[torch.Tensor]) -> None:
    """In place, as ``DeltaState.keep`` folds."""
    fold(layer.state, *entries[:3], out=layer.state)
    layer.window = conv_window(layer.window, entries[3])


def fold_each_check(layer: Layer) -> None:
    _, k, u, big_g, x = layer.rule(1, layer.state, layer.window, Layer.empty(), causal(1))
    fold_in(layer, [k, u, big_g, x])


def prompt_chunk(layer: Layer, n: int) -> None:
    state, window = layer.state, layer.window
    for r in range(0, n, CHAIN_BLOCK):
        rows = min(CHAIN_BLOCK, n - r)
        _, k, u, big_g, x = layer.rule(rows, state, window, Layer.empty(), causal(rows))
        state, window = fold(state, k, u, big_g), conv_window(window, x)


def median_ms(work, reps: int) -> float:
    work()  # first-call costs
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--subnormals", action="store_true", help="keep subnormal floats (the engine flushes them)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {cpu})
    layer = Layer()
    with torch.no_grad(), subnormals_flushed(not args.subnormals):  # as the engine's passes run
        drafted = list(layer.rule(16, layer.state, layer.window, Layer.empty(), causal(16))[1:])  # 16 entries
        verified = list(layer.rule(FOLD_AFTER, layer.state, layer.window, Layer.empty(), causal(FOLD_AFTER))[1:])
        half = [t[: FOLD_AFTER // 2] for t in verified]
        result = {
            "check_ms": {n: median_ms(lambda n=n: check(layer, half, n), args.reps) for n in (1, 4, 16, 32)},
            "fold_ms": median_ms(lambda: fold_in(layer, verified), args.reps),
            "fold_each_check_ms": median_ms(lambda: fold_each_check(layer), args.reps),
            "draft_level_ms": {n: median_ms(lambda n=n: check(layer, drafted, n), args.reps) for n in (1, 4, 8)},
            "prompt_chunk_256_ms": median_ms(lambda: prompt_chunk(layer, 256), args.reps),
        }
    result["decode_token_ms"] = round(result["check_ms"][1] + result["fold_ms"] / FOLD_AFTER, 3)
    weights = HIDDEN * (NET.conv_dim + NET.n_v * NET.v_dim + 2 * NET.n_v) + NET.n_v * NET.v_dim * HIDDEN
    code_bytes = weights * (2 + 16 / 128) / 8
    bandwidth = read_bandwidth([cpu])
    result |= {
        "projection_weights": weights,
        "projection_code_bytes": round(code_bytes),
        "read_gb_s": round(bandwidth / 1e9, 2),
        "projection_read_ms": round(1e3 * code_bytes / bandwidth, 3),
        "cpu": cpu,
        "threads": 1,
        "chain_block": CHAIN_BLOCK,
        "fold_after": FOLD_AFTER,
        "flush_subnormals": not args.subnormals,
    }
    result["decode_token_over_read"] = round(result["decode_token_ms"] / result["projection_read_ms"], 3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
