"""The residual kernel's tuning constants and vector types, shared by its loops and drivers."""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from splitspec.kernels.ir import F32, I16, I32
from splitspec.quantize.packing import GROUP, TILE

# below this many weight × token products per thread, another thread saves nothing
MIN_WORK_PER_THREAD = 64 * 1024

# Largest token block: 6 tokens × 2 ymm = 12 accumulators, plus a column (pair)'s 2 code vectors and a
# broadcast activation, fit the 16 ymm registers of AVX2.
TB = 6
BLOCKS = tuple(range(1, TB + 1))  # token block sizes, each its own loop
TAILS = tuple(range(TB))  # sizes of the last, short block after blocks of TB
WIDTHS = (8, 7, 6)  # residual widths, each its own unpacking (the last also takes any other)

# Up to this many tokens, integer passes unpack the codes in registers as they stream them (pair_products, one
# block); more unpack each group once into a buffer that every block of tokens reads (many_dot; unpacking
# again per block would cost 1-3 ops per 16 codes per block, against one load).
STREAMED_TOKENS = 5

# How far ahead the streaming loops prefetch, in tile columns: several memory latencies of 8-bit codes
PF_COLS = 512

PF_SCALE = PF_COLS // GROUP * TILE  # the same distance in the scale plane, in bytes

HALF = 8 * GROUP  # bytes of one half (rows 0-7 or 8-15) of a group's unpacked int8 codes

# a group's unpacked codes: int16 for integer activations (the larger), int8 [2, HALF] for fp32 ones; a
# module constant because stack needs a literal
CODES_BYTES = TILE * GROUP * 2

# uint64 constants: numba types mixed uint64/int64 arithmetic as float64
U0, U1, U3, U4 = (np.uint64(v) for v in (0, 1, 3, 4))

UT, UG, UTB = np.uint64(TILE), np.uint64(GROUP), np.uint64(TB)

V8F = ir.VectorType(F32, 8)  # one ymm: half a tile column (rows 0-7 or 8-15)

V8I32 = ir.VectorType(I32, 8)

V16I16 = ir.VectorType(I16, 16)  # one ymm of int16 codes: rows 0-7 (or 8-15) of a column pair

ZERO8I = ir.Constant(V8I32, [0] * 8)

ZERO8 = ir.Constant(V8F, [0.0] * 8)
