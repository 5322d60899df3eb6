"""What a converted folder holds, for ``splitspec inspect``."""

from __future__ import annotations

from typing import Any


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB ({n:,} bytes)"


def describe(converted: Any) -> list[str]:
    """What a converted folder holds, one fact a line (``splitspec inspect``)."""
    from splitspec.quantize.format import BASE_FILE, DENSE_FILE, residual_file

    m, spec = converted.manifest, converted.spec
    sizes = {name: info["bytes"] for name, info in m["files"].items()}
    source = m.get("source", {})
    lines = [
        f"folder          {converted.folder}",
        f"model           {spec.family}, {spec.n_layers} layers, hidden {spec.hidden}, intermediate "
        f"{spec.intermediate}, {spec.n_heads} heads ({spec.n_kv_heads} kv) of {spec.head_dim}, vocab {spec.vocab}",
        f"source          {source.get('kind', '?')} {source.get('path', '?')}, sha256 {source.get('sha256', '?')}",
        f"format          version {converted.format_version}, conversion {converted.conversion_id}, "
        f"{m.get('created_by', 'unknown writer')}",
        f"rotation        {converted.rotation}, seed {m.get('seed')}",
        f"base            2-bit, levels {[round(float(v), 4) for v in converted.levels]}: {_mib(sizes[BASE_FILE])}",
    ]
    for bits in converted.residual_bits:
        lines.append(f"residual {bits}-bit  {_mib(sizes.get(residual_file(bits), 0))}")
    lines.append(f"dense           embeddings, norms, lm_head: {_mib(sizes[DENSE_FILE])}")
    calib = m.get("calibration", {})
    if calib:
        lines.append(f"calibration     {calib.get('sequences')} x {calib.get('seq_len')} tokens")
    return lines
