"""The architecture facts every other component needs, read once from a HF config.

The converter, the CPU actors and the GPU actor's own forward pass all reason in terms of Linear
*groups*: the Linears of a decoder layer that read the same input (q/k/v; gate/up) are rotated with
one set of input signs and travel as one request, so the spec names them once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
GROUP_NAMES = ("qkv", "o", "gate_up", "down")


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not one whose layer structure splitspec knows."""


@dataclass(frozen=True)
class LinearSpec:
    name: str  # module path relative to the decoder layer, e.g. "self_attn.q_proj"
    d_out: int
    bias: bool


@dataclass(frozen=True)
class GroupSpec:
    """Linears that share one input: one rotation of x, one request to the CPU actors."""

    name: str
    d_in: int
    linears: tuple[LinearSpec, ...]

    @property
    def d_out(self) -> int:
        return sum(lin.d_out for lin in self.linears)

    def row_offsets(self) -> list[int]:
        """Where each Linear's rows start in the group's concatenated output."""
        offsets, start = [], 0
        for lin in self.linears:
            offsets.append(start)
            start += lin.d_out
        return offsets


@dataclass(frozen=True)
class ArchSpec:
    family: str
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    tie_embeddings: bool
    groups: tuple[GroupSpec, ...]

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no Linear group {name!r}; groups are {[g.name for g in self.groups]}")

    @property
    def linear_params_per_layer(self) -> int:
        return sum(g.d_in * g.d_out for g in self.groups)


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def arch_spec(config: Any) -> ArchSpec:
    """Derive the spec from a transformers config (or anything with the same attributes)."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {family!r} is not supported; splitspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = config.hidden_size
    n_heads = config.num_attention_heads
    n_kv = _get(config, "num_key_value_heads", n_heads)
    head_dim = _get(config, "head_dim", hidden // n_heads)
    inter = config.intermediate_size
    qkv_bias = bool(_get(config, "attention_bias", family == "qwen2"))
    rope = _get(config, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta", _get(config, "rope_theta", 10000.0)))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if rope_scaling and rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    sliding = _get(config, "sliding_window", None)
    if family in ("qwen2", "qwen3") and not _get(config, "use_sliding_window", False):
        sliding = None
    groups = (
        GroupSpec(
            "qkv",
            hidden,
            (
                LinearSpec("self_attn.q_proj", n_heads * head_dim, qkv_bias),
                LinearSpec("self_attn.k_proj", n_kv * head_dim, qkv_bias),
                LinearSpec("self_attn.v_proj", n_kv * head_dim, qkv_bias),
            ),
        ),
        GroupSpec("o", n_heads * head_dim, (LinearSpec("self_attn.o_proj", hidden, False),)),
        GroupSpec(
            "gate_up",
            hidden,
            (LinearSpec("mlp.gate_proj", inter, False), LinearSpec("mlp.up_proj", inter, False)),
        ),
        GroupSpec("down", inter, (LinearSpec("mlp.down_proj", hidden, False),)),
    )
    return ArchSpec(
        family=family,
        hidden=hidden,
        intermediate=inter,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab=config.vocab_size,
        rms_eps=float(config.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_positions=int(_get(config, "max_position_embeddings", 4096)),
        qkv_bias=qkv_bias,
        qk_norm=family == "qwen3",
        sliding_window=sliding,
        tie_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        groups=groups,
    )
