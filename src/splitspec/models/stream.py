"""A model whose weights are read from its safetensors shards one decoder layer at a time.

A float32 copy of a 31B model does not fit a workstation's RAM, but one of its layers does. The skeleton
is built with its parameters on the ``meta`` device (buffers such as the rotary table are computed as
usual, so the layers' keyword arguments come out as the full model's); a layer's tensors are read, one
by one and widened to float32, just before the converter needs them, and dropped back to ``meta`` after.

``ResidentModel`` offers the same three calls over a model loaded whole (``load_reference``), so the
converter has one loop for both and the two can be compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from splitspec.config import ModelConfig
from splitspec.models.loader import ShardIndex, hf_folder, load_config, load_reference, spec_of, truncate_config
from splitspec.models.spec import ArchSpec


def dense_names(model: Any, spec: ArchSpec) -> list[str]:
    """The tensors the converted folder keeps in float32: all but the quantized Linears (and a tied head)."""
    quantized = {
        f"model.layers.{i}.{lin.module}.weight"
        for i in range(spec.n_layers)
        for g in spec.layer_groups(i)
        for lin in g.linears
    }
    names = [k for k in model.state_dict() if k not in quantized]
    return [k for k in names if not (spec.tie_embeddings and k == "lm_head.weight")]


class StreamedModel:
    """The model's skeleton; ``layer(i)`` holds layer ``i``'s weights only while it is in use."""

    def __init__(self, cfg: ModelConfig) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, src = hf_folder(cfg)
        config = load_config(folder)
        spec_of(config, folder)  # refuse an unsupported architecture before anything else
        truncate_config(config, cfg.num_layers)
        with init_empty_weights(include_buffers=False):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.spec = spec_of(self.model.config, folder)
        self.shards = ShardIndex(folder, src.file if src.kind == "safetensors" else None)

    @contextmanager
    def _loaded(self, module: torch.nn.Module, prefix: str) -> Iterator[torch.nn.Module]:
        state = self.shards.read(prefix + k for k in module.state_dict())
        module.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, assign=True)
        try:
            yield module
        finally:
            # Back to meta through the state dict alone: non-persistent buffers (computed, not stored) stay.
            empty = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in module.state_dict().items()}
            module.load_state_dict(empty, assign=True)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._loaded(self.model.model.embed_tokens, "model.embed_tokens.") as embed_tokens:
            return embed_tokens(tokens)

    def layer(self, i: int) -> Any:
        """A context manager: decoder layer ``i`` with its weights, freed on exit."""
        return self._loaded(self.model.model.layers[i], f"model.layers.{i}.")

    def dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The float32 tensors kept unquantized, read one at a time (an embedding can be gigabytes)."""
        for name in dense_names(self.model, self.spec):
            yield name, self.shards.read([name])[name]


class ResidentModel:
    """The whole float32 model in RAM: the converter's original source of weights."""

    def __init__(self, model: Any, spec: ArchSpec, tokenizer: Any = None) -> None:
        self.model, self.spec, self.tokenizer = model, spec, tokenizer

    @classmethod
    def load(cls, cfg: ModelConfig) -> ResidentModel:
        model, tokenizer, spec = load_reference(cfg)
        return cls(model, spec, tokenizer)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(tokens)

    @contextmanager
    def layer(self, i: int) -> Iterator[torch.nn.Module]:
        yield self.model.model.layers[i]

    def dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self.model.state_dict()
        for name in dense_names(self.model, self.spec):
            yield name, state[name].detach().float()
