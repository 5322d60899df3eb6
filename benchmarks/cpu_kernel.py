"""Claim: the CPU residual kernel runs at its roofline, so a 16-token tree costs about what 1 token does
where the memory term dominates.

In one run and with the kernel's own thread count, measure the RAM read bandwidth (a numba parallel
read-and-sum of a 2 GB int8 array, just before every timed pass) and the cores' fp32 flop rate (a
large torch sgemm, the best of three, at the start of every round), then time one verify pass
of the kernel for n = 1 … 32 tokens over (a) a >= 1 GB residual with the layer shapes of a ~31B model
(d = 5376, intermediate 21504) and (b) the real SmolLM2-135M shapes (30 layers). A pass is one call per
Linear group per layer, as the actor makes them.

Every activation mode is timed, alternating: int16 (the default: x' rounded to int16, integer dot
products), int8 (rounded to int8, on the same integer paths) and fp32.
Roofline(n) = max(bytes / bandwidth, 2·n·weights / fp32 flop rate), for all of them: the
integer modes can beat it where compute bounds. Ratios are what count, since absolute times on a
shared machine are noisy: this VM's read bandwidth drifts between ~10 and ~30 GB/s within a run, and
its sgemm rate between ~75 and ~160 GFLOP/s. So each timed pass is paired with one read of the array
just before it (one read against one pass, adjacent in time) and the sgemm sample of its round (a round
times every n and mode in turn), and a row's ratio is the median of its rounds' ratios.
``ratio_best_gflops`` judges the same passes against the run's best sgemm sample, for the record. Planes
are random bytes: timing does not depend on the values.

A call's fixed costs (dispatch, a parallel region's start, the first misses before the prefetchers run)
matter where a group streams in tens of microseconds, as SmolLM2's do. So every round also times the
floor: the same calls made as bare parallel reads of the same planes (``_read_planes``), after a read
of the array of its own; ``ratio_to_floor`` is a pass against the floor of its round, ``floor_ms`` the
best floor (as ``ms`` is the best pass) and ``floor_memory_ratio`` the floor against its own read
sample.

    .venv/bin/python benchmarks/cpu_kernel.py [--quick] [--threads N]

writes benchmarks/results/cpu_kernel.json and cpu_kernel.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from pathlib import Path

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from splitspec.config import ACTIVATION_MODES, CpuActorConfig
from splitspec.kernels.ir import I8, call
from splitspec.kernels.residual import ResidualMatrix, warmup
from splitspec.quantize.packing import PLANES, num_tiles, plane_shapes, residual_nbytes

RESULTS = Path(__file__).parent / "results"
NS = (1, 2, 4, 8, 16, 32)
# (rows, d_in) of the Linear groups of one layer: qkv, o, gate_up, down
BIG_LAYER = [(8192, 5376), (5376, 4096), (43008, 5376), (5376, 21504)]
SMOL_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SMOL_LAYERS = 30


@njit(parallel=True, cache=True)
def _read_sum(words):
    total = np.uint64(0)
    for i in prange(words.shape[0]):
        part = np.uint64(0)
        for j in range(words.shape[1]):
            part += words[i, j]
        total += part
    return total


@njit(inline="always")
def _share_sum(plane, chunk, chunks):
    """The sum of ``chunk``'s contiguous share of ``plane`` (uint64 indices: numba puts a negative-index
    fix-up on signed ones, which kept this loop scalar)."""
    size, part = np.uint64(plane.size), np.uint64(0)
    for i in range(np.uint64(chunk) * size // chunks, (np.uint64(chunk) + np.uint64(1)) * size // chunks):
        part += plane[i]
    return part


@njit(parallel=True, cache=True)
def _read_planes(w0, w1, w2, scale, chunks):
    """One group's planes (as uint64 words) read and summed by ``chunks`` threads, a share of each plane
    apiece: a call that only streams the kernel's bytes, the floor of a call of this size."""
    total = np.uint64(0)
    for chunk in prange(chunks):
        words = _share_sum(w0, chunk, chunks) + _share_sum(w1, chunk, chunks) + _share_sum(w2, chunk, chunks)
        total += words + _share_sum(scale, chunk, chunks)
    return total


def processor() -> str:
    """The CPU's model name and its widest vector extension, since the sgemm roof depends on it."""
    cpuinfo = Path("/proc/cpuinfo")
    info = cpuinfo.read_text() if cpuinfo.exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    wide = "avx512f" if " avx512f" in info else "avx2" if " avx2" in info else "?"
    return f"{name or platform.processor()} ({wide})"


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def stream_words(nbytes: int) -> np.ndarray:
    """``nbytes`` of int8 ones viewed as uint64 words (the same bytes, 8 per add), read once to compile."""
    words = np.ones(nbytes, np.int8).view(np.uint64).reshape(-1, 8192)
    _read_sum(words)
    return words


