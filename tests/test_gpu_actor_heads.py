"""The lm_head's forms (gpu_actor.heads) and the int16 product (kernels.head) against float64 references."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from splitspec.gpu_actor.heads import Int8Head, Int16Head, TiledHead, verifier_head
from splitspec.kernels import head


def _weight(vocab: int, hidden: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    w[::7] *= 30  # rows of very different magnitudes: each keeps its own scale
    return w


@pytest.mark.parametrize(("vocab", "n"), [(1, 1), (7, 3), (64, 1), (1001, 2), (1000, 16), (513, 17)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int16_product_is_the_dequantized_product(vocab, n, threads):
    """The kernel's logits are h · (codes · scale)ᵀ to fp32 rounding (float64 reference), whatever the
    vocabulary's remainder of ROWS or of the threads' chunks, into a given ``out`` too."""
    codes, scale = head.quantize_rows(_weight(vocab, 96, vocab + n))
    h = np.random.default_rng(n).standard_normal((n, 96)).astype(np.float32)
    want = h.astype(np.float64) @ (codes.astype(np.float64) * scale[:, None]).T
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        got = head.product(codes, scale, h)
        out = np.full((n, vocab), np.nan, np.float32)
        assert head.product(codes, scale, h, out) is out
    finally:
        numba.set_num_threads(before)
    tol = 1e-5 * np.abs(h).sum(1, keepdims=True) * (np.abs(codes) * scale[:, None]).max(1)[None, :]
    assert np.all(np.abs(got - want) <= tol)
    assert np.array_equal(out, got)


def test_int16_codes_keep_each_row_to_half_a_step():
    """Each weight is within half a step (its row's largest magnitude / 32767 / 2) of the stored value; the
    largest maps to ±32767; an all-zero row stays zero."""
    w = _weight(50, 64, 0)
    w[3] = 0
    codes, scale = head.quantize_rows(w)
    assert codes.dtype == np.int16 and scale.dtype == np.float32
    step = np.abs(w).max(1) / head.CODE_MAX
    assert np.all(np.abs(codes * scale[:, None] - w) <= 0.5 * step[:, None] * (1 + 1e-5))
    assert np.all(np.abs(codes[np.arange(50) != 3]).max(1) == head.CODE_MAX)
    assert not codes[3].any()


def test_int16_product_refuses_bad_operands():
    codes, scale = head.quantize_rows(_weight(8, 32, 1))
    h = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match=r"h must be float32 \[n, 32\]"):
        head.product(codes, scale, np.ones((2, 31), np.float32))
    with pytest.raises(ValueError, match=r"h must be float32"):
        head.product(codes, scale, h.astype(np.float64))
    with pytest.raises(ValueError, match="codes must be int16"):
        head.product(codes.astype(np.int32), scale, h)
    with pytest.raises(ValueError, match="out must be C-contiguous float32"):
        head.product(codes, scale, h, np.empty((2, 7), np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        head.quantize_rows(np.full((2, 2), np.inf, np.float32))


def test_int16_head_matches_the_fp32_head():
    """``Int16Head`` (the default verifier head) against the stored fp32 weight: each logit within half a step
    of its row times Σ|h| (the codes' rounding bound, plus fp32's), the same top-1 for every row; half the
    bytes plus a scale per row."""
    weight = torch.from_numpy(_weight(3000, 128, 2))
    h = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    got, want = Int16Head(weight)(h), (h.double() @ weight.double().T)
    assert got.dtype == torch.float32 and got.shape == (5, 3000)
    step = weight.abs().amax(1).double() / head.CODE_MAX
    bound = 0.5 * step[None, :] * h.abs().sum(1, keepdim=True).double() + 1e-6 * want.abs().max()
    assert torch.all((got.double() - want).abs() <= bound)
    assert torch.equal(got.argmax(1), want.argmax(1))
    assert Int16Head(weight).nbytes == 3000 * 128 * 2 + 3000 * 4
    assert isinstance(verifier_head(weight, "int16"), Int16Head)
    assert isinstance(verifier_head(weight, "fp32"), TiledHead)
    with pytest.raises(ValueError, match="head must be one of int16, fp32, bf16"):
        verifier_head(weight, "fp8")


def test_the_drafts_int8_head_ranks_like_the_fp32_head():
    """The draft's int8 copy of the lm_head (a scale per 128 columns, int16 activations): logits within 1% of
    the largest, the same top-1 and nearly the same top-8 as the fp32 head (it only ranks the draft's
    candidates; the verifier keeps its own head)."""

    gen = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(4096, 576, generator=gen), torch.randn(16, 576, generator=gen)
    head = Int8Head(weight)
    ref, got = hidden @ weight.T, head(hidden)
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    assert torch.equal(got.argmax(1), ref.argmax(1))
    pairs = zip(got.topk(8).indices.tolist(), ref.topk(8).indices.tolist(), strict=True)
    overlap = [len(set(a) & set(b)) for a, b in pairs]
    assert sum(overlap) >= 0.9 * 8 * len(overlap)
    assert head.nbytes < weight.numel() * 4 / 3


@pytest.mark.parametrize(("vocab", "n"), [(512, 1), (512, 3), (1000, 2), (1000, 16), (100, 4)])
def test_tiled_head_is_the_fp32_product(vocab, n):
    """The tiled lm_head (whole tiles, a short tail, or only a tail) gives hidden @ W.T up to fp32 rounding."""

    gen = torch.Generator().manual_seed(vocab + n)
    weight, h = torch.randn(vocab, 64, generator=gen), torch.randn(n, 64, generator=gen)
    want = (h.double() @ weight.double().T).float()
    got = TiledHead(weight)(h)
    assert got.shape == (n, vocab)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
