"""Streamed conversion of a model larger than its layers: peak RSS against the bound it is meant to keep.

A synthetic Llama-shaped model with random bfloat16 weights (several GB, sharded safetensors with an
index, the default model's tokenizer beside it) is written once under the cache, in a child process so
its making does not count towards this process's peak. It is then converted with the streamed path and
the round-to-nearest quantizer (GPTQ would add hours and each group's d_in² Hessians), and the
process's peak RSS is compared with

    bound = RSS before converting (libraries, skeleton, calibration text) + 2 × one layer in float32
            + calibration activations + the dense tensors in float32 (embeddings, head, norms),

beside what the whole float32 model in RAM would take.

``--smollm2 DIR`` instead times the full recipe on the default model, the command a user runs
(``make convert``: ``splitspec convert default DIR`` with the default width map; GPTQ, 28 × 2048
calibration tokens, residuals 6/7/8), with the conversion and the tree fitting that follows it timed
apart, and records it under ``smollm2_full`` in the same file. Usage::

    python benchmarks/convert_stream.py [--layers 16 --hidden 2048 --intermediate 8192 --out PATH]
    python benchmarks/convert_stream.py --smollm2 /tmp/convert_full

Writes benchmarks/results/convert_stream.json; the machine's load average is recorded beside each time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitspec.config import ConvertConfig, DataConfig, ModelConfig
from splitspec.models.data import calibration_tokens, make_split
from splitspec.models.loader import hf_folder
from splitspec.models.stream import StreamedModel
from splitspec.quantize.convert import convert

RESULTS = Path(__file__).parent / "results"
SHARD_BYTES = 500 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # the default model's tokenizer


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_tensors(self) -> dict[str, tuple[int, ...]]:
        kv = self.kv_heads * self.head_dim
        h, m = self.hidden, self.intermediate
        return {
            "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (m, h), "mlp.up_proj.weight": (m, h), "mlp.down_proj.weight": (h, m),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        }  # fmt: skip

    def layer_params(self) -> int:
        return sum(torch.Size(s).numel() for s in self.layer_tensors().values())

    def dense_params(self) -> int:
        return 2 * VOCAB * self.hidden + self.hidden + self.layers * 2 * self.hidden


def _write_model(shape: Shape, folder: Path) -> None:
    """Random weights, one layer generated at a time, cut into shards of about ``SHARD_BYTES``."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    gen = torch.Generator().manual_seed(0)

    def tensor(name: str, size: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=torch.bfloat16)
        return (torch.randn(size, generator=gen) * size[-1] ** -0.5).to(torch.bfloat16)

    def named() -> list[tuple[str, tuple[int, ...]]]:
        out = [("model.embed_tokens.weight", (VOCAB, shape.hidden))]
        for i in range(shape.layers):
            out += [(f"model.layers.{i}.{k}", s) for k, s in shape.layer_tensors().items()]
        return [*out, ("model.norm.weight", (shape.hidden,)), ("lm_head.weight", (VOCAB, shape.hidden))]

    weight_map, shard, shard_bytes, total = {}, {}, 0, 0
    for name, size in [*named(), ("", ())]:
        if shard and (not name or shard_bytes + 2 * torch.Size(size).numel() > SHARD_BYTES):
            file = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            shard, shard_bytes = {}, 0
        if name:
            shard[name] = tensor(name, size)
            shard_bytes += 2 * shard[name].numel()
            total += 2 * shard[name].numel()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    default, _ = hf_folder(ModelConfig())
    for name in TOKENIZER_FILES:
        if (default / name).is_file():
            shutil.copy(default / name, folder / name)
    LlamaConfig(
        vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=False, dtype="bfloat16",
    ).save_pretrained(folder)  # fmt: skip


def synthetic_model(shape: Shape) -> Path:
    """The cached folder of ``shape``, written by a child process the first time (renamed when complete)."""
    root = ModelConfig().cache_dir.parent / "synthetic"
    folder = root / f"llama-l{shape.layers}-h{shape.hidden}-m{shape.intermediate}-kv{shape.kv_heads}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    child = multiprocessing.get_context("spawn").Process(target=_write_model, args=(shape, tmp))
    child.start()
    child.join()
    if child.exitcode:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"writing the synthetic model failed (exit code {child.exitcode})")
    os.replace(tmp, folder)
    return folder


