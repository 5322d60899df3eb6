"""What one step of the engine costs, next to its peers, all in one run on this machine: speculation pays
only when a draft step is much cheaper than a verify pass, and a verify pass is meant to cost what its
bytes cost.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/step_cost.py [FOLDER] [--bits 8]
        [--prompts 8] [--new-tokens 64] [--repeats 15] [--rounds 5] [--out PATH]

FOLDER is a converted model (default: the one ``make demo`` converts). One engine as ``start_local``
starts it (one CPU actor process serving the ``--bits`` residual and its default share of a prompt's base,
``EngineConfig.base_share``, engine and actor pinned to cores of their own, speculation off,
``resident_bytes = 0``: no dense copy of the residual on the engine's side).
The context is a 256-token chat prompt: the held-out questions as the turns of one conversation,
chat-templated by the model's tokenizer, its last 256 tokens (so that it ends where the answer starts).
In this order:

- the base kernel against its roofline, before the engine starts: ``base_kernel.py`` in a process of its
  own on the engine's core (its affinity and thread counts must not leak into the engine), ``--rounds``
  rounds; ``base_roofline_ratio`` is its per-n ``ratio``;
- the draft step after the context: one forward of the 2-bit base alone (``NoResidual``, ``draft=True``
  as ``speculative.draft_tree`` calls it, the draft's own head) for 1 and 4 tokens (one tree level:
  siblings at one position, each seeing the context and itself), with the top-k that follows it;
  the median of ``--repeats``;
- the verify pass for 1-16 tokens after the same context, and its breakdown
  (``verify_pass.verify_rows``, ``--repeats`` passes per n, back to back). ``residual_wait_ms`` is the wait in
  ``gather`` less the channel's latency; ``channel_ms`` is that latency plus the submit side;
  ``other_ms`` is what is left of the pass (rotations, norms, RoPE, Python, allocations);
- every rotation of one pass for 1 and 16 tokens (``rotation_cost``), in the compiled layers as a verify
  pass runs them and op by op, against its floor from the base kernel's read bandwidth and sgemm rate;
- prefill of the same prompt on the engine's chosen path and its parts, and transformers fp32's prefill of
  it (its head for the last position, as the engine's), the two in turn (``paired_prefill``: the engine's
  prefill on a fresh cache, ``prefill.prefill_once``, then the transformers process's, ``--repeats`` pairs
  after a warm-up pair; medians of each side), as decode below and for the same reason;
- decode tok/s of the verifier alone over ``--prompts`` held-out prompts x ``--new-tokens`` greedy
  tokens, as ``e2e.py`` counts it (tokens after the first over the checks' time), and transformers fp32's
  ``generate`` tok/s on the same prompts as ``e2e.transformers_tok_s`` counts it, the two taking the
  prompts in turn (``e2e.paired_decode``: transformers in a process of its own, started before the
  engine, on both cores while the engine and its actor wait), so that the machine's slow phases, which
  last minutes here, fall on both sides of the ratio; and transformers counted as the verifier is
  (``transformers_fp32_decode_tok_s``: without its prefill and first token);
- transformers fp32 (2 torch threads, sdpa): one-token forward after the same context (median of
  ``--repeats`` after a warm-up);
- llama.cpp (``llamacpp_peer.py`` through ``e2e.llamacpp_rows``, a process of its own): Q8_0 on 2
  threads and Q4_1 on 1, llama.cpp's own eval time per token; null and why if it cannot run.

``goals`` gives each goal's ratio in this run. Writes benchmarks/results/step_cost.json and step_cost.png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from numba import njit

from acceptance import RESULTS, run_args
from cpu_kernel import processor
from e2e import PROMPTS, TransformersPeer, heldout_prompts, llamacpp_rows, paired_decode, transformers_model
from prefill import median_parts, prefill_once
from splitspec.config import EngineConfig, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.kernels import cpu_step
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import NoResidual
from splitspec.quantize.format import ConvertedModel
from splitspec.scheduler.cpus import plan_cpus
from splitspec.scheduler.local import start_local
from verify_pass import verify_rows

CONTEXT = 256
DRAFT_TOKENS = (1, 4)
TOP_K = 4  # the widest rank a draft node's children take in the folder's trees is well under this


def llamacpp_build() -> str | None:
    """The installed llama-cpp-python's version and the CPU features its build uses (its own report, from a
    process of its own): which build the peer rows come from."""
    code = "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return f"llama-cpp-python {done.stdout.strip()}" if done.returncode == 0 else None


def chat_context(tokenizer, n: int = CONTEXT) -> list[int]:
    """The held-out questions (the chats, then the code ones) as the turns of one conversation, as many as
    make ``n`` tokens chat-templated; its last ``n`` tokens, which end where the answer starts."""
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    ordered = [p for p in lines if p["kind"] == "chat"] + [p for p in lines if p["kind"] != "chat"]
    messages: list[dict] = []
    for p in ordered:
        messages += p["messages"]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        if len(ids) >= n:
            return ids[-n:]
    raise SystemExit(f"the held-out prompts make {len(ids)} tokens, fewer than {n}")


def draft_ms(model: SplitModel, cache, tokens: int, repeats: int) -> float:
    """Median ms of one draft forward of ``tokens`` siblings after what ``cache`` holds, top-k included."""
    start = cache.length
    ids = torch.arange(tokens) + 1000
    mask = torch.cat((torch.ones(tokens, start, dtype=torch.bool), torch.eye(tokens, dtype=torch.bool)), dim=1)
    positions = torch.full((tokens,), start)
    times = []
    for _ in range(repeats + 1):  # the first warms the path
        cache.truncate(start)
        t0 = time.perf_counter()
        logits = model.forward(ids, cache, NoResidual(), positions, mask, draft=True)
        logits.topk(TOP_K, dim=-1)
        times.append(time.perf_counter() - t0)
    cache.truncate(start)
    return round(statistics.median(times[1:]) * 1e3, 3)


def breakdown(row: dict) -> dict:
    """A verify row's parts, summing to its total: base, exposed residual wait, channel, attention, head, other."""
    wait = max(row["wait_ms"] - row["channel_ms"], 0.0)
    channel = row["wait_ms"] - wait + row["submit_ms"]
    parts = {
        "base_ms": row["base_ms"],
        "residual_wait_ms": wait,
        "channel_ms": channel,
        "attention_ms": row["attention_ms"],
        "head_ms": row["head_ms"],
    }
    parts["other_ms"] = row["total_ms"] - sum(parts.values())
    return {"total_ms": row["total_ms"], **{k: round(v, 3) for k, v in parts.items()}}


