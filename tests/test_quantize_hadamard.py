"""The rotation must be exactly invertible and commute with the GPU/CPU split, or the verifier is wrong.

Both kinds: the recipe's block-diagonal Sylvester and the full-width Kronecker (Paley ⊗ Sylvester), whose
Paley factor is not symmetric, so every transpose is checked too.
"""

import functools
import zlib

import pytest
import torch

from splitspec.quantize.hadamard import (
    ROTATIONS,
    block_size,
    check_rotation,
    fwht,
    hadamard,
    hadamard_matrix,
    linear_seed,
    paley_matrix,
    paley_order,
    random_signs,
    rot_fwd,
    rot_inv,
    rotate_hessian,
    rotate_input,
    rotation_matrix,
    unrotate_output,
)

POWERS = [2**k for k in range(13)]  # 1 .. 4096
# Widths of the target models (SmolLM2 576/1536, Llama 4096/14336, Gemma-like 5376) and a fallback:
# 368 = 16·23 has no Paley construction (q = 91 and 45 are not prime).
DIMS = [576, 1536, 4096, 14336, 5376, 368]


@functools.cache
def dense64(b: int) -> torch.Tensor:
    """fp64 reference matrices, built once: the 4096 one alone is 128 MiB."""
    return hadamard_matrix(b, torch.float64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    ("n", "b"),
    [(576, 64), (1536, 512), (192, 64), (15360, 1024), (5376, 256), (4096, 4096), (8192, 4096), (3840, 256)],
)
def test_block_size(n, b):
    assert block_size(n) == b


def test_block_size_odd_and_invalid():
    assert block_size(1) == 1
    assert block_size(49) == 1
    for n in (0, -4):
        with pytest.raises(ValueError, match="positive"):
            block_size(n)


@pytest.mark.parametrize("b", POWERS)
def test_hadamard_orthonormal_symmetric_self_inverse(b):
    H = dense64(b)
    assert torch.equal(H, H.T)
    assert float((H.abs() - b**-0.5).abs().max()) < 1e-15 * b**-0.5
    # H symmetric, so H·H == H·H^T: self-inverse and orthonormal are the same check. Past 1024 a dense
    # product costs seconds, so check a sample of columns there.
    cols = torch.arange(b) if b <= 1024 else torch.randperm(b, generator=torch.Generator().manual_seed(0))[:48]
    torch.testing.assert_close(H @ H[:, cols], torch.eye(b, dtype=torch.float64)[:, cols], atol=1e-12, rtol=0)


def test_hadamard_rejects_non_power_of_two():
    for b in (0, 3, 576):
        with pytest.raises(ValueError, match="power of two"):
            hadamard_matrix(b)


