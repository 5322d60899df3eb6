"""Numba 2-bit GEMM ``y[n, rows] = x · dequant(Q_base)ᵀ``: the GPU actor's kernel when no GPU is present.

The weights are never dequantized. With ``s0``, ``s1`` = ±1 for bits 0 and 1 of a code, any four levels
are ``levels[c] = c0 + c1·s1 + c2·s0 + c3·s1·s0``, so a row's dot with x over one 128-column group is
``c0·Σx + c1·Σ s1·x + c2·Σ s0·x + c3·Σ s1·s0·x``, and each signed sum splits into short runs of columns
whose signs are a few consecutive bits of a bit plane: they are looked up in tables of signed sums of x,
built once per call and shared by every row (T-MAC / LUT-GEMM style), instead of being multiplied out.
The converter's levels are symmetric (c0 = c3 = 0 exactly, see ``coefficients``), so a group needs the
two planes' sums; other levels add the sums over ``~(b0 ^ b1)`` and the Σx term. x is not rounded (but on
tiles, below): the tables hold fp32 sums, and the result differs from the dequantized reference only in the
order of fp32 additions.

Four ways, by token count:

- Few tokens (up to ``FEW``) on an AVX-512 host: a block of 16 rows at a time. The codes are laid out
  once, when the product is bound to its matrix (a copy as large as the codes), so that a block's group
  is 8 registers, each one plane word of every row of the block; then every 4 bits of it index, by one
  vpermps, a table of one token's signed sums over those columns held in one register (``rows_perm``): a
  block of rows × 4 columns per instruction. Each further token costs its own vpermps and add per chunk.
  A tile of 16 blocks goes through one group at a time, so the group's tables stay in L1, and the codes
  are laid out in that order, so they stream in memory order.
- Few tokens on an AVX2 host, where vpermps takes two cycles on some cores (Zen 2): a block of 32 rows,
  4-column tables of fp32 sums kept as 4 byte planes and looked up by vpshufb, one byte of 32 rows per
  lookup, then put back together by unpacks (``nibbles``). The codes are laid out for it once, when the
  product is bound to its matrix: a copy as large as the codes.
- More tokens: per 8 columns, a table of the 256 signed sums of a block of tokens at once (an entry is
  one register: 8 tokens on AVX2, 16 on AVX-512), indexed by one byte of a row's plane (``group_dot``):
  one add per 8 columns, plane and block. These tables take 128 or 256 KiB a group, so the loops go block
  by block, then group by group, rows inner: a block's sums stay in cache while its groups pass. On
  AVX-512 they take whole blocks only, and the few-token tables the tokens left over (a 17-token pass is
  one block and one token, not two blocks); on AVX2 the last block is padded.
- Many tokens (from ``DENSE_TOKENS``) on an AVX2 host: arithmetic, not the codes' bytes, bounds the
  product, and an 8-lane lookup does less work per instruction than sgemm's FMAs at the core's peak; so a
  tile of rows is decoded to fp32 in L2 and multiplied by torch's sgemm (``dense``). An AVX-512 host's
  16-token lookups beat that at every token count measured.
- Many tokens (from ``TILE_TOKENS``) on a CPU with AMX tiles and symmetric levels, in place of the two
  above: x rounded to int16 codes as the CPU actors round it for the residual, the sign planes as ±1
  bytes, and the two planes' sums as exact int8 tile products (``tiles``). The verifier's Linear then
  multiplies one rounding of x' by both its parts.

Whichever way, the codes stream from memory once per call (prefetched ahead: the hardware prefetchers left
a pass from RAM well behind one from cache). The loops over codes are LLVM IR with explicit vectors
(numba intrinsics): numba leaves LLVM's SLP vectorizer off, and its loop vectorizer vectorized the wrong
loops. Scales are fp16, widened in the IR (F16C). Threads split the rows, each building its own tables:
with one thread, the engine's case, they are built once.

The Python wrapper hands numba the tensors' addresses rather than numpy views: a small layer's call takes
tens of microseconds, and converting the views had cost a large share of it.

AVX2 is required (vpermps): every machine this project targets has it.
"""

from splitspec.kernels.cpu_base.dense import DENSE_TOKENS
from splitspec.kernels.cpu_base.kernel import Product, ShareProduct, base_matmul
from splitspec.kernels.cpu_base.perm import WIDE

__all__ = ["DENSE_TOKENS", "WIDE", "Product", "ShareProduct", "base_matmul"]
