"""What logit shaping costs speculation (penalties, a JSON schema): tokens per check and tok/s against plain.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/shaping.py [FOLDER] [--prompts 8]

Greedy generation of up to ``--new-tokens`` tokens per prompt, (the evaluation split's first turns, as
in ``acceptance.py``), ending at the model's end of turn, through the split verifier with the exact-KV
16-node tree, the residual computed in this process on the engine's one thread, under each of
``CONFIGS`` in turn for each prompt:

- ``plain``: no shaping;
- ``penalties``: ``PENALTIES``, each tree node shaped along its path, the draft's rows too;
- ``json schema``: the text must follow ``SCHEMA`` (``gpu_actor.grammar``), masked the same way;
- each of those with the draft ranking its raw logits (``draft unshaped``, an ablation: why
  ``draft_tree`` shapes its rows), and through the verifier alone: the reference each text must equal
  (a tree pass sums in another order, so a near-tie may part them).

Decode tok/s counts the tokens after the first and the time after the prefill. Apart, the median ms of
shaping one row (``Shaping.apply``): penalties, and the schema inside the answer's string.

Writes benchmarks/results/shaping.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import splitspec.gpu_actor.speculative as speculative
from acceptance import eval_prompts
from large_model import DEMO
from splitspec.config import EngineConfig, SamplingParams, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import LocalResidual
from splitspec.models.spec import end_ids
from splitspec.quantize.format import ConvertedModel

RESULTS = Path(__file__).parent / "results"
PENALTIES = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON = SamplingParams(json_schema=json.dumps(SCHEMA))
# name: (its params, its draft ranks shaped rows, the verifier alone instead of the tree)
CONFIGS = {
    "plain": (SamplingParams(), True, False),
    "plain, verifier alone": (SamplingParams(), True, True),
    "penalties": (PENALTIES, True, False),
    "penalties, draft unshaped": (PENALTIES, False, False),
    "penalties, verifier alone": (PENALTIES, True, True),
    "json schema": (JSON, True, False),
    "json schema, draft unshaped": (JSON, False, False),
    "json schema, verifier alone": (JSON, True, True),
}


def _draft_unshaped(model, cache, root, shape, p_min=0.0, shaping=None):
    return _DRAFT_TREE(model, cache, root, shape, p_min)


_DRAFT_TREE = speculative.draft_tree


def measure(folder: Path, bits: int, n_prompts: int, new_tokens: int) -> dict:
    converted = ConvertedModel(folder)
    fitted = converted.tree_stats()
    if fitted is None:
        raise SystemExit(f"{folder} has no tree statistics: run `splitspec fit-tree {folder}`")
    model, residual = SplitModel(converted), LocalResidual.load(folder, bits)
    config = EngineConfig(spec=SpecConfig(mode="tree", draft_max=16))
    tree = SplitEngine(model, residual, config, tree_stats=fitted["p"])
    alone = SplitEngine(model, residual, EngineConfig(spec=SpecConfig(mode="off")))
    alone.grammars = tree.grammars  # one compiled schema for both
    prompts = eval_prompts(folder, n_prompts)
    ends = end_ids(AutoTokenizer.from_pretrained(folder), converted.spec.eos_ids)  # texts end as a chat's turn
    tree.generate(prompts[0], 4, params=JSON)  # warm: compiled kernels, the draft shape, the schema
    seconds = dict.fromkeys(CONFIGS, 0.0)
    tokens, checks, accepted = (dict.fromkeys(CONFIGS, 0) for _ in range(3))
    texts: dict[str, list[list[int]]] = {c: [] for c in CONFIGS}
    for prompt in prompts:
        for name, (params, draft_shaped, verifier_alone) in CONFIGS.items():
            engine = alone if verifier_alone else tree
            speculative.draft_tree = _DRAFT_TREE if draft_shaped else _draft_unshaped
            t0 = time.perf_counter()
            out, stats = engine.generate(prompt, new_tokens, ends, params)
            seconds[name] += time.perf_counter() - t0 - stats.prefill.verify_ms / 1e3  # decoding only
            speculative.draft_tree = _DRAFT_TREE
            texts[name].append(out)
            tokens[name] += len(out) - 1  # the first came with the prefill
            checks[name] += len(stats.checks)
            accepted[name] += sum(c.accepted + 1 for c in stats.checks)

    def alone_of(name: str) -> str:
        return name.split(",")[0] + ", verifier alone"

    rows = {
        name: {
            "tokens_per_check": round(accepted[name] / checks[name], 3),
            "decode_tok_s": round(tokens[name] / seconds[name], 2),
            "texts_unlike_the_verifier_alone": sum(
                a != b for a, b in zip(texts[name], texts[alone_of(name)], strict=True)
            ),
        }
        for name in CONFIGS
    }
    docs = [_complete(folder, t) for t in texts["json schema"]]
    return {
        "folder": str(folder),
        "bits": bits,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "draft": "tree16, exact KV",
        "penalties": {k: v for k, v in vars(PENALTIES).items() if k.endswith("_penalty")},
        "schema": SCHEMA,
        "rows": rows,
        "penalty_texts_unlike_plain": sum(a != b for a, b in zip(texts["plain"], texts["penalties"], strict=True)),
        "json_documents_complete": sum(d is not None for d in docs),
        "json_documents_valid": sum(d is not None and set(d) == {"answer"} for d in docs),
        "json_texts": [_decode(folder, t) for t in texts["json schema"]],
        "shaping_ms_per_row": _row_costs(tree, folder),
    }


def _row_costs(engine: SplitEngine, folder: Path) -> dict[str, float]:
    """Median ms of ``Shaping.apply`` on one row of logits, penalties and schema apart, the schema's matcher
    inside the answer's string (where most of its tokens are decided), with no path and with a 2-token one."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    row = torch.randn(engine.model.spec.vocab)
    penalties = engine.shaping(PENALTIES, tokenizer("Why is the sky blue?")["input_ids"], frozenset())
    penalties.add(tokenizer(" Because the air scatters blue light more than red.")["input_ids"])
    schema = engine.shaping(JSON, [], frozenset())
    schema.add(tokenizer('{"answer": "Because the air')["input_ids"])
    path = tokenizer(" scatters")["input_ids"][:2]

    def ms(work) -> float:
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(times), 4)

    return {
        "penalties": ms(lambda: penalties.apply(row)),
        "penalties_path2": ms(lambda: penalties.apply(row, path)),
        "schema": ms(lambda: schema.apply(row)),
        "schema_path2": ms(lambda: schema.apply(row, path)),
    }


def _decode(folder: Path, tokens: list[int]) -> str:
    return AutoTokenizer.from_pretrained(folder).decode(tokens, skip_special_tokens=True)


def _complete(folder: Path, tokens: list[int]) -> dict | None:
    """The document a text holds, or None for one cut short by the token limit."""
    try:
        return json.loads(_decode(folder, tokens))
    except json.JSONDecodeError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "shaping.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.folder, args.bits, args.prompts, args.new_tokens)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
