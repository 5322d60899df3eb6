"""The engine's own decoder forward pass with the split verifier (every family ``models.spec`` admits).

Not transformers modules: every decoder Linear is one of four *groups* per layer (qkv, o, gate_up, down)
computed from the packed 2-bit base plus a residual source, with the activation rotated once per group
(recipe, section 4). Per group: x' = H_i·S_i·x, ``residual.submit(x')``, y_b = Q_base·x' while the CPU
actors work, y_r = ``residual.gather``, then each Linear's rows are rotated back, y = S_o·H_oᵀ·(y_b + y_r),
with H of the converted folder's rotation kind.
The same weights serve the draft (``NoResidual``) and the verifier, so the residual is a per-call
argument, not part of the model.

Embeddings, norms, attention and lm_head stay fp32 (logits in fp32, recipe section 9). Positions and the
attention mask are the caller's, so a draft tree (siblings sharing a position, a tree-shaped mask) runs
through the same code as plain decoding. The families' differences are the ``ArchSpec``'s facts: each
layer's type picks its RoPE table, whether the sliding window narrows its mask, and its heads (Gemma 4's
global layers: their own size and count, V from K's projection); Gemma's (1 + w) norms are folded into
the stored weights once, so every norm is the same ``rms_norm``. Qwen 3.5's linear-attention layers mix
tokens by the gated delta rule instead (``delta_rule``), over the tree the same mask describes, from the
recurrent state the cache keeps beside its K/V (``DeltaState``); its q/k/v and o groups are the mixer's
input and output projections.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import astuple, dataclass, fields
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from splitspec.config import check_activations
from splitspec.gpu_actor.delta_rule import conv_window, fold, mix_rows, subnormals_flushed
from splitspec.gpu_actor.delta_state import DeltaState
from splitspec.gpu_actor.heads import Int8Head, Int16Head, verifier_head
from splitspec.gpu_actor.kernels import BaseProduct, cpu_step
from splitspec.gpu_actor.kernels.rotation import Rotation
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.residual import Lanes, NoResidual, RemoteResidual, Residual
from splitspec.kernels.cpu_base.kernel import thread_count
from splitspec.kernels.shard import base_share_from
from splitspec.models.spec import FULL, LINEAR, SLIDING, ArchSpec
from splitspec.protocol import HEAD, HEAD_TOKENS, RemoteError
from splitspec.quantize.format import CODE_WORD, ConvertedModel


@dataclass
class PassStats:
    """Seconds spent in the parts of forward passes (accumulated over the passes it is given to).

    ``submit_s`` is this process's side of the channel (writing x' into the slots and posting);
    ``wait_s`` is the time blocked in ``gather`` (or ``add_into``, which also adds y_r into the base's
    output): the residual's compute not hidden behind the base product, plus the channel's latency.
    ``head_s`` is the final norm and lm_head (a fixed cost per pass, whatever the depth). ``round_trips``
    counts group requests (4 per layer per pass).
    """

    total_s: float = 0.0
    base_s: float = 0.0
    submit_s: float = 0.0
    wait_s: float = 0.0
    attention_s: float = 0.0
    head_s: float = 0.0
    round_trips: int = 0

    def ms(self) -> list[float]:
        """total, base, wait, submit, attention and head, in milliseconds."""
        return [t * 1e3 for t in (self.total_s, self.base_s, self.wait_s, self.submit_s, self.attention_s, self.head_s)]

    def add(self, other: PassStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


Clock = Callable[[], float]


def device_clock(device: torch.device) -> Clock:
    """perf_counter, on CUDA after waiting for the device: its kernels are asynchronous, so a plain clock
    would charge their time to whichever later call happens to block. On the CPU perf_counter itself (a
    pass reads the clock ~18 times a layer: a wrapper's call would cost more than the reading)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced


def no_clock() -> float:
    """The clock of a pass whose parts nobody reads: on CUDA a synced clock would wait for the device ~18
    times a layer."""
    return 0.0


Pending = list[tuple[slice, Any]]  # a group's requests to the residual: each one's rows and handle


def submit_chunks(residual: Residual, layer: int, group: str, x: Tensor, step: int | None = None) -> Pending:
    """``residual.submit`` of ``x``'s rows in requests of at most ``step`` rows each (default: the residual's
    ``max_tokens``; none: all of them): each request's rows and handle, in row order."""
    n = x.shape[0]
    step = step or getattr(residual, "max_tokens", None) or n
    if step >= n:
        return [(slice(None), residual.submit(layer, group, x))]
    return [(slice(i, i + step), residual.submit(layer, group, x[i : i + step])) for i in range(0, n, step)]


def add_chunks(residual: Residual, pending: Pending, out: Tensor) -> None:
    """Each request's y_r added into its rows of ``out`` (``residual.add_into``). Where an actor refused one
    (``RemoteError``: the channel stays up, the engine keeps its clients), the later ones are still
    gathered, so that their slots come back; then the first refusal is raised. A lost or hung actor ends
    the loop at once: the engine reconnects, and waiting out each later request would take a timeout each."""
    refused = None
    for rows, handle in pending:
        try:
            residual.add_into(handle, out[rows])
        except RemoteError as e:
            refused = refused or e
    if refused is not None:
        raise refused


def _count_compiled(stats: PassStats, times: np.ndarray, leased: list[Lanes], steps: int) -> None:
    """What compiled code timed of a pass (``cpu_step.TIMES``) into ``stats``, and its round trips: one a
    group per request's rows of each ``leased`` lanes, to all actors at once."""
    part = times.tolist()  # Python floats, as the other paths count
    stats.submit_s += part[cpu_step.SUBMIT_S]
    stats.base_s += part[cpu_step.BASE_S]
    stats.wait_s += part[cpu_step.WAIT_S] + part[cpu_step.HELD_S]  # as gather counts the held rows
    stats.attention_s += part[cpu_step.ATTENTION_S]
    for lanes in leased:
        lanes.held(part[cpu_step.HELD_S])
    stats.round_trips += steps * sum(lanes.chunks for lanes in leased)


def base_share(residual: Residual) -> float:
    """The part of every group's base (its rows' last code words) whose product the CPU actors behind
    ``residual`` add into their replies to requests of ``BASE_SHARE_TOKENS`` rows or more
    (``EngineConfig.base_share``); 0 for the others."""
    return getattr(residual, "base_share", 0.0)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def sdpa(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor | str | None,
    softcap: float | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Attention of q [n, heads, head_dim] (scale folded in) over keys and values [slots, kv heads,
    head_dim]: [n, heads · head_dim], into ``out`` (contiguous, q's dtype) when given. ``mask`` [n, slots]
    (True = attend), ``CAUSAL`` or None (all). With ``softcap`` (Gemma 2) the scores are capped before the
    softmax, which sdpa cannot do: the products are written out. A cache of another element
    (``EngineConfig.kv_dtype``) takes q in its own, and the output comes back in q's."""
    n, heads, dim = q.shape
    target = (torch.empty(n, heads * dim, dtype=q.dtype, device=q.device) if out is None else out).view(n, heads, dim)
    q, keys, values = q.transpose(0, 1).to(keys.dtype), keys.transpose(0, 1), values.transpose(0, 1)
    if softcap is not None:
        group = q.shape[0] // keys.shape[0]
        scores = capped(q @ keys.repeat_interleave(group, 0).transpose(1, 2), softcap)
        if mask is CAUSAL:
            mask = torch.ones(n, keys.shape[1], dtype=torch.bool, device=q.device).tril(keys.shape[1] - n)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        target.copy_((torch.softmax(scores, -1) @ values.repeat_interleave(group, 0)).transpose(0, 1))
    else:
        _causal_blocks(q, keys, values, mask, target)
    return target.view(n, heads * dim)


def _sdpa_call(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | str | None) -> Tensor:
    """sdpa of q [heads, n, head_dim] over keys and values [kv heads, slots, head_dim]."""
    causal = mask is CAUSAL
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=None if causal else mask, is_causal=causal, scale=1.0,
        enable_gqa=True,
    )[0]  # fmt: skip


def _causal_blocks(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | str | None, out: Tensor) -> None:
    """``_sdpa_call`` into out [n, heads, head_dim]; on the CPU, for a long pass whose rows see no slot past
    their own (a prompt's chunk, a tree in its order), ``SDPA_BLOCK`` query rows at a time, each block
    against the slots up to its last row's, which measured faster than one call over the whole pass. The
    same sums per row."""
    n, slots = q.shape[1], keys.shape[1]
    blocks = q.device.type == "cpu" and n >= 2 * SDPA_BLOCK and mask is not None
    # an explicit mask in which a row sees a later slot keeps them all: one call
    if not blocks or (mask is not CAUSAL and bool(mask.triu(slots - n + 1).any())):
        out.copy_(_sdpa_call(q, keys, values, mask).transpose(0, 1))
        return
    seen = torch.ones(n, slots, dtype=torch.bool).tril_(slots - n) if mask is CAUSAL else mask
    for first in range(0, n, SDPA_BLOCK):
        end = min(n, first + SDPA_BLOCK)
        limit = slots - n + end
        part = _sdpa_call(q[:, first:end], keys[:, :limit], values[:, :limit], seen[first:end, :limit])
        out[first:end].copy_(part.transpose(0, 1))


def gated(out: Tensor, gate: Tensor | None) -> Tensor:
    """Attention's output times sigmoid(gate) (Qwen 3.5's, ``SplitModel._gate_split``), in place."""
    return out if gate is None else out.mul_(torch.sigmoid(gate))


def capped(x: Tensor, cap: float | None) -> Tensor:
    """cap · tanh(x / cap), Gemma 2's soft cap on attention scores and logits (x itself without a cap)."""
    return x if cap is None else torch.tanh(x / cap) * cap


# From this many new tokens of one sequence on, RoPE is two products with cos/sin over the whole block
# rather than a [head_dim, head_dim] matrix per token (one batched product, the cheaper for a few tokens).
ROPE_TABLE_TOKENS = 16

GROUPS = ("qkv", "o", "gate_up", "down")  # a layer's Linear groups, in ``cpu_step``'s order

MAX_GRAPHS = 16  # recorded steps kept (``SplitModel._replay``): a tree's level widths, its check, a few caches
CHAIN_BLOCK = 64  # rows of a prompt's chunk a linear-attention layer takes at a time (``SplitModel._mix``)
CAUSAL = "causal"  # a block's mask that is the plain lower triangle from slot 0: sdpa's own ``is_causal``
SDPA_BLOCK = 64  # query rows a CPU sdpa call takes at a time in a long causal pass (``_causal_blocks``)
PART_ROWS = 32  # the fewest rows a part of a pass in parts carries (``SplitModel.prefill_parts``)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin [n, 1, head_dim] of a block's positions (a factor such as the attention scale folded into
    both): x·R = x·cos + rotate_half(x)·sin as products over the whole block, no per-token matrices."""

    cos: Tensor
    sin: Tensor

    def apply(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [n, heads, head_dim] rotated, into ``out`` when given."""
        half = x.shape[-1] // 2
        out = torch.mul(x, self.cos, out=out)
        out[..., :half].addcmul_(x[..., half:], self.sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], self.sin[..., half:])
        return out


