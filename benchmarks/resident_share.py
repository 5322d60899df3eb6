"""The engine's share of the residual on a CPU engine: what a verify pass and decoding gain when the engine
keeps the first rows of every group (``EngineConfig.resident_bytes``) and multiplies them in its compiled
pass while it would otherwise wait for the CPU actor.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/resident_share.py [FOLDER] [--bits 8]
        [--shares 0 0.15 0.3 0.45] [--rounds 2] [--prompts 4] [--new-tokens 64] [--repeats 15] [--prefills 5]

Per round, the shares in turn (so that a slow phase of the machine falls on all of them), each an engine as
``start_local`` starts it with one CPU actor started with the same figure, speculation off: the verify
pass for 1-16 tokens after ``step_cost``'s 256-token chat context (``verify_pass.verify_rows``), then
decode tok/s over ``--prompts`` held-out prompts × ``--new-tokens`` greedy tokens (as ``e2e.py`` counts
it), then the prefill of that context (``prefill.prefill_once``, the median of ``--prefills``, the path the
engine picks): the rows the engine holds are multiplied by the engine in a prompt's pass too, and there
the engine is the longer side. Each share's row is the median over rounds; ``verify_1_over_none`` is its
1-token pass over the share 0 row's. Writes benchmarks/results/resident_share.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from acceptance import RESULTS, run_args
from cpu_kernel import processor
from e2e import heldout_prompts, run_prompts
from prefill import prefill_once
from splitspec.config import EngineConfig, SpecConfig
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.packing import residual_nbytes
from splitspec.scheduler.local import start_local
from step_cost import chat_context
from verify_pass import verify_rows


def one(
    converted: ConvertedModel, bits: int, share: float, total: int, context, prompts, new_tokens, eos, repeats, prefills
) -> dict:
    config = EngineConfig(resident_bytes=int(share * total), spec=SpecConfig(mode="off"))
    with start_local(converted.folder, bits, n_cpu_actors=1, config=config) as engine:
        cache, prompt = engine.new_cache(), torch.tensor(context)
        engine.prefill(prompt, cache)
        rows = verify_rows(converted, engine.model, engine.residual, cache, repeats)
        outputs, checks = run_prompts(engine, prompts, new_tokens, eos)
        prefill_s = statistics.median(prefill_once(engine, prompt)[0] for _ in range(prefills))
        held_bytes = engine.device_residual.resident_nbytes if engine.device_residual is not None else 0
    return {
        "verify_ms": {str(r["n"]): r["total_ms"] for r in rows},
        "actor_ms": {str(r["n"]): r["residual_ms"] for r in rows},
        "tok_s": 1e3 * sum(len(o) - 1 for o in outputs) / sum(c.total_ms for c in checks),
        "held_bytes": held_bytes,
        "prefill_ms": 1e3 * prefill_s,
        "prefill_tok_s": len(context) / prefill_s,
    }


def main() -> None:
    parser = run_args(__doc__, 64, RESULTS / "resident_share.json")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.15, 0.3, 0.45])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefills", type=int, default=5)
    parser.set_defaults(prompts=4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    converted = ConvertedModel(args.folder)
    total = sum(residual_nbytes(g.rows, g.d_in, args.bits) for layer in converted.layers for g in layer.values())
    context, prompts = chat_context(tokenizer), heldout_prompts(tokenizer, args.prompts)
    t0 = time.perf_counter()
    runs: dict[float, list[dict]] = {share: [] for share in args.shares}
    for r in range(args.rounds):
        for share in args.shares:
            row = one(converted, args.bits, share, total, context, prompts, args.new_tokens,
                      tokenizer.eos_token_id, args.repeats, args.prefills)  # fmt: skip
            runs[share].append(row)
            print(f"round {r} share {share}: verify {row['verify_ms']} ms, {row['tok_s']:.1f} tok/s, "
                  f"prefill {row['prefill_ms']:.0f} ms", flush=True)  # fmt: skip

    def med(rows: list[dict], key: str) -> dict | float:
        if isinstance(rows[0][key], dict):
            return {n: round(statistics.median(x[key][n] for x in rows), 3) for n in rows[0][key]}
        return round(statistics.median(x[key] for x in rows), 3)

    table = [
        {
            "share": s,
            "held_bytes": rows[0]["held_bytes"],
            **{k: med(rows, k) for k in ("verify_ms", "actor_ms", "tok_s", "prefill_ms", "prefill_tok_s")},
        }
        for s, rows in runs.items()
    ]
    none = next((row for row in table if row["share"] == 0), None)
    for row in table:
        row["verify_1_over_none"] = round(row["verify_ms"]["1"] / none["verify_ms"]["1"], 3) if none else None
    result = {
        "folder": str(args.folder),
        "bits": args.bits,
        "residual_bytes": total,
        "processor": processor(),
        "rounds": args.rounds,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "rows": table,
        "runs": {str(s): rows for s, rows in runs.items()},
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average": list(os.getloadavg()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
