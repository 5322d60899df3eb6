"""End-to-end decode speed: the verifier alone, fixed drafts, the cost model's choice, and a peer.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/e2e.py [FOLDER] [--prompts 8] [--new-tokens 64]

One engine as ``splitspec generate`` starts it (a real CPU actor process serving the 8-bit residual, the
engine and the actor pinned to different cores), the same held-out prompts (``prompts/heldout.jsonl``:
chat and code the project never tuned on) and the same cores for every row. Per row, decode tok/s is the
tokens after the first divided by the time of the checks that made them (prefill excluded), over all
prompts. The fixed drafts are 2-bit chains and trees, and ``ngram``: drafts copied from the text, up to
16 tokens a check (``--draft ngram``). ``predicted_tok_s`` is the cost model's figure for the row's draft
from the costs this engine measured at start and the folder's fitted statistics (the rank statistics, and
the n-gram draft's replay on the tree split). The cost model's choice is a row of its own unless it
is a draft measured above (the verifier alone, a fixed one): that row then stands for it (``same_as``),
since timing one configuration twice compares the machine's drift, not the choice (on this VM two runs
of one shape came 19% apart). Every row's greedy text is compared with the
verifier alone's: where they part, the verifier alone's top-2 logits there decide whether it is a
near-tie (gap < 1e-4, either token is right) or a mismatch.

The peers: transformers' fp32 ``generate`` of the reference model on the same prompts (2 torch threads,
sdpa, after one warm-up; wall time over new tokens), and llama.cpp's Q8_0 on 2 threads
(``llamacpp_peer.py``) when llama-cpp-python is installed (the ``bench`` extra; it compiles from
source), else null with the reason.

Writes benchmarks/results/e2e.json and e2e.png.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from acceptance import RESULTS, run_args
from splitspec.config import EngineConfig, ModelConfig, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.models.loader import load_reference
from splitspec.scheduler.cost import chain, evaluate, evaluate_ngram
from splitspec.scheduler.local import start_local

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"
FIXED = [("chain1", "chain", 1), ("chain2", "chain", 2), ("chain4", "chain", 4), ("tree4", "tree", 4)]
FIXED += [("tree16", "tree", 16)]
NEAR_TIE = 1e-4
BREAKDOWN = (
    "draft_ms",
    "verify_ms",
    "base_ms",
    "residual_wait_ms",
    "channel_ms",
    "attention_ms",
    "head_ms",
    "total_ms",
)


def heldout_prompts(tokenizer, n: int) -> list[list[int]]:
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    chat, code = [p for p in lines if p["kind"] == "chat"], [p for p in lines if p["kind"] == "code"]
    mixed = [p for pair in zip(chat, code, strict=False) for p in pair][:n]
    return [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)["input_ids"] for p in mixed]


def _gap(engine: SplitEngine, ids: list[int]) -> float:
    logits, _, _ = engine.prefill(torch.tensor(ids), engine.new_cache())
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


def run_prompts(engine: SplitEngine, prompts: list[list[int]], new_tokens: int, eos: int) -> tuple[list, list]:
    outputs, checks = [], []
    for prompt in prompts:
        tokens, stats = engine.generate(prompt, new_tokens, eos)
        outputs.append(tokens)
        checks += stats.checks
    return outputs, checks


def transformers_model():
    """The reference model in fp32 as the peer runs it: 2 torch threads, sdpa attention."""
    torch.set_num_threads(2)
    model, _, _ = load_reference(ModelConfig())
    model.config._attn_implementation = "sdpa"
    return model


def _transformers_generate(model, prompt: list[int], new_tokens: int, eos: int) -> tuple[int, float]:
    """(new tokens, seconds) of one greedy ``generate``."""
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


def transformers_prefill_s(model, prompt: list[int]) -> float:
    """Seconds of one forward of ``prompt`` that fills a fresh cache (a prefill), the head for the last
    position alone, as ``generate``'s prefill and the engine's compute it (``logits_to_keep``): the head over
    every position would cost the peer work that no prefill does."""
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def transformers_tok_s(prompts: list[list[int]], new_tokens: int, eos: int) -> float:
    model = transformers_model()
    _transformers_generate(model, prompts[0], new_tokens, eos)  # the warm-up
    runs = [_transformers_generate(model, prompt, new_tokens, eos) for prompt in prompts]
    return sum(new for new, _ in runs) / sum(seconds for _, seconds in runs)


def _transformers_worker(conn, cpus: set[int]) -> None:
    """``TransformersPeer``'s process: the reference model on ``cpus`` with 2 threads; answers each job,
    ("generate", prompt, new tokens, eos) with (new tokens, seconds of its ``generate``), ("prefill", prompt)
    with the seconds of its prefill."""
    os.sched_setaffinity(0, cpus)  # a child of a pinned engine would inherit its one core
    model = transformers_model()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        kind, *args = job
        run = _transformers_generate if kind == "generate" else transformers_prefill_s
        conn.send(run(model, *args))


class TransformersPeer:
    """transformers fp32 in a process of its own, as ``transformers_tok_s`` runs it, one prompt at a time on
    request: so that a benchmark can take its prompts in turn with the engine's (``paired_decode``) and a
    slow phase of the machine falls on both. Start it before the engine pins this process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_transformers_worker, args=(child, os.sched_getaffinity(0)), daemon=True)
        self._process.start()
        # loading the model takes both cores for seconds: nothing may be timed until it is done
        if self._conn.recv() != "ready":
            raise RuntimeError("the transformers peer did not start")

    def generate(self, prompt: list[int], new_tokens: int, eos: int) -> tuple[int, float]:
        self._conn.send(("generate", prompt, new_tokens, eos))
        return self._conn.recv()

    def prefill(self, prompt: list[int]) -> float:
        """Seconds of one prefill of ``prompt`` (``transformers_prefill_s``)."""
        self._conn.send(("prefill", prompt))
        return self._conn.recv()

    def __enter__(self) -> TransformersPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def paired_decode(
    engine: SplitEngine, peer: TransformersPeer, prompts: list[list[int]], new_tokens: int, eos: int
) -> dict:
    """Each prompt through the engine, then through transformers, in turn (the first prompt once more
    before, as both sides' warm-up): tok/s of each side over all prompts as ``run_prompts`` and
    ``transformers_tok_s`` count them, and the ratio of the two per prompt.

    The two count differently, as the engine fast-path issue defines them: the engine's decode tok/s is its
    tokens after the first over its checks' time, transformers' the new tokens over ``generate``'s wall
    time, its prefill and first token included. ``transformers_decode_tok_s`` counts transformers as the
    engine is counted: tokens after the first over ``generate``'s time less a one-token ``generate`` of the
    same prompt (its prefill and first token)."""
    engine.generate(prompts[0], new_tokens, eos)
    peer.generate(prompts[0], new_tokens, eos)
    made = check_ms = hf_new = hf_s = hf_first_s = 0.0
    ratios = []
    for prompt in prompts:
        tokens, stats = engine.generate(prompt, new_tokens, eos)
        ms = sum(c.total_ms for c in stats.checks)
        new, seconds = peer.generate(prompt, new_tokens, eos)
        hf_first_s += peer.generate(prompt, 1, eos)[1]
        made, check_ms, hf_new, hf_s = made + len(tokens) - 1, check_ms + ms, hf_new + new, hf_s + seconds
        ratios.append(((len(tokens) - 1) / ms * 1e3) / (new / seconds))
    return {
        "verifier_tok_s": 1e3 * made / check_ms,
        "transformers_tok_s": hf_new / hf_s,
        "transformers_decode_tok_s": (hf_new - len(prompts)) / (hf_s - hf_first_s),
        "per_prompt_ratio": [round(r, 3) for r in ratios],
    }


