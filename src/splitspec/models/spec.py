"""The architecture facts every other component needs, read once from a HF config.

The converter, the CPU actors and the GPU actor's own forward pass all reason in terms of Linear
*groups*: the Linears of a decoder layer that read the same input (q/k/v; gate/up) are rotated with
one set of input signs and travel as one request, so the spec names them once, here.

The families differ only in a few facts the forward pass branches on (biases, q/k norm per head or over
all heads, which layers attend within a sliding window and each layer type's RoPE and heads (Gemma 4's
global layers: wider heads, fewer of them, V from K's projection, so their qkv and o groups have shapes
of their own), Gemma's (1 + w) norms, where a block's norms sit (its input; both sides, Gemma; its output,
OLMo 2 and EXAONE 4), scaled embeddings, attention scale (by position, Ministral 3), Gemma 2's soft caps
on scores and logits, MLP activation, Cohere's LayerNorms, attention and MLP side by side and scaled
logits, Gemma 4's V norm and per-layer scale on the residual stream, Qwen 3.5's gated attention and its
linear-attention layers, whose groups are their gated DeltaNet mixer's input and output projections); a
config that asks for anything else is refused here, before any weight is read, rather than run wrong.
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
    "glm4",
    "phi3",
    "ministral3",
    "cohere",
    "cohere2",
    "gemma4_text",
    "qwen3_5_text",
)
# multimodal models whose language model runs here (Gemma 3 ≥ 4B, Mistral Small 3.1+, Aya Vision, Qwen2.5-VL, Qwen3-VL,
# Gemma 4, Qwen 3.5)
WRAPPERS = ("gemma3", "mistral3", "aya_vision", "qwen2_5_vl", "qwen3_vl", "gemma4", "qwen3_5")
# a VL model's language model as the text model it extends: on text alone the three axes of its M-RoPE hold
# the same position, which makes it that model's plain RoPE
TEXT_AS = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
POST_NORM = ("olmo2", "olmo3", "exaone4")  # a block's norms on its output alone
INTERLEAVED = ("glm4", "cohere", "cohere2")  # RoPE over pairs of neighbouring dimensions
COHERE = ("cohere", "cohere2")  # LayerNorm (centred, no bias), attention and MLP side by side, scaled logits
GEMMA = ("gemma2", "gemma3_text", "gemma4_text")
QK_NORM = ("qwen3", "gemma3_text", "gemma4_text", "qwen3_5_text", *POST_NORM)
OFFSET_NORMS = ("gemma2", "gemma3_text", "qwen3_5_text")  # every RMSNorm scales by (1 + w)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names of the attention layer types
LINEAR = "linear_attention"  # Qwen 3.5's gated DeltaNet layers: a recurrent state instead of K/V
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> the forward's
GROUP_NAMES = ("qkv", "o", "gate_up", "down")


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not one whose layer structure splitspec knows."""


@dataclass(frozen=True)
class LinearSpec:
    name: str  # module path relative to the decoder layer, e.g. "self_attn.q_proj"
    d_out: int
    bias: bool
    fused: str | None = None  # the module whose rows these are, where the model fuses Linears (GLM-4's gate_up)
    first_row: int = 0  # and where in it they start

    @property
    def module(self) -> str:
        """The decoder layer's module that holds this Linear's weight."""
        return self.fused or self.name

    def rows_of(self, weight: Any) -> Any:
        """This Linear's rows of its module's weight (the whole weight where nothing is fused)."""
        return weight if self.fused is None else weight[self.first_row : self.first_row + self.d_out]


@dataclass(frozen=True)
class Norms:
    """A decoder layer's RMS norm modules by place, None where it has none: the attention block's and the
    MLP's input (folded into their groups' input rotation) and output (before the residual add)."""

    attn_in: str | None
    attn_out: str | None
    mlp_in: str | None
    mlp_out: str | None


