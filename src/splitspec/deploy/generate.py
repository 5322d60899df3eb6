"""``splitspec generate``: one chat prompt answered by the float32 reference, or with ``--converted`` by
the split verifier and real CPU actor processes, placed on Ray by the scheduler or started here
(``--no-ray``); the text on stdout, a line of figures on stderr."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from splitspec.config import ACTIVATION_MODES, EngineConfig, ModelConfig, SamplingParams
from splitspec.deploy import openai_api
from splitspec.deploy.args import (
    CliError,
    checked,
    connected,
    context_args,
    device_name,
    draft_args,
    engine_config,
    placement_args,
    positive_int,
    residual_width,
    scheduler_config,
)
from splitspec.deploy.inspect import open_converted
from splitspec.models.spec import end_ids
from splitspec.scheduler.cpus import check_engine_cpus


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``generate`` subcommand and its flags."""
    gen = sub.add_parser("generate", parents=[common], help="greedy answer to a chat prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="HF folder, .safetensors or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--gguf-file", default=None, help="the GGUF file's name inside --model's folder")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    context_args(gen)
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    gen.add_argument("--device", type=device_name, default=EngineConfig.device, help="cpu, cuda or cuda:N")
    gen.add_argument("--cuda-graphs", action="store_true", help="replay draft steps and checks as CUDA graphs (cuda)")
    gen.add_argument(
        "--converted", default=None, help="a converted folder: generate with the split verifier and CPU actors"
    )
    gen.add_argument(
        "--bits", type=residual_width, default=8, help="residual width to serve (with --converted): 6, 7 or 8"
    )
    gen.add_argument("--no-ray", action="store_true", help="start the CPU actor processes directly, without Ray")
    placement_args(gen)
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
    gen.set_defaults(func=generate_command)


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


def generate_command(args: argparse.Namespace) -> int:
    """Greedy (or sampled) text for one chat prompt: the float32 reference, or with ``--converted`` the
    split verifier and its CPU actors."""
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


# ``SamplingParams``' fields that ``generate`` takes as flags (``args.draft_args``)
SAMPLING_FLAGS = (
    "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


def _sampling(args: argparse.Namespace) -> SamplingParams:
    schema = grammar = None
    if args.json_schema is not None:
        try:
            schema = json.dumps(json.loads(args.json_schema.read_text()))
        except (OSError, ValueError) as e:
            raise CliError(f"--json-schema {args.json_schema}: not a readable JSON file ({e})") from e
    if args.grammar_file is not None:
        try:
            grammar = args.grammar_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--grammar-file {args.grammar_file}: cannot read it ({e})") from e
    try:
        flags = {name: getattr(args, name) for name in SAMPLING_FLAGS}
        return SamplingParams(**flags, json_schema=schema, grammar=grammar)
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
    converted = open_converted(args.converted)  # before the tokenizer or any process
    widths = converted.residual_bits
    if args.bits not in widths:
        raise CliError(
            f"{converted.folder} has no {args.bits}-bit residual, only {', '.join(map(str, widths))}-bit: "
            f"use --bits {widths[-1]}, or convert again with --residual-bits including {args.bits}"
        )
    converted.check_residual(args.bits)  # a residual in an older layout: CorruptFileError, re-convert
    config = engine_config(args, prefill=args.prefill, activations=args.activations)
    params = _sampling(args)
    checked(config.check_context, converted.spec.max_positions)
    checked(check_engine_cpus, config.engine_cpus)
    if params.constraint is not None:  # before any process starts: a schema or grammar that does not compile
        from splitspec.gpu_actor.grammar import Grammars

        flag = f"--json-schema {args.json_schema}" if params.json_schema else f"--grammar-file {args.grammar_file}"
        try:
            Grammars(converted.folder, converted.spec.vocab, converted.spec.eos_ids).compiled(*params.constraint)
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from e
    fitted = converted.tree_stats()
    if config.spec.mode in ("auto", "tree") and fitted is None:
        raise CliError(
            f"{converted.folder} has no tree statistics for --draft {config.spec.mode}: run `splitspec fit-tree "
            f"{converted.folder}` once, or pass --draft chain or --draft off"
        )
    if config.spec.mode == "auto" and "ngram" not in fitted:
        print(
            f"[{converted.folder}'s tree statistics predate n-gram drafts: --draft auto weighs only the 2-bit "
            f"drafts; run `splitspec fit-tree {converted.folder}` to weigh them too]",
            file=sys.stderr,
        )

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted.folder)
    ids = openai_api.chat_ids(tokenizer, args.prompt)
    checked(config.check_length, len(ids), args.max_new_tokens)
    run = _run_direct if args.no_ray else _run_on_ray
    ends = sorted(end_ids(tokenizer, converted.spec.eos_ids))
    tokens, s, start_s, gen_s = run(args, converted.folder, config, ids, ends, params)
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


def _run_direct(
    args: argparse.Namespace, folder: Path, config: EngineConfig, ids: list[int], eos: list[int], params
) -> Run:
    """This process is the engine and starts the CPU actor processes itself."""
    from splitspec.cpu_actor.service import CpuActorError
    from splitspec.deploy.stopping import Stopping
    from splitspec.gpu_actor.batcher import generation_summary
    from splitspec.protocol import RemoteError
    from splitspec.scheduler.local import start_local

    t0 = time.perf_counter()
    with Stopping("generate", args.stop_timeout) as stopping:  # SIGTERM too stops it as Ctrl-C does
        try:
            weights = args.row_weights
            engine = start_local(folder, args.bits, n_cpu_actors=args.cpu_actors, config=config, row_weights=weights)
        except CpuActorError as e:
            raise CliError(f"{_actor_error(e)} (run with --debug for the actor's whole stderr)") from e
        except RemoteError as e:  # a CPU actor that started but refused the engine's session (no room for slots)
            raise CliError(str(e)) from e
        with engine:
            start_s = (t1 := time.perf_counter()) - t0
            tokens, stats = engine.generate(ids, args.max_new_tokens, eos, params)
            stopping.arm()
            return tokens, generation_summary(stats), start_s, time.perf_counter() - t1


def _run_on_ray(
    args: argparse.Namespace, folder: Path, config: EngineConfig, ids: list[int], eos: list[int], params
) -> Run:
    """The scheduler places the engine and the CPU actors on Ray and says where (on stderr)."""
    import ray

    from splitspec.deploy.stopping import Stopping
    from splitspec.scheduler.cluster import Deployment, SchedulerError

    scheduler = scheduler_config(args)
    t0 = time.perf_counter()
    # stdout is the text's alone: while connected, Ray's driver prints its job's error events there (a worker
    # that died in a run that still succeeded was one), whatever ``log_to_driver`` says: they go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        cluster = connected(scheduler)
        with Stopping("generate", scheduler.stop_timeout_s) as stopping:  # after ray.init: see serve
            try:
                with Deployment.start(folder, args.bits, config, scheduler) as deployment:
                    start_s = (t1 := time.perf_counter()) - t0
                    kind = "embedded Ray cluster" if cluster.started else f"Ray cluster at {cluster.address}"
                    print(f"[placed on the {kind}:", *deployment.where(), sep="\n  ", end="]\n", file=sys.stderr)
                    tokens, summary = deployment.generate(ids, args.max_new_tokens, eos, params)
                    stopping.arm()
                    return tokens, summary, start_s, time.perf_counter() - t1
            except SchedulerError as e:  # the cluster cannot hold the actors, or one could not start
                raise CliError(_actor_error(e)) from e
            except ray.exceptions.RayError as e:  # an actor died for good (out of restarts): Ray's first line
                raise CliError(str(e).splitlines()[0]) from e
            finally:
                stopping.arm()
                cluster.shutdown()


def _shape_line(s: dict[str, Any]) -> str:
    if s["predicted_tok_s"] is None:
        return s["shape"]
    return f"{s['shape']} (chosen by the cost model, predicted {s['predicted_tok_s']:.1f} tok/s)"
