"""Claim: on a CPU with AMX, the residual's integer passes of many tokens (a prompt's prefill, a wide tree)
run on tiles several times faster than on the vector loops, to the same result bit for bit.

One run, the CPU actor's thread count (one by default, as on this box), int16 activations (the default).
For each model's shapes and each width, the same matrices are bound twice, ``tiled=True`` and
``tiled=False`` (``ResidualMatrix``), and every round times one whole pass of each (one call per Linear
group per layer, as the actor makes them) for every n, the two alternating, so that the VM's slow phases
hit both alike; a row's ``speedup`` is the median over rounds of vector ÷ tiled. The first round's outputs
are compared bit for bit. Shapes: SmolLM2-135M's 30 layers and one layer of a ~31B model (d = 5376,
intermediate 21504), whose codes stream from RAM.

    .venv/bin/python benchmarks/residual_tiles.py [--threads N] [--rounds R]

writes benchmarks/results/residual_tiles.json and residual_tiles.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numba
import numpy as np

from cpu_kernel import BIG_LAYER, SMOL_LAYER, SMOL_LAYERS, random_planes
from splitspec.kernels import amx
from splitspec.kernels.residual import ResidualMatrix, warmup
from splitspec.kernels.residual.tiled import AMX_TOKENS

RESULTS = Path(__file__).parent / "results"
NS = (AMX_TOKENS, 8, 16, 32, 64, 128, 256)
MODELS = {"SmolLM2-135M": SMOL_LAYER * SMOL_LAYERS, "31B-like (one layer)": BIG_LAYER}


def bench(model: str, groups: list[tuple[int, int]], bits: int, rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    planes = [random_planes(r, d, bits, rng) for r, d in groups]
    bound = {
        tiled: [ResidualMatrix(p, bits, r, d, tiled=tiled) for p, (r, d) in zip(planes, groups, strict=True)]
        for tiled in (True, False)
    }
    weights = sum(r * d for r, d in groups)
    times: dict[tuple[int, bool], list[float]] = {(n, t): [] for n in NS for t in (True, False)}
    for round_ in range(rounds):
        for n in NS:
            xs = [rng.standard_normal((n, d)).astype(np.float32) for _, d in groups]
            outs = {t: [np.empty((n, r), np.float32) for r, _ in groups] for t in (True, False)}
            for tiled in (True, False) if round_ % 2 == 0 else (False, True):
                start = time.perf_counter()
                for matrix, x, out in zip(bound[tiled], xs, outs[tiled], strict=True):
                    matrix.matmul(x, out)
                times[n, tiled].append(time.perf_counter() - start)
            if round_ == 0:
                for a, b in zip(outs[True], outs[False], strict=True):
                    if not np.array_equal(a, b):
                        raise AssertionError(f"{model} {bits}-bit n={n}: tiles and vector loops differ")
    return ab_rows({"model": model, "bits": bits}, NS, times, weights, "vector")


def ab_rows(label: dict, ns: tuple[int, ...], times: dict, weights: int, other: str) -> list[dict]:
    """Per n, the tiles against the ``other`` path from ``times[n, tiled]`` (seconds per round): each one's
    median pass and rate, and the median over rounds of other ÷ tiled (``speedup``), printed as it goes."""
    rows = []
    for n in ns:
        tiled, rest = (np.array(times[n, t]) for t in (True, False))
        row = {
            **label,
            "n": n,
            "weights": weights,
            "tiled_ms": 1e3 * float(np.median(tiled)),
            f"{other}_ms": 1e3 * float(np.median(rest)),
            "speedup": float(np.median(rest / tiled)),
            "tiled_gmacs": n * weights / float(np.median(tiled)) / 1e9,
            f"{other}_gmacs": n * weights / float(np.median(rest)) / 1e9,
        }
        print(
            f"  {' '.join(map(str, label.values()))} n={n:3d}: tiles {row['tiled_ms']:8.2f} ms "
            f"({row['tiled_gmacs']:5.1f} GMAC/s)  {other} {row[f'{other}_ms']:8.2f} ms "
            f"({row[f'{other}_gmacs']:5.1f})  ×{row['speedup']:.2f}"
        )
        rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(6 * len(MODELS), 4.5), squeeze=False)
    for ax, model in zip(axes[0], MODELS, strict=True):
        for bits, color in zip((8, 6), ("tab:green", "tab:blue"), strict=True):
            rows = [r for r in result["rows"] if (r["model"], r["bits"]) == (model, bits)]
            ns = [r["n"] for r in rows]
            ax.plot(ns, [r["tiled_gmacs"] for r in rows], "o-", color=color, label=f"{bits}-bit, AMX tiles")
            ax.plot(ns, [r["vector_gmacs"] for r in rows], "x--", color=color, label=f"{bits}-bit, vector loops")
        ax.set(xscale="log", xlabel="tokens per pass (n)", ylabel="GMAC/s (weights × tokens / s)", title=model)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"residual product, int16 activations, {result['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (default 1: one actor core)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not amx.enabled():
        raise SystemExit("this CPU (or kernel, or SPLITSPEC_AMX=0) gives no AMX tiles: nothing to compare")
    numba.set_num_threads(args.threads)
    warmup()
    result = {"threads": args.threads, "rounds": args.rounds, "amx_tokens": AMX_TOKENS, "rows": []}
    for model, groups in MODELS.items():
        for bits in (8, 6):
            result["rows"] += bench(model, groups, bits, args.rounds)
    smol = [r for r in result["rows"] if r["model"] == "SmolLM2-135M"]
    result["speedup_min_n16_up"] = min(r["speedup"] for r in result["rows"] if r["n"] >= 16)
    result["smol_prefill256_ms"] = {f"{r['bits']}-bit": r["tiled_ms"] for r in smol if r["n"] == 256}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "residual_tiles.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "residual_tiles.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
