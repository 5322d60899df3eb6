"""Many tokens: the base dequantized to fp32 a tile of rows at a time, then an sgemm on that tile.

With tens of tokens or more a product is bound by arithmetic, not by reading the codes, and a table lookup
does one token's work per weight and instruction where MKL's sgemm does it with FMAs at the core's
peak. So a tile of rows is decoded to ``levels[c]·scale`` (the very fp32 products ``dequantize_base``
forms, so the result differs from the reference only in the order of fp32 additions), and torch's sgemm
multiplies it. A tile is sized to stay in L2 between the decode that writes it and the sgemm that reads
it; the buffer is kept per thread and reused, so that a call neither allocates nor faults in fresh pages.
"""

from __future__ import annotations

import threading

import numba
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels.cpu_base.common import half
from splitspec.kernels.cpu_base.perm import WIDE
from splitspec.kernels.ir import F32, F32_PTR, I32, U16_PTR, c64, data, splat
from splitspec.quantize.format import CODE_WORD, GROUP

# from this many tokens on, decoding and sgemm beat the 8-token byte tables of an AVX2 host (measured on
# SmolLM2's shapes, one core); an AVX-512 host's 16-token tables beat it at every count measured (None)
DENSE_TOKENS: int | None = None if WIDE else 128

# fp32 bytes of one decoded tile: room in a 2 MiB L2 for it and the sgemm's panels of x and y
TILE_BYTES = 1 << 20

_ROW_ALIGN = 16  # tile rows are a multiple of this, so that the sgemm's row blocks stay whole


@intrinsic
def _decode_words(typingctx, planes, at, words, w, wi, scaled):
    """w[wi + 32k + j] = scaled[code of column j of word k] for ``words`` code words from uint16 element
    ``at`` of ``planes`` (each word: plane 0's two halves, then plane 1's): per 16 columns, two bit tests
    of a broadcast half word and three blends of the four scaled levels."""
    sig = types.void(planes, at, words, w, wi, scaled)

    def codegen(context, builder, sig, args):
        planes_t, _, _, w_t, _, _ = sig.args
        planes_v, at_v, words_v, w_v, wi_v, scaled_v = args
        vi, vf = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
        bits = ir.Constant(vi, [1 << j for j in range(16)])
        zero = ir.Constant(vi, [0] * 16)
        level = [splat(builder, builder.extract_value(scaled_v, k), 16) for k in range(4)]
        half_words = data(context, builder, planes_t, planes_v)
        out = data(context, builder, w_t, w_v)
        with cgutils.for_range(builder, words_v) as loop:
            first = builder.add(at_v, builder.mul(loop.index, c64(4)))
            for h in range(2):  # columns 16h .. 16h + 15 of the word
                test = []
                for plane in range(2):
                    bits16 = builder.load(builder.gep(half_words, [builder.add(first, c64(2 * plane + h))]))
                    word = splat(builder, builder.zext(bits16, I32), 16)
                    test.append(builder.icmp_unsigned("!=", builder.and_(word, bits), zero))
                low = builder.select(test[0], level[1], level[0])
                high = builder.select(test[0], level[3], level[2])
                col = builder.add(wi_v, builder.add(builder.mul(loop.index, c64(CODE_WORD)), c64(16 * h)))
                ptr = builder.bitcast(builder.gep(out, [col]), vf.as_pointer())
                builder.store(builder.select(test[1], high, low), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def decode_rows(codes_at: int, scale_at: int, levels_at: int, w_at: int, r_lo: int, r_hi: int, words: int) -> None:
    """w[r - r_lo, c] = levels[code(r, c)] · scale[r, c // 128] for rows r_lo .. r_hi - 1: codes int32
    [rows, words, 2] bit planes, scale fp16 bits [rows, groups], levels fp32 [4], w fp32 [r_hi - r_lo,
    32·words], all C-contiguous, given by address."""
    d_in = words * CODE_WORD
    groups = -(-d_in // GROUP)
    planes = numba.carray(U16_PTR(codes_at), r_hi * words * 4)  # int32 bit planes as uint16 halves
    scale = numba.carray(U16_PTR(scale_at), r_hi * groups)
    levels = numba.carray(F32_PTR(levels_at), 4)
    w = numba.carray(F32_PTR(w_at), (r_hi - r_lo) * d_in)
    per_group = GROUP // CODE_WORD
    for r in range(r_lo, r_hi):
        for g in range(groups):
            s = half(scale[r * groups + g])
            scaled = (levels[0] * s, levels[1] * s, levels[2] * s, levels[3] * s)
            first = g * per_group
            _decode_words(
                planes,
                (r * words + first) * 4,
                min(per_group, words - first),
                w,
                (r - r_lo) * d_in + first * CODE_WORD,
                scaled,
            )


_scratch = threading.local()


def _tile_buffer(nbytes: int) -> torch.Tensor:
    """This thread's decode buffer, grown to ``nbytes`` if it is smaller (only the first large call pays)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() * 4 < nbytes:
        buf = _scratch.buf = torch.empty(nbytes // 4, dtype=torch.float32)
    return buf


def dense_matmul(
    codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> None:
    """y = x · dequant(Q_base)ᵀ, tile by tile; x float32 [n, d_in] and y float32 [n, rows] contiguous,
    codes and scale contiguous, levels float32 contiguous; y may be a column slice of a wider buffer."""
    rows, words = codes.shape[0], codes.shape[1]
    d_in = words * CODE_WORD
    tile = max(_ROW_ALIGN, TILE_BYTES // (4 * d_in) // _ROW_ALIGN * _ROW_ALIGN)
    buf = _tile_buffer(4 * tile * d_in)
    args = (codes.data_ptr(), scale.data_ptr(), levels.data_ptr(), buf.data_ptr())
    for r in range(0, rows, tile):
        stop = min(rows, r + tile)
        decode_rows(*args, r, stop, words)
        w = buf[: (stop - r) * d_in].view(stop - r, d_in)
        torch.mm(x, w.T, out=y[:, r:stop])  # a column slice: sgemm writes it in place (leading dim rows)
