"""What each decoder layer of a transformers model needs to run on its own over whole sequences.

The converter calls the decoder layers one by one (two calibration streams, quantized in between), so it
must hand each layer what the model's own forward would: the rotary table and the causal mask of the
layer's type. A sliding-window layer given the plain causal mask, or a Gemma 3 local layer given the
global layers' RoPE base, would calibrate on inputs the model never sees.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from splitspec.models.spec import FULL, SLIDING, ArchSpec


def layer_kwargs(model: Any, spec: ArchSpec, h: torch.Tensor) -> list[dict[str, Any]]:
    """Keyword arguments for each of ``model.model.layers`` on embeddings ``h`` [batch, seq, hidden]."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
    rotary = model.model.rotary_emb
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    mask_fns = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
    # transformers renamed the mask builders' ``past_key_values`` to ``cache`` (5.2x); both mean "none" here
    params = inspect.signature(create_causal_mask).parameters
    no_cache = {"cache": None} if "cache" in params else {"past_key_values": None}
    if "cache_position" in params:
        no_cache["cache_position"] = positions[0]
    by_type = {}
    for kind in sorted(set(spec.layer_types)):
        rope = rotary(h, positions, kind) if per_type else rotary(h, positions)
        mask = None  # a linear-attention layer (Qwen 3.5) is causal by its recurrence: no mask without padding
        if kind in mask_fns:
            mask = mask_fns[kind](
                config=model.config, inputs_embeds=h, attention_mask=None, position_ids=positions, **no_cache
            )
        by_type[kind] = {"position_embeddings": rope, "attention_mask": mask, "position_ids": positions}
    if "shared_kv_states" in inspect.signature(model.model.layers[0].forward).parameters:
        shared: dict = {}  # Gemma 4's last layer of each type stores its K/V there for layers that share it
        by_type = {kind: kw | {"shared_kv_states": shared} for kind, kw in by_type.items()}
    return [by_type[kind] for kind in spec.layer_types]
