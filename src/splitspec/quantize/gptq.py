"""GPTQ/LDLQ error feedback for the 2-bit base and the uniform residual (POC recipe, sections 2–3).

Rounding a column alone leaves an error that GPTQ pushes onto the not-yet-quantized columns, weighted by
the upper Cholesky factor U of H^-1, so the loss tr((W - Q)·H·(W - Q)^T) and not the plain squared error
is what gets minimised. Columns go in natural order in blocks of `block`; inside a block the update is
applied column by column (the only Python loop, vectorised over rows), and to the columns after the block
once per block as a GEMM (the "lazy batch" update). Scales are chosen per (row, group) from the weights as
updated so far, when the loop reaches the group's first column, so they see the errors they must absorb.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from splitspec.quantize.packing import SCALE_MANTISSA, SCALE_MAX, SCALE_SPAN, TILE, tile_tops

# Cholesky retries multiply the damping by this factor, up to MAX_DAMP_RETRIES times.
DAMP_GROWTH = 10.0
MAX_DAMP_RETRIES = 8


class Quantizer(Protocol):
    """Scalar quantizer with one scale per row of a group.

    quantize must be elementwise with broadcasting: gptq calls it with a column [rows] and scales [rows],
    rtn with a whole group [rows, g] and scales [rows, 1].
    """

    def scales(self, block: Tensor) -> Tensor:
        """Per-row scale of a [rows, g] group, already rounded to fp16 values (as the file stores it)."""
        ...

    def quantize(self, w_col: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, dequantized float32 values); a zero scale must give dequantized zeros, not NaN."""
        ...


def _fp16_values(x: Tensor) -> Tensor:
    """Round to fp16 and back: quantize against the scale the reader will see, not a finer one."""
    return x.to(torch.float16).to(torch.float32)


def round_scales(scales: Tensor, floor: Tensor, up: bool | None) -> Tensor:
    """The residual's scale grid (``packing``, "scale"): the grid value just below (``up`` False), just
    above (True) or nearest (None) each scale, never under ``floor``, floats with a ``SCALE_MANTISSA``-bit
    mantissa."""
    mant, exp = torch.frexp(torch.maximum(scales, floor))  # mant in [0.5, 1)
    steps = mant * 2.0 ** (SCALE_MANTISSA + 1)
    steps = torch.round(steps) if up is None else torch.ceil(steps) if up else torch.floor(steps)
    return torch.ldexp(steps, exp - (SCALE_MANTISSA + 1))


def to_scale_grid(scales: np.ndarray) -> np.ndarray:
    """The nearest grid values (float32) of positive scales [rows, G] chosen elsewhere, a tile's smallest
    raised to its floor: for tools and tests (the quantizer picks grid values itself)."""
    floor = np.repeat(tile_tops(scales), TILE)[: scales.shape[0], None] * 2.0 ** (1 - SCALE_SPAN)
    grid = round_scales(torch.from_numpy(scales.astype(np.float64)), torch.from_numpy(floor), None)
    return grid.numpy().astype(np.float32)