@intrinsic
def _clflush(typingctx, address):
    """Write back and drop the cache line holding ``address`` (an int64) from every level."""
    sig = types.void(types.int64)

    def codegen(context, builder, sig, args):
        call(builder, "llvm.x86.sse2.clflush", ir.VoidType(), [builder.inttoptr(args[0], I8.as_pointer())])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def flush_lines(ranges: np.ndarray) -> None:
    """clflush every cache line of the (address, bytes) rows of ``ranges`` [k, 2] int64: those bytes leave
    every cache level, whatever the caches' size and replacement policy. Reading a large buffer did not do
    that on this VM: its L3 is reported as 480 MB, and lines read twice just before survived a 1 GB read."""
    for i in range(ranges.shape[0]):
        for line in range(ranges[i, 0] - ranges[i, 0] % 64, ranges[i, 0] + ranges[i, 1], 64):
            _clflush(line)


def tensor_ranges(tensors) -> np.ndarray:
    """(address, bytes) of each tensor, for ``flush_lines``."""
    return np.array([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], np.int64).reshape(-1, 2)


def read_gbps(words: np.ndarray, reps: int) -> float:
    """Read bandwidth: the best of ``reps`` sums of ``words``."""
    return words.nbytes / best_of(lambda: _read_sum(words), reps) / 1e9


def sgemm_gflops(size: int) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    return 2 * size**3 / best_of(lambda: a @ b, 3) / 1e9


def spread(samples: list[float]) -> dict[str, float]:
    return {"count": len(samples), "min": min(samples), "median": float(np.median(samples)), "max": max(samples)}


class Limits:
    """The machine's limits, sampled all through the run: RAM read bandwidth just before every timed
    pass (each pass is judged by its own sample), the sgemm rate at the start of every round (its passes'
    compute roof). On this shared VM both drift by a quarter or more within a minute (sgemm samples
    of 73-134 GFLOP/s in one run), so samples at the ends of the run said little about the minutes in
    between; a bandwidth sample before each round of three modes' passes was already half a second stale
    for the last, and the run's best sgemm judged passes timed while the cores ran 30% slower."""

    def __init__(self, nbytes: int = 2 * 2**30) -> None:
        self._words = stream_words(nbytes)
        self.stream: list[float] = []
        self.gflops: list[float] = []

    def sample_stream(self, reads: int = 2) -> float:
        """The best of ``reads`` reads of the array, in GB/s (two, to pair with one pass). The first read of
        an array left untouched for a second reads at about half the speed on this VM (14-15 GB/s warm,
        6.5-9 after 1-3 s idle or an sgemm, then warm again: benchmarks/README, the forty-fourth session),
        while the passes it judges read buffers that a warm-up pass touched a moment before; one read
        judged them against that slow first read."""
        self.stream.append(read_gbps(self._words, reads))
        return self.stream[-1]

    def sample_gflops(self) -> float:
        self.gflops.append(sgemm_gflops(3072))
        return self.gflops[-1]


