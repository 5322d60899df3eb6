"""The verifier's lm_head in int16 and bf16 (``EngineConfig.head``) against fp32: each one's cost per pass and
what it does to the logits, to choose the default.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/head_precision.py [--converted FOLDER]
        [--bits 8] [--sequences N] [--repeats 30] [--out PATH]

FOLDER is a converted model (default: the one ``make demo`` converts). Two parts:

- time: the final norm's output times each head (``gpu_actor.heads.verifier_head``: the tiled fp32 product,
  ``Int16Head``, ``Bf16Head``) for 1-16 rows on one torch and numba thread, best and median thread-CPU ms of
  ``--repeats`` after a warm-up (the thread's own CPU time, so that other processes on this shared machine
  inflate it less than a wall clock);
- quality: the evaluation split (``quality.py``'s default ``--split eval``), scored by the reference with
  the decoder Linears replaced by the converted folder's ``--bits`` verifier weights (what the split
  verifier computes, up to fp32 rounding: ``tests/test_gpu_actor_model.py``), once with each head.
  KL(fp32 reference ‖ row) per scored token for both rows, the top-1 mismatch against the reference, and
  the paired-bootstrap 95% CI of KL(head) − KL(fp32 head) over whole sequences for int16 and bf16.

Writes benchmarks/results/head_precision.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import torch

from acceptance import DEMO, RESULTS
from quality import paired_bootstrap, swap
from splitspec.config import VERIFIER_HEADS, DataConfig, ModelConfig
from splitspec.gpu_actor.heads import verifier_head
from splitspec.models.data import evaluation_sequences, make_split
from splitspec.models.loader import load_reference
from splitspec.quantize.format import ConvertedModel

TOKENS = (1, 2, 4, 8, 16)


def head_ms(heads: dict, hidden: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{head: {n: [best, median] thread-CPU ms}} of the head product on n rows, one torch thread."""
    threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in heads}
    for n in TOKENS:
        h = torch.randn(n, hidden)
        for name, head in heads.items():
            head(h)
            times = []
            for _ in range(repeats):
                t0 = time.thread_time()
                head(h)
                times.append(time.thread_time() - t0)
            out[name][str(n)] = [round(min(times) * 1e3, 3), round(statistics.median(times) * 1e3, 3)]
    torch.set_num_threads(threads[0])
    numba.set_num_threads(threads[1])
    return out


def quality(cm: ConvertedModel, bits: int, sequences: int | None) -> dict:
    """KL(fp32 reference ‖ verifier with each head) on the evaluation split, per token and per sequence."""
    source = cm.manifest["source"]["path"]
    model, tokenizer, _ = load_reference(ModelConfig(source=source, num_layers=cm.spec.n_layers))
    data = DataConfig()
    seqs = evaluation_sequences(make_split(data), tokenizer, data)[:sequences]
    verifier = {
        f"model.layers.{i}.{name}": w
        for i in range(cm.spec.n_layers)
        for g in cm.spec.groups
        for name, w in cm.linear_weights(i, g.name, bits).items()
    }
    original = {k: model.get_submodule(k).weight.data for k in verifier}
    weight = model.lm_head.weight.detach().float()
    heads = {"fp32": lambda h: h @ weight.T} | {n: verifier_head(weight, n) for n in VERIFIER_HEADS if n != "fp32"}
    kl = {name: np.zeros(len(seqs)) for name in heads}
    mism = {name: np.zeros(len(seqs)) for name in heads}
    counts = np.array([s.num_scored for s in seqs], dtype=np.float64)
    with torch.no_grad():
        for j, seq in enumerate(seqs):
            swap(model, original)
            hidden = model.model(seq.input_ids[None]).last_hidden_state[0, seq.score_mask].float()
            ref = torch.log_softmax(hidden @ weight.T, dim=-1)
            swap(model, verifier)
            hidden = model.model(seq.input_ids[None]).last_hidden_state[0, seq.score_mask].float()
            for name, head in heads.items():
                lp = torch.log_softmax(head(hidden), dim=-1)
                kl[name][j] = float((ref.exp() * (ref - lp)).sum())
                mism[name][j] = float((lp.argmax(-1) != ref.argmax(-1)).sum())
            print(f"sequence {j + 1}/{len(seqs)}: " + ", ".join(f"{n}={kl[n][j] / counts[j]:.6f}" for n in heads))
    total = counts.sum()
    return {
        "rows": [
            {"head": name, "kl": kl[name].sum() / total, "top1_mismatch": mism[name].sum() / total} for name in heads
        ],
        "kl_minus_fp32_ci95": {n: paired_bootstrap(kl[n], kl["fp32"], counts) for n in heads if n != "fp32"},
        "tokens": int(total),
        "sequences": len(seqs),
        "per_sequence": {"tokens": counts.astype(int).tolist(), "kl_sum": {n: kl[n].tolist() for n in heads}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", type=Path, default=DEMO)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=None, help="score only the first N (smoke runs)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "head_precision.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    cm = ConvertedModel(args.converted)
    weight = cm.head_weight().float()
    heads = {name: verifier_head(weight, name) for name in VERIFIER_HEADS}
    timing = head_ms(heads, weight.shape[1], args.repeats)
    print(json.dumps(timing))
    del weight
    torch.set_num_threads(2)
    result = {
        "converted": str(cm.folder),
        "bits": args.bits,
        "head_bytes": {n: h.nbytes for n, h in heads.items()},
        "head_ms_best_median": timing,
        "timing": "thread-CPU ms of the head product alone, one torch thread, best and median of the repeats",
        **quality(cm, args.bits, args.sequences),
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average": list(os.getloadavg()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("rows", "kl_minus_fp32_ci95", "tokens")}, indent=2))


if __name__ == "__main__":
    main()
