"""The engine's own decoder forward pass with the split verifier (Llama, Mistral, Qwen2, Qwen3, Gemma 3).

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
layer's type picks its RoPE table and whether the sliding window narrows its mask; Gemma's (1 + w) norms
are folded into the stored weights once, so every norm is the same ``rms_norm``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from splitspec.gpu_actor.kernels import base_matmul, rotate_input, unrotate_output
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.residual import Residual
from splitspec.models.spec import FULL, SLIDING, ArchSpec
from splitspec.quantize.format import ConvertedModel


@dataclass
class PassStats:
    """Seconds spent in the parts of forward passes (accumulated over the passes it is given to).

    ``submit_s`` is this process's side of the channel (writing x' into the slots and posting);
    ``wait_s`` is the time blocked in ``gather``: the residual's compute not hidden behind the base
    product, plus the channel's latency. ``head_s`` is the final norm and lm_head (a fixed cost per pass,
    whatever the depth). ``round_trips`` counts group requests (4 per layer per pass).
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


class _Clock:
    """perf_counter that first waits for the device: CUDA kernels are asynchronous, so a plain clock would
    charge their time to whichever later call happens to block."""

    def __init__(self, device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None

    def __call__(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SplitGroup:
    """One Linear group of one layer: packed base, signs, row slices and rotation kind, on the model's device."""

    def __init__(
        self, model: ConvertedModel, layer: int, name: str, dense: dict[str, Tensor], device: torch.device
    ) -> None:
        layout = model.group(layer, name)
        codes, scale = model.base(layer, name)
        s_i, s_os = layout.signs()
        self.layer, self.name, self.rotation = layer, name, model.rotation
        self.codes, self.scale = codes.to(device), scale.to(device)
        self.s_i = s_i.to(device)
        self.s_os = [s.to(device) for s in s_os]
        self.slices = [slice(lin["row_offset"], lin["row_offset"] + lin["rows"]) for lin in layout.linears]
        bias_names = [f"model.layers.{layer}.{lin['name']}.bias" for lin in layout.linears]
        self.biases = [dense[b].to(device) if b in dense else None for b in bias_names]

    def __call__(self, x: Tensor, levels: Tensor, residual: Residual, stats: PassStats, clock: _Clock) -> list[Tensor]:
        x_rot = rotate_input(x, self.s_i, self.rotation)
        t0 = clock()
        step = getattr(residual, "max_tokens", None) or x_rot.shape[0]  # more rows: one request per chunk
        handles = [residual.submit(self.layer, self.name, x_rot[i : i + step]) for i in range(0, x_rot.shape[0], step)]
        t1 = clock()
        y = base_matmul(self.codes, self.scale, levels, x_rot)
        t2 = clock()
        parts = [residual.gather(h) for h in handles]
        y_r = None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts)
        t3 = clock()
        stats.submit_s += t1 - t0
        stats.base_s += t2 - t1
        stats.wait_s += t3 - t2
        stats.round_trips += len(handles)
        if y_r is not None:
            y += y_r
        outs = [unrotate_output(y[:, sl], s_o, self.rotation) for sl, s_o in zip(self.slices, self.s_os, strict=True)]
        return [o if b is None else o + b for o, b in zip(outs, self.biases, strict=True)]


class _Layer:
    """One decoder layer's norms (offset folded in) and groups. ``attn_in`` and ``mlp_in`` norm each block's
    input; with sandwich norms (Gemma) ``attn_out`` and ``mlp_out`` norm each block's output too."""

    def __init__(self, model: ConvertedModel, i: int, dense: dict[str, Tensor], device: torch.device) -> None:
        spec = model.spec
        prefix = f"model.layers.{i}."

        def norm(name: str) -> Tensor:
            return (dense[prefix + name + ".weight"] + spec.norm_offset).to(device)

        self.kind = spec.layer_types[i]
        self.attn_in, self.attn_out = norm("input_layernorm"), None
        self.mlp_in, self.mlp_out = norm("post_attention_layernorm"), None
        if spec.sandwich_norms:
            self.attn_out, self.mlp_in = self.mlp_in, norm("pre_feedforward_layernorm")
            self.mlp_out = norm("post_feedforward_layernorm")
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm, self.k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        self.groups = {name: SplitGroup(model, i, name, dense, device) for name in model.layers[i]}


@dataclass
class Segment:
    """One sequence's part of a forward pass: its new tokens, its cache, and (optionally) their positions,
    the mask over cached + new slots, and whether only the last position's logits are wanted."""

    tokens: Tensor
    cache: KVCache
    positions: Tensor | None = None
    mask: Tensor | None = None
    last_only: bool = False


class Int8Head:
    """The draft's copy of the lm_head in int8 with one scale per vocabulary row, multiplied by torch's
    quantized dynamic linear (int8 weights, activations quantized per call). The draft only ranks its
    candidates and the verifier's fp32 head decides every token, so this copy's precision never changes
    the output; it reads a quarter of the bytes."""

    def __init__(self, weight: Tensor) -> None:
        scale = (weight.abs().amax(1).clamp(min=1e-30) / 127).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its qint8 tensors deprecated; torch is pinned here
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            q = torch.quantize_per_channel(weight.float().cpu(), scale, zeros, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        self.nbytes = weight.numel() + 8 * weight.shape[0]

    def __call__(self, h: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(h.contiguous(), self._packed)


class SplitModel:
    """The decoder of a converted folder on one device; ``forward`` runs n new tokens through it.

    ``draft_head="int8"`` gives the draft (``forward(draft=True)``) its own int8 copy of the lm_head
    (``Int8Head``, CPU only); ``"fp32"`` shares the verifier's."""

    def __init__(self, model: ConvertedModel, device: str | torch.device = "cpu", draft_head: str = "int8") -> None:
        spec = model.spec
        self.spec: ArchSpec = spec
        self.device = torch.device(device)
        self.conversion_id = model.conversion_id
        self._clock = _Clock(self.device)
        dense = model.dense()
        self.levels = model.levels.to(self.device)
        self.embed = dense["model.embed_tokens.weight"].to(self.device)
        self.lm_head = self.embed if spec.tie_embeddings else dense["lm_head.weight"].to(self.device)
        self.norm = (dense["model.norm.weight"] + spec.norm_offset).to(self.device)
        self._embed_scale = torch.tensor(spec.embed_scale, dtype=torch.float32, device=self.device)
        if draft_head not in ("int8", "fp32"):
            raise ValueError(f"draft_head must be int8 or fp32, got {draft_head!r}")
        self.draft_head = Int8Head(self.lm_head) if draft_head == "int8" and self.device.type == "cpu" else None
        self.layers = [_Layer(model, i, dense, self.device) for i in range(len(model.layers))]
        half = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        local_theta = spec.local_rope_theta or spec.rope_theta
        factor = float((spec.rope_scaling or {}).get("factor", 1.0))  # the spec admits linear scaling only
        self._inv_freq = {  # linear scaling (Gemma 3's global layers) divides the frequencies by its factor
            FULL: ((1.0 / spec.rope_theta**half) / factor).to(self.device),
            SLIDING: (1.0 / local_theta**half).to(self.device),
        }

    def new_cache(self, max_seq: int) -> KVCache:
        s = self.spec
        return KVCache(len(self.layers), max_seq, s.n_kv_heads, s.head_dim, device=self.device)

    def _rope(self, positions: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """(cos, sin) [n, 1, head_dim] (broadcast over heads) per layer type."""
        out = {}
        for kind, inv_freq in self._inv_freq.items():
            freqs = positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            out[kind] = (emb.cos(), emb.sin())
        return out

    def _mask(self, cache: KVCache, start: int, positions: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """[n, start + n] bool per layer type, True = attend. Default: causal by position; the sliding
        layers' window narrows any mask, the caller's too."""
        key_pos = torch.cat((cache.positions[:start], positions))
        if mask is None:
            mask = key_pos[None, :] <= positions[:, None]
        elif tuple(mask.shape) != (positions.shape[0], start + positions.shape[0]):
            raise ValueError(f"mask must be [n, cached + n] = {(positions.shape[0], start + positions.shape[0])}")
        mask = mask.to(self.device)
        window = self.spec.sliding_window
        if window is None:
            return {FULL: mask, SLIDING: mask}
        in_window = (positions[:, None] - key_pos[None, :] < window).to(self.device)
        return {FULL: mask, SLIDING: mask & in_window}

    def _attention(
        self, layer: int, qkv: list[Tensor], cache: KVCache, start: int, cos_sin: tuple[Tensor, Tensor], mask: Tensor
    ) -> Tensor:
        s, lay = self.spec, self.layers[layer]
        n = qkv[0].shape[0]
        q = qkv[0].view(n, s.n_heads, s.head_dim)
        k = qkv[1].view(n, s.n_kv_heads, s.head_dim)
        v = qkv[2].view(n, s.n_kv_heads, s.head_dim)
        if lay.q_norm is not None:
            q, k = rms_norm(q, lay.q_norm, s.rms_eps), rms_norm(k, lay.k_norm, s.rms_eps)
        cos, sin = cos_sin
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.write(layer, start, k, v)
        keys, values = cache.view(layer, start + n)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            scale=s.attn_scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, s.n_heads * s.head_dim)

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

    @torch.no_grad()
    def forward_many(
        self, segments: Sequence[Segment], residual: Residual, stats: PassStats | None = None, draft: bool = False
    ) -> list[Tensor]:
        """One pass for the new tokens of several sequences, each with its own cache (``forward`` for each).

        The Linear groups see all the sequences' rows at once, so the residual is streamed once for all
        of them; attention runs per sequence against its own cache and mask.
        """
        stats = stats if stats is not None else PassStats()
        clock = self._clock
        t_start = clock()
        spans, starts, masks, cos_sins, all_positions = [], [], [], [], []
        row = 0
        for seg in segments:
            n = seg.tokens.shape[0]
            start = seg.cache.reserve(n)
            positions = seg.positions if seg.positions is not None else torch.arange(start, start + n)
            positions = positions.to(self.device)
            masks.append(self._mask(seg.cache, start, positions, seg.mask))
            cos_sins.append(self._rope(positions))
            spans.append(slice(row, row + n))
            starts.append(start)
            all_positions.append(positions)
            row += n
        eps = self.spec.rms_eps
        act = F.silu if self.spec.activation == "silu" else partial(F.gelu, approximate="tanh")
        h = self.embed[torch.cat([seg.tokens for seg in segments]).to(self.device)]
        if self.spec.embed_scale != 1.0:
            h = h * self._embed_scale
        for i, lay in enumerate(self.layers):
            g = lay.groups
            qkv = g["qkv"](rms_norm(h, lay.attn_in, eps), self.levels, residual, stats, clock)
            t0 = clock()
            parts = [
                self._attention(i, [t[sp] for t in qkv], seg.cache, start, cos_sin[lay.kind], mask[lay.kind])
                for seg, sp, start, cos_sin, mask in zip(segments, spans, starts, cos_sins, masks, strict=True)
            ]
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            stats.attention_s += clock() - t0
            (o,) = g["o"](attn, self.levels, residual, stats, clock)
            h = h + (o if lay.attn_out is None else rms_norm(o, lay.attn_out, eps))
            gate, up = g["gate_up"](rms_norm(h, lay.mlp_in, eps), self.levels, residual, stats, clock)
            (down,) = g["down"](act(gate) * up, self.levels, residual, stats, clock)
            h = h + (down if lay.mlp_out is None else rms_norm(down, lay.mlp_out, eps))
        for seg, start, positions in zip(segments, starts, all_positions, strict=True):
            seg.cache.commit(start, positions)
        rows = [sp.stop - 1 if seg.last_only else sp for seg, sp in zip(segments, spans, strict=True)]
        t0 = clock()
        if all(isinstance(r, slice) for r in rows):
            hidden = h
        else:
            hidden = torch.cat([h[r] if isinstance(r, slice) else h[r : r + 1] for r in rows])
        hidden = rms_norm(hidden, self.norm, eps)
        logits = self.draft_head(hidden) if draft and self.draft_head is not None else hidden @ self.lm_head.T
        t1 = clock()
        stats.head_s += t1 - t0
        stats.total_s += t1 - t_start
        sizes = [1 if seg.last_only else sp.stop - sp.start for seg, sp in zip(segments, spans, strict=True)]
        return list(logits.split(sizes))
