"""The dequantized reference: transformers' own model holding exactly the weights the split verifier uses.

Every Linear of the converted layers gets ``ConvertedModel.linear_weights`` (W_v = rot⁻¹(Q_base + Q_resid),
or the base alone), everything else stays the source's. The split verifier must then give transformers'
logits up to fp32 rounding, so any larger difference is a bug in the split forward pass, not quantization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitspec.config import ModelConfig
from splitspec.models.loader import load_reference
from splitspec.quantize.format import ConvertedModel


def dequantized_reference(converted: ConvertedModel, source: str | Path, bits: int | None) -> Any:
    """The source model truncated to the converted layers, with their Linears dequantized at ``bits``
    (``None``: the 2-bit base alone)."""
    model, _, _ = load_reference(ModelConfig(source=str(source), num_layers=len(converted.layers)))
    modules = dict(model.model.layers.named_modules())
    for i, layer in enumerate(converted.layers):
        linears = {lin.name: lin for g in converted.spec.layer_groups(i) for lin in g.linears}
        for group in layer:
            for name, w in converted.linear_weights(i, group, bits).items():
                lin = linears[name]
                lin.rows_of(modules[f"{i}.{lin.module}"].weight.data).copy_(w)
    return model
