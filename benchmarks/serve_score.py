"""The HTTP endpoint as an evaluation harness scores it: prompt log-probabilities through ``/v1/completions``
(``echo`` and ``logprobs``), against the float32 reference on the same tokens.

    flock /tmp/splitspec-bench.lock .venv/bin/python benchmarks/serve_score.py [FOLDER] [--texts 16]
        [--max-tokens-per-text 256]

One Ray cluster, one placement (the engine and one CPU actor serving the 8-bit residual), one Serve app on
loopback. The texts are the evaluation split's chats (never seen by the calibration nor the tree fit), each
rendered with the chat template and cut to ``--max-tokens-per-text`` tokens; each goes to the endpoint as a
completion prompt with ``echo: true, logprobs: 1, max_tokens: 1``, as lm-evaluation-harness asks for a
log-likelihood, one request at a time. The reference (transformers, float32, the folder's source) scores
the same token ids. Per text and over all: the mean negative log-likelihood per token and its perplexity,
the mean and largest |logprob difference|, how often the endpoint's likeliest token is the reference's,
and the endpoint's scored tokens per second (request wall time, HTTP included).

Writes benchmarks/results/serve_score.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import openai
import torch
from ray import serve

from large_model import DEMO
from serve_load import ALIAS, RESULTS, _free_port
from splitspec.config import BatchConfig, DataConfig, EngineConfig, ModelConfig
from splitspec.deploy.serve import build_app, start_server
from splitspec.models.data import evaluation_sequences, make_split
from splitspec.models.loader import load_reference
from splitspec.scheduler.cluster import Deployment, SchedulerConfig, connect_or_start


def texts(tokenizer, n: int, cut: int) -> list[str]:
    """The first ``n`` evaluation chats as text, cut to ``cut`` tokens (special tokens kept as text, which
    the tokenizer reads back as the same special tokens)."""
    data = DataConfig()
    seqs = evaluation_sequences(make_split(data), tokenizer, data)[:n]
    return [tokenizer.decode(s.input_ids[:cut]) for s in seqs]


def endpoint_scores(client: openai.OpenAI, text: str) -> tuple[list[float], list[str], float]:
    """(logprob of each prompt token after the first, the likeliest token's text there, seconds)."""
    start = time.perf_counter()
    done = client.completions.create(model=ALIAS, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    seconds = time.perf_counter() - start
    lp = done.choices[0].logprobs
    n = len(lp.tokens) - done.usage.completion_tokens  # the prompt's tokens
    return lp.token_logprobs[1:n], [max(t, key=t.get) for t in lp.top_logprobs[1:n]], seconds


def reference_scores(model, tokenizer, ids: list[int]) -> tuple[list[float], list[str]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    rows = torch.log_softmax(logits, dim=-1)
    mine = rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    return mine, [tokenizer.decode([t]) for t in rows.argmax(-1).tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=DEMO)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--max-tokens-per-text", type=int, default=256)
    args = ap.parse_args()
    model, tokenizer, _ = load_reference(ModelConfig())
    torch.set_num_threads(1)
    corpus = texts(tokenizer, args.texts, args.max_tokens_per_text)
    cluster = connect_or_start(SchedulerConfig(address="local"))
    try:
        with Deployment.start(args.folder, 8, EngineConfig(batch=BatchConfig(max_batch=1))) as deployment:
            url = start_server(build_app(deployment.engine, args.folder, ALIAS), port=_free_port())
            try:
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
                endpoint_scores(client, corpus[0][:200])  # warm-up: Serve's first request, the engine's compiles
                served = [endpoint_scores(client, text) for text in corpus]
            finally:
                serve.shutdown()
    finally:
        cluster.shutdown()
    rows, diffs, agree, ours_all, theirs_all, seconds = [], [], 0, [], [], 0.0
    for text, (ours, our_top, s) in zip(corpus, served, strict=True):
        ids = tokenizer(text)["input_ids"]
        theirs, their_top = reference_scores(model, tokenizer, ids)
        if len(theirs) != len(ours):
            raise SystemExit(f"the endpoint scored {len(ours)} tokens of a text the reference reads as {len(ids)}")
        d = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
        diffs += d
        agree += sum(a == b for a, b in zip(our_top, their_top, strict=True))
        ours_all += ours
        theirs_all += theirs
        seconds += s
        nll, ref = -sum(ours) / len(ours), -sum(theirs) / len(theirs)
        rows.append({"tokens": len(ours), "nll": nll, "reference_nll": ref, "max_abs_diff": max(d), "seconds": s})
    nll, ref = -sum(ours_all) / len(ours_all), -sum(theirs_all) / len(theirs_all)
    out = {
        "folder": str(args.folder),
        "bits": 8,
        "texts": len(corpus),
        "scored_tokens": len(ours_all),
        "nll": nll,
        "reference_nll": ref,
        "perplexity": math.exp(nll),
        "reference_perplexity": math.exp(ref),
        "perplexity_ratio": math.exp(nll - ref),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs),
        "max_abs_logprob_diff": max(diffs),
        "top1_agreement": agree / len(diffs),
        "scored_tok_s": len(ours_all) / seconds,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_score.json").write_text(json.dumps(out, indent=2) + "\n")
    json.dump({k: v for k, v in out.items() if k != "rows"}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
