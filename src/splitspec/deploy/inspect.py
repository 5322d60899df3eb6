"""What a converted folder holds, for ``splitspec inspect``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitspec.deploy.args import CliError
from splitspec.models.files import CorruptFileError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB ({n:,} bytes)"


def _full_heads(spec: Any) -> str:
    """The global layers' heads where they differ from the others' (Gemma 4)."""
    h = spec.full_heads
    return "" if h is None else f" ({h.n_kv} kv of {h.dim} in global layers{', V = K' if h.k_is_v else ''})"


def _linear(spec: Any) -> str:
    """The linear-attention layers (Qwen 3.5) and the state each sequence keeps in them instead of K/V."""
    net = spec.delta_net
    if net is None:
        return ""
    count = spec.linear_layers
    state = net.sequence_bytes(count)  # as ``plan`` counts it: the state and the copy a final pass writes
    layers = "layer keeps" if count == 1 else "layers keep"
    return f"; {count} linear-attention {layers} a state of {state:,} bytes a sequence instead (two copies)"


def _rings(spec: Any) -> str:
    """Which layers' K/V stop growing past their window on a GPU (``EngineConfig.kv_window``)."""
    from splitspec.models.spec import SLIDING

    sliding = spec.layer_types.count(SLIDING) if spec.sliding_window else 0
    last = f"their last {spec.sliding_window} positions on a GPU (--kv-window)"
    return f"; {sliding} sliding layers keep {last}" if sliding else ""


def describe(converted: Any) -> list[str]:
    """What a converted folder holds, one fact a line (``splitspec inspect``)."""
    from splitspec.quantize.format import BASE_FILE, DENSE_FILE, RESIDUAL_LAYOUT_VERSION, residual_file

    m, spec = converted.manifest, converted.spec
    sizes = {name: info["bytes"] for name, info in m["files"].items()}
    source = m.get("source", {})
    lines = [
        f"folder          {converted.folder}",
        f"model           {spec.family}, {spec.n_layers} layers, hidden {spec.hidden}, intermediate "
        f"{spec.intermediate}, {spec.n_heads} heads ({spec.n_kv_heads} kv) of {spec.head_dim}{_full_heads(spec)}, "
        f"vocab {spec.vocab}",
        f"context         up to {spec.max_positions:,} tokens (--ctx-size); K/V "
        f"{4 * spec.kv_token_values:,} bytes a token in float32, half in bfloat16{_rings(spec)}{_linear(spec)}",
        f"source          {source.get('kind', '?')} {source.get('path', '?')}, sha256 {source.get('sha256', '?')}",
        f"format          version {converted.format_version}, conversion {converted.conversion_id}, "
        f"{m.get('created_by', 'unknown writer')}",
        f"rotation        {converted.rotation}, seed {m.get('seed')}",
        f"base            2-bit, levels {[round(float(v), 4) for v in converted.levels]}: {_mib(sizes[BASE_FILE])}",
    ]
    for bits in converted.residual_bits:
        line = f"residual {bits}-bit  {_mib(sizes.get(residual_file(bits), 0))}"
        if converted.format_version >= RESIDUAL_LAYOUT_VERSION:
            line += f", {converted.residual_bits_per_weight(bits):.3f} bits a weight"
        wider = converted.widths.get(bits, {})
        if wider:
            line += f", {len(wider)} groups wider: " + ", ".join(f"{k} r{w}" for k, w in wider.items())
        lines.append(line)
    lines.append(f"dense           embeddings, norms, lm_head: {_mib(sizes[DENSE_FILE])}")
    calib = m.get("calibration", {})
    if calib:
        lines.append(f"calibration     {calib.get('sequences')} x {calib.get('seq_len')} tokens")
    return [*lines, _draft_stats(converted)]


def _draft_stats(converted: Any) -> str:
    """What ``tree_stats.json`` holds for --draft tree and auto, or what to run to fit it."""
    from splitspec.scheduler.cost import NgramStats

    stats = converted.tree_stats()
    fit = f"`splitspec fit-tree {converted.folder}`"
    if stats is None:
        return f"draft stats     none: run {fit} for --draft tree and auto"
    line = (
        f"draft stats     version {stats.get('version', 1)}, {stats.get('bits')}-bit verifier on "
        f"{stats.get('prompts')} chats x {stats.get('new_tokens')} tokens: 2-bit draft top-1 at depth 1 "
        f"{stats['p'][0][0]:.3f}"
    )
    ngram = NgramStats.fitted(stats)
    if ngram is None:
        return f"{line}; no n-gram replay (auto weighs only the 2-bit drafts until {fit})"
    return f"{line}; n-gram drafts {ngram.tokens_per_check():.2f} tokens a check"


def open_converted(folder: str, verify: bool = False) -> Any:
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
