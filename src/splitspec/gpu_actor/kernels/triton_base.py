"""Triton 2-bit GEMM ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's base product.

One program owns a block of output rows and a block of tokens and walks K in 128-column groups (one
scale per row and group). Per group it loads the four int32 words of each bit plane, spreads them to
128 code bits with shifts, maps codes to levels with selects, and multiplies by the group scale after
the dot, so the scale costs one multiply per output instead of one per weight. Only the packed codes
cross memory: 2 bits per weight instead of 16 for a bf16 copy.

The dot runs in IEEE fp32 ("ieee"), not TF32: the verifier adds this product to the CPU residual and
must stay within fp32 rounding of the reference. Activations of any float dtype are upcast after loading
(bf16 arithmetic is also wrong under ``TRITON_INTERPRET=1``, where the tests run this kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitspec.quantize.format import CODE_WORD, GROUP

_BLOCK_ROWS = 64
_MIN_TOKENS = 16  # tl.dot needs at least 16 rows per operand
_MAX_TOKENS = 64


@triton.jit
def _base_matmul_kernel(
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
    GROUP_K: tl.constexpr,
    WORD: tl.constexpr,
):
    WORDS_PER_GROUP: tl.constexpr = GROUP_K // WORD
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < rows
    t_ok = t < n
    l0 = tl.load(levels_ptr + 0)
    l1 = tl.load(levels_ptr + 1)
    l2 = tl.load(levels_ptr + 2)
    l3 = tl.load(levels_ptr + 3)
    wi = tl.arange(0, WORDS_PER_GROUP)
    shifts = tl.arange(0, WORD)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for g in range(groups):
        word = g * WORDS_PER_GROUP + wi
        w_ok = r_ok[:, None] & (word < words)[None, :]
        base = codes_ptr + (r[:, None] * words + word[None, :]) * 2
        lo = tl.load(base, mask=w_ok, other=0)
        hi = tl.load(base + 1, mask=w_ok, other=0)
        b0 = tl.reshape((lo[:, :, None] >> shifts[None, None, :]) & 1, (BLOCK_R, GROUP_K))
        b1 = tl.reshape((hi[:, :, None] >> shifts[None, None, :]) & 1, (BLOCK_R, GROUP_K))
        w = tl.where(b1 != 0, tl.where(b0 != 0, l3, l2), tl.where(b0 != 0, l1, l0))
        k = g * GROUP_K + tl.arange(0, GROUP_K)
        x = tl.load(x_ptr + t[:, None] * stride_xn + k[None, :], mask=t_ok[:, None] & (k < d_in)[None, :], other=0.0)
        s = tl.load(scale_ptr + r * groups + g, mask=r_ok, other=0.0).to(tl.float32)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee") * s[None, :]
    tl.store(out_ptr + t[:, None] * stride_on + r[None, :], acc, mask=t_ok[:, None] & r_ok[None, :])


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ with Triton; arguments as ``gpu_actor.kernels.base_matmul``, which checks them."""
    rows, words, _ = codes.shape
    n, d_in = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(n, rows, dtype=torch.float32, device=x.device)
    block_n = min(max(triton.next_power_of_2(n), _MIN_TOKENS), _MAX_TOKENS)
    grid = (triton.cdiv(rows, _BLOCK_ROWS), triton.cdiv(n, block_n))
    _base_matmul_kernel[grid](
        codes.contiguous(),
        scale.contiguous(),
        levels.to(device=x.device, dtype=torch.float32).contiguous(),
        x,
        out,
        n,
        rows,
        d_in,
        words,
        scale.shape[1],
        x.stride(0),
        out.stride(0),
        BLOCK_N=block_n,
        BLOCK_R=_BLOCK_ROWS,
        GROUP_K=GROUP,
        WORD=CODE_WORD,
    )
    return out