def rss_bytes() -> int:
    """This process's resident set now (``ru_maxrss`` is only the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def activation_bytes(shape: Shape, data: DataConfig) -> int:
    """The two streams' hidden states and the next one, a layer's MLP intermediates and attention scores."""
    tokens = data.calib_sequences * data.calib_seq_len
    hidden = tokens * (3 * shape.hidden + 3 * shape.intermediate)
    scores = data.calib_sequences * shape.heads * data.calib_seq_len**2
    return 4 * (hidden + 2 * scores)


def smollm2_full(out: Path) -> dict:
    """``splitspec convert default OUT --residual-widths results/residual_widths.json`` (``make convert``) in a
    child process; its own report of the conversion's and the tree fitting's seconds and of its peak RSS."""
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another folder")
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    widths = ["--residual-widths", str(RESULTS / "residual_widths.json")]
    cmd = [sys.executable, "-m", "splitspec.deploy.cli", "convert", "default", str(out), *widths]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    load.append(os.getloadavg()[0])
    converted = re.search(r"\[converted in (\d+) s, peak RSS (\d+) MiB", run.stderr)
    tree = re.search(r"\[tree statistics .* in (\d+) s", run.stderr)
    if not converted or not tree:
        raise RuntimeError(f"unexpected output of {' '.join(cmd)}:\n{run.stderr[-2000:]}")
    return {
        "command": f"splitspec convert default {out} {' '.join(widths)}",
        "convert_seconds": int(converted[1]),
        "fit_tree_seconds": int(tree[1]),
        "wall_seconds": wall,
        "peak_rss_mib": int(converted[2]),
        "load_average_1min_before_after": load,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS / "convert_stream.json")
    ap.add_argument("--smollm2", type=Path, default=None, help="time the full recipe on the default model into DIR")
    args = ap.parse_args()
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if args.smollm2 is not None:
        result = previous | {"smollm2_full": smollm2_full(args.smollm2)}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["smollm2_full"], indent=1))
        return
    torch.set_num_threads(2)
    shape = Shape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
    folder = synthetic_model(shape)
    data = DataConfig(calib_sequences=4, calib_seq_len=128)
    cfg = ConvertConfig(quantizer="rtn", data=data)
    model_cfg = ModelConfig(source=str(folder))
    # The libraries, a skeleton and the calibration text, no weights: the floor every conversion starts from.
    warm = StreamedModel(model_cfg)
    calibration_tokens(make_split(data), warm.tokenizer, data)
    del warm
    before = rss_bytes()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        report = convert(model_cfg, Path(scratch) / "converted", cfg)
        written = sum(p.stat().st_size for p in report.folder.iterdir())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load.append(os.getloadavg()[0])
    layer, dense = 4 * shape.layer_params(), 4 * shape.dense_params()
    bound = before + 2 * layer + activation_bytes(shape, data) + dense
    gib = 2**30
    result = {k: v for k, v in previous.items() if k == "smollm2_full"} | {
        "shape": asdict(shape) | {"vocab": VOCAB},
        "source_gib_bf16": sum(p.stat().st_size for p in folder.glob("*.safetensors")) / gib,
        "shards": len(list(folder.glob("*.safetensors"))),
        "convert": {
            "quantizer": cfg.quantizer,
            "residual_bits": list(cfg.residual_bits),
            "stream": cfg.stream,
            "calib_tokens": data.calib_sequences * data.calib_seq_len,
            "quantize_block_mib": cfg.quantize_block_mib,
        },
        "seconds": report.seconds,
        "load_average_1min_before_after": load,
        "written_gib": written / gib,
        "rss_before_convert_gib": before / gib,
        "peak_rss_gib": peak / gib,
        "bound_gib": bound / gib,
        "bound_terms_gib": {
            "rss_before_convert": before / gib,
            "two_layers_f32": 2 * layer / gib,
            "activations": activation_bytes(shape, data) / gib,
            "dense_f32": dense / gib,
        },
        "peak_over_before_gib": (peak - before) / gib,
        # the quantizer's working set scales with the largest group (gate_up: both MLP input Linears)
        "largest_group_f32_gib": 4 * 2 * shape.intermediate * shape.hidden / gib,
        "whole_model_f32_gib": 4 * (shape.layers * shape.layer_params() + shape.dense_params()) / gib,
        "within_bound": peak <= bound,
        "command": "python benchmarks/convert_stream.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
