"""Claim: the GPU actor's CPU kernel for the 2-bit base product (``kernels/cpu_base/``) runs
within 1.5× of its roofline on the engine's one core for 1-16 tokens.

One thread (numba and torch), pinned to one CPU. The codes are random, with the shapes of all 30 layers
of SmolLM2-135M (qkv 960 × 576, o 576 × 576, gate_up 3072 × 576, down 576 × 1536: ~28 MB with the fp16
scales), so that a pass streams them from RAM; a pass is one product call per Linear group and layer, as
the model makes them (the new kernel bound to its matrix once, ``cpu_base.Product``, which reads a
block-major copy of the scales), and every cache line of the codes, scales and copies is flushed
(clflush) just before it, so that the pass reads them from RAM (``cpu_kernel.flush_lines``).
The engine's compiled layers (``cpu_step``) call the bound products from compiled code, so a row's ``ms``
is that: one compiled loop over the products' fields; ``python_ms`` is the same products called from
Python one group at a time (``Product.__call__``, the op-by-op path), for what a call costs.

Roofline(n) = max(bytes / read bandwidth, 2·n·weights / sgemm rate), both of one thread and sampled in
every round: the bandwidth by reading a 1 GB array, the rate by a torch sgemm. A round times every n, for
the kernel and for the kernel it replaced (kept below, as it was, for this comparison), in turn, so that
the machine's drift (other work shares its two CPUs) reaches every row alike; a row's ratio is the
median over rounds of a pass against its round's roofline, ``ms`` the median pass; ``best_ratio`` is the
best pass against the roofline at the run's best samples, what a quiet machine would show.

    .venv/bin/python benchmarks/base_kernel.py [--rounds N] [--cpu K] [--out PATH]

writes benchmarks/results/base_kernel.json and base_kernel.png (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

from cpu_kernel import RESULTS, SMOL_LAYER, SMOL_LAYERS, Limits, flush_lines, processor, spread, tensor_ranges
from splitspec.kernels import cpu_base
from splitspec.kernels.cpu_base.kernel import kernel as base_kernel
from splitspec.kernels.cpu_base.kernel import table_scratch, thread_count
from splitspec.quantize.format import CODE_WORD, GROUP

NS = (1, 2, 4, 8, 16)
LEVELS = torch.tensor([-1.51, -0.45, 0.45, 1.51])  # symmetric, as the converter writes them


@njit(cache=True)
def compiled_pass(fields, x_ats, y_ats, n, threads, tables_at):
    """Every group's product from one compiled loop over the bound matrices' fields, as the engine's
    compiled layers (``cpu_step``) make them: no Python call per group."""
    for i in range(fields.shape[0]):
        f = fields[i]
        rows = f[5]
        words, tiled = f[6], f[7] != 0
        base_kernel(f[0], f[1], f[2], f[3], f[4], x_ats[i], y_ats[i], n, rows, words, words, threads, tiled, tables_at)


# --- the kernel this one replaced (dequantize a row to fp32 scratch, then FMAs), for old_ms ----------

_TWO_POW_112 = np.float32(2.0**112)
_BIT = (np.uint32(1) << np.arange(CODE_WORD, dtype=np.uint32)).view(np.int32)


@njit(inline="always", cache=True)
def _old_half_to_float(bits, out):
    as_bits = out.view(np.uint32)
    for g in range(bits.size):
        h = np.uint32(bits[g])
        as_bits[g] = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))
    for g in range(bits.size):
        out[g] *= _TWO_POW_112


@njit(inline="always", fastmath=True, cache=True)
def _old_dequant_row(codes, scale, levels, w):
    for word in range(codes.shape[0]):
        s = scale[word // (GROUP // CODE_WORD)]
        l0, l1, l2, l3 = levels[0] * s, levels[1] * s, levels[2] * s, levels[3] * s
        lo, hi = codes[word, 0], codes[word, 1]
        for j in range(CODE_WORD):
            b0 = (lo & _BIT[j]) != 0
            b1 = (hi & _BIT[j]) != 0
            w[word * CODE_WORD + j] = (l3 if b0 else l2) if b1 else (l1 if b0 else l0)


@njit(inline="always", fastmath=True, cache=True)
def _old_rows_times_tokens(w, x, out, r0, nr):
    n, d_in = x.shape
    full = n - n % 4
    for i in range(nr):
        for k in range(0, full, 4):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for c in range(d_in):
                wc = w[i, c]
                s0 += wc * x[k, c]
                s1 += wc * x[k + 1, c]
                s2 += wc * x[k + 2, c]
                s3 += wc * x[k + 3, c]
            out[k, r0 + i], out[k + 1, r0 + i], out[k + 2, r0 + i], out[k + 3, r0 + i] = s0, s1, s2, s3
    for k in range(full, n):
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for c in range(d_in):
            xc = x[k, c]
            s0 += w[0, c] * xc
            s1 += w[1, c] * xc
            s2 += w[2, c] * xc
            s3 += w[3, c] * xc
        for i, s in enumerate((s0, s1, s2, s3)):
            if i < nr:
                out[k, r0 + i] = s


@njit(parallel=True, fastmath=True, cache=True)
def _old_base_matmul(codes, scale_bits, levels, x, out):
    rows, d_in = codes.shape[0], x.shape[1]
    for task in prange((rows + 15) // 16):
        w = np.zeros((4, d_in), np.float32)
        scale = np.empty(scale_bits.shape[1], np.float32)
        for r0 in range(task * 16, min(rows, (task + 1) * 16), 4):
            nr = min(4, rows - r0)
            for i in range(nr):
                _old_half_to_float(scale_bits[r0 + i], scale)
                _old_dequant_row(codes[r0 + i], scale, levels, w[i])
            _old_rows_times_tokens(w, x, out, r0, nr)


def old_base_matmul(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], codes.shape[0])
    bits = scale.contiguous().view(torch.int16).numpy().view(np.uint16)
    _old_base_matmul(codes.numpy(), bits, levels.float().numpy(), x.float().contiguous().numpy(), y.numpy())
    return y


# --- the run ----------------------------------------------------------------------------------------


def random_base(rows: int, d_in: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = rng.integers(0, 2**32, (rows, d_in // CODE_WORD, 2), dtype=np.uint32).view(np.int32)
    scale = (rng.random((rows, -(-d_in // GROUP))) * 0.02 + 0.005).astype(np.float16)
    return torch.from_numpy(codes), torch.from_numpy(scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)), help="the one CPU to run on")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "base_kernel.json", help="the JSON (and a .png beside it)"
    )
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    numba.set_num_threads(1)
    torch.set_num_threads(1)

    rng = np.random.default_rng(0)
    groups = SMOL_LAYER * SMOL_LAYERS
    bases = [random_base(r, d, rng) for r, d in groups]
    nbytes = sum(c.nbytes + s.nbytes for c, s in bases)
    weights = sum(r * d for r, d in groups)
    inputs = {n: {d: torch.randn(n, d) for d in {d for _, d in SMOL_LAYER}} for n in NS}
    # each group's product as the model makes it: the new kernel bound to its matrix once (``Product``)
    kernels = {
        "new": [cpu_base.Product(codes, scale, LEVELS) for codes, scale in bases],
        "old": [partial(old_base_matmul, codes, scale, LEVELS) for codes, scale in bases],
    }
    widths = [codes.shape[1] * CODE_WORD for codes, _ in bases]
    # the same bound products driven from compiled code: their fields, and per n every group's x and y
    fields = np.array([product.fields for product in kernels["new"]], np.int64)
    outputs = {n: [torch.empty(n, r) for r, _ in groups] for n in NS}
    addresses = {
        n: (np.array([inputs[n][w].data_ptr() for w in widths]), np.array([y.data_ptr() for y in outputs[n]]))
        for n in NS
    }
    threads = thread_count()()

    def one_pass(kernel: str, n: int) -> float:
        if kernel == "compiled":
            start = time.perf_counter()
            compiled_pass(fields, *addresses[n], n, threads, table_scratch(threads))
            return time.perf_counter() - start
        products, xs = kernels[kernel], inputs[n]
        start = time.perf_counter()
        for product, width in zip(products, widths, strict=True):
            product(xs[width])
        return time.perf_counter() - start

    for kernel, products in kernels.items():  # compile or load from cache, and check the two agree
        x = torch.randn(3, 576)
        want = old_base_matmul(*bases[0], LEVELS, x)
        got = products[0](x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), kernel
    one_pass("compiled", 1)
    want = kernels["new"][0](inputs[1][widths[0]])
    assert torch.equal(outputs[1][0], want), "the compiled loop's product differs from the bound call's"
    kernels["compiled"] = kernels["new"]
    # every byte a pass reads from its matrices (the old kernel's codes and scales are the products' own)
    evict = tensor_ranges([t for product in kernels["new"] for t in product.buffers])
    flush_lines(evict)  # compiles, or loads, the flush
    limits = Limits(2**30)
    print(f"{nbytes / 1e6:.1f} MB of codes and scales, {weights / 1e6:.1f} M weights, CPU {args.cpu}, 1 thread")

    keys = [(kernel, n) for n in NS for kernel in kernels]
    samples: dict[tuple[str, int], dict[str, list[float]]] = {k: {"pass_s": [], "gbps": [], "gflops": []} for k in keys}
    for r in range(args.rounds):
        gflops, gbps = limits.sample_gflops(), limits.sample_stream()
        for key in keys:
            one_pass(*key)  # warm the call path; the flush below evicts its data again
            flush_lines(evict)
            samples[key]["pass_s"].append(one_pass(*key))
            samples[key]["gbps"].append(gbps)
            samples[key]["gflops"].append(gflops)
        line = "  ".join(f"{k[0]} n={k[1]} {1e3 * samples[k]['pass_s'][-1]:.1f}" for k in keys)
        print(f"round {r}: {gbps:.1f} GB/s, {gflops:.0f} GFLOP/s | {line} ms", flush=True)

    def summary(kernel: str, n: int) -> dict:
        s = {key: np.array(v) for key, v in samples[kernel, n].items()}
        memory_s = nbytes / (s["gbps"] * 1e9)
        compute_s = 2 * n * weights / (s["gflops"] * 1e9)
        roof = np.maximum(memory_s, compute_s)
        best_roof = max(nbytes / (limits_best["gbps"] * 1e9), 2 * n * weights / (limits_best["gflops"] * 1e9))
        return {
            "ms": 1e3 * float(np.median(s["pass_s"])),
            "best_ms": 1e3 * float(s["pass_s"].min()),
            # the quiet-machine view: the best pass against the roofline at the run's best samples
            "best_ratio": float(s["pass_s"].min() / best_roof),
            "roofline_ms": 1e3 * float(np.median(roof)),
            "memory_ms": 1e3 * float(np.median(memory_s)),
            "compute_ms": 1e3 * float(np.median(compute_s)),
            "ratio": float(np.median(s["pass_s"] / roof)),
            "pass_s": s["pass_s"].tolist(),
        }

    limits_best = {"gbps": max(limits.stream), "gflops": max(limits.gflops)}
    rows = []
    for n in NS:
        new, called, old = summary("compiled", n), summary("new", n), summary("old", n)
        rows.append(
            {
                "n": n,
                **new,
                "python_ms": called["ms"],
                "python_ratio": called["ratio"],
                "old_ms": old["ms"],
                "old_best_ms": old["best_ms"],
                "old_ratio": old["ratio"],
                "speedup": old["ms"] / new["ms"],
            }
        )
        print(
            f"n={n:2d}: {new['ms']:7.2f} ms (x{new['ratio']:.2f} of roofline {new['roofline_ms']:.2f} ms; "
            f"best x{new['best_ratio']:.2f})  called from Python {called['ms']:7.2f} ms (x{called['ratio']:.2f})  "
            f"old {old['ms']:7.2f} ms (x{old['ratio']:.2f})  speedup {old['ms'] / new['ms']:.1f}"
        )
    result = {
        "rows": rows,
        "read_gbps": float(np.median(limits.stream)),
        "sgemm_gflops": float(np.median(limits.gflops)),
        "read_gbps_samples": spread(limits.stream),
        "sgemm_gflops_samples": spread(limits.gflops),
        "bytes": nbytes,
        "weights": weights,
        "layers": SMOL_LAYERS,
        "threads": 1,
        "cpu": args.cpu,
        # other work on the machine slows the kernel and the roofline's samples alike, but not exactly so
        "load_average_1min": os.getloadavg()[0],
        "processor": processor(),
        "kernel": "AVX-512: 16-row blocks, 4-column tables"
        if cpu_base.WIDE
        else "AVX2: 32-row blocks, 4-column tables in byte planes (vpshufb)",
        "goal": "ms <= 1.5 x roofline for n = 1..16",
        "goal_met": all(r["ratio"] <= 1.5 for r in rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(ns, [r["ms"] for r in rows], "o-", label="table kernel, from compiled code (median pass)")
    ax.plot(ns, [r["python_ms"] for r in rows], "^-", alpha=0.6, label="table kernel, a Python call per group")
    ax.plot(ns, [r["old_ms"] for r in rows], "s:", label="dequantize + FMA kernel (before)")
    ax.plot(ns, [r["roofline_ms"] for r in rows], "k--", alpha=0.6, label="roofline")
    ax.plot(ns, [1.5 * r["roofline_ms"] for r in rows], "k:", alpha=0.4, label="1.5 x roofline")
    ax.set(xscale="log", yscale="log", xlabel="tokens per pass (n)", ylabel="ms per pass (30 layers)")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"SmolLM2-135M 2-bit base, 1 thread: {result['read_gbps']:.1f} GB/s, {result['sgemm_gflops']:.0f} GFLOP/s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
