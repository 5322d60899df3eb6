"""Claim: on a CPU with AMX, the engine's 2-bit base product of many tokens (a prompt's prefill) runs on
tiles faster than on its fp32 paths (the byte tables, then decode + sgemm from ``DENSE_TOKENS``), with x'
rounded as the residual's int16 mode rounds it.

One thread, the engine's. For each model's shapes the same matrices are bound twice (``BaseProduct``,
``tiled=True`` and ``tiled=False``), and every round times one whole pass of each for every n (one call per
Linear group per layer, the input and output buffers reused as the engine reuses them), the two
alternating, so that the VM's slow phases hit both alike; a row's ``speedup`` is the median over rounds of
fp32 ÷ tiled. The first round checks that the two differ by no more than x's rounding can explain. Shapes:
SmolLM2-135M's 30 layers and one layer of a ~31B model (d = 5376, intermediate 21504).

    .venv/bin/python benchmarks/base_tiles.py [--rounds R]

writes benchmarks/results/base_tiles.json and base_tiles.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numba
import torch

from cpu_kernel import BIG_LAYER, SMOL_LAYER, SMOL_LAYERS
from residual_tiles import ab_rows
from splitspec.gpu_actor.kernels import BaseProduct, warmup
from splitspec.kernels import amx
from splitspec.kernels.cpu_base.tiles import TILE_TOKENS

RESULTS = Path(__file__).parent / "results"
NS = tuple(sorted({TILE_TOKENS, 32, 64, 128, 256}))
MODELS = {"SmolLM2-135M": SMOL_LAYER * SMOL_LAYERS, "31B-like (one layer)": BIG_LAYER}
LEVELS = torch.tensor([-1.5071, -0.4528, 0.4528, 1.5071])  # the converter's: symmetric


def bench(model: str, groups: list[tuple[int, int]], rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    bound = {True: [], False: []}
    for rows, d in groups:
        codes = torch.randint(-(2**31), 2**31 - 1, (rows, d // 32, 2), dtype=torch.int32, generator=gen)
        scale = (torch.rand(rows, -(-d // 128), generator=gen) * 0.01 + 1e-3).half()
        for tiled in (True, False):
            bound[tiled].append(BaseProduct(codes, scale, LEVELS, tiled=tiled))
    weights = sum(r * d for r, d in groups)
    times: dict[tuple[int, bool], list[float]] = {(n, t): [] for n in NS for t in (True, False)}
    for round_ in range(rounds):
        for n in NS:
            xs = {d: torch.randn(n, d, generator=gen) for _, d in groups}
            outs = {t: {(r, d): torch.empty(n, r) for r, d in groups} for t in (True, False)}
            for tiled in (True, False) if round_ % 2 == 0 else (False, True):
                start = time.perf_counter()
                for product, (r, d) in zip(bound[tiled], groups, strict=True):
                    product(xs[d], outs[tiled][r, d])
                times[n, tiled].append(time.perf_counter() - start)
            if round_ == 0:
                for shape in groups[-4:]:  # the last layer's outputs are still in the buffers
                    a, b = outs[True][shape], outs[False][shape]
                    if (a - b).abs().max() > 1e-4 * b.abs().max():
                        raise AssertionError(f"{model} n={n}: tiles and fp32 paths differ past x's rounding")
    return ab_rows({"model": model}, NS, times, weights, "fp32")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS), 4.5), squeeze=False)
    for ax, model in zip(axes[0], MODELS, strict=True):
        rows = [r for r in result["rows"] if r["model"] == model]
        ns = [r["n"] for r in rows]
        ax.plot(ns, [r["tiled_gmacs"] for r in rows], "o-", color="tab:green", label="AMX tiles (x' int16)")
        ax.plot(ns, [r["fp32_gmacs"] for r in rows], "x--", color="tab:gray", label="tables / decode + sgemm")
        ax.axvline(TILE_TOKENS, color="k", alpha=0.3, linestyle=":", label="TILE_TOKENS")
        ax.set(xscale="log", xlabel="tokens per pass (n)", ylabel="GMAC/s (weights × tokens / s)", title=model)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("2-bit base product, one thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not amx.enabled():
        raise SystemExit("this CPU (or kernel, or SPLITSPEC_AMX=0) gives no AMX tiles: nothing to compare")
    torch.set_num_threads(1)  # the sgemm's
    numba.set_num_threads(1)  # the tables' and the tiles'
    warmup()
    result = {"threads": 1, "rounds": args.rounds, "tile_tokens": TILE_TOKENS, "rows": []}
    for model, groups in MODELS.items():
        result["rows"] += bench(model, groups, args.rounds)
    result["speedup_min_from_tile_tokens"] = min(r["speedup"] for r in result["rows"] if r["n"] >= TILE_TOKENS)
    result["smol_prefill256_ms"] = next(
        {"tiled": r["tiled_ms"], "fp32": r["fp32_ms"]}
        for r in result["rows"]
        if (r["model"], r["n"]) == ("SmolLM2-135M", 256)
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "base_tiles.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "base_tiles.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