@pytest.mark.parametrize(("n", "b"), [(576, 64), (1536, 512), (192, 64), (4096, 4096), (24, 8), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fwht_equals_dense_block_diagonal(n, b, dtype):
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    want = (x.reshape(2, 3, n // b, b) @ dense64(b)).reshape(x.shape)  # block-diagonal product
    got = fwht(x.to(dtype))
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert rel_err(got.double(), want) < tol


def test_fwht_explicit_block_returns_new_tensor_and_checks_divisibility():
    x = torch.randn(4, 32)
    y = fwht(x, 8)
    torch.testing.assert_close(y, (x.reshape(4, 4, 8) @ hadamard_matrix(8)).reshape(4, 32))
    assert fwht(x, 1).data_ptr() != x.data_ptr()
    torch.testing.assert_close(fwht(fwht(x)), x)
    with pytest.raises(ValueError, match="multiple"):
        fwht(torch.randn(4, 24), 16)


def test_random_signs_and_seed():
    s = random_signs(20261008, 576)
    g = torch.Generator().manual_seed(20261008)
    assert s.dtype == torch.float32
    assert torch.equal(s, (torch.randint(0, 2, (576,), generator=g) * 2 - 1).float())
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, random_signs(20261008, 576))
    name = "model.layers.0.self_attn.q_proj"
    assert linear_seed(20261008, name) == 20261008 + zlib.crc32(name.encode()) % 100000


def test_check_rotation():
    assert ROTATIONS == ("sylvester", "kronecker")
    for kind in ROTATIONS:
        assert check_rotation(kind) == kind
    with pytest.raises(ValueError, match="unknown rotation 'walsh'"):
        check_rotation("walsh")
    with pytest.raises(ValueError, match="unknown rotation"):
        hadamard(torch.zeros(2, 8), "walsh")


@pytest.mark.parametrize(
    ("n", "p"),
    [
        (576, 36),  # Paley II, q = 17
        (1536, 12),  # Paley I, q = 11
        (14336, 28),  # Paley II, q = 13
        (5376, 84),  # Paley I, q = 83
        (15360, 60),  # Paley I, q = 59
        (192, 12),
        (4096, None),  # m = 1: a power of two, Sylvester already spans it
        (368, None),  # 4·23: neither 91 nor 45 is prime
        (18, None),  # 2·9: k < 2, no Hadamard matrix of order 18
        (9, None),
    ],
)
def test_paley_order(n, p):
    assert paley_order(n) == p


# (order, symmetric): Paley I (q = p − 1 prime) is identity plus a skew matrix, Paley II is symmetric.
@pytest.mark.parametrize(
    ("p", "symmetric"), [(12, False), (20, False), (24, False), (28, True), (36, True), (60, False), (84, False)]
)
def test_paley_matrix_is_hadamard(p, symmetric):
    P = paley_matrix(p, torch.float64)
    assert torch.equal((P * p**0.5).round().abs(), torch.ones(p, p, dtype=torch.float64))  # entries ±1/√p
    torch.testing.assert_close(P @ P.T, torch.eye(p, dtype=torch.float64), atol=1e-13, rtol=0)
    assert torch.equal(P, P.T) == symmetric


def test_paley_matrix_rejects_orders_without_construction():
    for p in (8, 92, 18):
        with pytest.raises(ValueError, match="no Paley construction"):
            paley_matrix(p)


@pytest.mark.parametrize("n", [576, 1536, 192, 368, 24])
@pytest.mark.parametrize("kind", ROTATIONS)
def test_rotation_matrix_orthonormal_and_hadamard_matches_it(n, kind):
    """The dense reference is orthonormal with entries of one magnitude, and hadamard(x) == H·x, Hᵀ·x."""
    R = rotation_matrix(n, kind)
    torch.testing.assert_close(R @ R.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    mags = R[R != 0].abs()
    assert float(mags.max() - mags.min()) < 1e-15
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    assert rel_err(hadamard(x, kind), x @ R.T) < 1e-13
    assert rel_err(hadamard(x, kind, transpose=True), x @ R) < 1e-13


@pytest.mark.parametrize("n", DIMS)
@pytest.mark.parametrize("kind", ROTATIONS)
def test_transpose_inverts_and_norms_are_kept_at_model_widths(n, kind):
    """Orthonormal at every target width, without a dense matrix: Hᵀ·H·x == x and ‖H·x‖ == ‖x‖."""
    x = torch.randn(4, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = hadamard(x, kind)
    assert rel_err(y, x) > 0.5
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-13, atol=0)
    assert rel_err(hadamard(y, kind, transpose=True), x) < 1e-13


def test_kronecker_is_full_width_and_sylvester_is_block_diagonal():
    """The point of the kronecker kind: every output of 576 mixes all 576 inputs, not a block of 64."""
    assert bool((rotation_matrix(576, "kronecker") != 0).all())
    assert int((rotation_matrix(576, "sylvester") != 0).sum(1).max()) == 64
    assert not torch.equal(rotation_matrix(1536, "kronecker"), rotation_matrix(1536, "kronecker").T)


@pytest.mark.parametrize("n", [14336, 5376])
def test_kronecker_columns_of_large_widths(n):
    """Too wide for a dense reference: columns and rows H·e_j, Hᵀ·e_j against kron(P, H_r)'s, sampled."""
    p = paley_order(n)
    P, S = paley_matrix(p, torch.float64), hadamard_matrix(n // p, torch.float64)
    cols = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:6]
    E = torch.zeros(len(cols), n, dtype=torch.float64)
    E[torch.arange(len(cols)), cols] = 1.0
    for transpose, pick in ((False, lambda m, j: m[:, j]), (True, lambda m, j: m[j])):
        got = hadamard(E, "kronecker", transpose)
        for row, j in zip(got, cols.tolist(), strict=True):
            want = torch.kron(pick(P, j // (n // p)), pick(S, j % (n // p)))
            torch.testing.assert_close(row, want, atol=1e-15, rtol=0)


@pytest.mark.parametrize("kind", ROTATIONS)
@pytest.mark.parametrize(("d_out", "d_in"), [(576, 1536), (192, 576), (1536, 576), (368, 368)])
def test_rot_inv_inverts_rot_fwd(kind, d_out, d_in):
    g = torch.Generator().manual_seed(d_out + d_in)
    W = torch.randn(d_out, d_in, generator=g) * 0.02
    W[:, 3] *= 50  # an outlier input channel
    s_o, s_i = random_signs(1, d_out), random_signs(2, d_in)
    Wr = rot_fwd(W, s_o, s_i, kind)
    assert rel_err(Wr, W) > 0.5  # it really rotated
    torch.testing.assert_close(Wr.double().norm(), W.double().norm(), rtol=1e-6, atol=0)  # and orthogonal
    assert rel_err(rot_inv(Wr, s_o, s_i, kind), W) < 1e-6


def test_rot_fwd_matches_dense_two_sided_product():
    """W~ = H_o·S_o·W·S_i·H_iᵀ with the dense matrices: the transposes sit where the docstring says."""
    d_out, d_in = 192, 1536  # both with a non-symmetric Paley factor (H_12)
    W = torch.randn(d_out, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    s_o, s_i = random_signs(3, d_out).double(), random_signs(4, d_in).double()
    H_o, H_i = rotation_matrix(d_out, "kronecker"), rotation_matrix(d_in, "kronecker")
    want = H_o @ torch.diag(s_o) @ W @ torch.diag(s_i) @ H_i.T
    assert rel_err(rot_fwd(W, s_o, s_i, "kronecker"), want) < 1e-13


@pytest.mark.parametrize("kind", ROTATIONS)
def test_rotated_path_matches_direct_product_for_a_group(kind):
    """q, k, v share one rotated input; each has its own output signs."""
    d_in, n_tok = 576, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, d_in, generator=g)
    s_i = random_signs(linear_seed(20261008, "layers.0.qkv") + 1, d_in)
    x_rot = rotate_input(x, s_i, kind)
    for name, d_out in (("q_proj", 576), ("k_proj", 192), ("v_proj", 192), ("down_proj", 1536)):
        W = torch.randn(d_out, d_in, generator=g) / d_in**0.5
        s_o = random_signs(linear_seed(20261008, name), d_out)
        y = unrotate_output(x_rot @ rot_fwd(W, s_o, s_i, kind).T, s_o, kind)
        assert rel_err(y, x @ W.T) < 1e-5


@pytest.mark.parametrize("kind", ROTATIONS)
def test_rotate_hessian_is_second_moment_of_rotated_inputs(kind):
    d_in = 192
    X = torch.randn(300, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    s_i = random_signs(7, d_in)
    Xr = rotate_input(X, s_i, kind)
    assert rel_err(rotate_hessian(X.T @ X / 300, s_i, kind), Xr.T @ Xr / 300) < 1e-12