Rope = Tensor | RopeTables  # a block's RoPE: per-token matrices [n, head_dim, head_dim], or its tables


def _apply_rope(x: Tensor, rope: Rope, out: Tensor | None = None) -> Tensor:
    return torch.bmm(x, rope, out=out) if isinstance(rope, Tensor) else rope.apply(x, out)


class SplitGroup:
    """One Linear group of one layer: packed base, signs, row slices and rotation kind, on the model's device.

    The input rotation and each output rotation are ``Rotation``s built once. Consecutive Linears of one
    width (k and v, gate and up) are rotated back in one call on a [n, count, width] view of their rows,
    with their signs stacked: fewer, larger operations per layer.

    ``norm`` (the RMS norm in front of the group, its weight) is folded into the input rotation: H·S·(w ⊙
    x/rms(x)) = H·(S ⊙ w)·x · 1/rms(x), the weight merged with the signs once and the row's 1/rms scaling x'
    after the rotation (a linear map), so the norm costs one reduction per call, not a pass of its own. With
    √d merged into the signs too, 1/rms(x) = √d / hypot(‖x‖, √(d·eps)): a norm and a hypot, two calls.
    ``center`` (a LayerNorm, Cohere's) takes each row's mean off x first: the rest is the same."""

    def __init__(
        self,
        model: ConvertedModel,
        layer: int,
        name: str,
        dense: dict[str, Tensor],
        device: torch.device,
        norm: Tensor | None = None,
        eps: float = 0.0,
        tiled: bool | None = None,
        center: bool = False,
    ) -> None:
        layout = model.group(layer, name)
        codes, scale = model.base(layer, name)
        s_i, s_os = layout.signs()
        self.layer, self.name = layer, name
        self.codes, self.scale = codes.to(device), scale.to(device)
        self.base = BaseProduct(self.codes, self.scale, model.levels.to(device), tiled)
        d_in = s_i.shape[0]
        signs_in = s_i if norm is None else s_i.to(norm.device, norm.dtype) * norm * d_in**0.5
        self.rotate_in = Rotation(d_in, model.rotation, False, signs_in, device=device)
        # √(d·eps), the hypot's second leg (see the docstring); None: no norm in front of this group
        self._eps_leg = None if norm is None else torch.tensor((d_in * eps) ** 0.5, device=device)
        self.center = center and norm is not None
        # runs of consecutive Linears of equal width: (first row, width, count, their output rotation)
        self.runs: list[tuple[int, int, int, Rotation]] = []
        i = 0
        while i < len(layout.linears):
            rows, j = layout.linears[i]["rows"], i
            while j < len(layout.linears) and layout.linears[j]["rows"] == rows:
                j += 1
            signs = torch.stack(s_os[i:j])
            rotation = Rotation(rows, model.rotation, True, signs, device=device)
            self.runs.append((layout.linears[i]["row_offset"], rows, j - i, rotation))
            i = j
        self.linears = [lin["name"] for lin in layout.linears]
        bias_names = [f"model.layers.{layer}.{name}.bias" for name in self.linears]
        self.biases = [dense[b].to(device, torch.float32).contiguous() if b in dense else None for b in bias_names]
        self._any_bias = any(b is not None for b in self.biases)

    def step_fields(self) -> tuple[list[int], float] | None:
        """This group's fields of ``cpu_step``'s layer table and its eps leg (``cpu_step.NO_NORM`` without a
        norm), or None where a part of it does not run there (a GPU, a rotation ``kron`` does not take)."""
        base = self.base.cpu_fields
        rotations = [self.rotate_in.kron_fields] + [rotation.kron_fields for *_, rotation in self.runs]
        too_many = len(self.runs) > cpu_step.MAX_RUNS or len(self.linears) > cpu_step.MAX_LINEARS
        if base is None or None in rotations or too_many:
            return None
        fields = [0] * cpu_step.GROUP
        fields[cpu_step.BASE : cpu_step.BASE + len(base)] = base
        fields[cpu_step.ROTATE_IN : cpu_step.ROTATE_IN + cpu_step.KRON] = rotations[0]
        fields[cpu_step.RUNS] = len(self.runs)
        for k, ((first, width, count, _), kron) in enumerate(zip(self.runs, rotations[1:], strict=True)):
            at = cpu_step.RUNS + 1 + k * cpu_step.RUN
            fields[at : at + cpu_step.RUN] = (first, width, count, *kron)
        for i, bias in enumerate(self.biases):
            fields[cpu_step.BIASES + i] = 0 if bias is None else bias.data_ptr()
        return fields, cpu_step.NO_NORM if self._eps_leg is None else float(self._eps_leg)

    def product(self, x: Tensor, residual: Residual, stats: PassStats, clock: Clock) -> Tensor:
        """y' = (Q_base + Q_resid)·x' [n, rows], still in the rotated output basis."""
        if self.center:
            x = x - x.mean(dim=-1, keepdim=True)
        x_rot = self.rotate_in(x)
        if self._eps_leg is not None:
            x_rot.div_(torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), self._eps_leg))
        t0 = clock()
        pending = submit_chunks(residual, self.layer, self.name, x_rot)
        t1 = clock()
        share = base_share(residual)
        q = cpu_step.shared_tokens(x_rot.shape[0], residual.max_tokens) if share else 0
        if q:  # the replies to a prompt's requests carry the base's last code words: they add them in
            y = torch.empty(x_rot.shape[0], self.base.rows)
            self.base(x_rot[:q], y[:q], base_share_from(self.base.d_in // CODE_WORD, share))
            self.base(x_rot[q:], y[q:])
        else:
            y = self.base(x_rot)
        t2 = clock()
        add_chunks(residual, pending, y)
        t3 = clock()
        stats.submit_s += t1 - t0
        stats.base_s += t2 - t1
        stats.wait_s += t3 - t2
        stats.round_trips += len(pending)
        return y

    def __call__(self, x: Tensor, residual: Residual, stats: PassStats, clock: Clock) -> list[Tensor]:
        """Each Linear's output [n, its rows], bias included."""
        y = self.product(x, residual, stats, clock)
        n = y.shape[0]
        outs = []
        for first, width, count, rotation in self.runs:
            if count == 1:
                outs.append(rotation(y[:, first : first + width]))
            else:
                outs += rotation(y[:, first : first + width * count].view(n, count, width)).unbind(1)
        if not self._any_bias:
            return outs
        return [o if b is None else o + b for o, b in zip(outs, self.biases, strict=True)]

    def add_into(self, h: Tensor, x: Tensor, residual: Residual, stats: PassStats, clock: Clock) -> Tensor:
        """h += the group's output, in place, for a group of one Linear (o, down): the output rotation's
        signs and the residual stream's add are one fused call."""
        ((_, _, count, rotation),) = self.runs
        if count != 1:
            raise ValueError(f"add_into takes a group of one Linear; {self.name!r} has {count}")
        rotation.add_to(h, self.product(x, residual, stats, clock))
        return h if self.biases[0] is None else h.add_(self.biases[0])


class _Layer:
    """One decoder layer's norms (offset folded in) and groups. ``attn_in`` and ``mlp_in`` norm each block's
    input, ``attn_out`` and ``mlp_out`` its output, whichever the model has (``ArchSpec.norms``)."""

    def __init__(
        self, model: ConvertedModel, i: int, dense: dict[str, Tensor], device: torch.device, tiled: bool | None
    ) -> None:
        spec = model.spec
        prefix = f"model.layers.{i}."

        def norm(name: str) -> Tensor:
            return (dense[prefix + name + ".weight"] + spec.norm_offset).to(device)

        self.kind = spec.layer_types[i]
        self.heads = spec.heads(i)
        # Gemma 4: the layer's output stream times its scalar (None: 1)
        self.scalar = dense[prefix + "layer_scalar"].to(device) if spec.layer_scale else None
        in_out = (None if name is None else norm(name) for name in astuple(spec.norms))  # as ``Norms`` orders them
        self.attn_in, self.attn_out, self.mlp_in, self.mlp_out = in_out
        self.q_norm = self.k_norm = None
        if spec.qk_norm and self.kind != LINEAR:
            self.q_norm, self.k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        if self.kind == LINEAR:  # Qwen 3.5's mixer: conv [C, K], -exp(A_log), dt bias, gated norm (w, no offset)
            mixer = prefix + "linear_attn."
            self.conv = dense[mixer + "conv1d.weight"].squeeze(1).to(device)
            self.neg_a = -dense[mixer + "A_log"].float().exp().to(device)
            self.dt_bias = dense[mixer + "dt_bias"].float().to(device)
            self.gate_norm = dense[mixer + "norm.weight"].float().to(device)
            self.state_index = spec.layer_types[:i].count(LINEAR)
        self.qk_norm_full = spec.qk_norm_full
        # each block's input norm feeds one group alone: folded into that group's input rotation
        norms = {"qkv": self.attn_in, "gate_up": self.mlp_in}
        self.groups = {
            name: SplitGroup(model, i, name, dense, device, norms.get(name), spec.rms_eps, tiled, spec.centered)
            for name in model.layers[i]
        }

    def step_row(self) -> tuple[list[int], list[float]] | None:
        """This layer's row of ``cpu_step``'s table and its groups' eps legs, or None where it cannot run there."""
        order = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
        if set(self.groups) != set(GROUPS):
            return None
        for name, want in order.items():  # the kernel reads q, k, v and gate, up in this row order
            if tuple(lin.rsplit(".", 1)[-1] for lin in self.groups[name].linears) != want:
                return None
        parts = [self.groups[name].step_fields() for name in GROUPS]
        norms = (self.attn_out, self.mlp_out, self.q_norm, self.k_norm)
        if None in parts or any(w is not None and (w.dtype != torch.float32 or not w.is_contiguous()) for w in norms):
            return None
        row = [f for fields, _ in parts for f in fields] + [0 if w is None else w.data_ptr() for w in norms]
        return [*row, 0 if self.kind == FULL else 1, int(self.qk_norm_full)], [eps_leg for _, eps_leg in parts]


@dataclass
class Segment:
    """One sequence's part of a forward pass: its new tokens, its cache, and (optionally) their positions,
    the mask over cached + new slots, and whether only the last position's logits are wanted."""

    tokens: Tensor
    cache: KVCache
    positions: Tensor | None = None
    mask: Tensor | None = None
    last_only: bool = False


class SplitModel:
    """The decoder of a converted folder on one device; ``forward`` runs n new tokens through it.

    ``head``: the verifier's lm_head, one of ``VERIFIER_HEADS`` (``heads.verifier_head``).
    ``draft_head="int8"`` gives the draft (``forward(draft=True)``) its own int8 copy of the lm_head
    (``Int8Head``, CPU only); ``"fp32"`` shares the verifier's. ``activations``: how the residual multiplies
    x' (``EngineConfig.activations``); with "int16" a CPU base product of many tokens may run on AMX tiles,
    which round x' the same way (``cpu_base.tiles``), so that the whole Linear takes one rounding of x';
    otherwise the base stays on its fp32 paths. ``cuda_graphs`` (CUDA only) replays draft steps and checks
    of one sequence as recorded CUDA graphs (``draft_step``, ``verify_step``). ``prefill_parts``: how many
    parts of its rows a long causal pass through the CPU actors' leased slots runs in as a wavefront
    (``EngineConfig.prefill_parts``, ``cpu_step.parts_layers``)."""

    def __init__(
        self,
        model: ConvertedModel,
        device: str | torch.device = "cpu",
        draft_head: str = "int8",
        head: str = "int16",
        activations: str = "int16",
        cuda_graphs: bool = False,
        kv_dtype: str = "float32",
        ring_slack: int = 0,
        prefill_parts: int = 1,
    ) -> None:
        spec = model.spec
        self.spec: ArchSpec = spec
        self.device = torch.device(device)
        self.conversion_id, self.folder = model.conversion_id, model.folder
        self._clock = device_clock(self.device)
        dense = model.dense()
        weight = dense[model.head_name].to(self.device)
        self.lm_head = weight  # [vocab, hidden] as loaded; a tied embedding looks its rows up in it
        self.embed = self.lm_head if spec.tie_embeddings else dense["model.embed_tokens.weight"].to(self.device)
        # Cohere's logit scale folded into the final norm's weight: the head is linear
        self.norm = ((dense["model.norm.weight"] + spec.norm_offset) * spec.logit_scale).to(self.device)
        self._embed_scale = torch.tensor(spec.embed_scale, dtype=torch.float32, device=self.device)
        if draft_head not in ("int8", "fp32"):
            raise ValueError(f"draft_head must be int8 or fp32, got {draft_head!r}")
        self.draft_head = Int8Head(self.lm_head) if draft_head == "int8" and self.device.type == "cpu" else None
        self.head = verifier_head(self.lm_head, head)
        check_activations(activations, "SplitModel activations")
        tiled = None if activations == "int16" else False
        self.layers = [_Layer(model, i, dense, self.device, tiled) for i in range(len(model.layers))]
        self._rope_tables: dict[str, tuple[Tensor, Tensor]] = {}
        order = spec.rope_order
        self._rope_order = None if order is None else torch.tensor(order, device=self.device)
        self._kinds = sorted(set(spec.layer_types) - {LINEAR})  # the layer types with a RoPE
        self._attn_scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
        self._grow_rope(1024)
        self.kv_dtype: torch.dtype = getattr(torch, kv_dtype)
        # sliding layers' K/V in rings of their window plus this many slots (``KVCache``); 0: every slot
        self.ring_slack = ring_slack if spec.sliding_window is not None else 0
        self._compiled = self._compile()
        if prefill_parts < 1:
            raise ValueError(f"prefill_parts must be >= 1, got {prefill_parts}")
        self.prefill_parts = prefill_parts
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs records CUDA graphs: it needs a CUDA device, not {self.device}")
        # each step's graphs by (cache buffers, tokens, residual), most recently used last (``_replay``)
        self._graphs: OrderedDict[tuple[int, ...], Any] | None = OrderedDict() if cuda_graphs else None

    @property
    def graphed(self) -> bool:
        """Whether passes of one sequence replay recorded CUDA graphs, kept by token count (``_replay``)."""
        return self._graphs is not None

    def _compile(self) -> cpu_step.CompiledLayers | None:
        """The layers as ``cpu_step`` runs them, or None where they cannot (a GPU; a rotation or a layer form
        it does not take): then every pass runs them op by op."""
        s = self.spec
        if self.device.type != "cpu" or self.kv_dtype != torch.float32 or self.ring_slack:
            return None
        if not s.uniform or s.v_norm or s.layer_scale or s.attn_gate:
            return None
        rows = [lay.step_row() for lay in self.layers]
        if None in rows:
            return None
        table = np.array([r for r, _ in rows], np.int64)
        if not cpu_step.CompiledLayers.takes(table, s.n_heads, s.n_kv_heads, s.head_dim):
            return None
        eps_legs = np.array([e for _, e in rows], np.float32)
        shape = (s.n_heads, s.n_kv_heads, s.head_dim)
        gelu, softcap = s.activation != "silu", s.attn_softcap or 0.0
        order = None if s.rope_order is None else np.array(s.rope_order, np.int64)
        forms = (gelu, softcap, order, s.centered, s.parallel)
        return cpu_step.CompiledLayers(table, eps_legs, *shape, self._attn_scale, s.rms_eps, *forms)

    def new_cache(self, max_seq: int, device: torch.device | str | None = None) -> KVCache:
        """A sequence's K/V for ``max_seq`` slots (on ``device="meta"``: its size alone, ``cache_bytes``)."""
        heads = [(lay.heads.n_kv, lay.heads.dim) for lay in self.layers]
        rings = [lay.kind == SLIDING for lay in self.layers] if self.ring_slack else ()
        window, net = self.spec.sliding_window or 0, self.spec.delta_net
        device = device or self.device
        delta = None if net is None else DeltaState(self.spec.linear_layers, net, device)
        return KVCache(heads, max_seq, self.kv_dtype, device, rings, window, self.ring_slack, delta)

    def cache_bytes(self, max_seq: int) -> int:
        """The memory ``new_cache(max_seq)`` takes (less than max_seq slots' where sliding layers keep rings)."""
        return self.new_cache(max_seq, "meta").nbytes

    def _grow_rope(self, size: int) -> None:
        """cos and sin [size, head_dim] of positions 0…size-1 per layer type, computed once as the
        per-pass formula would (a pass only gathers its rows)."""
        self._rope_size = size
        positions = torch.arange(size, device=self.device).float()
        for kind, rope in self.spec.rope.items():
            inv_freq = torch.tensor(rope.inv_freq, device=self.device)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if rope.factor != 1.0:  # YaRN's and LongRoPE's attention scaling, as transformers applies it: to the
                # rotated dimensions alone (frequency 0 marks the rest, which a partial RoPE passes through)
                scale = torch.where(inv_freq == 0, 1.0, rope.factor).repeat(2)
                cos, sin = cos * scale, sin * scale
            self._rope_tables[kind] = (cos, sin)

    def _cover(self, positions: Tensor) -> None:
        """Grow the RoPE tables (doubling) when a position passes them."""
        top = int(positions.max()) + 1
        if top > self._rope_size:
            self._grow_rope(max(top, 2 * self._rope_size))

    def _rope(self, positions: Tensor) -> dict[str, tuple[Rope, Rope]]:
        """The rotary embedding of the positions per layer type, as (q's, with the attention scale folded in
        so that the scores come out scaled, k's). Under ``ROPE_TABLE_TOKENS`` positions, a [n, head_dim,
        head_dim] matrix per position, so that one batched product per tensor applies it: x·R = x·cos +
        rotate_half(x)·sin, R holding cos on its diagonal and ∓sin half a head away (two nonzeros per
        column, so the sum is the same two terms); from there on, the block's ``RopeTables``."""
        self._cover(positions)
        return self._rope_rows(positions)

    def _rope_rows(self, positions: Tensor) -> dict[str, tuple[Rope, Rope]]:
        """``_rope`` of positions the tables already cover: device work only, no read of the positions
        (a CUDA graph captures it, ``graphs.StaticStep``)."""
        scale = self._attn_scale if self.spec.q_scale is None else self._attn_scale * self.q_factor(positions)
        out: dict[str, tuple[Rope, Rope]] = {}
        for kind in self._kinds:  # the layer types this model has
            cos_t, sin_t = self._rope_tables[kind]
            d = cos_t.shape[1]  # the type's head size
            half = d // 2
            cos, sin = cos_t[positions], sin_t[positions]
            if positions.shape[0] >= ROPE_TABLE_TOKENS:
                cos, sin = cos[:, None], sin[:, None]
                q_scale = scale if isinstance(scale, float) else scale[:, None, None]
                out[kind] = (RopeTables(cos * q_scale, sin * q_scale), RopeTables(cos, sin))
                continue
            r = torch.zeros(positions.shape[0], d, d, device=self.device)
            r.diagonal(0, 1, 2).copy_(cos)
            r.diagonal(-half, 1, 2).copy_(-sin[:, :half])
            r.diagonal(half, 1, 2).copy_(sin[:, half:])
            out[kind] = (r * (scale if isinstance(scale, float) else scale[:, None, None]), r)
        return out

    def q_factor(self, positions: Tensor) -> Tensor:
        """Ministral 3's factor on q by position (``ArchSpec.q_scale``), fp32 [n]."""
        beta, span = self.spec.q_scale
        return 1 + beta * torch.log1p(torch.floor(positions.float() / span))

    def _masks(self, cache: KVCache, start: int, positions: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """[n, start + n] bool per layer type, True = attend. Default: causal by position; the sliding
        layers' window narrows any mask, the caller's too."""
        key_pos = torch.cat((cache.positions[:start], positions))
        if mask is None:
            mask = key_pos[None, :] <= positions[:, None]
        elif tuple(mask.shape) != (positions.shape[0], start + positions.shape[0]):
            raise ValueError(f"mask must be [n, cached + n] = {(positions.shape[0], start + positions.shape[0])}")
        mask = mask.to(self.device)
        window = self.spec.sliding_window
        masks = {FULL: mask, SLIDING: mask}
        if window is not None:
            masks[SLIDING] = mask & (positions[:, None] - key_pos[None, :] < window).to(self.device)
            if cache.ring:  # over the ring's entries, then the block's rows
                masks[SLIDING] = cache.ring_mask(start, masks[SLIDING])
        return masks

    def _mask_forms(self, masks: dict[str, Tensor], start: int) -> dict[str, Tensor | str | None]:
        """``_masks`` in the form attention takes them: None where every slot is seen (one token after a
        verified prefix: attention then needs no mask), ``CAUSAL`` for the plain lower triangle of a block
        that starts the cache (a prompt's first chunk), which sdpa applies without reading a mask."""
        n = next(iter(masks.values())).shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_() if start == 0 and n > 1 else None

        def form(m: Tensor) -> Tensor | str | None:
            if bool(m.all()):
                return None
            return CAUSAL if causal is not None and torch.equal(m, causal) else m

        return {kind: form(m) for kind, m in masks.items()}

    def _heads(
        self, layer: int, qkv: list[Tensor], rope: tuple[Rope, Rope], k_out: Tensor | None = None
    ) -> list[Tensor]:
        """[q, k, v] as [n, heads, head_dim]: q and k through the layer's q/k norms and RoPE (q's with the
        attention scale folded in), k into ``k_out`` when given; v is k's projection where the layer has no
        v_proj (``Heads.k_is_v``), through an RMS norm without weight where the model has one (Gemma 4)."""
        s, lay = self.spec, self.layers[layer]
        n, heads = qkv[0].shape[0], lay.heads
        q, k = qkv[0], qkv[1]
        v = (k if heads.k_is_v else qkv[2]).view(n, heads.n_kv, heads.dim)
        if s.v_norm:
            v = F.rms_norm(v, (heads.dim,), None, s.rms_eps)
        if lay.qk_norm_full:  # over all heads, before they are split
            q, k = rms_norm(q, lay.q_norm, s.rms_eps), rms_norm(k, lay.k_norm, s.rms_eps)
        q, k = q.view(n, s.n_heads, heads.dim), k.view(n, heads.n_kv, heads.dim)
        if lay.q_norm is not None and not lay.qk_norm_full:
            q, k = rms_norm(q, lay.q_norm, s.rms_eps), rms_norm(k, lay.k_norm, s.rms_eps)
        if self._rope_order is not None:  # the model's RoPE pairs, in the order the forward's RoPE takes
            q, k = q[..., self._rope_order], k[..., self._rope_order]
        k = _apply_rope(k, rope[1], out=k_out)
        return [_apply_rope(q, rope[0]), k, v]

    def _attention(
        self,
        layer: int,
        qkv: list[Tensor],
        cache: KVCache,
        start: int,
        rope: tuple[Rope, Rope],
        mask: Tensor | str | None,
    ) -> Tensor:
        """``rope`` is (q's RoPE with the attention scale folded in, k's), as ``_rope`` gives them: the scores
        come out scaled, one call fewer per layer. K is rotated straight into its cache slots; a ring layer's
        keys are its ring's entries and the block's own rows (``mask`` in ``KVCache.ring_mask``'s order),
        which go into the ring after. Qwen 3.5's q_proj puts out each head's q and then its gate: the output
        is times sigmoid(gate)."""
        s = self.spec
        n = qkv[0].shape[0]
        qkv, gate = self._gate_split(qkv)
        if cache.is_ring(layer):  # the ring's entries, then the block's own rows, which then go into the ring
            q, k, v = self._heads(layer, qkv, rope)
            old_k, old_v = cache.view(layer, start)
            keys, values = torch.cat((old_k, k.to(old_k.dtype))), torch.cat((old_v, v.to(old_v.dtype)))
            cache.ring_write(layer, start, k, v)
        else:
            k_slots, v_slots = cache.slots(layer, start, n)
            exact = k_slots.dtype == qkv[1].dtype  # else K is rotated in fp32, then rounded once into its slots
            q, k, v = self._heads(layer, qkv, rope, k_out=k_slots if exact else None)
            if not exact:
                k_slots.copy_(k)
            v_slots.copy_(v)
            keys, values = cache.view(layer, start + n)
        if n == 1 and mask is None:
            # one query row: two batched products per kv head and a softmax beat sdpa's set-up at this size
            heads = self.layers[layer].heads
            q = q.view(heads.n_kv, -1, heads.dim).to(keys.dtype)
            scores = capped(torch.bmm(q, keys.permute(1, 2, 0)), s.attn_softcap)
            out = torch.bmm(torch.softmax(scores, -1), values.transpose(0, 1))
            out = out.view(1, s.n_heads * heads.dim).to(qkv[0].dtype)
        else:
            out = sdpa(q, keys, values, mask, s.attn_softcap)
        return gated(out, gate)

    def _gate_split(self, qkv: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
        """(q, k, v outputs, the attention output's gate): Qwen 3.5's q_proj puts out each head's q and then
        its gate; other models have none."""
        if not self.spec.attn_gate:
            return qkv, None
        n = qkv[0].shape[0]
        both = qkv[0].view(n, self.spec.n_heads, 2, -1)
        return [both[:, :, 0].reshape(n, -1), *qkv[1:]], both[:, :, 1].reshape(n, -1)

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        residual: Residual,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        last_only: bool = False,
        stats: PassStats | None = None,
        draft: bool = False,
    ) -> Tensor:
        """fp32 logits [n, vocab] (or [1, vocab] with ``last_only``) for ``n`` new tokens appended to ``cache``.

        ``positions`` default to the slots they land in (a linear sequence); ``mask`` [n, cache.length + n]
        says which cached and new slots each token sees (default: causal). The new K/V are kept in the
        cache; roll them back with ``cache.truncate`` or ``cache.keep``. ``draft`` takes the logits from the
        draft's head (``draft_head``).
        """
        return self.forward_many([Segment(tokens, cache, positions, mask, last_only)], residual, stats, draft)[0]

    def append(self, tokens: Tensor, cache: KVCache, residual: Residual, stats: PassStats | None = None) -> None:
        """The tokens' K/V appended to ``cache``, as ``forward`` writes them, with no head: a prompt's chunks
        before its last, and caches filled only to be read (the lm_head costs a layer's worth of bytes)."""
        self.forward_many([Segment(tokens, cache)], residual, stats, head=False)

    def prefill(
        self,
        prompt: Tensor,
        cache: KVCache,
        residual: Residual,
        chunk: int,
        stats: PassStats | None = None,
        every: Callable[[Tensor, int], None] | None = None,
    ) -> Tensor:
        """The last position's logits [1, vocab] after the prompt's K/V, in forwards of at most ``chunk``
        tokens (``prefill_step`` after ``prefill_step``)."""
        start = 0
        while (logits := self.prefill_step(prompt, cache, residual, chunk, start, stats, every)) is None:
            start += chunk
        return logits

    def prefill_step(
        self,
        prompt: Tensor,
        cache: KVCache,
        residual: Residual,
        chunk: int,
        start: int,
        stats: PassStats | None = None,
        every: Callable[[Tensor, int], None] | None = None,
    ) -> Tensor | None:
        """One forward of the prompt's tokens from ``start``, at most ``chunk`` of them: the K/V alone
        (``append``: only the last position's logits are wanted) and None, or for the last chunk the last
        position's logits [1, vocab]; unless ``every`` takes each forward's logits for all its positions,
        with where they start."""
        end = min(start + chunk, prompt.shape[0])
        part = prompt[start:end]
        if every is not None:
            logits = self.forward(part, cache, residual, stats=stats)
            every(logits, start)
            return logits[-1:] if end == prompt.shape[0] else None
        if end < prompt.shape[0]:
            self.append(part, cache, residual, stats)
            return None
        return self.forward(part, cache, residual, last_only=True, stats=stats)

    def draft_step(
        self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """``forward(tokens, cache, NoResidual(), positions, mask, draft=True)``: the 2-bit base alone; with
        ``cuda_graphs``, one replay of the step's graph (``graphs.StaticStep``)."""
        if self._graphs is None:
            return self.forward(tokens, cache, NoResidual(), positions, mask, draft=True)
        return self._replay(tokens, cache, None, positions, mask, None)

    def verify_step(
        self,
        tokens: Tensor,
        cache: KVCache,
        residual: Residual,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        stats: PassStats | None = None,
    ) -> Tensor:
        """``forward(tokens, cache, residual, positions, mask, stats=stats)``: a check of one sequence; with
        ``cuda_graphs``, a replay of the pass's graphs with the residual's crossings between them
        (``graphs.StaticStep``), where ``stats`` gets the total and the crossings' submit and wait only."""
        if self._graphs is None:
            return self.forward(tokens, cache, residual, positions, mask, stats=stats)
        return self._replay(tokens, cache, residual, positions, mask, stats)

    def _replay(
        self,
        tokens: Tensor,
        cache: KVCache,
        residual: Residual | None,
        positions: Tensor | None,
        mask: Tensor | None,
        stats: PassStats | None,
    ) -> Tensor:
        """A ``graphs.StaticStep`` of the pass, recorded the first time a cache's buffers see that many tokens
        with that residual (None: the draft's); the ``MAX_GRAPHS`` most recently used are kept."""
        from splitspec.gpu_actor.graphs import StaticStep

        if cache.delta is not None:  # the room its pending entries need, before a step is made for it
            cache.delta.hold(cache.length + tokens.shape[0])
        key = (*cache.buffers, cache.max_seq, tokens.shape[0], id(residual))
        step = self._graphs.get(key) or StaticStep(self, cache, tokens.shape[0], residual)
        logits = step(tokens, cache, positions, mask, stats).clone()
        self._graphs[key] = step  # kept once a call of it succeeded: a first call that failed recorded nothing
        self._graphs.move_to_end(key)
        if len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return logits

    def logits(self, hidden: Tensor, draft: bool = False, residual: Residual | None = None) -> Tensor:
        """fp32 logits [n, vocab] of last hidden states [n, hidden]: the final norm, then the verifier's head
        (``head``), or with ``draft`` the draft's (``draft_head``). Where the CPU actors behind ``residual``
        serve the last rows of the int16 head (``head_start``), they multiply theirs while this process
        multiplies the first ones."""
        if self.spec.centered:
            hidden = F.layer_norm(hidden, self.norm.shape, self.norm, None, self.spec.rms_eps)
        else:
            hidden = rms_norm(hidden, self.norm, self.spec.rms_eps)
        return capped(self._head(hidden, draft, residual), self.spec.final_softcap)

    def _head(self, hidden: Tensor, draft: bool, residual: Residual | None) -> Tensor:
        if draft and self.draft_head is not None:
            return self.draft_head(hidden)
        start = getattr(residual, "head_start", None)
        if start is not None and isinstance(self.head, Int16Head) and hidden.shape[0] <= residual.max_head_rows:
            handles = submit_chunks(residual, 0, HEAD, hidden, HEAD_TOKENS)
            mine = self.head(hidden, rows=start)
            theirs = [residual.gather(h) for _, h in handles]
            return torch.cat((mine, theirs[0] if len(theirs) == 1 else torch.cat(theirs)), dim=1)
        return hidden @ self.lm_head.T if self.head is None else self.head(hidden)

    @torch.no_grad()
    def forward_many(
        self,
        segments: Sequence[Segment],
        residual: Residual,
        stats: PassStats | None = None,
        draft: bool = False,
        head: bool = True,
    ) -> list[Tensor]:
        """One pass for the new tokens of several sequences, each with its own cache (``forward`` for each);
        without ``head``, the K/V alone (``append``): no logits, an empty list.

        The Linear groups see all the sequences' rows at once, so the residual is streamed once for all
        of them; attention runs per sequence against its own cache and mask. Up to ``cpu_step.MAX_TOKENS``
        rows on the CPU (a prompt's chunk too) run through its compiled layers (a draft step's in one call:
        ``stats`` then gets its total and head only); more, or on a GPU, op by op. A linear-attention model's
        pass on a CPU runs with subnormal floats flushed (``delta_rule.subnormals_flushed``).
        """
        with subnormals_flushed(self.spec.delta_net is not None and self.device.type == "cpu"):
            return self._forward_many(segments, residual, stats, draft, head)

    def _forward_many(
        self, segments: Sequence[Segment], residual: Residual, stats: PassStats | None, draft: bool, head: bool
    ) -> list[Tensor]:
        clock = self._clock if stats is not None else no_clock
        stats = stats if stats is not None else PassStats()
        t_start = clock()
        spans, starts, masks, all_positions = [], [], [], []
        row = 0
        for seg in segments:
            n = seg.tokens.shape[0]
            start = seg.cache.reserve(n)
            positions = seg.positions if seg.positions is not None else torch.arange(start, start + n)
            positions = positions.to(self.device)
            self._cover(positions)
            masks.append(self._masks(seg.cache, start, positions, seg.mask))
            spans.append(slice(row, row + n))
            starts.append(start)
            all_positions.append(positions)
            row += n
        h = self.embed[torch.cat([seg.tokens for seg in segments]).to(self.device)]  # a new tensor: added into
        if self.spec.embed_scale != 1.0:
            h *= self._embed_scale
        if self._compiled is not None and row <= cpu_step.MAX_TOKENS:
            self._compiled_layers(h, segments, starts, all_positions, masks, residual, stats)
        else:
            attend = self._attend_segments(segments, spans, starts, masks, all_positions)
            self._layers(h, residual, stats, attend, clock)
        for seg, start, positions in zip(segments, starts, all_positions, strict=True):
            seg.cache.commit(start, positions, final=seg.mask is None)
        if not head:
            stats.total_s += clock() - t_start
            return []
        rows = [sp.stop - 1 if seg.last_only else sp for seg, sp in zip(segments, spans, strict=True)]
        t0 = clock()
        if all(isinstance(r, slice) for r in rows):
            hidden = h
        else:
            hidden = torch.cat([h[r] if isinstance(r, slice) else h[r : r + 1] for r in rows])
        logits = self.logits(hidden, draft, residual)
        t1 = clock()
        stats.head_s += t1 - t0
        stats.total_s += t1 - t_start
        sizes = [1 if seg.last_only else sp.stop - sp.start for seg, sp in zip(segments, spans, strict=True)]
        return list(logits.split(sizes))

    def _compiled_layers(
        self,
        h: Tensor,
        segments: Sequence[Segment],
        starts: list[int],
        all_positions: list[Tensor],
        masks: list[dict[str, Tensor]],
        residual: Residual,
        stats: PassStats,
    ) -> None:
        """The decoder layers on h [rows, hidden] in place through ``cpu_step``: the draft's (``NoResidual``)
        as one call; the verifier's in compiled code that posts to the CPU actors' slots itself where the
        channel leases them (``_verify_through``), else as two calls a group around the residual's submit and
        gather; either way the base product overlaps the CPU actors' work, and each reply is added into the
        base's output where it lies. Past ``cpu_step.LOOP_TOKENS`` rows (a prompt) attention is sdpa's
        (``_attend_many``), whose blocked products beat the compiled loops there."""
        compiled, clock = self._compiled, self._clock
        n = h.shape[0]
        if isinstance(residual, RemoteResidual) and self._in_parts(segments, n):
            args = (segments[0], starts[0], all_positions[0], masks[0])
            if self._verify_parts(h, *args, residual, stats):
                return
        sequences = [self._sequence(*args) for args in zip(segments, starts, all_positions, masks, strict=True)]
        at = compiled.bind(h, sequences, thread_count()(), 0, *self._shares(residual))
        if isinstance(residual, NoResidual) and n <= cpu_step.LOOP_TOKENS:
            cpu_step.draft_layers(at)
            return
        attend = self._attend_many(segments, starts, all_positions, masks) if n > cpu_step.LOOP_TOKENS else None
        lanes = residual.lanes(n, GROUPS, compiled.d_in) if isinstance(residual, RemoteResidual) else nullcontext()
        with lanes as leased:
            if leased is not None:
                self._verify_through(at, n, leased, attend, stats)
                return
        cpu_step.begin(at)
        for layer in range(len(self.layers)):
            for g, name in enumerate(GROUPS):
                t0 = clock()
                pending = submit_chunks(residual, layer, name, compiled.x_rot(n, g))
                t1 = clock()
                cpu_step.base(at, layer, g)
                t2 = clock()
                add_chunks(residual, pending, compiled.y(n, g))
                t3 = clock()
                cpu_step.finish(at, layer, g)
                stats.submit_s += t1 - t0
                stats.base_s += t2 - t1
                stats.wait_s += t3 - t2
                stats.round_trips += len(pending)
                if g == cpu_step.QKV:
                    t4 = clock()
                    if attend is None:
                        cpu_step.attend(at, layer)
                    else:
                        attend(layer, compiled.qkv(n), compiled.attn(n))
                        cpu_step.o_input(at, layer)
                    stats.attention_s += clock() - t4

    def _sequence(self, seg: Segment, start: int, positions: Tensor, mask: dict[str, Tensor]) -> cpu_step.Sequence:
        """A sequence's rows of a pass as the compiled layers take them."""
        kinds = (FULL, SLIDING)
        return cpu_step.Sequence(
            seg.cache.k,
            seg.cache.v,
            start,
            np.stack([mask[kind].numpy() for kind in kinds]),
            np.stack([self._rope_tables[kind][0][positions].numpy() for kind in kinds]),
            np.stack([self._rope_tables[kind][1][positions].numpy() for kind in kinds]),
            None if self.spec.q_scale is None else self.q_factor(positions).numpy(),
        )

    def _shares(self, residual: Residual) -> tuple[list[int] | None, int]:
        """``CompiledLayers.bind``'s ``share_from`` and ``chunk`` for a pass through ``residual``."""
        share = base_share(residual)
        if not share:
            return None, 0
        return [base_share_from(d // CODE_WORD, share) for d in self._compiled.d_in], residual.max_tokens

    def _in_parts(self, segments: Sequence[Segment], n: int) -> bool:
        """Whether a pass runs in ``prefill_parts`` parts: one sequence's causal rows (a prompt's chunk), at
        least ``PART_ROWS`` a part."""
        return (
            self.prefill_parts > 1
            and len(segments) == 1
            and segments[0].mask is None
            and (n >= self.prefill_parts * PART_ROWS)
        )

    def _verify_parts(
        self, h: Tensor, seg: Segment, start: int, positions: Tensor, mask: dict[str, Tensor], residual: RemoteResidual,
        stats: PassStats,
    ) -> bool:  # fmt: skip
        """The verifier's layers for one sequence's causal rows in ``prefill_parts`` parts of whole 16-row
        blocks, each with its own context and leased slots (``cpu_step.parts_layers``), attention in the
        compiled loops or, for parts of more rows than they take, sdpa's (``_attend_many``). False, having run
        nothing, where the channel cannot lease every part its slots or the engine holds residual rows."""
        compiled, parts = self._compiled, self.prefill_parts
        n = h.shape[0]
        cuts = [n * p // parts // 16 * 16 for p in range(parts)] + [n]
        spans = list(itertools.pairwise(cuts))
        table = np.zeros((parts, cpu_step.PART), np.int64)
        elsewhere = max(b - a for a, b in spans) > cpu_step.LOOP_TOKENS
        leased, attends, shares = [], [], self._shares(residual)
        with ExitStack() as stack:
            for p, (a, b) in enumerate(spans):
                lanes = stack.enter_context(residual.lanes(b - a, GROUPS, compiled.d_in))
                if lanes is None or lanes.held_at:
                    return False
                part_mask = {kind: m[a:b, : start + b] for kind, m in mask.items()}
                sequence = self._sequence(seg, start + a, positions[a:b], part_mask)
                at = compiled.bind(h[a:b], [sequence], thread_count()(), p, *shares)
                table[p] = (at, lanes.address, lanes.count)
                leased.append(lanes)
                if elsewhere:
                    part = Segment(seg.tokens[a:b], seg.cache)
                    attends.append(self._attend_many([part], [start + a], [positions[a:b]], [part_mask]))
            self._run_parts(table, spans, leased, attends, stats)
        return True

    def _run_parts(
        self, table: np.ndarray, spans: list[tuple[int, int]], leased: list[Lanes],
        attends: list[Callable[[int, Tensor, Tensor], None]], stats: PassStats,
    ) -> None:  # fmt: skip
        """``cpu_step.parts_layers`` over the parts in ``table`` to its last op, back in Python to wait on a
        part's slots where its replies are slow or not plain results, and (with ``attends``, one a part) for
        each part's attention."""
        compiled, parts = self._compiled, len(spans)
        times = np.zeros(cpu_step.TIMES)
        for p in range(parts):
            cpu_step.begin(table[p, cpu_step.PART_CONTEXT])
        op, ops = 0, cpu_step.parts_ops(parts, len(self.layers))
        chunk = leased[0].chunk
        while True:
            reached = cpu_step.parts_layers(table.ctypes.data, parts, chunk, op, times.ctypes.data, bool(attends))
            t0 = self._clock()
            if reached < 0:  # a part's qkv group is finished: its attention is ours, then its o group's input
                op = -1 - reached
                p, step, _ = cpu_step.part_op(op, parts)
                rows, layer = spans[p][1] - spans[p][0], step // 4
                attends[p](layer, compiled.qkv(rows, p), compiled.attn(rows, p))
                cpu_step.o_input(table[p, cpu_step.PART_CONTEXT], layer)
                stats.attention_s += self._clock() - t0
                op += 1
                continue
            if reached >= ops:
                break
            leased[cpu_step.part_op(reached, parts)[0]].wait()
            stats.wait_s += self._clock() - t0
            op = reached
        _count_compiled(stats, times, leased, 4 * len(self.layers))

    def _attend_many(
        self, segments: Sequence[Segment], starts: list[int], all_positions: list[Tensor], masks: list[dict]
    ) -> Callable[[int, Tensor, Tensor], None]:
        """Attention for a pass of more rows than ``cpu_step.attend``'s loops take, as the op-by-op path runs
        it (``_attend_segments``: sdpa), from the qkv output z into ``out``."""
        s = self.spec
        cuts = np.cumsum([0] + [seg.tokens.shape[0] for seg in segments]).tolist()
        spans = [slice(a, b) for a, b in itertools.pairwise(cuts)]
        widths = [s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim]
        attend = self._attend_segments(segments, spans, starts, masks, all_positions)
        plain = self._plain_attention(segments, starts, all_positions, masks)

        def into(layer: int, z: Tensor, out: Tensor) -> None:
            if plain is None or not plain(layer, z, out):
                out.copy_(attend(layer, list(z.split(widths, dim=1))))

        return into

    def _plain_attention(
        self, segments: Sequence[Segment], starts: list[int], all_positions: list[Tensor], masks: list[dict]
    ) -> Callable[[int, Tensor, Tensor], bool] | None:
        """sdpa after RoPE and the K/V writes in compiled code (``cpu_step.rope_rows``), for one sequence
        whose attention needs nothing else (no q/k/v norm, gate, softcap, reordered RoPE or per-position q
        factor; fp32 slots): the op-by-op form's dozen calls a layer cost more than their arithmetic. It says
        per layer whether it took it (not a ring's, a linear-attention or another head size's); None where
        no layer fits."""
        s = self.spec
        unfit = s.attn_gate or s.v_norm or s.attn_softcap is not None or s.q_scale is not None
        if unfit or len(segments) != 1 or self.device.type != "cpu" or self._rope_order is not None:
            return None
        cache, start, positions = segments[0].cache, starts[0], all_positions[0]
        if cache.k.dtype != torch.float32 or any(lay.q_norm is not None for lay in self.layers):
            return None
        mask = self._mask_forms(masks[0], start)
        tables = {kind: [t[positions].numpy() for t in self._rope_tables[kind]] for kind in self._kinds}
        q = torch.empty(positions.shape[0], s.n_heads, s.head_dim)
        k_cache, v_cache, scale = cache.k.numpy(), cache.v.numpy(), np.float32(self._attn_scale)

        def attend(layer: int, z: Tensor, out: Tensor) -> bool:
            lay = self.layers[layer]
            heads = lay.heads
            if lay.kind == LINEAR or cache.is_ring(layer) or heads.k_is_v or heads.dim != s.head_dim:
                return False
            cos, sin = tables[lay.kind]
            cpu_step.rope_rows(z.numpy(), layer, k_cache, v_cache, start, cos, sin, scale, s.n_heads, q.numpy())
            sdpa(q, *cache.view(layer, start + q.shape[0]), mask[lay.kind], out=out)
            return True

        return attend

    def _verify_through(
        self, at: int, n: int, lanes: Lanes, attend: Callable[[int, Tensor, Tensor], None] | None, stats: PassStats
    ) -> None:
        """The verifier's layers in compiled code that posts to the CPU actors' leased slots itself
        (``cpu_step.verify_layers``), back in Python only to wait where a reply is slow or is not a plain
        result (``Lanes.wait``, which raises what ``gather`` would), and, for a pass of more rows than the
        compiled attention takes, for each layer's attention (``attend``: sdpa's)."""
        compiled = self._compiled
        times = np.zeros(cpu_step.TIMES)
        steps, step, resumed = 4 * len(self.layers), 0, False
        cpu_step.begin(at)
        while True:
            reached = cpu_step.verify_layers(
                at, lanes.address, lanes.count, lanes.chunk, step, resumed, times.ctypes.data, lanes.held_at,
                lanes.levels, attend is not None,
            )  # fmt: skip
            t0 = self._clock()
            if reached < 0:  # layer -1 - reached's attention is ours; its o group follows
                layer = -1 - reached
                attend(layer, compiled.qkv(n), compiled.attn(n))
                cpu_step.o_input(at, layer)
                stats.attention_s += self._clock() - t0
                step, resumed = 4 * layer + cpu_step.O, False
                continue
            if reached >= steps:
                break
            lanes.wait()
            stats.wait_s += self._clock() - t0
            step, resumed = reached, True
        _count_compiled(stats, times, [lanes], steps)

    def _mix(self, layer: int, outs: list[Tensor], cache: KVCache, start: int, mask: Tensor, final: bool) -> Tensor:
        """A linear-attention layer's token mixer for one sequence's new rows, the o group's input [n, n_v ·
        v_dim]: the causal conv and the gated delta rule along each row's path (``mask`` [n, start + n]),
        from the state at the cache's base and the pending slots after it, whose entries the rows then join.
        A ``final`` pass's rows (a prompt's chunk: one chain) run in blocks of ``CHAIN_BLOCK``, each folded
        into a running state before the next, so that its memory grows with the rows, not their square;
        the state at its end goes to the state's next copy (``DeltaState.advance``)."""
        lay, state = self.layers[layer], cache.delta
        x, z, b, a = outs  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        n, j, m = x.shape[0], lay.state_index, start - state.base
        stored = state.entries(j, start if final else start + n)  # k, u, G, x from the base
        pending = [t[:m] for t in stored]
        if final:
            running = fold(state.state[j], *pending[:3]), conv_window(state.window[j], pending[3])
            empty, blocks = [t[:0] for t in pending], []
            for r in range(0, n, CHAIN_BLOCK):
                rows = slice(r, r + CHAIN_BLOCK)
                causal = torch.ones(x[rows].shape[0], x[rows].shape[0], dtype=torch.bool, device=x.device).tril()
                out, *entry = self._mix_rows(lay, x[rows], b[rows], a[rows], *running, empty, causal)
                running = fold(running[0], *entry), conv_window(running[1], x[rows])
                blocks.append(out)
            state.advance(j, *running)
            out = torch.cat(blocks)
        else:
            out, k, u, big_g = self._mix_rows(
                lay, x, b, a, state.state[j], state.window[j], pending, mask[:, state.base :]
            )
            for t, rows in zip(stored, (k, u, big_g, x), strict=True):
                t[m:] = rows
        return self._mixed(lay, out, z)

    def _mix_rows(
        self, lay: _Layer, x: Tensor, b: Tensor, a: Tensor, s: Tensor, window: Tensor, pending: list, anc: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``delta_rule.mix_rows`` with ``lay``'s mixer weights: (out, k, u, G) of its rows."""
        net = self.spec.delta_net
        return mix_rows(net, lay.conv, lay.neg_a, lay.dt_bias, x, b, a, s, window, pending, anc)

    def _mixed(self, lay: _Layer, out: Tensor, z: Tensor) -> Tensor:
        """The mixer's output [n, n_v, v_dim] through its RMS norm per head, times silu(z) (in_proj_z's): the
        o group's input [n, n_v · v_dim]."""
        net, n = self.spec.delta_net, out.shape[0]
        return (rms_norm(out, lay.gate_norm, self.spec.rms_eps) * F.silu(z.view(n, net.n_v, net.v_dim))).view(n, -1)

    def _attend_segments(
        self,
        segments: Sequence[Segment],
        spans: list[slice],
        starts: list[int],
        explicit: list[dict[str, Tensor]],
        all_positions: list[Tensor],
    ) -> Callable[[int, list[Tensor]], Tensor]:
        """Attention of a pass's rows, each sequence against its own cache: (layer, its qkv outputs) ↦ the
        o group's input [rows, heads · head_dim]."""
        masks = [self._mask_forms(m, start) for m, start in zip(explicit, starts, strict=True)]
        ropes = [self._rope(positions) for positions in all_positions]

        def attend(i: int, qkv: list[Tensor]) -> Tensor:
            kind = self.layers[i].kind
            if kind == LINEAR:  # over the tree the mask describes: its own column of every cached slot and row
                return torch.cat(
                    [
                        self._mix(i, [t[sp] for t in qkv], seg.cache, start, mask[FULL], seg.mask is None)
                        for seg, sp, start, mask in zip(segments, spans, starts, explicit, strict=True)
                    ]
                )
            if len(segments) == 1:
                return self._attention(i, qkv, segments[0].cache, starts[0], ropes[0][kind], masks[0][kind])
            return torch.cat(
                [
                    self._attention(i, [t[sp] for t in qkv], seg.cache, start, rope[kind], mask[kind])
                    for seg, sp, start, rope, mask in zip(segments, spans, starts, ropes, masks, strict=True)
                ]
            )

        return attend

    def _layers(
        self,
        h: Tensor,
        residual: Residual,
        stats: PassStats,
        attend: Callable[[int, list[Tensor]], Tensor],
        clock: Clock,
    ) -> None:
        """The decoder layers on h [rows, hidden] in place, op by op: a prompt, a GPU, or a model the compiled
        layers do not take. ``attend`` runs each layer's attention (``_attend_segments``, or a CUDA graph's
        on static buffers)."""
        eps = self.spec.rms_eps
        act = F.silu if self.spec.activation == "silu" else partial(F.gelu, approximate="tanh")
        for i, lay in enumerate(self.layers):
            g = lay.groups
            qkv = g["qkv"](h, residual, stats, clock)  # attn_in is folded into the group
            if self.spec.parallel:  # the MLP reads the layer's input too (Cohere): before the attention adds
                gate, up = g["gate_up"](h, residual, stats, clock)
            t0 = clock()
            attn = attend(i, qkv)
            stats.attention_s += clock() - t0
            if lay.attn_out is None:
                g["o"].add_into(h, attn, residual, stats, clock)
            else:
                (o,) = g["o"](attn, residual, stats, clock)
                h += rms_norm(o, lay.attn_out, eps)
            if not self.spec.parallel:
                gate, up = g["gate_up"](h, residual, stats, clock)  # mlp_in is folded into the group
            if lay.mlp_out is None:
                g["down"].add_into(h, act(gate).mul_(up), residual, stats, clock)
            else:
                (down,) = g["down"](act(gate).mul_(up), residual, stats, clock)
                h += rms_norm(down, lay.mlp_out, eps)
            if lay.scalar is not None:
                h *= lay.scalar