def base_roofline(cpu: int, rounds: int) -> dict:
    """``base_kernel.py``'s result on ``cpu``, run in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "base_kernel.json"
        script = Path(__file__).parent / "base_kernel.py"
        args = [str(script), "--rounds", str(rounds), "--cpu", str(cpu), "--out", str(out)]
        subprocess.run([sys.executable, *args], check=True)
        return json.loads(out.read_text())


@njit(cache=False)
def _compiled_rotations(table, xs, ys, zs, ws):
    """Every group's input rotation and output runs of one pass, as ``cpu_step``'s compiled layers call them."""
    for layer in range(table.shape[0]):
        t = table[layer]
        for g in range(4):
            cpu_step._rotate_rows_in(t, g, cpu_step.NO_NORM, xs[g], ys[g], False)
            cpu_step._rotate_rows_out(t, g, zs[g], ws[g])


def rotation_cost(model: SplitModel, tokens: int, repeats: int, read_gbps: float, sgemm_gflops: float) -> dict:
    """One pass's rotations (every group's input rotation and output runs) on ``tokens`` rows: median ms of
    ``repeats`` in the compiled layers (``ms``, the verify pass's path: one numba call walks them all) and
    op by op (``op_by_op_ms``, ``SplitGroup``'s calls from Python, a prompt's path), and their floor on this
    core, the larger of their bytes at the base kernel's read bandwidth and their flops at its sgemm rate
    (both measured in this run)."""
    calls = []
    for layer in model.layers:
        for g in layer.groups.values():
            calls.append((g.rotate_in, torch.randn(tokens, g.rotate_in.width), tokens))
            calls += [(rot, torch.randn(tokens, count, width), tokens * count) for _, width, count, rot in g.runs]
    flops = sum(rot.work(rows)[0] for rot, _, rows in calls)
    nbytes = sum(rot.work(rows)[1] for rot, _, rows in calls)

    def median_ms(run) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms the path
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3

    def op_by_op() -> None:
        for rot, x, _ in calls:
            rot(x)

    compiled = model._compiled
    xs = tuple(np.random.randn(tokens, d).astype(np.float32) for d in compiled.d_in)
    ys = tuple(np.empty((tokens, d), np.float32) for d in compiled.d_in)
    zs = tuple(np.random.randn(tokens, r).astype(np.float32) for r in compiled.rows)
    ws = tuple(np.empty((tokens, r), np.float32) for r in compiled.rows)
    ms = median_ms(lambda: _compiled_rotations(compiled.table, xs, ys, zs, ws))
    loose = median_ms(op_by_op)
    floor_ms = max(nbytes / (read_gbps * 1e9), flops / (sgemm_gflops * 1e9)) * 1e3
    ratios = {"ratio": round(ms / floor_ms, 2), "op_by_op_ratio": round(loose / floor_ms, 1)}
    return {
        "ms": round(ms, 3),
        "op_by_op_ms": round(loose, 3),
        "floor_ms": round(floor_ms, 4),
        **ratios,
        "calls": len(calls),
    }


def transformers_forward(prompt: list[int], repeats: int) -> float:
    """transformers fp32 (2 threads, sdpa): ms of a one-token forward after ``prompt``, the median of
    ``repeats`` after a warm-up."""
    model = transformers_model()
    step = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        past, token = out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(token, cache=past, use_cache=True)
            step.append(time.perf_counter() - t0)
            past.crop(-1)  # back to the prompt
    return statistics.median(step[1:]) * 1e3


def paired_prefill(engine: SplitEngine, peer: TransformersPeer, prompt: list[int], repeats: int) -> dict:
    """The engine's prefill of ``prompt`` and transformers' (``peer``), in turn, ``repeats`` pairs after a
    warm-up pair: each side's median, the engine's parts (medians), and the ratio per pair. A prefill
    takes a quarter of a second, a slow phase of this VM minutes: taken minutes apart, the two sides'
    medians had moved the ratio by up to a sixth from run to run."""
    ids = torch.tensor(prompt)
    runs = []
    for _ in range(repeats + 1):
        seconds, parts = prefill_once(engine, ids)
        runs.append((seconds, parts, peer.prefill(prompt)))
    runs = runs[1:]
    return {
        "ms": round(statistics.median(s for s, _, _ in runs) * 1e3, 2),
        "parts_ms": median_parts([p for _, p, _ in runs]),
        "transformers_tok_s": len(prompt) / statistics.median(hf for _, _, hf in runs),
        "per_pair_ratio": [round(hf / s, 3) for s, _, hf in runs],
    }


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int, repeats: int, rounds: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.eos_token_id
    context = chat_context(tokenizer)
    prompts = heldout_prompts(tokenizer, n_prompts)
    config = EngineConfig(resident_bytes=0, spec=SpecConfig(mode="off"))
    engine_cpus, _ = plan_cpus(1, None, config)
    t0 = time.perf_counter()
    base = base_roofline(engine_cpus[0] if engine_cpus else max(os.sched_getaffinity(0)), rounds)
    print(f"base kernel: {[round(r['ratio'], 2) for r in base['rows']]} x roofline", flush=True)
    converted = ConvertedModel(folder)
    with TransformersPeer() as peer, start_local(folder, bits, n_cpu_actors=1, config=config) as engine:
        model = engine.model
        cache = engine.new_cache()
        _, _, path = engine.prefill(torch.tensor(context), cache)
        draft = {str(n): draft_ms(model, cache, n, repeats) for n in DRAFT_TOKENS}
        print(f"draft: {draft} ms", flush=True)
        rows = verify_rows(converted, model, engine.residual, cache, repeats)
        rates = (base["read_gbps"], base["sgemm_gflops"])
        rotation = {str(n): rotation_cost(model, n, repeats, *rates) for n in (1, 16)}
        print(f"rotations per pass: {rotation}", flush=True)
        prefill_pairs = paired_prefill(engine, peer, context, repeats)
        prefill, prefill_split, hf_prefill = (prefill_pairs[k] for k in ("ms", "parts_ms", "transformers_tok_s"))
        print(f"prefill: {prefill} ms ({path}): {prefill_split}; transformers {hf_prefill:.0f} tok/s (in turn)")
        decode = paired_decode(engine, peer, prompts, new_tokens, eos)
        verifier_tok_s, hf_tok_s = decode["verifier_tok_s"], decode["transformers_tok_s"]
        print(f"verifier alone: {verifier_tok_s:.1f} tok/s, transformers {hf_tok_s:.1f} (in turn)", flush=True)
        actor_cpus = engine.actors[0].ready["cpus"]
        head_bytes = {
            f"verifier_{config.head}": model.lm_head.numel() * model.lm_head.element_size()
            if model.head is None
            else model.head.nbytes,
            "draft": model.draft_head.nbytes if model.draft_head is not None else None,
        }
    hf_ms = transformers_forward(context, repeats)
    print(f"transformers fp32: {hf_ms:.1f} ms a token, {hf_tok_s:.1f} tok/s, prefill {hf_prefill:.0f} tok/s")
    peers, peer_note = llamacpp_rows(folder, n_prompts, new_tokens)

    def peer_ms(quant: str, threads: int) -> float | None:
        row = next((r for r in peers or [] if r["quant"] == quant and r["threads"] == threads), None)
        return row["token_ms"] if row else None

    q8, q4 = peer_ms("q8_0", 2), peer_ms("q4_1", 1)
    verify = {str(r["n"]): r["total_ms"] for r in rows}
    ratio = {str(r["n"]): round(r["ratio"], 3) for r in base["rows"]}
    prefill_tok_s = CONTEXT / prefill * 1e3
    return {
        "folder": str(folder),
        "bits": bits,
        "context_tokens": CONTEXT,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "processor": processor(),
        "engine_cpus": engine_cpus,
        "actor_cpus": actor_cpus,
        "draft_ms": draft,
        "draft_form": f"one tree level of n siblings, draft head, top-{TOP_K}",
        "verify_ms": verify,
        "breakdown": {str(r["n"]): breakdown(r) for r in rows},
        "verify_rows": rows,
        "base_roofline_ratio": ratio,
        "rotation_per_pass": rotation,
        "base_kernel": {k: base[k] for k in ("read_gbps", "sgemm_gflops", "bytes", "weights", "kernel", "cpu")},
        "base_kernel_rows": [
            {k: r[k] for k in ("n", "ms", "roofline_ms", "ratio", "best_ratio")} for r in base["rows"]
        ],
        "verifier_tok_s": round(verifier_tok_s, 3),
        "transformers_fp32_ms": round(hf_ms, 3),
        "transformers_fp32_tok_s": round(hf_tok_s, 3),
        # counted as the verifier is: tokens after the first over the time after it (``paired_decode``)
        "transformers_fp32_decode_tok_s": round(decode["transformers_decode_tok_s"], 3),
        "decode_ratio_per_prompt": decode["per_prompt_ratio"],
        "llamacpp_q8_2thread_ms": q8,
        "llamacpp_q4_1thread_ms": q4,
        "llamacpp_rows": peers,
        "llamacpp_note": peer_note,
        "llamacpp_build": llamacpp_build(),
        "llamacpp_models": "Q4_1: the GGUF the model ships as; Q8_0: llama.cpp's quantizer on it (llamacpp_peer.py)",
        "prefill_tok_s": round(prefill_tok_s, 2),
        "prefill_path": path,
        "prefill_parts_ms": prefill_split,
        "prefill_ratio_per_pair": prefill_pairs["per_pair_ratio"],
        "resident_bytes": config.resident_bytes,
        "transformers_fp32_prefill_tok_s": round(hf_prefill, 2),
        "head_bytes": head_bytes,
        "goals": {
            "draft_1_over_q4_1thread": round(draft["1"] / q4, 3) if q4 else None,
            "verify_1_over_2x_q8_2thread": round(verify["1"] / (2 * q8), 3) if q8 else None,
            "base_roofline_ratio_max": max(ratio.values()),
            "verifier_over_transformers_tok_s": round(verifier_tok_s / hf_tok_s, 3),
            "verifier_over_transformers_decode_tok_s": round(verifier_tok_s / decode["transformers_decode_tok_s"], 3),
            "prefill_over_transformers_prefill": round(prefill_tok_s / hf_prefill, 3),
            "targets": "draft <= 1, verify <= 1, roofline <= 1.5, decode >= 3, prefill >= 1",
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average": list(os.getloadavg()),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"draft {n}" for n in result["draft_ms"]] + [f"verify {n}" for n in result["breakdown"]]
    parts = ["base_ms", "residual_wait_ms", "channel_ms", "attention_ms", "head_ms", "other_ms"]
    left.bar(labels[: len(result["draft_ms"])], list(result["draft_ms"].values()), color="gray", label="draft step")
    bottom = [0.0] * len(result["breakdown"])
    for part in parts:
        values = [b[part] for b in result["breakdown"].values()]
        left.bar(labels[len(result["draft_ms"]) :], values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for value, style, name in (
        (result["llamacpp_q4_1thread_ms"], ":", "llama.cpp Q4_1, 1 thread"),
        (result["llamacpp_q8_2thread_ms"], "--", "llama.cpp Q8_0, 2 threads"),
        (result["transformers_fp32_ms"], "-.", "transformers fp32, 2 threads"),
    ):
        if value:
            left.axhline(value, color="k", ls=style, lw=1, label=name)
    left.set_ylabel("ms per forward (median)")
    left.set_title(f"after a {result['context_tokens']}-token chat context", fontsize=9)
    left.tick_params(axis="x", labelsize=7, rotation=30)
    left.legend(fontsize=7)
    goals = result["goals"]
    names = ["draft / Q4_1", "verify / 2xQ8_0", "base / roofline", "3x hf decode / decode", "hf prefill / prefill"]
    values = [
        goals["draft_1_over_q4_1thread"] or 0.0,
        goals["verify_1_over_2x_q8_2thread"] or 0.0,
        goals["base_roofline_ratio_max"] / 1.5,
        3 / goals["verifier_over_transformers_tok_s"],
        1 / goals["prefill_over_transformers_prefill"],
    ]
    right.bar(names, values, color=["C2" if v <= 1 else "C3" for v in values])
    right.axhline(1.0, color="k", lw=1)
    right.set_ylabel("measured / goal (≤ 1 meets it)")
    right.set_title("goals", fontsize=9)
    right.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = run_args(__doc__.split("\n\n")[0], 64, RESULTS / "step_cost.json")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=5, help="base_kernel.py's rounds")
    args = parser.parse_args()
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens, args.repeats, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["goals"], indent=2))


if __name__ == "__main__":
    main()
