"""Triton 2-bit products ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's base product.

A draft step multiplies one token or a few: the product is a few GEMVs sharing one read of the packed
codes. ``_few_kernel`` gives each program a few output rows and all the tokens and walks K in chunks: each
row loads the chunk's code words of both bit planes once (2 bits a weight cross memory), spreads them to
bits with shifts, decodes each code to its level times its group's scale as ``format.dequantize_base``
does, multiplies by the tokens' activations in a [rows, tokens, columns] block and sums along the columns.
Small row blocks give even a 5120-row matrix hundreds of programs, so the reads of all SMs are in flight.
Its block shape (``Stream``: rows a program, the product block's size, warps, and whether the decoded block
is flattened to [rows, columns] or kept as [rows, words, 32]) is picked per matrix shape and token block on
the device itself, by timing the ``STREAMS`` on the first product of that shape (``stream_for``), as
Triton's autotuner would (which cannot run under the interpreter, where the tests run every shape).

Its fp32 arithmetic grows with the tokens, so more of them (a verify pass of a tree, a prompt's chunk)
take ``_dequant_kernel``, which decodes a slice of rows to fp32 for cuBLAS to multiply, slice by slice
(``_SLICE_BYTES`` of fp32 weights at a time).

Everything is IEEE fp32, never TF32: the verifier adds this product to the CPU residual and must stay
within fp32 rounding of the reference. Activations of any float dtype are upcast after loading (bf16
arithmetic is also wrong under ``TRITON_INTERPRET=1``, where the tests run these kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitspec.quantize.format import CODE_WORD, GROUP

# Up to this many tokens the product streams the codes (``_few_kernel``); beyond, decode + cuBLAS. Both
# paths were timed against each other on an H200 (benchmarks/gpu_check.py).
FEW_TOKENS = 4


@dataclass(frozen=True)
class Stream:
    """A block shape of ``_few_kernel``: ``rows`` a program, ``elements`` (rows × tokens × columns) of one
    step's product block, ``warps``, and ``flat``: the decoded block reshaped to [rows, columns] before the
    product, or the product taken on its [rows, words, 32] layout (no layout conversion, the scale applied
    once a word)."""

    rows: int
    elements: int
    warps: int
    flat: bool

    def words(self, block_n: int) -> int:
        """Code words a step walks: the product block's columns ÷ 32, at least one."""
        return max(self.elements // (self.rows * block_n * CODE_WORD), 1)


# What ``stream_for`` times. The first is run 3's on the H200 (the kept kernel then, and the default where
# nothing is timed: the CPU's interpreter, a graph being captured); the rest are its leads: no reshape, more
# rows a program (fewer reads of x per code byte), larger blocks on more warps.
STREAMS = (
    Stream(8, 8192, 4, True),
    Stream(8, 8192, 4, False),
    Stream(16, 8192, 4, False),
    Stream(32, 8192, 4, False),
    Stream(16, 16384, 8, True),
    Stream(32, 16384, 8, False),
    Stream(64, 16384, 8, False),
)
_chosen: dict[tuple[int, ...], Stream] = {}  # by (rows, words, token block, device index)
_DEQUANT_ROWS = 32
_DEQUANT_WORDS = 16
_SLICE_BYTES = 64 << 20


@triton.jit
def _spread(
    codes_ptr,
    scale_ptr,
    r,
    r_ok,
    w0,
    words,
    groups,
    l0,
    l1,
    l2,
    l3,
    BLOCK_W: tl.constexpr,
    WORD: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """The levels [rows, BLOCK_W, WORD] of rows ``r`` in code words ``w0 + arange(BLOCK_W)`` and their
    groups' scales [rows, BLOCK_W] in fp32: each row loads its code words once (both bit planes) and
    spreads them to bits with shifts; words past the row (or rows past the matrix) decode to 0."""
    wi = w0 + tl.arange(0, BLOCK_W)
    ok = r_ok[:, None] & (wi < words)[None, :]
    at = (r[:, None] * words + wi[None, :]) * 2
    shifts = tl.arange(0, WORD)[None, None, :]
    b0 = (tl.load(codes_ptr + at, mask=ok, other=0)[:, :, None] >> shifts) & 1
    b1 = (tl.load(codes_ptr + at + 1, mask=ok, other=0)[:, :, None] >> shifts) & 1
    level = tl.where(b1 != 0, tl.where(b0 != 0, l3, l2), tl.where(b0 != 0, l1, l0))
    s = tl.load(scale_ptr + r[:, None] * groups + (wi // (GROUP_K // WORD))[None, :], mask=ok, other=0.0)
    return level, s.to(tl.float32)


@triton.jit
def _decode(
    codes_ptr,
    scale_ptr,
    r,
    r_ok,
    w0,
    words,
    groups,
    l0,
    l1,
    l2,
    l3,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    WORD: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """[rows, BLOCK_W · WORD] fp32 weights of rows ``r`` from code word ``w0`` on, as
    ``format.dequantize_base`` makes them: each code's level times its group's scale."""
    level, s = _spread(codes_ptr, scale_ptr, r, r_ok, w0, words, groups, l0, l1, l2, l3, BLOCK_W, WORD, GROUP_K)
    return tl.reshape(level * s[:, :, None], (BLOCK_R, BLOCK_W * WORD))


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
    BLOCK_W: tl.constexpr,
    FLAT: tl.constexpr,
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
    for w0 in range(0, words, BLOCK_W):
        if FLAT:
            k = w0 * WORD + tl.arange(0, BLOCK_W * WORD)
            w = _decode(
                codes_ptr, scale_ptr, r, r_ok, w0, words, groups, l0, l1, l2, l3, BLOCK_R, BLOCK_W, WORD, GROUP_K
            )
            x_ok = t_ok[:, None] & (k < d_in)[None, :]
            x = tl.load(x_ptr + t[:, None] * stride_xn + k[None, :], mask=x_ok, other=0.0)
            acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
        else:
            level, s = _spread(codes_ptr, scale_ptr, r, r_ok, w0, words, groups, l0, l1, l2, l3, BLOCK_W, WORD, GROUP_K)
            col = (w0 + tl.arange(0, BLOCK_W))[:, None] * WORD + tl.arange(0, WORD)[None, :]  # [words, 32]
            x_ok = t_ok[:, None, None] & (col < d_in)[None, :, :]
            x = tl.load(x_ptr + t[:, None, None] * stride_xn + col[None, :, :], mask=x_ok, other=0.0)
            part = tl.sum(level[:, None, :, :] * x.to(tl.float32)[None, :, :, :], axis=3)  # [rows, tokens, words]
            acc += tl.sum(part * s[:, None, :], axis=2)
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
    BLOCK_W: tl.constexpr = BLOCK_K // WORD
    w0 = k0 // WORD
    w = _decode(codes_ptr, scale_ptr, r, r_ok, w0, words, groups, l0, l1, l2, l3, BLOCK_R, BLOCK_W, WORD, GROUP_K)
    tl.store(w_ptr + r[:, None] * d_in + k[None, :], w, mask=r_ok[:, None] & (k < d_in)[None, :])


def dequantize(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 weights [rows, d_in] of packed ``codes`` (as ``format.dequantize_base``) into ``w``."""
    rows, words, _ = codes.shape
    block_k = _DEQUANT_WORDS * CODE_WORD
    grid = (triton.cdiv(rows, _DEQUANT_ROWS), triton.cdiv(w.shape[1], block_k))
    args = (codes, scale, levels, w, rows, w.shape[1], words, scale.shape[1])
    _dequant_kernel[grid](*args, BLOCK_R=_DEQUANT_ROWS, BLOCK_K=block_k, WORD=CODE_WORD, GROUP_K=GROUP)
    return w


def stream(
    codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, x: torch.Tensor, out: torch.Tensor, block: Stream
) -> None:
    """``out`` = x · dequant(Q_base)ᵀ by ``_few_kernel`` in the ``block`` shape (contiguous codes and scales,
    fp32 levels on the device, x with unit column stride)."""
    rows, words, _ = codes.shape
    n, d_in = x.shape
    block_n = triton.next_power_of_2(n)
    grid = (triton.cdiv(rows, block.rows), triton.cdiv(n, block_n))
    args = (codes, scale, levels, x, out, n, rows, d_in, words, scale.shape[1], x.stride(0), out.stride(0))
    _few_kernel[grid](
        *args,
        BLOCK_N=block_n,
        BLOCK_R=block.rows,
        BLOCK_W=block.words(block_n),
        FLAT=block.flat,
        WORD=CODE_WORD,
        GROUP_K=GROUP,
        num_warps=block.warps,
    )


def stream_for(
    codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, x: torch.Tensor, out: torch.Tensor
) -> Stream:
    """The fastest of ``STREAMS`` for this matrix shape and token block on this device, timed on its first
    product (``triton.testing.do_bench``, a few milliseconds each, writing ``out``, which the product then
    overwrites) and kept; ``STREAMS[0]`` off CUDA and while a CUDA graph is being captured (the eager pass
    before a capture times it)."""
    key = (*codes.shape[:2], triton.next_power_of_2(x.shape[0]), x.device.index or 0)
    if key not in _chosen:
        if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return STREAMS[0]
        from triton.testing import do_bench

        times = {b: do_bench(lambda b=b: stream(codes, scale, levels, x, out, b), warmup=5, rep=20) for b in STREAMS}
        _chosen[key] = min(times, key=times.get)
    return _chosen[key]


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    few_tokens: int = FEW_TOKENS,
    block: Stream | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ with Triton; arguments as ``gpu_actor.kernels.base_matmul``, which checks them.
    Up to ``few_tokens`` tokens stream the codes, in the ``block`` shape given or else ``stream_for``'s;
    more decode slices of rows for cuBLAS."""
    rows = codes.shape[0]
    n, d_in = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(n, rows, dtype=torch.float32, device=x.device)
    codes, scale = codes.contiguous(), scale.contiguous()
    levels = levels.to(device=x.device, dtype=torch.float32).contiguous()
    if n <= few_tokens:
        stream(codes, scale, levels, x, out, stream_for(codes, scale, levels, x, out) if block is None else block)
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
