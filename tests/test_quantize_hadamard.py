"""The rotation must be exactly invertible and commute with the GPU/CPU split, or the verifier is wrong."""

import functools
import zlib

import pytest
import torch

from splitspec.quantize.hadamard import (
    block_size,
    fwht,
    hadamard_matrix,
    linear_seed,
    random_signs,
    rot_fwd,
    rot_inv,
    rotate_hessian,
    rotate_input,
    unrotate_output,
)

POWERS = [2**k for k in range(13)]  # 1 .. 4096


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


@pytest.mark.parametrize(("d_out", "d_in"), [(576, 1536), (192, 576), (1536, 576)])
def test_rot_inv_inverts_rot_fwd(d_out, d_in):
    g = torch.Generator().manual_seed(d_out + d_in)
    W = torch.randn(d_out, d_in, generator=g) * 0.02
    W[:, 3] *= 50  # an outlier input channel
    s_o, s_i = random_signs(1, d_out), random_signs(2, d_in)
    Wr = rot_fwd(W, s_o, s_i)
    assert rel_err(Wr, W) > 0.5  # it really rotated
    torch.testing.assert_close(Wr.double().norm(), W.double().norm(), rtol=1e-6, atol=0)  # and orthogonal
    assert rel_err(rot_inv(Wr, s_o, s_i), W) < 1e-6


def test_rotated_path_matches_direct_product_for_a_group():
    """q, k, v share one rotated input; each has its own output signs."""
    d_in, n_tok = 576, 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, d_in, generator=g)
    s_i = random_signs(linear_seed(20261008, "layers.0.qkv") + 1, d_in)
    x_rot = rotate_input(x, s_i)
    for name, d_out in (("q_proj", 576), ("k_proj", 192), ("v_proj", 192)):
        W = torch.randn(d_out, d_in, generator=g) / d_in**0.5
        s_o = random_signs(linear_seed(20261008, name), d_out)
        y = unrotate_output(x_rot @ rot_fwd(W, s_o, s_i).T, s_o)
        assert rel_err(y, x @ W.T) < 1e-5


def test_rotate_hessian_is_second_moment_of_rotated_inputs():
    d_in = 192
    X = torch.randn(300, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    s_i = random_signs(7, d_in)
    Xr = rotate_input(X, s_i)
    assert rel_err(rotate_hessian(X.T @ X / 300, s_i), Xr.T @ Xr / 300) < 1e-12