def llamacpp_tok_s(folder: Path, n_prompts: int, new_tokens: int) -> tuple[float | None, str]:
    """llama.cpp Q8_0 on 2 threads on the same prompts (``llamacpp_rows``), or None and why."""
    rows, note = llamacpp_rows(folder, n_prompts, new_tokens)
    if rows is None:
        return None, note
    row = next(r for r in rows if r["quant"] == "q8_0" and r["threads"] == 2)
    return row["tok_s"], note


def llamacpp_rows(folder: Path, n_prompts: int, new_tokens: int) -> tuple[list[dict] | None, str]:
    """``llamacpp_peer.py``'s rows on the same prompts, run in a process of its own (a crash of the native
    library must not take this run with it), or None and why."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, 'llama-cpp-python is not installed (pip install -e ".[bench]" builds it from source)'
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        script = Path(__file__).parent / "llamacpp_peer.py"
        args = [str(folder), "--prompts", str(n_prompts), "--new-tokens", str(new_tokens), "--out", str(out)]
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
        if done.returncode < 0:
            return None, f"llamacpp_peer.py was killed by signal {-done.returncode} (see benchmarks/README.md)"
        if done.returncode != 0:
            return None, f"llamacpp_peer.py failed: {done.stderr.strip().splitlines()[-1:]}"
        rows = json.loads(out.read_text())["rows"]
    return rows, "llama.cpp's eval time per token, best of 3 per prompt, median over prompts"


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int, device: str = "cpu") -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.eos_token_id
    prompts = heldout_prompts(tokenizer, n_prompts)
    config = EngineConfig(device=device, spec=SpecConfig(mode="auto", draft_max=16))
    with start_local(folder, bits, config=config) as engine:
        costs = engine.check_costs()
        chosen = engine.draft_shape()
        if engine.ngram is None:
            raise SystemExit(f"{folder} has no n-gram statistics: run `splitspec fit-tree {folder}` again")
        fitted = {"tree_stats": engine.tree_stats, "ngram": engine.ngram}

        def view(spec: SpecConfig) -> SplitEngine:
            return SplitEngine(engine.model, engine.residual, EngineConfig(device=device, spec=spec), **fitted)

        alone = view(SpecConfig(mode="off"))
        views = {"verifier": (evaluate(chain(0), engine.tree_stats, costs), alone)}
        for name, mode, size in FIXED:
            fixed = view(SpecConfig(mode=mode, draft_max=size))
            views[name] = (evaluate(fixed.draft_shape(), engine.tree_stats, costs), fixed)
        views["ngram"] = (evaluate_ngram(engine.ngram, costs, 16), view(SpecConfig(mode="ngram", draft_max=16)))
        views["chosen"] = (chosen, engine)
        rows, texts, breakdown = [], {}, {}
        for name, (predicted, runner) in views.items():
            same = next((r for r in rows if r["shape"] == predicted.name), None) if name == "chosen" else None
            if same is not None:  # the choice is a draft measured above: the same engine, so its row
                rows.append({**same, "config": name, "same_as": same["config"]})
                texts[name], breakdown[name] = texts[same["config"]], breakdown[same["config"]]
                print(rows[-1], flush=True)
                continue
            outputs, checks = run_prompts(runner, prompts, new_tokens, eos)
            texts[name] = outputs
            decode_ms = sum(c.total_ms for c in checks)
            made = sum(len(o) - 1 for o in outputs)
            rows.append(
                {
                    "config": name,
                    "shape": predicted.name,
                    "measured_tok_s": round(1e3 * made / decode_ms, 3),
                    "predicted_tok_s": round(predicted.tok_s, 3),
                    "tokens_per_check": round(sum(c.accepted + 1 for c in checks) / len(checks), 3),
                    "predicted_tokens_per_check": round(predicted.tokens_per_check, 3),
                }
            )
            n = len(checks)
            breakdown[name] = {k: round(sum(getattr(c, k) for c in checks) / n, 3) for k in BREAKDOWN}
            print(rows[-1], flush=True)
        mismatches = near_ties = 0
        for name in views:
            for prompt, ours, theirs in zip(prompts, texts[name], texts["verifier"], strict=True):
                t = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
                if t is None:
                    continue
                if _gap(alone, prompt + theirs[:t]) < NEAR_TIE:
                    near_ties += 1
                else:
                    mismatches += 1
    by = {r["config"]: r["measured_tok_s"] for r in rows}
    best_fixed = max(by[name] for name in views if name not in ("verifier", "chosen"))
    peer = transformers_tok_s(prompts, new_tokens, eos)
    llamacpp, llamacpp_note = llamacpp_tok_s(folder, n_prompts, new_tokens)
    prediction_error = max(abs(r["predicted_tok_s"] / r["measured_tok_s"] - 1) for r in rows)
    return {
        "folder": str(folder),
        "bits": bits,
        "device": device,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "rows": rows,
        "chosen": chosen.name,
        "verifier_tok_s": by["verifier"],
        "chosen_tok_s": by["chosen"],
        "best_fixed_tok_s": best_fixed,
        "pipelined_tok_s": None,
        "transformers_fp32_tok_s": round(peer, 3),
        "llamacpp_q8_2thread_tok_s": llamacpp,
        "llamacpp_note": llamacpp_note,
        "mismatches": mismatches,
        "near_ties": near_ties,
        "breakdown": breakdown,
        "costs": {
            "verify_ms": dict(costs.verify.points),
            "draft_ms": dict(costs.draft.points),
            "overhead_ms": round(costs.overhead_ms, 3),
        },
        "goals": {
            "no_mismatch": mismatches == 0,
            "chosen_within_10pct_of_best_fixed": by["chosen"] >= 0.9 * best_fixed,
            "chosen_not_slower_than_verifier": by["chosen"] >= by["verifier"],
            "prediction_max_relative_error": round(prediction_error, 3),
            "prediction_within_25pct": prediction_error <= 0.25,
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_tok_s"] for r in rows], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_tok_s"] for r in rows], width=0.4, label="cost model")
    ax.axhline(result["transformers_fp32_tok_s"], color="gray", ls="--", label="transformers fp32")
    ax.set_xticks(list(xs), [f"{r['config']}\n{r['shape']}" for r in rows], fontsize=8)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"SmolLM2-135M, {result['bits']}-bit residual, {result['prompts']} prompts x {result['new_tokens']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = run_args(__doc__.splitlines()[0], 64, RESULTS / "e2e.json")
    parser.add_argument("--device", default="cpu", help="where the engine runs: cpu, cuda or cuda:N")
    args = parser.parse_args()
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens, args.device)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["goals"], indent=2))


if __name__ == "__main__":
    main()
