"""Triton 2-bit products ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's base product.

A draft step multiplies one token or a few: the product is a few GEMVs sharing one read of the packed
codes. ``_few_kernel`` gives each program a few output rows and all the tokens and walks K in chunks: each
row loads the chunk's code words of both bit planes once (2 bits a weight cross memory), spreads them to
bits with shifts, decodes each code to its level times its group's scale as ``format.dequantize_base``
does, multiplies by the tokens' activations in a [rows, tokens, columns] block and sums along the columns.
Small row blocks give even a 5120-row matrix hundreds of programs, so the reads of all SMs are in flight.

Its fp32 arithmetic grows with the tokens, so more of them (a verify pass of a tree, a prompt's chunk)
take ``_dequant_kernel``, which decodes a slice of rows to fp32 for cuBLAS to multiply, slice by slice
(``_SLICE_BYTES`` of fp32 weights at a time).

Everything is IEEE fp32, never TF32: the verifier adds this product to the CPU residual and must stay
within fp32 rounding of the reference. Activations of any float dtype are upcast after loading (bf16
arithmetic is also wrong under ``TRITON_INTERPRET=1``, where the tests run these kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitspec.quantize.format import CODE_WORD, GROUP

# Up to this many tokens the product streams the codes (``_few_kernel``); beyond, decode + cuBLAS. Both
# paths and these block shapes were timed against each other on an H200 (benchmarks/gpu_check.py).
FEW_TOKENS = 4
_BLOCK_ROWS = 8
_BLOCK_ELEMENTS = 8192  # rows × tokens × columns of one step's product block: the registers of 4 warps
_DEQUANT_ROWS = 32
_DEQUANT_WORDS = 16
_SLICE_BYTES = 64 << 20


@triton.jit
def _decode(
    codes_ptr,
    scale_ptr,
    r,
    r_ok,
    k0,
    words,
    groups,
    l0,
    l1,
    l2,
    l3,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WORD: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """[rows, BLOCK_K] fp32 weights at rows ``r`` and columns ``k0 + arange(BLOCK_K)``, as
    ``format.dequantize_base`` makes them: each row loads its code words once ([rows, words], both bit
    planes), spreads them to bits with shifts and picks each code's level times its group's scale."""
    BLOCK_W: tl.constexpr = BLOCK_K // WORD
    wi = k0 // WORD + tl.arange(0, BLOCK_W)
    ok = r_ok[:, None] & (wi < words)[None, :]
    at = (r[:, None] * words + wi[None, :]) * 2
    shifts = tl.arange(0, WORD)[None, None, :]
    b0 = (tl.load(codes_ptr + at, mask=ok, other=0)[:, :, None] >> shifts) & 1
    b1 = (tl.load(codes_ptr + at + 1, mask=ok, other=0)[:, :, None] >> shifts) & 1
    level = tl.where(b1 != 0, tl.where(b0 != 0, l3, l2), tl.where(b0 != 0, l1, l0))
    s = tl.load(scale_ptr + r[:, None] * groups + (wi // (GROUP_K // WORD))[None, :], mask=ok, other=0.0)
    return tl.reshape(level * s.to(tl.float32)[:, :, None], (BLOCK_R, BLOCK_K))


@triton.jit
def _few_kernel(
    codes_ptr,
    scale_ptr,
    levels_ptr,
    x_ptr,
    out_ptr,
    n,
    rows,
    d_in,
    words,
    groups,
    stride_xn,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WORD: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < rows
    t_ok = t < n
    l0 = tl.load(levels_ptr + 0)
    l1 = tl.load(levels_ptr + 1)
    l2 = tl.load(levels_ptr + 2)
    l3 = tl.load(levels_ptr + 3)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _decode(codes_ptr, scale_ptr, r, r_ok, k0, words, groups, l0, l1, l2, l3, BLOCK_R, BLOCK_K, WORD, GROUP_K)
        x = tl.load(x_ptr + t[:, None] * stride_xn + k[None, :], mask=t_ok[:, None] & (k < d_in)[None, :], other=0.0)
        acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + t[None, :] * stride_on + r[:, None], acc, mask=r_ok[:, None] & t_ok[None, :])


@triton.jit
def _dequant_kernel(
    codes_ptr,
    scale_ptr,
    levels_ptr,
    w_ptr,
    rows,
    d_in,
    words,
    groups,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WORD: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    r_ok = r < rows
    l0 = tl.load(levels_ptr + 0)
    l1 = tl.load(levels_ptr + 1)
    l2 = tl.load(levels_ptr + 2)
    l3 = tl.load(levels_ptr + 3)
    w = _decode(codes_ptr, scale_ptr, r, r_ok, k0, words, groups, l0, l1, l2, l3, BLOCK_R, BLOCK_K, WORD, GROUP_K)
    tl.store(w_ptr + r[:, None] * d_in + k[None, :], w, mask=r_ok[:, None] & (k < d_in)[None, :])


def dequantize(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 weights [rows, d_in] of packed ``codes`` (as ``format.dequantize_base``) into ``w``."""
    rows, words, _ = codes.shape
    block_k = _DEQUANT_WORDS * CODE_WORD
    grid = (triton.cdiv(rows, _DEQUANT_ROWS), triton.cdiv(w.shape[1], block_k))
    args = (codes, scale, levels, w, rows, w.shape[1], words, scale.shape[1])
    _dequant_kernel[grid](*args, BLOCK_R=_DEQUANT_ROWS, BLOCK_K=block_k, WORD=CODE_WORD, GROUP_K=GROUP)
    return w


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    few_tokens: int = FEW_TOKENS,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ with Triton; arguments as ``gpu_actor.kernels.base_matmul``, which checks them.
    Up to ``few_tokens`` tokens stream the codes; more decode slices of rows for cuBLAS."""
    rows, words, _ = codes.shape
    n, d_in = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(n, rows, dtype=torch.float32, device=x.device)
    codes, scale = codes.contiguous(), scale.contiguous()
    levels = levels.to(device=x.device, dtype=torch.float32).contiguous()
    if n <= few_tokens:
        block_n = triton.next_power_of_2(n)
        block_k = max(_BLOCK_ELEMENTS // (_BLOCK_ROWS * block_n), CODE_WORD)
        grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(n, block_n))
        args = (codes, scale, levels, x, out, n, rows, d_in, words, scale.shape[1], x.stride(0), out.stride(0))
        _few_kernel[grid](*args, BLOCK_N=block_n, BLOCK_R=_BLOCK_ROWS, BLOCK_K=block_k, WORD=CODE_WORD, GROUP_K=GROUP)
        return out
    slice_rows = max(_SLICE_BYTES // (4 * d_in), 1)
    w = torch.empty(min(slice_rows, rows), d_in, dtype=torch.float32, device=x.device)
    xf = x.float()
    for a in range(0, rows, slice_rows):
        b = min(a + slice_rows, rows)
        part = dequantize(codes[a:b], scale[a:b], levels, w[: b - a])
        if b - a == rows and out.is_contiguous():
            torch.mm(xf, part.T, out=out)
        else:
            out[:, a:b] = xf @ part.T
    return out
