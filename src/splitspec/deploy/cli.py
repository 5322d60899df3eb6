"""The `splitspec` command line: convert a model, generate text."""

from __future__ import annotations

import argparse
import sys
import time

from splitspec.config import ACTIVATION_MODES, ROTATIONS, ConvertConfig, EngineConfig, ModelConfig


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder, .safetensors or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--gguf-file", default=None, help="the GGUF file's name inside --model's folder")


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _generate(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.converted:
        return _generate_split(args)
    from splitspec.models.loader import load_reference

    t0 = time.perf_counter()
    model, tokenizer, spec = load_reference(ModelConfig(source=args.model, gguf_file=args.gguf_file))
    load_s = time.perf_counter() - t0
    ids = torch.tensor([_chat_ids(tokenizer, args.prompt)])
    t1 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    gen_s = time.perf_counter() - t1
    new = out[0, ids.shape[1] :]
    print(tokenizer.decode(new, skip_special_tokens=True).strip())
    print(
        f"[reference float32 {spec.family}, {spec.n_layers} layers: loaded in {load_s:.1f} s, "
        f"{len(new)} tokens in {gen_s:.1f} s ({len(new) / gen_s:.1f} tok/s)]",
        file=sys.stderr,
    )
    return 0


def _generate_split(args: argparse.Namespace) -> int:
    """Greedy generation through the split verifier: this process + real CPU actor processes."""
    from transformers import AutoTokenizer

    from splitspec.gpu_actor.engine import SplitEngine

    tokenizer = AutoTokenizer.from_pretrained(args.converted)
    t0 = time.perf_counter()
    config = EngineConfig(prefill=args.prefill, activations=args.activations)
    with SplitEngine.start(args.converted, args.bits, n_cpu_actors=args.cpu_actors, config=config) as engine:
        start_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        tokens, stats = engine.generate(_chat_ids(tokenizer, args.prompt), args.max_new_tokens, tokenizer.eos_token_id)
        gen_s = time.perf_counter() - t1
    print(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    s = stats.summary()
    print(
        f"[split verifier, {args.bits}-bit residual on {args.cpu_actors} CPU actor process(es): started in "
        f"{start_s:.1f} s; prompt {stats.prompt_tokens} tokens ({stats.prefill_path} prefill "
        f"{stats.prefill.verify_ms:.0f} ms); {len(tokens)} tokens in {gen_s:.1f} s "
        f"({len(tokens) / gen_s:.1f} tok/s); per step: verify {s.get('verify_ms', 0):.1f} ms, "
        f"base {s.get('base_ms', 0):.1f}, residual wait {s.get('residual_wait_ms', 0):.1f}, "
        f"attention {s.get('attention_ms', 0):.1f}, lm_head {s.get('head_ms', 0):.1f}]",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from splitspec.config import DataConfig
    from splitspec.quantize.convert import convert

    source = None if args.model == "default" else args.model
    bits = tuple(int(b) for b in args.residual_bits.split(",") if b)
    data = DataConfig(calib_sequences=args.calib_sequences, calib_seq_len=args.calib_seq_len)
    cfg = ConvertConfig(residual_bits=bits, rotation=args.rotation, seed=args.seed, data=data)
    model_cfg = ModelConfig(source=source, gguf_file=args.gguf_file, num_layers=args.num_layers)
    report = convert(model_cfg, args.out, cfg)
    print(report.folder)
    print(
        f"[converted in {report.seconds:.0f} s, peak RSS {report.peak_rss_mb:.0f} MiB, "
        f"levels {[round(v, 4) for v in report.levels]}]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy answer to a chat prompt")
    gen.add_argument("prompt")
    _model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    gen.add_argument(
        "--converted", default=None, help="a converted folder: generate with the split verifier and CPU actors"
    )
    gen.add_argument("--bits", type=int, default=8, help="residual width to serve (with --converted)")
    gen.add_argument("--cpu-actors", type=int, default=1, help="CPU actor processes sharing the residual rows")
    gen.add_argument(
        "--prefill",
        choices=EngineConfig.PREFILL_PATHS,
        default="auto",
        help="prompt path: through the CPU actors (split), the residual on the device, or the measured cheaper",
    )
    gen.add_argument(
        "--activations",
        choices=ACTIVATION_MODES,
        default=EngineConfig.activations,
        help="how the residual multiplies x': rounded to int16 or int8 (integer kernel), or fp32",
    )
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="write the 2-bit base and the residual(s) of a model")
    conv.add_argument("model", help="HF folder, .safetensors or .gguf file, or 'default'")
    conv.add_argument("out", help="output folder (written atomically)")
    conv.add_argument("--gguf-file", default=None)
    conv.add_argument("--residual-bits", default="6,7,8", help="comma-separated widths among 6, 7, 8")
    conv.add_argument("--calib-sequences", type=int, default=28)
    conv.add_argument("--calib-seq-len", type=int, default=2048)
    conv.add_argument("--num-layers", type=int, default=None, help="convert only the first N decoder layers")
    conv.add_argument("--seed", type=int, default=20261008)
    conv.add_argument(
        "--rotation",
        choices=ROTATIONS,
        default=ConvertConfig.rotation,
        help="Hadamard kind: full-width kronecker (Paley ⊗ Sylvester) or the recipe's block-diagonal sylvester",
    )
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
