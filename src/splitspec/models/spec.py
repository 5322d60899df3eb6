"""The architecture facts every other component needs, read once from a HF config.

The converter, the CPU actors and the GPU actor's own forward pass all reason in terms of Linear
*groups*: the Linears of a decoder layer that read the same input (q/k/v; gate/up) are rotated with
one set of input signs and travel as one request, so the spec names them once, here.

The families differ only in a few facts the forward pass branches on (biases, q/k norm per head or over
all heads, which layers attend within a sliding window and each layer type's RoPE, Gemma's (1 + w) norms,
where a block's norms sit (its input; both sides, Gemma; its output, OLMo 2 and EXAONE 4), scaled
embeddings, attention scale, Gemma 2's soft caps on scores and logits, and MLP activation); a config that
asks for anything else is refused here, before any weight is read, rather than run wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "olmo3",
    "exaone4",
    "seed_oss",
)
POST_NORM = ("olmo2", "olmo3", "exaone4")  # a block's norms on its output alone
QK_NORM = ("qwen3", "gemma3_text", *POST_NORM)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names of the two layer types
PRE, SANDWICH, POST = "pre", "sandwich", "post"  # a block's norms: on its input, on both sides, on its output
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> the forward's
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
class Rope:
    """One layer type's rotary embedding: its inverse frequencies (all 0: no positions, EXAONE 4's global
    layers) and the factor on its cos and sin (YaRN's attention scaling)."""

    inv_freq: tuple[float, ...]
    factor: float = 1.0


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
    rope: dict[str, Rope]  # per layer type (FULL and SLIDING, whichever the model has)
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the window of the sliding layers; None when there are none
    tie_embeddings: bool
    groups: tuple[GroupSpec, ...]
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w): Gemma stores w - 1
    norms: str = PRE  # where a block's RMS norms are: PRE (its input), SANDWICH (Gemma), POST (its output)
    qk_norm_full: bool = False  # OLMo 2: the q/k norms span all heads of q and k, not one head
    embed_scale: float = 1.0  # Gemma scales the embeddings by sqrt(hidden)
    attn_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores become cap·tanh(scores / cap) before the softmax
    final_softcap: float | None = None  # Gemma 2: and the logits likewise
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    eos_ids: tuple[int, ...] = ()  # config.json's end-of-sequence ids (Llama 3 and Gemma 3 list several)

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


def _refuse(family: str, problem: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"{family}: {problem} is not implemented by splitspec's forward pass")


