"""Numba kernels for the residual product ``Y[n, rows] = dequant(Q[rows, :]) · X[n, :]ᵀ``.

One pass over the weights serves all ``n`` tree tokens, because a verify pass is bound by how fast
the residual streams from RAM; reading it once per token would multiply that cost by ``n``.

A shard makes one ``ResidualMatrix`` per group at load (planes checked and flattened once), and a
request is then a single call into numba that also rounds x: a small model's group streams in tens of
microseconds, and checking, rounding and switching thread counts from Python per call had cost about as
much (figures in benchmarks/README.md, kernel structure notes).

Threads split the row tiles; a thread walks its tiles' 128-column groups in memory order. Per
(tile, group), the codes come out of the three ``words`` planes (packing.py, one layout for 6, 7 and 8
bits) as int16 vectors, each rows 8h .. 8h + 7 of one column pair with the pair's two columns side by
side, one 16-bit shift and/or mask each (``step_codes``). Three ways to multiply (``activations``):

- "int16" (the default): x' is rounded to int16 per (token, group) (``quantize/activations.py``); one
  vpmaddwd multiplies a code vector by a broadcast of its pair's two activations, giving 8 rows' sums in
  int32, exactly (``pair_products``), 2 ymm of sums per token in registers. The codes stay unsigned; their
  offset comes off once per group. One loop nest walks a tile's whole row of groups (a call per group cost
  more than the group's products at n = 1). Up to ``STREAMED_TOKENS`` tokens, the codes never leave
  registers; with more (``many_dot``), each group's codes are unpacked once into a buffer that blocks of
  ``TB`` tokens and one smaller tail block read.
  On a CPU with AMX (``kernels/amx.py``), passes of ``AMX_TOKENS`` or more multiply on tiles instead
  (``tiled.py``): each int16 code splits into a signed high and an unsigned low byte, so that two int8
  tile products per 64 columns give the same int32 sums, and the same scaling follows: the result is
  the vector loops', bit for bit. A group's codes are unpacked once into two tiles that every 16-token
  tile of activations meets.
- "int8": the same with x' rounded to int8, which the same loop sums to the same exact result.
- "fp32": the group's codes are unpacked once to int8 (``unpack``), then converted to fp32 in registers
  (vpmovsxbd + vcvtdq2ps) and FMA'd (``fp32_products``) by blocks of at most ``TB`` tokens; blocks of 1-3 tokens
  spread columns over 2-4 sets of partial sums so that FMA latency does not bound the loop. The integer
  modes need no conversion per weight and half the multiplies.

Partial sums are multiplied by the group's scales once per group and added to the tile's fp32
accumulators, as the reference does up to rounding.

The loops that touch the weights are LLVM IR with explicit vectors (numba intrinsics) rather than
numba code left to LLVM's auto-vectorizers, which gave these loops scalar per-group epilogues, register
spills and no prefetching. The loops that read the planes from RAM prefetch them ``PF_COLS`` columns
ahead: a core has only so many cache misses in flight, and without the prefetches it alternated between
waiting for memory and computing (a pass took about the sum of its memory time and its in-cache compute
time).

Scales are one byte per (row, group) under a power-of-two top per tile (``quantize.packing``): a byte
is shifted into an fp32's bits (``codes.scale_to_f32``) and the tile's top multiplies the sums.
"""

from splitspec.kernels.residual.api import ResidualMatrix, residual_matmul, slot_product, warmup

__all__ = ["ResidualMatrix", "residual_matmul", "slot_product", "warmup"]