def random_planes(rows: int, d_in: int, bits: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random codes in every plane, each starting on a cache line as in a shard's arena (numpy's own
    allocations start 16 bytes past one, so that every other 32-byte load would straddle two lines)."""
    planes = {}
    for name, (shape, dtype) in plane_shapes(num_tiles(rows), d_in, bits).items():
        nbytes = math.prod(shape) * dtype.itemsize
        raw = np.empty(nbytes + 64, np.uint8)
        plane = raw[-raw.ctypes.data % 64 :][:nbytes].view(dtype).reshape(shape)
        if name == "scale":
            plane[...] = 64  # top / 4
        elif name == "scale_top":
            plane[...] = 2.0**-5
        else:
            plane.view(np.uint8)[...] = rng.integers(0, 256, plane.view(np.uint8).shape, dtype=np.uint8)
        planes[name] = plane
    return planes


def bench_model(groups: list[tuple[int, int]], bits: int, limits: Limits, reps: int) -> list[dict]:
    """One row per (n, activation mode). Each round times every n and mode in turn, each pass just after a
    read of the array, and starts with an sgemm sample, the compute roof of its passes: a slow phase of
    this VM lasts seconds, so rounds that each take every row's turn make it cost each row one round of
    its median, where rounds of one row at a time had let it take a whole row."""
    rng = np.random.default_rng(0)
    planes = [random_planes(r, d, bits, rng) for r, d in groups]
    matrices = [ResidualMatrix(p, bits, r, d) for p, (r, d) in zip(planes, groups, strict=True)]  # as a shard does
    nbytes = sum(residual_nbytes(r, d, bits) for r, d in groups)
    weights = sum(r * d for r, d in groups)
    inputs = {
        n: (
            [rng.standard_normal((n, d)).astype(np.float32) for _, d in groups],
            [np.empty((n, r), np.float32) for r, _ in groups],
        )
        for n in NS
    }

    def one_pass(n: int, activations: str) -> None:
        for matrix, x, out in zip(matrices, *inputs[n], strict=True):
            matrix.matmul(x, out, activations)

    words = [[p[name].reshape(-1).view(np.uint64) for name in (*PLANES[bits], "scale")] for p in planes]
    chunks = np.uint64(numba.get_num_threads())

    def floor_pass() -> None:
        for group in words:
            _read_planes(*group, chunks)

    keys = [(n, mode) for n in NS for mode in ACTIVATION_MODES]
    samples: dict[tuple[int, str], dict[str, list[float]]] = {
        key: {"pass_s": [], "round_gbps": [], "round_gflops": [], "floor_s": [], "floor_gbps": []} for key in keys
    }
    floor_pass()  # compiles, or loads, _read_planes
    for _ in range(reps):
        gflops = limits.sample_gflops()
        floor_gbps = limits.sample_stream()
        floor_s = best_of(floor_pass, 1)
        for n, mode in keys:
            one_pass(n, mode)  # warms the mode's threads (the read below evicts its data again)
            sample = samples[n, mode]
            sample["round_gflops"].append(gflops)
            sample["floor_s"].append(floor_s)
            sample["floor_gbps"].append(floor_gbps)
            sample["round_gbps"].append(limits.sample_stream())
            sample["pass_s"].append(best_of(lambda n=n, mode=mode: one_pass(n, mode), 1))
    rows = [
        rescale({"bits": bits, "n": n, "activations": mode, "bytes": nbytes, "weights": weights, **samples[n, mode]})
        for n, mode in keys
    ]
    for n in NS:
        by = {r["activations"]: r for r in rows if r["n"] == n}
        print(
            f"  {bits}-bit n={n:2d}: roofline {by['int16']['roofline_ms']:8.2f} ms  "
            + "  ".join(f"{m} {by[m]['ms']:8.2f} (×{by[m]['ratio']:.2f})" for m in ACTIVATION_MODES)
            + f"  floor {by['int16']['floor_ms']:8.2f} (int16 ×{by['int16']['ratio_to_floor']:.2f})"
        )
    return rows


def rescale(row: dict) -> dict:
    """Fill in a row's best time and its ratios to the roofline and to the memory term. Each pass is judged
    by the bandwidth sampled just before it and the sgemm rate sampled at the start of its round, so that
    drift hits the pass and its limits alike, and the ratio is the median over the rounds; ``ms`` is the
    best pass, ``roofline_ms`` and ``memory_ms`` the limits at the median bandwidth."""
    seconds, stream, floor = (np.array(row[key]) for key in ("pass_s", "round_gbps", "floor_s"))
    memory_s = row["bytes"] / stream / 1e9
    roof = np.maximum(memory_s, 2 * row["n"] * row["weights"] / np.array(row["round_gflops"]) / 1e9)
    row.update(
        ms=1e3 * seconds.min(),
        roofline_ms=1e3 * float(np.median(roof)),
        memory_ms=1e3 * float(np.median(memory_s)),
        ratio=float(np.median(seconds / roof)),
        memory_ratio=float(np.median(seconds / memory_s)),
        gbps=row["bytes"] / seconds.min() / 1e9,
        floor_ms=1e3 * floor.min(),
        ratio_to_floor=float(np.median(seconds / floor)),
        floor_memory_ratio=float(np.median(floor * np.array(row["floor_gbps"]) * 1e9 / row["bytes"])),
    )
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for bits, color in zip((6, 7, 8), ("tab:blue", "tab:orange", "tab:green"), strict=True):
            for mode, style in zip(ACTIVATION_MODES, ("o-", "s-.", "x:"), strict=True):
                rows = [r for r in result["rows"] if (r["model"], r["bits"], r["activations"]) == (model, bits, mode)]
                if rows:
                    ns = [r["n"] for r in rows]
                    ax.plot(ns, [r["ms"] for r in rows], style, color=color, label=f"{bits}-bit, {mode} activations")
            if rows:
                roof = [r["roofline_ms"] for r in rows]
                ax.plot(ns, roof, "--", color=color, alpha=0.5, label=f"{bits}-bit fp32 roofline")
                ax.plot(ns, [r["floor_ms"] for r in rows], ":", color=color, alpha=0.5, label=f"{bits}-bit call floor")
        ax.set(xscale="log", yscale="log", xlabel="tokens per pass (n)", ylabel="ms per pass", title=model)
        ax.set_xticks(NS, [str(n) for n in NS])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"residual kernel vs roofline: {result['stream_gbps']:.1f} GB/s (median sample), "
        f"{result['gflops']:.0f} GFLOP/s, {result['threads']} threads"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8-bit only, fewer repetitions")
    parser.add_argument("--threads", type=int, help="kernel threads (default: numba's, one per CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_kernel.json", help="the JSON (and a .png beside it)")
    args = parser.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    threads = numba.get_num_threads()
    torch.set_num_threads(threads)
    compile_s = warmup()
    limits = Limits()
    stream, gflops = limits.sample_stream(5), limits.sample_gflops()
    print(f"threads {threads}, compile/load {compile_s:.1f} s, stream {stream:.1f} GB/s, sgemm {gflops:.0f} GFLOP/s")
    result = {"threads": threads, "compile_s": compile_s, "processor": processor(), "rows": []}
    for bits in (8,) if args.quick else (8, 7, 6):
        layer_bytes = sum(residual_nbytes(r, d, bits) for r, d in BIG_LAYER)
        layers = -(-(2**30) // layer_bytes)
        print(f"31B-like, {layers} layers ({layers * layer_bytes / 1e9:.2f} GB):")
        for row in bench_model(BIG_LAYER * layers, bits, limits, reps=3 if args.quick else 7):
            result["rows"].append({"model": "31B-like", "layers": layers, **row})
        gc.collect()  # free this layout's planes before the next one is made
    for bits in (8,) if args.quick else (8, 6):
        print(f"SmolLM2-135M, {SMOL_LAYERS} layers:")
        for row in bench_model(SMOL_LAYER * SMOL_LAYERS, bits, limits, reps=5):
            result["rows"].append({"model": "SmolLM2-135M", "layers": SMOL_LAYERS, **row})

    limits.sample_stream(5)
    limits.sample_gflops()
    print(f"after: stream {limits.stream[-1]:.1f} GB/s, sgemm {limits.gflops[-1]:.0f} GFLOP/s")
    gflops = max(limits.gflops)
    result.update(
        stream_gbps=float(np.median(limits.stream)),
        gflops=gflops,
        stream_gbps_samples=spread(limits.stream),
        gflops_samples=spread(limits.gflops),
    )
    for row in result["rows"]:
        # the strictest views, for the record: the best pass against the best bandwidth of the whole run, and
        # the median pass against the roofline at the run's best sgemm rate
        row["ratio_best_pass_best_stream"] = row["ms"] / 1e3 / (row["bytes"] / max(limits.stream) / 1e9)
        row["ratio_best_gflops"] = rescale({**row, "round_gflops": [gflops] * len(row["pass_s"])})["ratio"]

    def cost(bits: int, n: int, mode: str) -> float:
        key = ("31B-like", bits, n, mode)
        return next(r["ms"] for r in result["rows"] if (r["model"], r["bits"], r["n"], r["activations"]) == key)

    default = CpuActorConfig().activations
    result["activations_default"] = default
    result["cost16_over_cost1"] = cost(8, 16, default) / cost(8, 1, default)
    result["cost16_over_cost1_by_mode"] = {
        f"{bits}-bit {mode}": cost(bits, 16, mode) / cost(bits, 1, mode)
        for bits in sorted({r["bits"] for r in result["rows"] if r["model"] == "31B-like"})
        for mode in ACTIVATION_MODES
    }

    def goals(mode: str) -> dict[str, bool]:
        big = [r for r in result["rows"] if r["model"] == "31B-like" and r["activations"] == mode]
        return {
            "ms <= 1.25 x roofline, n = 1..16": all(r["ratio"] <= 1.25 for r in big if r["n"] <= 16),
            "ms <= 1.15 x memory term at n = 1": all(r["memory_ratio"] <= 1.15 for r in big if r["n"] == 1),
        }

    result["goals"] = goals(default)
    result["goals_by_mode"] = {mode: goals(mode) for mode in ACTIVATION_MODES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
