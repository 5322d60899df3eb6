"""The gated delta rule over a tree (splitspec.gpu_actor.delta_rule) against transformers' token-by-token reference:
every node of a random tree, split into pending entries and new rows, equals the recurrence run along its own path
from the base state; folding along a path equals the reference's final state; the causal conv likewise."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update, torch_recurrent_gated_delta_rule

from splitspec.gpu_actor.delta_rule import conv_window, fold, prepare, subnormals_flushed, tree_conv, tree_delta

HK, HV, DK, DV, C, K = 2, 4, 8, 6, 20, 4
PARENTS = [-1, 0, 0, 1, -1, 2, 3, 3, 5, 4, 8, 6]  # index order; the first 5 are the pending entries
M = 5
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _ancestors(parents: list[int]) -> torch.Tensor:
    anc = torch.eye(len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def _path(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _inputs(n: int, seed: int, g_scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, HK, DK, generator=gen), torch.randn(n, HK, DK, generator=gen)
    v = torch.randn(n, HV, DV, generator=gen)
    beta = torch.rand(n, HV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * g_scale
    state = torch.randn(HV, DK, DV, generator=gen)
    return q, k, v, beta, g, state


def _reference(q, k, v, beta, g, state, rows):
    """transformers' recurrence along ``rows`` from ``state``: outputs [T, Hv, dv] and the final state."""
    out, last = torch_recurrent_gated_delta_rule(
        q[rows][None], k[rows][None], v[rows][None], g=g[rows][None], beta=beta[rows][None],
        initial_state=state[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], last[0]


def _empty():
    return torch.zeros(0, HV, DK), torch.zeros(0, HV, DV), torch.zeros(0, HV)


def test_chain_equals_transformers():
    n = 7
    q, k, v, beta, g, state = _inputs(n, seed=0)
    qn, kn = prepare(q, k, HV)
    out, u, big_g = tree_delta(qn, kn, v, beta, g, state, *_empty(), torch.ones(n, n, dtype=torch.bool).tril())
    ref_out, ref_state = _reference(q, k, v, beta, g, state, list(range(n)))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(big_g, g.cumsum(0), **TOL)
    torch.testing.assert_close(fold(state, kn, u, big_g), ref_state, **TOL)
    assert torch.equal(fold(state, *_empty()), state)


def _tree(q, k, v, beta, g, state):
    """The tree in two calls: the pending entries (m = 0), then the new rows on top of them."""
    anc = _ancestors(PARENTS)
    qn, kn = prepare(q, k, HV)
    out_p, u_p, g_p = tree_delta(qn[:M], kn[:M], v[:M], beta[:M], g[:M], state, *_empty(), anc[:M, :M])
    out_n, u_n, g_n = tree_delta(qn[M:], kn[M:], v[M:], beta[M:], g[M:], state, kn[:M], u_p, g_p, anc[M:])
    return kn, torch.cat([out_p, out_n]), torch.cat([u_p, u_n]), torch.cat([g_p, g_n])


@pytest.mark.parametrize("g_scale", [1.0, 4.0])
def test_tree_equals_each_path(g_scale):
    q, k, v, beta, g, state = _inputs(len(PARENTS), seed=1, g_scale=g_scale)
    kn, out, u, big_g = _tree(q, k, v, beta, g, state)
    leaves = set(range(len(PARENTS))) - set(PARENTS)
    for i in range(len(PARENTS)):
        path = _path(PARENTS, i)
        ref_out, ref_state = _reference(q, k, v, beta, g, state, path)
        torch.testing.assert_close(out[i], ref_out[-1], **TOL)
        torch.testing.assert_close(big_g[i], g[path].sum(0), **TOL)
        if i in leaves:
            torch.testing.assert_close(fold(state, kn[path], u[path], big_g[path]), ref_state, **TOL)
            into = state.clone()
            assert fold(into, kn[path], u[path], big_g[path], out=into) is into
            torch.testing.assert_close(into, ref_state, **TOL)


def test_large_negative_decay_stays_finite():
    q, k, v, beta, _, state = _inputs(len(PARENTS), seed=2)
    g = torch.full((len(PARENTS), HV), -30.0)
    g[::3] = 0.0  # some steps keep the state, so that both tiny and unit decays meet
    kn, out, u, big_g = _tree(q, k, v, beta, g, state)
    assert torch.isfinite(out).all() and torch.isfinite(u).all()
    for i in range(len(PARENTS)):
        path = _path(PARENTS, i)
        ref_out, ref_state = _reference(q, k, v, beta, g, state, path)
        torch.testing.assert_close(out[i], ref_out[-1], **TOL)
        folded = fold(state, kn[path], u[path], big_g[path])
        assert torch.isfinite(folded).all()
        torch.testing.assert_close(folded, ref_state, **TOL)


@pytest.mark.parametrize("window_zero", [False, True])
def test_tree_conv_equals_transformers(window_zero):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(len(PARENTS), C, generator=gen)
    window = torch.zeros(K - 1, C) if window_zero else torch.randn(K - 1, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    anc = _ancestors(PARENTS)
    got = torch.cat(
        [tree_conv(x[:M], window, x[:0], anc[:M, :M], weight), tree_conv(x[M:], window, x[:M], anc[M:], weight)]
    )
    for i in range(len(PARENTS)):
        path = _path(PARENTS, i)
        conv_state = window.t()[None].clone()
        ref = causal_conv1d_update(x[path].t()[None], conv_state, weight, None, activation="silu")
        torch.testing.assert_close(got[i], ref[0, :, -1], **TOL)
        torch.testing.assert_close(conv_window(window, x[path]), conv_state[0].t(), rtol=0, atol=0)


def test_subnormals_are_flushed_inside_the_block_alone():
    """A pass of a linear-attention model flushes subnormal floats on the CPU, and gives the thread back as
    it found it (another test's subnormals, e.g. hypothesis's, still exist after)."""
    tiny = torch.tensor([1e-39])  # below float32's smallest normal
    assert (tiny * 1.0).item() != 0
    with subnormals_flushed():
        assert (tiny * 1.0).item() == 0
    assert (tiny * 1.0).item() != 0
    with subnormals_flushed(False):
        assert (tiny * 1.0).item() != 0
