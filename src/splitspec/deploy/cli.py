"""The `splitspec` command line: convert a model, generate text, inspect a converted folder, serve it.

A bad input (a missing or corrupt folder, an unknown model, an unsupported architecture, a width the
folder lacks, a CPU actor that cannot start) ends in one line on stderr that says what was wrong and
what to do, with exit status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import time

from splitspec.config import ROTATIONS, ConvertConfig, ModelConfig
from splitspec.deploy import generate, plan_cli, serve
from splitspec.deploy.args import (
    USAGE_ERROR,
    CliError,
    Parser,
    fit_args,
    positive_int,
    residual_width,
    residual_widths,
    width_map,
)
from splitspec.deploy.config_file import parse_leniently, parse_with_config
from splitspec.deploy.inspect import open_converted
from splitspec.models.files import CorruptFileError

# --------------------------------------------------------------------------- convert, fit-tree, inspect


def _fit_tree(args: argparse.Namespace) -> int:
    from splitspec.gpu_actor.tree_fit import fit_tree_stats
    from splitspec.scheduler.cost import NgramStats

    converted = open_converted(args.folder)
    if args.bits is not None and args.bits not in converted.residual_bits:
        raise CliError(f"{converted.folder} has no {args.bits}-bit residual, only {list(converted.residual_bits)}")
    stats = fit_tree_stats(converted.folder, args.bits, n_prompts=args.prompts, new_tokens=args.new_tokens)
    p1, ngram = stats["p"][0], NgramStats.fitted(stats)
    print(
        f"[tree statistics of {stats['bits']}-bit verifier on {stats['prompts']} prompts x {stats['new_tokens']} "
        f"tokens in {stats['seconds']:.0f} s: draft top-1/2/4 at depth 1 = {p1[0]:.3f} / {sum(p1[:2]):.3f} / "
        f"{sum(p1[:4]):.3f}; n-gram drafts {ngram.tokens_per_check():.2f} tokens a check]",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from splitspec.config import DataConfig, ResidualConfig
    from splitspec.quantize.convert import convert

    source = None if args.model == "default" else args.model
    try:
        data = DataConfig(calib_sequences=args.calib_sequences, calib_seq_len=args.calib_seq_len)
        stream = not args.no_stream
        residual = ResidualConfig(widths=args.residual_widths or {})
        cfg = ConvertConfig(
            residual_bits=args.residual_bits,
            rotation=args.rotation,
            seed=args.seed,
            stream=stream,
            data=data,
            residual=residual,
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

    converted = open_converted(args.folder)
    print("\n".join(describe(converted)))
    if args.no_verify:
        return 0
    t0 = time.perf_counter()
    open_converted(args.folder, verify=True)  # the same checks, plus every file's sha256
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

    generate.add_parser(sub, common)  # deploy.generate

    conv = sub.add_parser("convert", parents=[common], help="write the 2-bit base and the residual(s) of a model")
    conv.add_argument("model", help="HF folder, .safetensors or .gguf file, or 'default'")
    conv.add_argument(
        "out", help="output folder (appears when complete; run the same command again to resume an interrupted one)"
    )
    conv.add_argument("--gguf-file", default=None)
    conv.add_argument(
        "--residual-bits", type=residual_widths, default=(6, 7, 8), help="comma-separated widths among 6, 7, 8"
    )
    conv.add_argument(
        "--residual-widths",
        type=width_map,
        default=None,
        metavar="FILE.json",
        help='groups the 6-bit residual stores wider, {"layer.group": 7 or 8} (benchmarks/residual_sensitivity.py)',
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
        "depth d, and replay n-gram drafts over the same text, on chats that calibration never saw; stored as "
        "tree_stats.json in the folder, for --draft tree and auto.",
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
    from splitspec.quantize.partial import DiskFullError

    return (CliError, CorruptFileError, ModelLoadError, UnsupportedArchitectureError, FileExistsError, DiskFullError)


def _disk_full(e: Exception) -> bool:
    """A write that found its disk (or the user's quota on it) full, whichever command made it."""
    from splitspec.quantize.partial import FULL

    return isinstance(e, OSError) and e.errno in FULL


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_leniently(parser, argv)
    try:
        args = parse_with_config(parser, argv)
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"splitspec {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or (not isinstance(e, _user_errors()) and not _disk_full(e)):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        if _disk_full(e):
            where = f"the disk of {e.filename}" if e.filename else "a disk it writes to"
            message = f"no space left on {where} ({e.strerror}): free space there and run the same command again"
        print(f"splitspec {args.command}: error: {message}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
