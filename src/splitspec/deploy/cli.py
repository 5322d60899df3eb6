"""The `splitspec` command line: convert a model, generate text, inspect a converted folder, serve it.

A bad input (a missing or corrupt folder, an unknown model, an unsupported architecture, a width the
folder lacks, a CPU actor that cannot start) ends in one line on stderr that says what was wrong and
what to do, with exit status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from splitspec.config import (
    ACTIVATION_MODES,
    ROTATIONS,
    ConvertConfig,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpecConfig,
)
from splitspec.deploy import openai_api, plan_cli, serve
from splitspec.deploy.args import (
    USAGE_ERROR,
    CliError,
    Parser,
    device_name,
    draft_args,
    fit_args,
    positive_int,
    residual_width,
    residual_widths,
)
from splitspec.deploy.config_file import parse_with_config
from splitspec.models.files import CorruptFileError


def _check_device(device: str) -> None:
    """Refuse a CUDA device this torch cannot reach before anything is loaded or started."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise CliError(
            f"--device {device}: this torch has no usable CUDA device (a CPU build, or no GPU here); "
            "use --device cpu, or install a CUDA build of torch"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CliError(
            f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s) here; "
            f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )


# --------------------------------------------------------------------------- generate


def _generate(args: argparse.Namespace) -> int:
    import torch

    _check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.converted:
        return _generate_split(args)
    from splitspec.models.loader import load_reference

    t0 = time.perf_counter()
    model, tokenizer, spec = load_reference(ModelConfig(source=args.model, gguf_file=args.gguf_file))
    model = model.to(args.device)
    load_s = time.perf_counter() - t0
    ids = torch.tensor([openai_api.chat_ids(tokenizer, args.prompt)], device=args.device)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    gen_s = time.perf_counter() - t1
    new = out[0, ids.shape[1] :]
    print(tokenizer.decode(new, skip_special_tokens=True).strip())
    print(
        f"[reference float32 {spec.family}, {spec.n_layers} layers on {args.device}: loaded in {load_s:.1f} s, "
        f"{len(new)} tokens in {gen_s:.1f} s ({len(new) / gen_s:.1f} tok/s)]",
        file=sys.stderr,
    )
    return 0


def _open_converted(folder: str, verify: bool = False) -> Any:
    """The validated converted folder (``ConvertedModel``), or a CliError that names what is wrong."""
    from splitspec.quantize.format import ConvertedModel

    path = Path(folder)
    if not path.is_dir():
        raise CliError(f"{path}: no such folder; give the output folder of `splitspec convert`")
    try:
        return ConvertedModel(path, verify=verify)
    except CorruptFileError as e:
        hint = "" if "convert" in e.problem else "; re-convert the model with `splitspec convert`"
        raise CliError(f"{e}{hint}") from e
    except (OSError, ValueError) as e:  # config.json unreadable by transformers, or of an unknown architecture
        raise CliError(f"{path}: cannot read its config.json ({e}); re-convert the model") from e


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's knobs from ``generate``'s flags: the one place a new flag is wired in."""
    try:
        spec = SpecConfig(mode=args.draft, draft_max=args.draft_max, draft_min=args.draft_min, p_min=args.draft_p_min)
        return EngineConfig(prefill=args.prefill, activations=args.activations, device=args.device, spec=spec)
    except ValueError as e:
        raise CliError(str(e)) from e


def _sampling(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from e


def _actor_error(e: BaseException) -> str:
    """One line from a CpuActorError: what failed, and the last line of the child's traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return "a CPU actor process failed to start"
    head, tail = lines[0].rstrip(":"), [line for line in lines[1:] if not line.startswith(("File ", "Traceback"))]
    return f"{head}: {tail[-1]}" if tail else head


