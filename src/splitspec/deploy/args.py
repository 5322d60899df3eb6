"""The CLI's argument types and shared flag groups: a bad value is refused by argparse in one line."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from splitspec.config import DRAFT_MODES, KV_DTYPES, KV_WINDOWS, EngineConfig, SchedulerConfig, SpecConfig

RESIDUAL_WIDTHS = (6, 7, 8)
USAGE_ERROR = 2


class CliError(Exception):
    """A bad input: its message (one line) says what was wrong and what to do."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# --------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def residual_width(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value not in RESIDUAL_WIDTHS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a residual width: choose 6, 7 or 8")
    return value


def residual_widths(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no width given: list some of 6, 7, 8, e.g. 6,7,8")
    try:
        return tuple(residual_width(p) for p in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (a comma-separated list, e.g. 6,7,8)") from None


def width_map(path: str) -> dict[str, int]:
    """A mixed-width map file: JSON ``{"layer.group": width}``, or a file with that map under ``"widths"``
    (``benchmarks/results/residual_widths.json``) or ``"allocation": {"widths": ...}``
    (``benchmarks/residual_sensitivity.py``'s output)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read the width map {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"the width map {path} is not JSON ({e})") from None
    widths = data
    if isinstance(data, dict) and ("allocation" in data or "widths" in data):
        widths = data["allocation"]["widths"] if "allocation" in data else data["widths"]
    if not (isinstance(widths, dict) and all(isinstance(w, int) for w in widths.values())):
        raise argparse.ArgumentTypeError(
            f'the width map {path} must map "layer.group" to a width, e.g. {{"9.qkv": 7}}, '
            "or be residual_sensitivity.py's output"
        )
    return widths


def device_name(text: str) -> str:
    kind, _, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N")


def draft_args(parser: argparse.ArgumentParser, sampling: bool = True) -> None:
    """The draft's flags (``generate`` and ``serve``), and with ``sampling`` the sampler's (``generate``)."""
    spec = parser.add_argument_group("speculative decoding" + " and sampling (with --converted)" * sampling)
    spec.add_argument(
        "--draft",
        choices=DRAFT_MODES,
        default=SpecConfig.mode,
        help="what each check drafts: the cost model's choice from measured costs among the others (auto), nothing "
        "(off: the verifier alone), a chain of --draft-max tokens, a best-first tree of --draft-max nodes, or "
        "(ngram) no model: up to --draft-max tokens copied from the text where its last tokens occurred before",
    )
    spec.add_argument("--draft-max", type=int, default=SpecConfig.draft_max, help="most drafted tokens per check")
    spec.add_argument("--draft-min", type=int, default=SpecConfig.draft_min, help="fewest (auto; 0 allows none)")
    spec.add_argument(
        "--draft-p-min", type=float, default=SpecConfig.p_min, help="drop drafted tokens the draft gives less"
    )
    spec.add_argument(
        "--ngram-max", type=int, default=SpecConfig.ngram_max, help="ngram: the longest run of last tokens to look up"
    )
    spec.add_argument("--ngram-min", type=int, default=SpecConfig.ngram_min, help="ngram: the shortest")
    spec.add_argument(
        "--ngram-branch",
        action="store_true",
        help="chain, tree and auto's 2-bit drafts: add the tokens the n-gram lookup finds as a branch of the "
        "tree (pays where a few more tokens a pass cost next to nothing: a GPU)",
    )
    if not sampling:
        return
    spec.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample (exactly the verifier's)")
    spec.add_argument("--top-p", type=float, default=1.0)
    spec.add_argument("--top-k", type=int, default=0, help="0: no cut")
    spec.add_argument("--min-p", type=float, default=0.0, help="drop tokens under this share of the likeliest's")
    spec.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="pushes down tokens already in the prompt or text (vLLM's); 1: off",
    )
    spec.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per repeat in the new text")
    spec.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, once a token is in the new text")
    spec.add_argument("--seed", type=int, default=None, help="sampling seed (same seed and draft: same text)")
    held = spec.add_mutually_exclusive_group()  # an answer follows one language at most (SamplingParams)
    held.add_argument("--json-schema", type=Path, help="a JSON schema file the answer must follow (structured output)")
    held.add_argument("--grammar-file", type=Path, help="an EBNF (GBNF) grammar file the answer must follow")


def context_args(parser: argparse.ArgumentParser) -> None:
    """``--ctx-size``, as llama.cpp names it (vLLM's ``--max-model-len``): a sequence's tokens, prompt and
    answer together. K/V memory is taken per request as it needs it, so a long context costs nothing
    until a request uses it; ``--kv-dtype`` halves it (``EngineConfig.kv_dtype``), and ``--kv-window ring``
    keeps only a sliding layer's window (``EngineConfig.kv_window``)."""
    parser.add_argument(
        "--ctx-size",
        type=positive_int,
        default=EngineConfig.max_seq_len,
        help="tokens one sequence holds, prompt and answer together (at most the model's positions)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=EngineConfig.kv_dtype,
        help="the K/V cache's element: float32 (exact), or bfloat16 / float16 (half the memory; for a GPU)",
    )
    parser.add_argument(
        "--kv-window",
        choices=KV_WINDOWS,
        default=EngineConfig.kv_window,
        help="sliding-window layers' K/V: ring (the window and a check's slots), full (every position), or auto "
        "(rings on a GPU)",
    )


def checked(check: Callable[..., None], *args: Any) -> None:
    """A config's check (``EngineConfig.check_context``, ``check_length``) run before anything starts, its
    ValueError the CLI's one-line error."""
    try:
        check(*args)
    except ValueError as e:
        raise CliError(str(e)) from e


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """``SpecConfig`` from ``draft_args``' flags (a ValueError names the bad one)."""
    return SpecConfig(
        mode=args.draft,
        draft_max=args.draft_max,
        draft_min=args.draft_min,
        p_min=args.draft_p_min,
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
        ngram_branch=args.ngram_branch,
    )


def fit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=positive_int, default=24, help="tree-split chats to fit on")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="verifier tokens generated per chat")


def _row_weights(text: str) -> tuple[float, ...]:
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if min(weights) <= 0:
        raise argparse.ArgumentTypeError(f"row weights must be positive, got {text!r}")
    return weights


def placement_args(parser: argparse.ArgumentParser) -> None:
    """Where the CPU actors go and how they split the rows (the Ray path)."""
    where = parser.add_argument_group("placement (Ray)")
    where.add_argument("--cpu-actors", type=positive_int, default=1, help="CPU actor processes sharing the rows")
    where.add_argument(
        "--row-weights", type=_row_weights, help="each actor's share of the rows, e.g. 3,1 (`splitspec plan`)"
    )
    where.add_argument(
        "--actor-hosts",
        type=lambda text: tuple(None if h in ("", "local") else h for h in text.split(",")),
        help="per actor: a Ray node resource naming its host (`ray start --resources`), or local; e.g. local,host2",
    )
    where.add_argument(
        "--engine-cpus",
        type=cpu_list,
        help="CPUs the engine runs on, e.g. 0-1 (default: the first this process may use); the CPU actors on this "
        "host split the rest",
    )
    where.add_argument("--ray-address", help="Ray cluster to use (default: a running one, else embedded; 'local')")
    where.add_argument(
        "--stop-timeout",
        type=_positive,
        default=SchedulerConfig.stop_timeout_s,
        help="seconds the teardown after Ctrl-C or SIGTERM may take before what was started is killed (a second "
        "Ctrl-C: at once)",
    )
    where.add_argument(
        "--resident-gb",
        type=_non_negative,
        default=0.0,
        help="GB of the residual the engine keeps and multiplies on its device (`splitspec plan` sizes it for a "
        "GPU); the CPU actors skip those rows",
    )


def cpu_list(text: str) -> tuple[int, ...]:
    """CPU ids as Linux lists them (``0,2-3``)."""
    from splitspec.numa import parse_cpulist

    try:
        cpus = parse_cpulist(text)
    except ValueError:
        cpus = []
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list: give ids and ranges, e.g. 0,2-3")
    return tuple(cpus)


def _number(text: str, ok: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    return _number(text, lambda v: v >= 0, ">= 0")


def _positive(text: str) -> float:
    return _number(text, lambda v: v > 0, "> 0")


def engine_config(args: argparse.Namespace, **own: Any) -> EngineConfig:
    """``EngineConfig`` from the flags ``generate`` and ``serve`` share (context, K/V, device, placement,
    drafts) and ``own``, the command's own fields: the one place a shared flag is wired in."""
    try:
        return EngineConfig(
            max_seq_len=args.ctx_size,
            kv_dtype=args.kv_dtype,
            kv_window=args.kv_window,
            device=args.device,
            cuda_graphs=args.cuda_graphs,
            resident_bytes=round(args.resident_gb * 1e9),
            engine_cpus=args.engine_cpus,
            spec=spec_config(args),
            **own,
        )
    except ValueError as e:
        raise CliError(str(e)) from e


def connected(scheduler: Any) -> Any:
    """The Ray cluster ``scheduler`` names, or an embedded one (``connect_or_start``); an address that cannot
    be reached is a one-line error."""
    from splitspec.scheduler.cluster import connect_or_start

    try:
        return connect_or_start(scheduler)
    except (ConnectionError, ValueError) as e:
        raise CliError(f"cannot reach Ray at {scheduler.address}: {e}; start it with `ray start --head`") from e


def scheduler_config(args: argparse.Namespace) -> Any:
    """``SchedulerConfig`` from ``placement_args``' flags; a mismatch is a one-line error."""
    try:
        return SchedulerConfig(
            address=args.ray_address,
            cpu_actors=args.cpu_actors,
            row_weights=args.row_weights or (),
            actor_hosts=args.actor_hosts or (),
            stop_timeout_s=args.stop_timeout,
        )
    except ValueError as e:
        raise CliError(str(e)) from e
