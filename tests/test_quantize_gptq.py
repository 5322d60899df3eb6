"""GPTQ must beat round-to-nearest on the loss it minimises, and its outputs must be what a reader rebuilds."""

import numpy as np
import pytest
import torch

from splitspec.quantize.gptq import GPTQResult, LloydMaxQuantizer, UniformQuantizer, gptq, int8_g32, round_scales, rtn
from splitspec.quantize.hadamard import random_signs, rot_fwd, rotate_hessian
from splitspec.quantize.packing import dequantize_residual, pack_residual

LEVELS = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
QUANTIZERS = {"lloyd_max": LloydMaxQuantizer(LEVELS), "uniform6": UniformQuantizer(6)}


def rotated_problem(rows: int, cols: int, dead: int | None = None, seed: int = 0):
    """Rotated weights and Hessian like a real Linear's: correlated inputs with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(cols) + torch.randn(cols, cols, generator=g) * (0.6 / cols**0.5)
    X = torch.randn(1024, cols, generator=g) @ mix
    X[:, :4] *= 10
    if dead is not None:
        X[:, dead] = 0.0
    s_o, s_i = random_signs(seed + 1, rows), random_signs(seed + 2, cols)
    W = rot_fwd(torch.randn(rows, cols, generator=g) * 0.02, s_o, s_i)
    return W, rotate_hessian(X.T @ X / X.shape[0], s_i)


def dead_problem(rows: int, cols: int, dead: int):
    """Unrotated, so the dead input stays one column (rotation would spread it over its block)."""
    g = torch.Generator().manual_seed(9)
    X = torch.randn(512, cols, generator=g)
    X[:, dead] = 0.0
    return torch.randn(rows, cols, generator=g), X.T @ X / 512


def hessian_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    D = (W - Q).double()
    return float(torch.einsum("ij,jk,ik->", D, H.double(), D))


def rebuild(res: GPTQResult, quantizer, group: int = 128) -> torch.Tensor:
    """What a reader of the file computes from the stored codes and fp16 scales."""
    scale = res.scales.float().repeat_interleave(group, dim=1)[:, : res.codes.shape[1]]
    if isinstance(quantizer, LloydMaxQuantizer):
        return quantizer.levels[res.codes.long()] * scale
    return res.codes.float() * scale


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("cols", [256, 576])
def test_gptq_beats_rtn_on_hessian_weighted_error(name, cols):
    quantizer = QUANTIZERS[name]
    W, H = rotated_problem(96, cols)
    g, r = gptq(W, H, quantizer), rtn(W, quantizer)
    assert hessian_error(W, g.dequant, H) < 0.8 * hessian_error(W, r.dequant, H)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_gptq_with_dead_column(name):
    quantizer, dead = QUANTIZERS[name], 130
    W, H = dead_problem(64, 576, dead)
    res = gptq(W, H, quantizer)
    assert torch.isfinite(res.dequant).all()
    assert hessian_error(W, res.dequant, H) < 0.8 * hessian_error(W, rtn(W, quantizer).dequant, H)
    # The dead input never reaches the output, so its weights must not influence anything.
    W2 = W.clone()
    W2[:, dead] = 123.0
    assert torch.equal(gptq(W2, H, quantizer).dequant, res.dequant)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_outputs_are_what_a_reader_rebuilds(name):
    quantizer = QUANTIZERS[name]
    W, H = rotated_problem(40, 576)
    for res in (gptq(W, H, quantizer), rtn(W, quantizer)):
        assert res.codes.shape == (40, 576) and res.dequant.shape == (40, 576)
        assert res.scales.shape == (40, 5) and res.scales.dtype == torch.float32
        assert torch.equal(res.scales, res.scales.half().float())  # fp16 values, as the base file stores them
        assert res.dequant.dtype == torch.float32
        torch.testing.assert_close(rebuild(res, quantizer), res.dequant, rtol=0, atol=0)
    codes = gptq(W, H, quantizer).codes
    if name == "lloyd_max":
        assert codes.dtype == torch.uint8 and int(codes.max()) == 3
    else:
        assert codes.dtype == torch.int8


def _same_solution(a: torch.Tensor, b: torch.Tensor, W: torch.Tensor, H: torch.Tensor) -> None:
    """Two GPTQ runs that differ only in the order of fp32 sums: a weight that lands within rounding of a
    quantization boundary may take the other level, and the error feedback then moves the rest of its
    row a little; so almost every weight must agree and the Hessian-weighted error must be the same."""
    off = (a - b).abs() > 1e-5
    assert off.float().mean() <= 0.03, f"{int(off.sum())} of {off.numel()} weights differ"
    assert hessian_error(W, a, H) == pytest.approx(hessian_error(W, b, H), rel=0.01)


def test_lazy_blocks_match_column_by_column_updates():
    W, H = rotated_problem(32, 320)
    W_before = W.clone()
    q = QUANTIZERS["uniform6"]
    ref = gptq(W, H, q, block=1).dequant  # every update goes through the lazy GEMM
    for block in (32, 128, 256):
        _same_solution(gptq(W, H, q, block=block).dequant, ref, W, H)
    _same_solution(gptq(W, H, q, group=32, block=128).dequant, gptq(W, H, q, group=32, block=32).dequant, W, H)
    assert torch.equal(W, W_before)  # W arrives transposed (a view); gptq must not write through it


def test_diagonal_hessian_reduces_to_rtn():
    """No input correlation means no error feedback: GPTQ must then be plain rounding."""
    W, _ = rotated_problem(16, 576)
    H = torch.diag(torch.rand(576, generator=torch.Generator().manual_seed(4)) + 0.1)
    for q in QUANTIZERS.values():
        torch.testing.assert_close(gptq(W, H, q).dequant, rtn(W, q).dequant, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 6, 7, 8])
def test_uniform_codes_within_qm(bits):
    W, H = rotated_problem(24, 192, seed=bits)
    W[0, 5] = 3.0  # an outlier sets the scale of its group
    q = UniformQuantizer(bits)
    for res in (gptq(W, H, q), rtn(W, q)):
        assert int(res.codes.abs().max()) <= q.qm == 2 ** (bits - 1) - 1
        assert int(res.codes.abs().max()) == q.qm


def test_zero_weights_give_zero_scales_and_no_nan():
    W, H = torch.zeros(8, 200), torch.eye(200)
    for q in QUANTIZERS.values():
        res = gptq(W, H, q)
        assert torch.equal(res.dequant, W) and not res.scales.float().any()


def test_indefinite_hessian_warns_and_adds_damping():
    W = torch.randn(4, 2)
    H = torch.tensor([[1.0, 2.0], [2.0, 1.0]])  # positive diagonal, eigenvalue -1
    with pytest.warns(RuntimeWarning, match="damping"):
        res = gptq(W, H, QUANTIZERS["uniform6"])
    assert torch.isfinite(res.dequant).all()


def test_invalid_arguments():
    q = QUANTIZERS["uniform6"]
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq(torch.zeros(4, 8), torch.eye(6), q)
    with pytest.raises(ValueError, match="nest"):
        gptq(torch.zeros(4, 8), torch.eye(8), q, group=48, block=128)
    with pytest.raises(ValueError, match="bits"):
        UniformQuantizer(9)
    with pytest.raises(ValueError, match="increasing"):
        LloydMaxQuantizer(torch.tensor([1.0, -1.0]))


def test_int8_g32_error_bound():
    g = torch.Generator().manual_seed(5)
    W = torch.randn(48, 80, generator=g) * torch.logspace(-4, 1, 48, dtype=torch.float32)[:, None]
    dq = int8_g32(W)  # 80 columns: two groups of 32 and a short one of 16
    assert dq.dtype == torch.float32 and dq.shape == W.shape
    for start in range(0, 80, 32):
        blk, got = W[:, start : start + 32], dq[:, start : start + 32]
        exact = blk.abs().amax(dim=1, keepdim=True) / 127
        scale = exact.half().float()
        # Half a step, plus what the clamp at ±127 loses where fp16 rounded the scale down (large only
        # where the scale is an fp16 subnormal, below 6.1e-5).
        bound = 0.5 * scale * (1 + 1e-5) + 127 * (exact - scale).clamp(min=0)
        assert bool(((blk - got).abs() <= bound).all())
        # and the values sit on the grid the file would store
        torch.testing.assert_close(got / scale, (got / scale).round(), rtol=0, atol=1e-4)


def test_clip_search_picks_each_rows_least_squared_error_ratio():
    """The MSE scale is the best of the candidate ratios, row by row, checked against a brute-force loop."""
    g = torch.Generator().manual_seed(11)
    blk = torch.randn(12, 128, generator=g)
    q = UniformQuantizer(3, clip_min=0.4, clip_steps=13)
    got = q.scales(blk)
    for r in range(blk.shape[0]):
        errs = []
        for c in torch.linspace(0.4, 1.0, 13):
            s = (blk[r].abs().max() * c / q.qm).half().float()
            errs.append((float((q.quantize(blk[r], s)[1] - blk[r]).square().sum()), float(s)))
        assert float(got[r]) == min(errs)[1]
    plain = UniformQuantizer(3).scales(blk)
    assert (got < plain).all()  # on Gaussian rows a 3-bit grid always gains by clipping the extremes
    assert torch.equal(UniformQuantizer(3, clip_min=1.0).scales(blk), plain)


def test_scale_grid_takes_the_better_neighbour_within_the_tile_window():
    """With tile tops, each scale is the grid value just below or just above max|group| / qm, whichever
    rounds the row with less squared error (checked by brute force), never under top/8 nor over 1.98 top;
    the packed file then rebuilds GPTQ's own dequantized values exactly."""
    W, H = rotated_problem(40, 576, seed=5)
    W[3] *= 1e-4  # a row far under its tile's largest: raised to the floor
    top = torch.full((40,), 2.0 ** torch.ceil(torch.log2(W.abs().max() / 31 / (2 - 1 / 64))).item())
    q = UniformQuantizer(6, top=top)
    blk = W[:, :128]
    got = q.scales(blk)
    for r in range(40):
        raw = torch.clamp(blk[r].abs().max() / 31, min=top[r] / 8)
        cands = [round_scales(raw[None], top[r : r + 1] / 8, up)[0] for up in (False, True)]
        errs = [(float((q.quantize(blk[r], c)[1] - blk[r]).square().sum()), float(c)) for c in cands]
        assert float(got[r]) == min(errs)[1]
    assert float(got[3]) == float(top[3] / 8)
    assert bool((got <= top * (2 - 1 / 64)).all())
    res = gptq(W, H, q)
    planes = pack_residual(res.codes.numpy().astype(np.int8), res.scales.numpy(), 6)
    np.testing.assert_array_equal(dequantize_residual(planes, 6, 40, d_in=576), res.dequant.numpy())
    # the grid costs no more squared error than fp16 scales here (it picks between two neighbours)
    fp16 = gptq(W, H, UniformQuantizer(6))
    assert hessian_error(W, res.dequant, H) < 1.02 * hessian_error(W, fp16.dequant, H)


