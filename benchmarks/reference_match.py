"""How close the split verifier's logits are to the dequantized reference over the whole default model.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/reference_match.py [FOLDER] [--bits 8]
        [--prompts 4] [--new-tokens 8]

The tests hold the verifier to transformers on 2-layer and tiny models; this runs every layer of a
converted folder (by default the demo's, SmolLM2-135M's 30 layers). For each held-out chat prompt
(``prompts/heldout.jsonl``), transformers' forward of the dequantized weights (``quantize.reference``)
decodes ``--new-tokens`` greedy tokens and scores the whole sequence once; the verifier prefills the
prompt and then takes the same tokens one by one through its KV cache. Both phases are compared row by
row: max |Δlogit|, that over the largest |logit| of the row's block, and whether the argmax agrees. The
residual runs in this process on the CPU actors' own shard code (``LocalResidual``), with x' in fp32 and
rounded to int16 (the CPU kernel's default), so the two rows separate the forward pass's fp32 rounding
from the activation rounding.

Writes benchmarks/results/reference_match.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from acceptance import DEMO, RESULTS
from e2e import heldout_prompts
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.reference import dequantized_reference

MODES = ("fp32", "int16")


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = (got - ref).abs().max().item()
    return {
        "max_abs": err,
        "rel": err / ref.abs().max().item(),
        "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def _worst(rows: list[dict[str, float]]) -> dict[str, float]:
    return {
        "max_abs": max(r["max_abs"] for r in rows),
        "rel": max(r["rel"] for r in rows),
        "argmax_agree": min(r["argmax_agree"] for r in rows),
    }


def _reference_sequence(reference, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt + greedy tokens, the reference's logits at every position of it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        full = torch.tensor(ids)
        return full, reference(full[None]).logits[0]


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int) -> dict:
    converted = ConvertedModel(folder)
    source = converted.manifest["source"]["path"]
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the converter saves the source's beside the weights
    reference = dequantized_reference(converted, source, bits)
    prompts = heldout_prompts(tokenizer, n_prompts)
    sequences = [_reference_sequence(reference, p, new_tokens) for p in prompts]
    del reference
    split = SplitModel(converted)
    rows = []
    for mode in MODES:
        residual = LocalResidual.load(folder, bits, activations=mode)
        prefill, decode = [], []
        for prompt, (full, ref) in zip(prompts, sequences, strict=True):
            cache, n = split.new_cache(len(full)), len(prompt)
            prefill.append(_compare(split.forward(full[:n], cache, residual), ref[:n]))
            steps = [split.forward(full[t : t + 1], cache, residual) for t in range(n, len(full) - 1)]
            decode.append(_compare(torch.cat(steps), ref[n : len(full) - 1]))
        rows.append({"activations": mode, "prefill": _worst(prefill), "decode": _worst(decode)})
        rows[-1]["per_prompt"] = [{"prefill": p, "decode": d} for p, d in zip(prefill, decode, strict=True)]
    return {
        "folder": str(folder),
        "conversion_id": converted.conversion_id,
        "layers": len(converted.layers),
        "bits": bits,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "decode_steps_per_prompt": new_tokens - 1,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "reference_match.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([{k: r[k] for k in ("activations", "prefill", "decode")} for r in result["rows"]], indent=2))


if __name__ == "__main__":
    main()