def _generate_split(args: argparse.Namespace) -> int:
    """Generation by the engine and real CPU actor processes: placed on Ray, or started here (``--no-ray``)."""
    converted = _open_converted(args.converted)  # before the tokenizer or any process
    widths = converted.residual_bits
    if args.bits not in widths:
        raise CliError(
            f"{converted.folder} has no {args.bits}-bit residual, only {', '.join(map(str, widths))}-bit: "
            f"use --bits {widths[-1]}, or convert again with --residual-bits including {args.bits}"
        )
    converted.check_residual(args.bits)  # a residual in an older layout: CorruptFileError, re-convert
    config, params = _engine_config(args), _sampling(args)
    if config.spec.mode in ("auto", "tree") and converted.tree_stats() is None:
        raise CliError(
            f"{converted.folder} has no tree statistics for --draft {config.spec.mode}: run `splitspec fit-tree "
            f"{converted.folder}` once, or pass --draft chain or --draft off"
        )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    ids = openai_api.chat_ids(tokenizer, args.prompt)
    run = _run_direct if args.no_ray else _run_on_ray
    tokens, s, start_s, gen_s = run(args, converted.folder, config, ids, tokenizer.eos_token_id, params)
    print(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    print(
        f"[split verifier, {args.bits}-bit residual on {args.cpu_actors} CPU actor process(es) "
        f"({'direct' if args.no_ray else 'Ray'}), engine "
        f"on {config.device}: started in {start_s:.1f} s; prompt {s['prompt_tokens']} tokens ({s['prefill_path']} "
        f"prefill {s['prefill_ms']:.0f} ms); {len(tokens)} tokens in {gen_s:.1f} s "
        f"({len(tokens) / gen_s:.1f} tok/s); draft {_shape_line(s)}; per check: "
        f"{s.get('tokens_per_check', 0):.2f} tokens, draft {s.get('draft_ms', 0):.1f} ms, "
        f"verify {s.get('verify_ms', 0):.1f} ms (base {s.get('base_ms', 0):.1f}, residual wait "
        f"{s.get('residual_wait_ms', 0):.1f}, attention {s.get('attention_ms', 0):.1f}, lm_head "
        f"{s.get('head_ms', 0):.1f})]",
        file=sys.stderr,
    )
    return 0


Run = tuple[list[int], dict[str, Any], float, float]  # tokens, summary, start seconds, generation seconds


def _run_direct(args: argparse.Namespace, folder: Path, config: EngineConfig, ids: list[int], eos: int, params) -> Run:
    """This process is the engine and starts the CPU actor processes itself."""
    from splitspec.cpu_actor.service import CpuActorError
    from splitspec.gpu_actor.batcher import generation_summary
    from splitspec.scheduler.local import start_local

    t0 = time.perf_counter()
    try:
        engine = start_local(folder, args.bits, n_cpu_actors=args.cpu_actors, config=config)
    except CpuActorError as e:
        raise CliError(f"{_actor_error(e)} (run with --debug for the actor's whole stderr)") from e
    with engine:
        start_s = (t1 := time.perf_counter()) - t0
        tokens, stats = engine.generate(ids, args.max_new_tokens, eos, params)
        return tokens, generation_summary(stats), start_s, time.perf_counter() - t1


def _run_on_ray(args: argparse.Namespace, folder: Path, config: EngineConfig, ids: list[int], eos: int, params) -> Run:
    """The scheduler places the engine and the CPU actors on Ray and says where (on stderr)."""
    import ray

    from splitspec.scheduler.cluster import Deployment, SchedulerConfig, SchedulerError, connect_or_start

    scheduler = SchedulerConfig(address=args.ray_address, cpu_actors=args.cpu_actors)
    t0 = time.perf_counter()
    try:
        cluster = connect_or_start(scheduler)
    except (ConnectionError, ValueError) as e:
        raise CliError(f"cannot reach Ray at {args.ray_address}: {e}; start it with `ray start --head`") from e
    try:
        with Deployment.start(folder, args.bits, config, scheduler) as deployment:
            start_s = (t1 := time.perf_counter()) - t0
            kind = "embedded Ray cluster" if cluster.started else f"Ray cluster at {cluster.address}"
            print(f"[placed on the {kind}:", *deployment.where(), sep="\n  ", end="]\n", file=sys.stderr)
            tokens, summary = deployment.generate(ids, args.max_new_tokens, eos, params)
            return tokens, summary, start_s, time.perf_counter() - t1
    except SchedulerError as e:  # the cluster cannot hold the actors, or one could not start
        raise CliError(_actor_error(e)) from e
    except ray.exceptions.RayError as e:  # an actor died for good (out of restarts): Ray's first line
        raise CliError(str(e).splitlines()[0]) from e
    finally:
        cluster.shutdown()


def _shape_line(s: dict[str, Any]) -> str:
    if s["predicted_tok_s"] is None:
        return s["shape"]
    return f"{s['shape']} (chosen by the cost model, predicted {s['predicted_tok_s']:.1f} tok/s)"


# --------------------------------------------------------------------------- convert, fit-tree, inspect


def _fit_tree(args: argparse.Namespace) -> int:
    from splitspec.gpu_actor.tree_fit import fit_tree_stats

    converted = _open_converted(args.folder)
    if args.bits is not None and args.bits not in converted.residual_bits:
        raise CliError(f"{converted.folder} has no {args.bits}-bit residual, only {list(converted.residual_bits)}")
    stats = fit_tree_stats(converted.folder, args.bits, n_prompts=args.prompts, new_tokens=args.new_tokens)
    p1 = stats["p"][0]
    print(
        f"[tree statistics of {stats['bits']}-bit verifier on {stats['prompts']} prompts x {stats['new_tokens']} "
        f"tokens in {stats['seconds']:.0f} s: draft top-1/2/4 at depth 1 = {p1[0]:.3f} / {sum(p1[:2]):.3f} / "
        f"{sum(p1[:4]):.3f}]",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from splitspec.config import DataConfig
    from splitspec.quantize.convert import convert

    source = None if args.model == "default" else args.model
    try:
        data = DataConfig(calib_sequences=args.calib_sequences, calib_seq_len=args.calib_seq_len)
        stream = not args.no_stream
        cfg = ConvertConfig(
            residual_bits=args.residual_bits, rotation=args.rotation, seed=args.seed, stream=stream, data=data
        )
        model_cfg = ModelConfig(source=source, gguf_file=args.gguf_file, num_layers=args.num_layers)
    except ValueError as e:
        raise CliError(str(e)) from e
    report = convert(model_cfg, args.out, cfg)
    print(report.folder)
    print(
        f"[converted in {report.seconds:.0f} s, peak RSS {report.peak_rss_mb:.0f} MiB, "
        f"levels {[round(v, 4) for v in report.levels]}]",
        file=sys.stderr,
    )
    if args.no_fit_tree:
        return 0
    args.folder, args.bits = str(report.folder), None
    return _fit_tree(args)


def _inspect(args: argparse.Namespace) -> int:
    from splitspec.deploy.inspect import describe

    converted = _open_converted(args.folder)
    print("\n".join(describe(converted)))
    if args.no_verify:
        return 0
    t0 = time.perf_counter()
    _open_converted(args.folder, verify=True)  # the same checks, plus every file's sha256
    n = len(converted.manifest["files"])
    print(f"checksums       {n} files match the manifest's sha256 ({time.perf_counter() - t0:.1f} s)")
    return 0


# --------------------------------------------------------------------------- parser, main


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common.add_argument("--config", help="a TOML file of settings, one [command] table of flag names")
    parser = Parser(prog="splitspec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[common], help="greedy answer to a chat prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="HF folder, .safetensors or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--gguf-file", default=None, help="the GGUF file's name inside --model's folder")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    gen.add_argument("--device", type=device_name, default=EngineConfig.device, help="cpu, cuda or cuda:N")
    gen.add_argument(
        "--converted", default=None, help="a converted folder: generate with the split verifier and CPU actors"
    )
    gen.add_argument(
        "--bits", type=residual_width, default=8, help="residual width to serve (with --converted): 6, 7 or 8"
    )
    gen.add_argument("--cpu-actors", type=positive_int, default=1, help="CPU actor processes sharing the residual rows")
    gen.add_argument("--no-ray", action="store_true", help="start the CPU actor processes directly, without Ray")
    gen.add_argument("--ray-address", help="Ray cluster to use (default: a running one, else embedded; 'local')")
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
    draft_args(gen)
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", parents=[common], help="write the 2-bit base and the residual(s) of a model")
    conv.add_argument("model", help="HF folder, .safetensors or .gguf file, or 'default'")
    conv.add_argument("out", help="output folder (written atomically)")
    conv.add_argument("--gguf-file", default=None)
    conv.add_argument(
        "--residual-bits", type=residual_widths, default=(6, 7, 8), help="comma-separated widths among 6, 7, 8"
    )
    conv.add_argument("--calib-sequences", type=positive_int, default=28)
    conv.add_argument("--calib-seq-len", type=positive_int, default=2048)
    conv.add_argument("--num-layers", type=positive_int, default=None, help="convert only the first N decoder layers")
    conv.add_argument("--seed", type=int, default=20261008)
    conv.add_argument("--no-fit-tree", action="store_true", help="skip fitting the draft's tree statistics")
    conv.add_argument(
        "--no-stream", action="store_true", help="load the whole float32 model, not a layer at a time (*.bin weights)"
    )
    fit_args(conv)
    conv.add_argument(
        "--rotation",
        choices=ROTATIONS,
        default=ConvertConfig.rotation,
        help="Hadamard kind: full-width kronecker (Paley ⊗ Sylvester) or the recipe's block-diagonal sylvester",
    )
    conv.set_defaults(func=_convert)

    fit = sub.add_parser(
        "fit-tree",
        parents=[common],
        help="fit the draft's rank statistics (which tree to draft) for a converted folder",
        description="Fit p_d(r), the chance that the verifier's next token is the draft's rank-r candidate at "
        "depth d, on chats that calibration never saw; stored as tree_stats.json in the folder.",
    )
    fit.add_argument("folder", help="a folder written by `splitspec convert`")
    fit.add_argument(
        "--bits", type=residual_width, default=None, help="the verifier's residual width (default: the widest)"
    )
    fit_args(fit)
    fit.set_defaults(func=_fit_tree)

    insp = sub.add_parser(
        "inspect", parents=[common], help="what a converted folder holds; verifies its files' checksums"
    )
    insp.add_argument("folder", help="a folder written by `splitspec convert`")
    insp.add_argument("--no-verify", action="store_true", help="skip the sha256 of every file (reads them all)")
    insp.set_defaults(func=_inspect)
    serve.add_parser(sub, common)  # its flags and command live in deploy.serve (Serve is imported on use)
    plan_cli.add_parser(sub, common)  # `splitspec plan` lives in deploy.plan_cli
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that report a bad input (not a bug): each becomes one line and exit status 2."""
    from splitspec.models.loader import ModelLoadError
    from splitspec.models.spec import UnsupportedArchitectureError

    return (CliError, CorruptFileError, ModelLoadError, UnsupportedArchitectureError, FileExistsError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args = parse_with_config(build_parser(), argv) if args.config else args
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"splitspec {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not isinstance(e, _user_errors()):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"splitspec {args.command}: error: {message}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