def test_clip_search_lowers_rounding_error_and_keeps_codes_in_range():
    W, H = rotated_problem(64, 256, seed=3)
    plain, clipped = UniformQuantizer(4), UniformQuantizer(4, clip_min=0.5)
    r_plain, r_clip = rtn(W, plain), rtn(W, clipped)
    assert float((r_clip.dequant - W).square().sum()) < float((r_plain.dequant - W).square().sum())
    g_clip = gptq(W, H, clipped)
    assert int(g_clip.codes.abs().max()) <= clipped.qm
    torch.testing.assert_close(rebuild(g_clip, clipped), g_clip.dequant, rtol=0, atol=0)
    with pytest.raises(ValueError, match="clip_min"):
        UniformQuantizer(6, clip_min=0.0)


def _act_order_reference(W: torch.Tensor, H: torch.Tensor, q: UniformQuantizer, damp: float = 0.01) -> torch.Tensor:
    """Textbook act-order GPTQ, one column at a time: static scales from W, columns by descending H_ii."""
    W = W.clone()
    cols = W.shape[1]
    per_col = torch.stack([q.scales(W[:, g : g + 128]) for g in range(0, cols, 128)], 1).repeat_interleave(128, 1)
    order = torch.argsort(H.diagonal(), descending=True, stable=True)
    Hp = H[order][:, order].double()
    Hp += damp * Hp.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hp)), upper=True).float()
    W, per_col = W[:, order], per_col[:, order]
    out = torch.empty_like(W)
    for j in range(cols):
        out[:, j] = q.quantize(W[:, j], per_col[:, j])[1]
        W[:, j + 1 :] -= ((W[:, j] - out[:, j]) / U[j, j])[:, None] * U[j, j + 1 :]
    return out[:, torch.argsort(order)]


def test_act_order_matches_the_textbook_loop_and_rebuilds():
    W, H = rotated_problem(24, 320, seed=6)
    q = UniformQuantizer(6)
    res = gptq(W, H, q, act_order=True)
    torch.testing.assert_close(res.dequant, _act_order_reference(W, H, q), rtol=0, atol=2e-6)
    torch.testing.assert_close(rebuild(res, q), res.dequant, rtol=0, atol=0)
    assert hessian_error(W, res.dequant, H) < hessian_error(W, rtn(W, q).dequant, H)
    # no input correlation: act-order with static scales is plain rounding
    Hd = torch.diag(torch.rand(320, generator=torch.Generator().manual_seed(2)) + 0.1)
    torch.testing.assert_close(gptq(W, Hd, q, act_order=True).dequant, rtn(W, q).dequant, rtol=0, atol=0)
