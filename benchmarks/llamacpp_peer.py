"""llama.cpp on the same machine, model and prompts: the peer for decode speed.

    .venv/bin/pip install -e ".[bench]"   # llama-cpp-python, built from source (minutes)

On an AVX-512 machine whose default (native) build crashes in decode, build it without what crashes. On a
Sapphire Rapids VM the crash was in ``ggml_backend_amx_mul_mat`` (AMX), so everything but AMX:
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
pip install --force-reinstall --no-deps llama-cpp-python``; where that still crashes, an AVX2 build
(``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON``). The build's features are recorded.
    .venv/bin/python benchmarks/llamacpp_peer.py [--prompts 8] [--new-tokens 64]

The default model ships as a Q4_1 GGUF, and the float32 reference every precision claim is measured
against is that file dequantized; llama.cpp's own quantizer makes the Q8_0 from it (requantizing
dequantizes to f32 first, so the result is the reference quantized to Q8_0). Per (quantization, threads):
the held-out prompts that ``e2e.py`` uses, chat-templated by the model's own tokenizer (handed to
llama.cpp as text, which it tokenizes with the same vocabulary), then
``--new-tokens`` greedy tokens; a token's time is llama.cpp's own eval time per token (its perf
counters, prompt processing excluded), best of 3 runs per prompt, median over prompts.

Writes benchmarks/results/llamacpp_peer.json; ``e2e.py`` reads it when present.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from acceptance import RESULTS, run_args
from e2e import heldout_prompts
from splitspec.models.loader import default_gguf

RUNS = (("q8_0", 2), ("q8_0", 1), ("q4_1", 1))


def _quantized(kind: str, folder: Path) -> Path:
    import llama_cpp

    source = default_gguf()
    if kind == "q4_1":
        return source
    out = folder / f"model.{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    return out


def token_ms(path: Path, threads: int, prompts: list[str], new_tokens: int) -> float:
    """Median over prompts of the best of 3 runs' eval ms per generated token."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_threads=threads, n_ctx=2048, verbose=True)  # verbose=False crashed here
    per_prompt = []
    for prompt in prompts:
        best = float("inf")
        for _ in range(3):
            llm.reset()
            llama_cpp.llama_perf_context_reset(llm.ctx)
            # a text prompt: the bindings crashed in decode here when given token ids
            llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, top_k=1)
            perf = llama_cpp.llama_perf_context(llm.ctx)
            best = min(best, perf.t_eval_ms / max(perf.n_eval, 1))
        per_prompt.append(best)
    return statistics.median(per_prompt)


def main() -> None:
    args = run_args(__doc__.splitlines()[0], 64, RESULTS / "llamacpp_peer.json").parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    prompts = [tokenizer.decode(ids) for ids in heldout_prompts(tokenizer, args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, threads in RUNS:
            ms = token_ms(_quantized(kind, Path(tmp)), threads, prompts, args.new_tokens)
            rows.append({"quant": kind, "threads": threads, "token_ms": round(ms, 3), "tok_s": round(1e3 / ms, 2)})
            print(rows[-1], flush=True)
    result = {"prompts": len(prompts), "new_tokens": args.new_tokens, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
