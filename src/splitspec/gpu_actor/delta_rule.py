"""Qwen 3.5's linear-attention token mixer (the gated delta rule and its causal conv1d) over a tree of tokens.

Speculative decoding verifies a tree of draft tokens in one forward pass, but the recurrence of
``torch_recurrent_gated_delta_rule`` (transformers' ``modeling_qwen3_5``) walks one chain token by token. Its closed
form from a base state S0 (per value head, [dk, dv]) needs only each entry's path from the base, given as an
ancestor mask ``anc`` [n, m + n] (``anc[i, j]``: entry j is row i or one of its ancestors; pending entries j < m,
then the new rows), with G_t the sum of the log decays g over t's path and u_t the entry's delta-rule update:

    u_s = β_s (v_s − e^{G_s} S0ᵀk_s − Σ_{r ancestor of s} e^{G_s − G_r} (k_s·k_r) u_r)
    o_t = e^{G_t} S0ᵀq_t + Σ_{s ancestor-or-self of t} e^{G_t − G_s} (q_t·k_s) u_s
    S_T = e^{G_T} S0 + Σ_{s on the chain to T} e^{G_T − G_s} k_s u_sᵀ

Each entry has one path, so (k, u, G) of entries not yet folded into S0 (the pending ones) are stored and reused.
Everything is batched over heads and rows: no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from splitspec.models.spec import DeltaNet


@contextmanager
def subnormals_flushed(on: bool = True) -> Iterator[None]:
    """Subnormal floats flushed to zero in this thread's CPU work inside the block (``on``), then kept again
    (torch's default). A head that decays fast shrinks its state through them, and a CPU's float units take
    far longer on them (benchmarks/deltanet_mixer.py), where they are worth nothing next to the state's
    other values. The setting is the calling thread's: the thread that runs the pass sets it."""
    if not on:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def prepare(q: Tensor, k: Tensor, n_v_heads: int) -> tuple[Tensor, Tensor]:
    """q, k [n, Hk, dk] -> [n, Hv, dk]: l2-normalised as transformers' ``l2norm`` (q also scaled by dk**-0.5), each
    key head repeated for its Hv // Hk consecutive value heads, so that the rule works per value head."""

    def l2norm(x: Tensor) -> Tensor:
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    rep = n_v_heads // k.shape[1]
    q = l2norm(q) * q.shape[-1] ** -0.5
    return q.repeat_interleave(rep, dim=1), l2norm(k).repeat_interleave(rep, dim=1)


def tree_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    state: Tensor,
    k_prev: Tensor,
    u_prev: Tensor,
    big_g_prev: Tensor,
    anc: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Outputs of the new rows [n, Hv, dv], with their u [n, Hv, dv] and G [n, Hv] (kept as pending entries until
    folded). The new rows' u solve one unit lower-triangular system per head, since each u depends on its ancestors'."""
    m, n = k_prev.shape[0], q.shape[0]
    anc_new = anc[:, m:]
    # G: the row's own g, its new proper ancestors' g, and the G of its deepest pending ancestor (0 for none)
    deepest = (torch.cat([anc.new_ones(n, 1), anc[:, :m]], 1).long() * torch.arange(m + 1, device=anc.device)).amax(1)
    big_g = anc_new.to(g.dtype) @ g + torch.cat([g.new_zeros(1, g.shape[1]), big_g_prev])[deepest]

    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, n, d]
    k_all = torch.cat([k_prev, k]).transpose(0, 1)  # [Hv, m + n, dk]
    g_row = big_g.t()  # [Hv, n]
    g_all = torch.cat([big_g_prev, big_g]).t()  # [Hv, m + n]
    # e^{G_i − G_j} over ancestor pairs only: masked before exp, as non-ancestors' differences may be large positive
    decay = (g_row[:, :, None] - g_all[:, None, :]).masked_fill(~anc, float("-inf")).exp()  # [Hv, n, m + n]
    gamma = g_row.exp()[..., None]  # [Hv, n, 1]
    beta_h = beta.t()[..., None]

    # q's and k's products with the state and the keys, one batched product each: the state, the largest
    # operand (n_v × k_dim × v_dim), is read once a pass
    qk = torch.cat([qh, kh], 1)
    qk_state, qk_keys = qk @ state, qk @ k_all.transpose(1, 2)  # [Hv, 2n, dv], [Hv, 2n, m + n]
    kk = decay * qk_keys[:, n:]
    rhs = vh - gamma * qk_state[:, n:] - kk[:, :, :m] @ u_prev.transpose(0, 1)
    lower = torch.eye(n, dtype=q.dtype, device=q.device) + beta_h * kk[:, :, m:].tril(-1)
    u = torch.linalg.solve_triangular(lower, beta_h * rhs, upper=False, unitriangular=True)  # [Hv, n, dv]

    u_all = torch.cat([u_prev.transpose(0, 1), u], 1)
    out = gamma * qk_state[:, :n] + (decay * qk_keys[:, :n]) @ u_all
    return out.transpose(0, 1), u.transpose(0, 1), big_g


def mix_rows(
    net: DeltaNet,
    conv: Tensor,
    neg_a: Tensor,
    dt_bias: Tensor,
    x: Tensor,
    b: Tensor,
    a: Tensor,
    state: Tensor,
    window: Tensor,
    pending: Sequence[Tensor],
    anc: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, k, u, G) of a layer's rows from its projections' outputs (x: in_proj_qkv's, b and a: in_proj_b's
    and in_proj_a's), as Qwen 3.5's layer turns them into the rule's inputs (conv weight [C, K], -exp(A_log),
    dt bias), from ``state`` and the conv ``window`` at the base, the ``pending`` entries (k, u, G, x) after
    it and the ancestor mask ``anc`` over them and the rows."""
    n, key_dim = x.shape[0], net.n_k * net.k_dim
    q, k, v = tree_conv(x, window, pending[3], anc, conv).split([key_dim, key_dim, net.n_v * net.v_dim], dim=1)
    q, k = prepare(q.view(n, net.n_k, net.k_dim), k.view(n, net.n_k, net.k_dim), net.n_v)
    g = neg_a * F.softplus(a + dt_bias)
    out, u, big_g = tree_delta(q, k, v.reshape(n, net.n_v, net.v_dim), b.sigmoid(), g, state, *pending[:3], anc)
    return out, k, u, big_g


def fold(state: Tensor, k: Tensor, u: Tensor, big_g: Tensor, out: Tensor | None = None) -> Tensor:
    """The state [Hv, dk, dv] after a chain of entries (k [T, Hv, dk], u [T, Hv, dv], G [T, Hv] from the base, in
    path order): e^{G_T} S0 + Σ e^{G_T − G_s} k_s u_sᵀ, which makes the chain's end the new base. ``out`` may be
    ``state`` itself."""
    if k.shape[0] == 0:
        return state.clone() if out is None else out.copy_(state)
    last = big_g[-1]
    # both operands contiguous: a strided batched product falls off BLAS's fast path
    weighted = (k * (last - big_g).exp()[..., None]).permute(1, 2, 0).contiguous()  # [Hv, dk, T]
    res = torch.mul(state, last.exp()[:, None, None], out=out) if out is not None else state * last.exp()[:, None, None]
    return res.baddbmm_(weighted, u.transpose(0, 1).contiguous())


def tree_conv(x: Tensor, window: Tensor, x_prev: Tensor, anc: Tensor, weight: Tensor) -> Tensor:
    """Qwen 3.5's depthwise causal conv1d (no bias) + SiLU of the new rows x [n, C], each over the last K inputs of its
    own path: the window [K-1, C] before the base, its ancestors (pending x_prev [m, C], then new rows), itself."""
    n, kernel = x.shape[0], weight.shape[1]
    a = anc.long()
    length = a.sum(1, keepdim=True)  # [n, 1]: path length from the base, self included
    want = length - kernel + torch.arange(kernel, device=x.device)  # [n, K]: path rank of each tap (< 0: window)
    hit = anc[:, None, :] & ((a.cumsum(1) - 1)[:, None, :] == want[..., None])  # [n, K, m + n]
    entry = (hit.long() * torch.arange(anc.shape[1], device=x.device)).sum(-1)
    idx = torch.where(want >= 0, kernel - 1 + entry, want + kernel - 1)  # into cat(window, x_prev, x)
    taps = torch.cat([window, x_prev, x])[idx.reshape(-1)].view(n, kernel, -1)  # [n, K, C]
    return F.silu((taps * weight.t()).sum(1))


def conv_window(window: Tensor, chain: Tensor) -> Tensor:
    """The K-1 inputs before a new base after the chain [T, C]: the conv state the next forward pass starts from."""
    seq = torch.cat([window, chain])
    return seq[seq.shape[0] - window.shape[0] :]