PRE = Norms("input_layernorm", None, "post_attention_layernorm", None)  # Llama and most
SANDWICH = Norms(
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)
POST = Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo 2, EXAONE 4
GLM = Norms("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
PARALLEL = Norms("input_layernorm", None, "input_layernorm", None)  # Cohere: one norm feeds both blocks


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
class Heads:
    """One layer type's K/V heads: how many, their size, and whether V is K's projection (Gemma 4's global
    layers have no v_proj: V is k_proj's output before the k norm)."""

    n_kv: int
    dim: int
    k_is_v: bool = False


@dataclass(frozen=True)
class DeltaNet:
    """Qwen 3.5's linear-attention layers: q/k heads and value heads (each q/k head serves n_v / n_k value
    heads), their sizes and the short causal convolution's width. Each keeps a [n_v, k_dim, v_dim] state."""

    n_k: int
    n_v: int
    k_dim: int
    v_dim: int
    conv: int

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v as ``in_proj_qkv`` puts them out."""
        return 2 * self.n_k * self.k_dim + self.n_v * self.v_dim

    @property
    def state_values(self) -> int:
        """One layer's recurrent state and conv window, in fp32 elements (a sequence keeps two copies of
        each, ``DeltaState``)."""
        return self.n_v * self.k_dim * self.v_dim + (self.conv - 1) * self.conv_dim

    def sequence_bytes(self, layers: int) -> int:
        """What one sequence's ``DeltaState`` holds for ``layers`` such layers' states: two fp32 copies (the
        second is where a final pass folds in before it commits), pending entries aside."""
        return 2 * 4 * layers * self.state_values


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
    rope: dict[str, Rope]  # per layer type (FULL and SLIDING, whichever the model has), over that type's head_dim
    rope_order: tuple[int, ...] | None  # q's and k's head dimensions in the forward's RoPE order (``rope_order``)
    max_positions: int  # positions the model takes (config.json's; LongRoPE's original context): the longest context
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None  # the window of the sliding layers; None when there are none
    tie_embeddings: bool
    groups: tuple[GroupSpec, ...]
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w): Gemma stores w - 1
    norms: Norms = PRE  # which RMS norms a layer has, where: PRE, SANDWICH (Gemma), POST (OLMo 2), GLM
    qk_norm_full: bool = False  # OLMo 2: the q/k norms span all heads of q and k, not one head
    embed_scale: float = 1.0  # Gemma scales the embeddings by sqrt(hidden)
    attn_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores become cap·tanh(scores / cap) before the softmax
    final_softcap: float | None = None  # Gemma 2: and the logits likewise
    q_scale: tuple[float, int] | None = None  # Ministral 3: q at position p times 1 + β·log(1 + ⌊p / n⌋): (β, n)
    centered: bool = False  # Cohere: every norm is LayerNorm's (x - mean) / std · w, not RMS's
    parallel: bool = False  # Cohere: the MLP reads the block's input, not the attention's sum; both add to it
    logit_scale: float = 1.0  # Cohere: the logits times this
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    eos_ids: tuple[int, ...] = ()  # config.json's end-of-sequence ids (Llama 3 and Gemma 3 list several)
    full_heads: Heads | None = None  # Gemma 4: the FULL layers' heads, unlike the others' (then ``full_groups``)
    full_groups: tuple[GroupSpec, ...] = ()  # the FULL layers' groups where ``full_heads`` is set
    v_norm: bool = False  # Gemma 4: V through an RMS norm without weight
    layer_scale: bool = False  # Gemma 4: each layer's output stream times its ``layer_scalar``
    attn_gate: bool = False  # Qwen 3.5: q_proj puts out q | gate per head; attention's output times sigmoid(gate)
    delta_net: DeltaNet | None = None  # Qwen 3.5: the LINEAR layers' mixer (then ``linear_groups``)
    linear_groups: tuple[GroupSpec, ...] = ()  # the LINEAR layers' groups: the mixer's in and out projections

    def group(self, name: str, layer: int = 0) -> GroupSpec:
        for g in self.layer_groups(layer):
            if g.name == name:
                return g
        raise KeyError(f"no Linear group {name!r}; groups are {[g.name for g in self.groups]}")

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same heads and groups (all but Gemma 4 and Qwen 3.5)."""
        return self.full_heads is None and self.delta_net is None

    @property
    def linear_layers(self) -> int:
        """How many linear-attention layers the model has (Qwen 3.5's; 0 elsewhere)."""
        return self.layer_types.count(LINEAR)

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer`` is a linear-attention layer (Qwen 3.5's DeltaNet): no K/V, a recurrent state."""
        return self.layer_types[layer] == LINEAR

    def _reshaped(self, layer: int) -> bool:
        """Whether ``layer`` is a global layer with heads of its own (Gemma 4)."""
        return self.full_heads is not None and self.layer_types[layer] == FULL

    def heads(self, layer: int) -> Heads:
        """Layer ``layer``'s K/V heads (none in a linear-attention layer)."""
        if self.is_linear(layer):
            return Heads(0, self.head_dim)
        return self.full_heads if self._reshaped(layer) else Heads(self.n_kv_heads, self.head_dim)

    def layer_groups(self, layer: int) -> tuple[GroupSpec, ...]:
        """Layer ``layer``'s Linear groups."""
        if self.is_linear(layer):
            return self.linear_groups
        return self.full_groups if self._reshaped(layer) else self.groups

    def _kv_values(self, layers: Sequence[int]) -> int:
        return sum(2 * h.n_kv * h.dim for h in map(self.heads, layers))

    @property
    def kv_token_values(self) -> int:
        """One token's K and V elements over every layer (times an element's bytes: its K/V cache's size)."""
        return self._kv_values(range(self.n_layers))

    @property
    def sliding_token_values(self) -> int:
        """The part of ``kv_token_values`` in sliding-window layers (what K/V rings stop growing)."""
        sliding = self.sliding_window is not None
        return self._kv_values([i for i, kind in enumerate(self.layer_types) if sliding and kind == SLIDING])

    @property
    def linear_params(self) -> int:
        """The quantized Linears' weights over every layer."""
        return sum(g.d_in * g.d_out for i in range(self.n_layers) for g in self.layer_groups(i))


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _refuse(family: str, problem: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"{family}: {problem} is not implemented by splitspec's forward pass")


def _rope(config: Any, family: str, head_dims: dict[str, int]) -> tuple[dict[str, Rope], tuple[int, ...] | None]:
    """Each layer type's RoPE over its head size from ``rope_parameters`` (one dict for every layer, or one
    per layer type as Gemma 3 and OLMo 3 have), computed by transformers' own initialisers, so every static
    kind it knows (linear, Llama 3's, YaRN, Gemma 4's proportional) is the model's; and ``rope_order`` where
    it rotates part of each head, or its pairs interleaved. LongRoPE (Phi-3.5, Phi-4-mini) is static up to
    its original context, which then bounds the model's (``_positions``); NTK scaling that changes with the
    sequence's length is refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _get(config, "rope_parameters", None) or {}
    per_type = FULL in params or SLIDING in params
    out, widths = {}, {}
    for kind, head_dim in head_dims.items():
        p = (params.get(kind) or params.get(FULL) or {}) if per_type else params
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            theta = float(p.get("rope_theta", _get(config, "rope_theta", 10000.0)))
            dim = int(head_dim * p.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0)))
            inv_freq, factor = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim), 1.0
        elif rope_type in ("linear", "llama3", "yarn", "longrope", "proportional"):  # longrope: its short factors
            layer_type = (kind if kind in params else FULL) if per_type else None
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        else:
            where = f" on the {kind} layers" if per_type else ""
            raise _refuse(family, f"rope scaling {rope_type!r}{where}")
        widths[kind] = 2 * inv_freq.numel()
        pad = (0.0,) * (head_dim // 2 - inv_freq.numel())  # dimensions left unrotated: frequency 0
        out[kind] = Rope(tuple(inv_freq.float().tolist()) + pad, float(factor))
    interleaved = family in INTERLEAVED
    if len(set(head_dims.values())) > 1:  # Gemma 4: the forward's one RoPE form over each type's whole head
        if widths != head_dims or interleaved:
            raise _refuse(family, "a partial or interleaved RoPE with a head size per layer type")
        return out, None
    if len(set(widths.values())) > 1:
        raise _refuse(family, "a rotary width per layer type")
    return out, rope_order(head_dims[FULL], widths[FULL], interleaved)


def rope_order(head_dim: int, rotary: int, interleaved: bool) -> tuple[int, ...] | None:
    """The order of a head's dimensions (the same for q and k, so their products are unchanged) in which
    the model's RoPE is the forward's one form: dimension j paired with j + head_dim / 2, at frequency j
    (0 past the rotated ones). Models pair (2i, 2i + 1) (GLM-4) or (i, i + rotary / 2), over the first
    ``rotary`` dimensions; None where the order is already the forward's."""
    half, r = head_dim // 2, rotary // 2
    if rotary == head_dim and not interleaved:
        return None
    pairs = [(2 * i, 2 * i + 1) if interleaved else (i, i + r) for i in range(r)]
    rest = list(range(rotary, head_dim))
    pairs += [(rest[2 * k], rest[2 * k + 1]) for k in range(half - r)]
    return tuple(a for a, _ in pairs) + tuple(b for _, b in pairs)


def _layer_types(config: Any, n_layers: int, sliding: int | None) -> tuple[str, ...]:
    types = _get(config, "layer_types", None)
    if types is None:  # Llama, Mistral: one kind for every layer
        return (SLIDING if sliding is not None else FULL,) * n_layers
    types = tuple(types[:n_layers])
    unknown = set(types) - {FULL, SLIDING, *((LINEAR,) if config.model_type == "qwen3_5_text" else ())}
    if unknown:
        raise _refuse(config.model_type, f"layer type {sorted(unknown)[0]!r}")
    return types


def _check_gemma(config: Any) -> None:
    # Gemma 4 31B's "vision" makes only image tokens see each other: text alone stays causal
    if _get(config, "use_bidirectional_attention", None) in (True, "all"):
        raise _refuse(config.model_type, "bidirectional attention")
    if config.model_type != "gemma4_text":
        return
    refused = {
        "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 4 E2B/E4B)",
        "num_kv_shared_layers": "K/V shared across layers (Gemma 4 E2B/E4B)",
        "enable_moe_block": "mixture-of-experts blocks (Gemma 4 26B-A4B)",
    }
    for name, what in refused.items():
        if _get(config, name, False):
            raise _refuse(config.model_type, what)


def _heads(config: Any, family: str) -> tuple[int, int, Heads | None]:
    """(kv heads, head size) of the model's layers, Gemma 4's sliding ones, and Gemma 4's global layers'
    ``Heads`` where they differ (None elsewhere): its config holds them per layer (``per_layer_config``)."""
    if family != "gemma4_text":
        n_heads = config.num_attention_heads
        head_dim = _get(config, "head_dim", config.hidden_size // n_heads)
        return _get(config, "num_key_value_heads", n_heads), head_dim, None
    local, full = config.per_layer_config[SLIDING], config.per_layer_config[FULL]
    heads = Heads(full.num_key_value_heads, full.head_dim, bool(_get(config, "attention_k_eq_v", False)))
    same = heads == Heads(local.num_key_value_heads, local.head_dim)
    return local.num_key_value_heads, local.head_dim, None if same else heads


def text_config(config: Any) -> Any:
    """The config of the language model a multimodal wrapper holds, with the wrapper's end-of-sequence ids
    where it has them (Gemma 3's end of turn) and its word embeddings tied as the wrapper ties them (the
    wrapper's flag is the one transformers follows), a VL model's as the text model's it extends
    (``TEXT_AS``: its tensors have that model's names); any other config as it is."""
    if getattr(config, "model_type", None) not in WRAPPERS:
        return config
    text = config.text_config
    for name in ("eos_token_id", "tie_word_embeddings"):
        if getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    if text.model_type in TEXT_AS:
        from transformers import AutoConfig

        fields = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures")}
        rope = {k: v for k, v in (fields.get("rope_parameters") or {}).items() if not k.startswith("mrope")}
        text = AutoConfig.for_model(TEXT_AS[text.model_type], **(fields | {"rope_parameters": rope}))
    return text


def arch_spec(config: Any) -> ArchSpec:
    """Derive the spec from a transformers config (or anything with the same attributes); a multimodal
    wrapper's from its language model's (the vision tower does not run here)."""
    config = text_config(config)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {family!r} is not supported; splitspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gemma = family in GEMMA
    if gemma:
        _check_gemma(config)
    if _get(config, "use_qk_norm", False):
        raise _refuse(family, "q/k LayerNorms (use_qk_norm)")
    hidden = config.hidden_size
    n_heads = config.num_attention_heads
    n_kv, head_dim, full_heads = _heads(config, family)
    inter = config.intermediate_size
    n_layers = config.num_hidden_layers
    attention_bias = bool(_get(config, "attention_bias", False))
    qkv_bias = family == "qwen2" or attention_bias
    o_bias = family not in ("qwen2", "glm4") and bool(_get(config, "attention_out_bias", attention_bias))
    mlp_bias = bool(_get(config, "mlp_bias", False))
    fused_qkv = "self_attn.qkv_proj" if family == "phi3" else None  # one module, rows q | k | v
    fused_mlp = "mlp.gate_up_proj" if family in ("glm4", "phi3") else None  # rows gate | up
    act_name = _get(config, "hidden_activation", None) or _get(config, "hidden_act", "silu")
    if act_name not in ACTIVATIONS:
        raise _refuse(family, f"MLP activation {act_name!r}")
    full_dim = head_dim if full_heads is None else full_heads.dim
    rope, order = _rope(config, family, {FULL: full_dim, SLIDING: head_dim})
    sliding = _get(config, "sliding_window", None)  # transformers leaves it None where it is switched off
    if family in ("exaone4", "cohere2") and sliding is not None:  # hybrid: the global layers see no positions
        rope[FULL] = Rope((0.0,) * (head_dim // 2))
    layer_types = _layer_types(config, n_layers, sliding)
    if SLIDING not in layer_types:
        sliding = None

    gated = family == "qwen3_5_text"

    def groups_of(heads: Heads) -> tuple[GroupSpec, ...]:
        q_rows, kv_rows = n_heads * heads.dim, heads.n_kv * heads.dim
        q_out = 2 * q_rows if gated else q_rows  # Qwen 3.5: each head's q, then its gate
        qkv = (["q", "k"], [q_out, kv_rows]) if heads.k_is_v else (["q", "k", "v"], [q_out, kv_rows, kv_rows])
        return (
            GroupSpec("qkv", hidden, _linears(*qkv, qkv_bias, "self_attn.", fused_qkv)),
            GroupSpec("o", q_rows, (LinearSpec("self_attn.o_proj", hidden, o_bias),)),
            GroupSpec("gate_up", hidden, _linears(["gate", "up"], [inter, inter], mlp_bias, "mlp.", fused_mlp)),
            GroupSpec("down", inter, (LinearSpec("mlp.down_proj", hidden, mlp_bias),)),
        )

    gemma4 = family == "gemma4_text"
    delta_net = _delta_net(config) if LINEAR in layer_types else None
    groups = groups_of(Heads(n_kv, head_dim))
    return ArchSpec(
        family=family,
        hidden=hidden,
        intermediate=inter,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab=config.vocab_size,
        rms_eps=float(_get(config, "rms_norm_eps", None) or config.layer_norm_eps),
        rope=rope,
        rope_order=order,
        max_positions=_positions(config),
        qkv_bias=qkv_bias,
        qk_norm=family in QK_NORM,
        sliding_window=sliding,
        tie_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        groups=groups,
        layer_types=layer_types,
        norm_offset=1.0 if family in OFFSET_NORMS else 0.0,  # Gemma 4's norms scale by w
        norms=_norms(family, gemma),
        qk_norm_full=family in ("olmo2", "olmo3"),
        embed_scale=hidden**0.5 if gemma else 1.0,
        attn_scale=(1.0 if gemma4 else float(config.query_pre_attn_scalar) ** -0.5) if gemma else None,
        attn_softcap=_get(config, "attn_logit_softcapping", None),
        final_softcap=_get(config, "final_logit_softcapping", None),
        q_scale=_q_scale(config),
        centered=family in COHERE,
        parallel=family in COHERE,
        logit_scale=float(_get(config, "logit_scale", 1.0)),
        activation=ACTIVATIONS[act_name],
        eos_ids=eos_ids(config),
        full_heads=full_heads,
        full_groups=() if full_heads is None else groups_of(full_heads),
        v_norm=gemma4,
        layer_scale=gemma4,
        attn_gate=gated,
        delta_net=delta_net,
        linear_groups=() if delta_net is None else _linear_groups(delta_net, hidden, groups[2:]),
    )


def _delta_net(config: Any) -> DeltaNet:
    net = DeltaNet(
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
    )
    if net.n_v % net.n_k or net.conv < 2:  # each q/k head serves n_v / n_k value heads; a conv sees its past
        raise _refuse(config.model_type, f"{net.n_v} value heads over {net.n_k} key heads, conv of {net.conv}")
    return net


def _linear_groups(net: DeltaNet, hidden: int, mlp: tuple[GroupSpec, ...]) -> tuple[GroupSpec, ...]:
    """A linear-attention layer's groups: its four input projections read the normed input as q/k/v do
    (one group, "qkv"), its output projection is the "o" group, its MLP as the attention layers' one."""
    v_rows = net.n_v * net.v_dim
    rows = {"in_proj_qkv": net.conv_dim, "in_proj_z": v_rows, "in_proj_b": net.n_v, "in_proj_a": net.n_v}
    return (
        GroupSpec("qkv", hidden, tuple(LinearSpec(f"linear_attn.{n}", r, False) for n, r in rows.items())),
        GroupSpec("o", v_rows, (LinearSpec("linear_attn.out_proj", hidden, False),)),
        *mlp,
    )


def _norms(family: str, gemma: bool) -> Norms:
    """Which RMS norms a family's decoder layer has, where (``Norms``)."""
    if gemma:
        return SANDWICH
    if family in POST_NORM:
        return POST
    return GLM if family == "glm4" else PARALLEL if family in COHERE else PRE


def _positions(config: Any) -> int:
    """The positions the model takes here: config.json's ``max_position_embeddings``, or with LongRoPE its
    original context, past which transformers switches every position to the long factors (one RoPE for
    the whole sequence, which a K/V cache written with the short ones cannot follow)."""
    limit = int(_get(config, "max_position_embeddings", 4096))
    params = _get(config, "rope_parameters", None) or {}
    for p in params.values() if FULL in params or SLIDING in params else [params]:
        if (p or {}).get("rope_type") == "longrope":
            limit = min(limit, int(p["original_max_position_embeddings"]))
    return limit


def _q_scale(config: Any) -> tuple[float, int] | None:
    """Llama 4's scaling of q by position, as Ministral 3 has it: (β, the positions a step spans), or None."""
    rope = _get(config, "rope_parameters", None) or {}
    beta = rope.get("llama_4_scaling_beta")
    return None if beta is None else (float(beta), int(rope["original_max_position_embeddings"]))


def _linears(names: list[str], rows: list[int], bias: bool, prefix: str, fused: str | None) -> tuple[LinearSpec, ...]:
    """A group's Linears (``prefix`` + name + "_proj"); where the model fuses them into one module, each
    with its rows' place in it."""
    starts = [sum(rows[:i]) if fused else 0 for i in range(len(rows))]
    return tuple(
        LinearSpec(f"{prefix}{name}_proj", n, bias, fused, start)
        for name, n, start in zip(names, rows, starts, strict=True)
    )


def eos_ids(config: Any) -> tuple[int, ...]:
    """A model config's ``eos_token_id``, one id or a list of them, as a tuple (empty when it has none)."""
    eos = _get(config, "eos_token_id", ())
    return tuple(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]))


def end_ids(tokenizer: Any, config_eos: Sequence[int]) -> frozenset[int]:
    """The tokens that end a text: the tokenizer's end-of-sequence token and each one config.json lists
    (Llama 3's end of turn beside its end of text), as transformers' generate stops at any of them."""
    return frozenset(config_eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