def _safe(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class LloydMaxQuantizer:
    """2-bit base: code k in 0..3 stands for levels[k] × the group's RMS (uint8 codes)."""

    def __init__(self, levels: Tensor) -> None:
        levels = torch.as_tensor(levels, dtype=torch.float32).reshape(-1)
        if levels.numel() < 2 or levels.numel() > 256 or not bool((levels[1:] > levels[:-1]).all()):
            raise ValueError(f"levels must be 2..256 strictly increasing values, got {levels.tolist()}")
        self.levels = levels
        self._cuts = (levels[1:] + levels[:-1]) / 2

    def scales(self, block: Tensor) -> Tensor:
        return _fp16_values(block.float().square().mean(dim=1).sqrt())

    def quantize(self, w_col: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        # A comparison count instead of torch.bucketize, which costs ~30x more on the CPU for a
        # handful of cut points.
        codes = ((w_col / _safe(scale)).unsqueeze(-1) > self._cuts).sum(-1)
        return codes.to(torch.uint8), self.levels[codes] * scale


class UniformQuantizer:
    """Symmetric uniform grid -qm..qm, qm = 2^(bits-1) - 1, scale = c · max|group| / qm (int8 codes).

    No zero-point: the residual is centred on zero, and a symmetric grid keeps the CPU kernel a plain
    int8 × scale multiply. c = 1 by default; with ``clip_min`` < 1 each row takes, of ``clip_steps`` ratios
    c evenly in [clip_min, 1], the one whose grid rounds the group with the least squared error (an
    MSE-optimal scale): clipping the few largest values buys a finer step for all the others, where the
    group's tail is long enough for that to pay.

    Scales are fp16 values, or with ``top`` (float32 [rows], a power of two per row: its tile's
    ``packing`` "scale_top") values of the residual's 8-bit scale grid within ``[top/8, 1.98·top]``. Each
    candidate then goes to the grid value below and the one above it, and the row keeps whichever rounds
    the group with the least squared error: the step is then no coarser than fp16's on average.
    """

    def __init__(self, bits: int, clip_min: float = 1.0, clip_steps: int = 16, top: Tensor | None = None) -> None:
        if not 2 <= bits <= 8:
            raise ValueError(f"uniform residual bits must be in 2..8 (int8 codes), got {bits}")
        if not 0 < clip_min <= 1 or clip_steps < 1:
            raise ValueError(f"need 0 < clip_min <= 1 and clip_steps >= 1, got {clip_min}, {clip_steps}")
        self.bits = bits
        self.qm = 2 ** (bits - 1) - 1
        self.ratios = torch.linspace(clip_min, 1.0, clip_steps) if clip_min < 1 else torch.ones(1)
        self.top = top

    def scales(self, block: Tensor) -> Tensor:
        block = block.float()
        amax = block.abs().amax(dim=1)
        if self.top is None and len(self.ratios) == 1:
            return _fp16_values(amax / self.qm)
        cand = amax[:, None] * self.ratios / self.qm  # [rows, ratios]
        if self.top is None:
            cand = _fp16_values(cand)
        else:
            top = self.top[:, None]
            floor = top * 2.0 ** (1 - SCALE_SPAN)
            cand = torch.minimum(cand, top * SCALE_MAX)
            cand = torch.cat([round_scales(cand, floor, up) for up in (False, True)], dim=1)
        q = torch.round(block[:, None, :] / _safe(cand)[..., None]).clamp(-self.qm, self.qm)
        err = (q * cand[..., None] - block[:, None, :]).square().sum(-1)
        return cand.gather(1, err.argmin(dim=1, keepdim=True)).squeeze(1)

    def quantize(self, w_col: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        # The clamp matters: fp16 rounding of the scale and GPTQ's updates after the scale was chosen can
        # push |w| / scale past qm.
        q = torch.round(w_col / _safe(scale)).clamp(-self.qm, self.qm)
        return q.to(torch.int8), q * scale


@dataclass
class GPTQResult:
    """codes [rows, cols] (dtype from the quantizer), scales [rows, n_groups] float32 (the quantizer's values:
    fp16 ones, or the residual's scale grid), dequant float32."""

    codes: Tensor
    scales: Tensor
    dequant: Tensor


def _n_groups(cols: int, group: int) -> int:
    return -(-cols // group)


def _upper_cholesky_of_inverse(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of (H + λI)^-1, in fp64; raises λ (with a warning) until H is definite."""
    H = H.to(torch.float64)
    base = float(H.diagonal().mean())
    eye = torch.eye(H.shape[0], dtype=torch.float64)
    lam = damp * base
    for attempt in range(MAX_DAMP_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex(H + lam * eye)
        if info == 0:
            # H^-1 = L^-T·L^-1 through a triangular solve: torch.cholesky_inverse took ~1 s for a 576²
            # matrix on a loaded 2-core machine, this takes ~50 ms.
            L_inv = torch.linalg.solve_triangular(L, eye, upper=False)
            U, info = torch.linalg.cholesky_ex(L_inv.T @ L_inv, upper=True)
            if info == 0:
                return U
        if attempt == MAX_DAMP_RETRIES:
            break
        new_lam = max(lam, 1e-12 * max(base, 1.0)) * DAMP_GROWTH
        warnings.warn(
            f"GPTQ: Hessian not positive definite with damping {lam / base:.3g}·mean(diag); "
            f"retrying with {new_lam / base:.3g}·mean(diag)",
            RuntimeWarning,
            stacklevel=3,
        )
        lam = new_lam
    raise ValueError(f"GPTQ: Hessian stays indefinite even with damping {lam / base:.3g}·mean(diag)")


def gptq(
    W: Tensor,
    H: Tensor,
    quantizer: Quantizer,
    group: int = 128,
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> GPTQResult:
    """Quantize W [rows, cols] against the input second moment H [cols, cols] with GPTQ error feedback.

    Dead inputs (H_ii <= 0) never reach the output, so their weights are zeroed and H_ii set to 1 to keep
    the factorisation defined. Damping adds damp·mean(diag) to the diagonal. group and block must nest
    (one a multiple of the other) so that every group's weights are fully updated when its scale is chosen.

    ``act_order`` quantizes the columns by descending H_ii (GPTQ's activation order: the inputs with the
    most energy first, while the most columns are left to absorb their error). A group's columns are then
    reached at scattered times, so its scale is fixed up front from W as given ("static groups"); the
    stored layout is the same.
    """
    rows, cols = W.shape
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match {cols} input columns")
    if group < 1 or block < 1 or (block % group and group % block):
        raise ValueError(f"group ({group}) and block ({block}) must be positive and nest")
    # Work on W^T so that a column is a contiguous row: the per-column update is then a dense rank-1
    # update of contiguous memory, about twice as fast as on strided columns. clone(), not contiguous():
    # a transposed caller tensor would otherwise come back as a view and be overwritten.
    Wt = W.detach().to(torch.float32).T.clone(memory_format=torch.contiguous_format)
    H = H.detach().to(torch.float64).clone()
    dead = H.diagonal() <= 0
    H[dead, dead] = 1.0
    Wt[dead] = 0.0
    scales = torch.empty(_n_groups(cols, group), rows, dtype=torch.float32)
    order = torch.arange(cols)
    if act_order:
        for g in range(scales.shape[0]):
            scales[g] = quantizer.scales(Wt[g * group : (g + 1) * group].T)
        order = torch.argsort(H.diagonal(), descending=True, stable=True)
        Wt, H = Wt[order], H[order][:, order]
    U = _upper_cholesky_of_inverse(H, damp).to(torch.float32)

    dequant = torch.empty(cols, rows, dtype=torch.float32)
    codes = []
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = Wt[i1:i2].clone()
        err = torch.empty(i2 - i1, rows, dtype=torch.float32)
        for j in range(i2 - i1):
            col = i1 + j
            if act_order:
                scale = scales[int(order[col]) // group]
            elif col % group == 0:
                # A group inside the block is fully updated in W1; a group wider than the block starts at
                # a block start, where Wt itself holds every update so far.
                g_end = min(col + group, cols)
                src = W1[j : j + group] if g_end <= i2 else Wt[col:g_end]
                scale = quantizer.scales(src.T)
                scales[col // group] = scale
            c, q = quantizer.quantize(W1[j], scale)
            codes.append(c)
            dequant[order[col]] = q
            torch.div(W1[j] - q, U[col, col], out=err[j])
            W1[j + 1 :].addr_(U[col, col + 1 : i2], err[j], alpha=-1.0)
        Wt[i2:] -= U[i1:i2, i2:].T @ err
    codes_t = torch.stack(codes, dim=1)
    if act_order:
        codes_t = codes_t[:, torch.argsort(order)]
    return GPTQResult(codes_t, scales.T.contiguous(), dequant.T.contiguous())


def rtn(W: Tensor, quantizer: Quantizer, group: int = 128) -> GPTQResult:
    """Round-to-nearest with the same groups and scales: the baseline that GPTQ has to beat."""
    W = W.detach().to(torch.float32)
    rows, cols = W.shape
    scales = torch.empty(rows, _n_groups(cols, group), dtype=torch.float32)
    codes, dequant = [], []
    for g, start in enumerate(range(0, cols, group)):
        blk = W[:, start : start + group]
        scales[:, g] = quantizer.scales(blk)
        c, q = quantizer.quantize(blk, scales[:, g, None])
        codes.append(c)
        dequant.append(q)
    return GPTQResult(torch.cat(codes, dim=1), scales, torch.cat(dequant, dim=1))


def int8_g32(W: Tensor) -> Tensor:
    """Q8_0-like reference (absmax/127 per (row, 32 columns), fp16 scale), dequantized to float32.

    It is the quality baseline the verifier is compared with (recipe, section 9), not a storage format.
    """
    return rtn(W, UniformQuantizer(8), group=32).dequant