def _rope(config: Any, family: str, head_dim: int) -> dict[str, Rope]:
    """Each layer type's RoPE from ``rope_parameters`` (one dict for every layer, or one per layer type as
    Gemma 3 and OLMo 3 have), computed by transformers' own initialisers, so every static kind it knows
    (linear, Llama 3's, YaRN) is the model's. Kinds that change with the sequence's length are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _get(config, "rope_parameters", None) or {}
    per_type = FULL in params or SLIDING in params
    out = {}
    for kind in (FULL, SLIDING):
        p = (params.get(kind) or params.get(FULL) or {}) if per_type else params
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            theta = float(p.get("rope_theta", _get(config, "rope_theta", 10000.0)))
            dim = int(head_dim * p.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0)))
            inv_freq, factor = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim), 1.0
        elif rope_type in ("linear", "llama3", "yarn"):
            layer_type = (kind if kind in params else FULL) if per_type else None
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        else:
            where = f" on the {kind} layers" if per_type else ""
            raise _refuse(family, f"rope scaling {rope_type!r}{where}")
        if 2 * inv_freq.numel() != head_dim:
            raise _refuse(family, "partial rotary embeddings")
        out[kind] = Rope(tuple(inv_freq.float().tolist()), float(factor))
    return out


def _layer_types(config: Any, n_layers: int, sliding: int | None) -> tuple[str, ...]:
    types = _get(config, "layer_types", None)
    if types is None:  # Llama, Mistral: one kind for every layer
        return (SLIDING if sliding is not None else FULL,) * n_layers
    types = tuple(types[:n_layers])
    unknown = set(types) - {FULL, SLIDING}
    if unknown:
        raise _refuse(config.model_type, f"layer type {sorted(unknown)[0]!r}")
    return types


def _check_gemma(config: Any) -> None:
    if _get(config, "use_bidirectional_attention", False):
        raise _refuse(config.model_type, "bidirectional attention")


def arch_spec(config: Any) -> ArchSpec:
    """Derive the spec from a transformers config (or anything with the same attributes)."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {family!r} is not supported; splitspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = family in ("gemma2", "gemma3_text")
    if gemma:
        _check_gemma(config)
    hidden = config.hidden_size
    n_heads = config.num_attention_heads
    n_kv = _get(config, "num_key_value_heads", n_heads)
    head_dim = _get(config, "head_dim", hidden // n_heads)
    inter = config.intermediate_size
    n_layers = config.num_hidden_layers
    attention_bias = bool(_get(config, "attention_bias", False))
    qkv_bias = family == "qwen2" or attention_bias
    o_bias = family != "qwen2" and bool(_get(config, "attention_out_bias", attention_bias))  # Seed-OSS: its own
    mlp_bias = bool(_get(config, "mlp_bias", False))
    act_name = _get(config, "hidden_activation", None) or _get(config, "hidden_act", "silu")
    if act_name not in ACTIVATIONS:
        raise _refuse(family, f"MLP activation {act_name!r}")
    rope = _rope(config, family, head_dim)
    sliding = _get(config, "sliding_window", None)  # transformers leaves it None where it is switched off
    if family == "exaone4" and sliding is not None:  # its hybrid form: the global layers see no positions
        rope[FULL] = Rope((0.0,) * (head_dim // 2))
    layer_types = _layer_types(config, n_layers, sliding)
    if SLIDING not in layer_types:
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
        GroupSpec("o", n_heads * head_dim, (LinearSpec("self_attn.o_proj", hidden, o_bias),)),
        GroupSpec(
            "gate_up",
            hidden,
            (LinearSpec("mlp.gate_proj", inter, mlp_bias), LinearSpec("mlp.up_proj", inter, mlp_bias)),
        ),
        GroupSpec("down", inter, (LinearSpec("mlp.down_proj", hidden, mlp_bias),)),
    )
    return ArchSpec(
        family=family,
        hidden=hidden,
        intermediate=inter,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab=config.vocab_size,
        rms_eps=float(config.rms_norm_eps),
        rope=rope,
        max_positions=int(_get(config, "max_position_embeddings", 4096)),
        qkv_bias=qkv_bias,
        qk_norm=family in QK_NORM,
        sliding_window=sliding,
        tie_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        groups=groups,
        layer_types=layer_types,
        norm_offset=1.0 if gemma else 0.0,
        norms=SANDWICH if gemma else POST if family in POST_NORM else PRE,
        qk_norm_full=family in ("olmo2", "olmo3"),
        embed_scale=hidden**0.5 if gemma else 1.0,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
        attn_softcap=_get(config, "attn_logit_softcapping", None),
        final_softcap=_get(config, "final_logit_softcapping", None),
        activation=ACTIVATIONS[act_name],
        eos_ids=eos_ids(config),
    )


def eos_ids(config: Any) -> tuple[int, ...]:
    """A model config's ``eos_token_id``, one id or a list of them, as a tuple (empty when it has none)."""
    eos = _get(config, "eos_token_id", ())
    return tuple(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]))


def end_ids(tokenizer: Any, config_eos: Sequence[int]) -> frozenset[int]:
    """The tokens that end a text: the tokenizer's end-of-sequence token and each one config.json lists
    (Llama 3's end of turn beside its end of text), as transformers' generate stops at any of them."""
    return frozenset(config_eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
