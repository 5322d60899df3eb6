"""Intel AMX tiles (AMX-INT8) for the products of many tokens: a prompt's prefill.

Eight tile registers of 16 rows × 64 bytes, and one instruction (tdpb??d) that adds a 16 × 16 block of
int32 dot products of 64 bytes each: a 16 × 64 by 64 × 16 int8 product, exact, in one instruction,
where AVX-512 needs 256 (vpdpbusd, 64 products each). The residual's integer product splits
its int16 activations into two bytes (``split_bytes``), so that two tile products give the vector loops'
int32 sums, bit for bit (``kernels/residual/tiled.py``).

Linux hands a process the tiles' 8 KiB of state only when it asks (``arch_prctl``); ``enabled`` asks once
per process, and a kernel uses tiles only where it said yes (elsewhere it keeps its vector loops). A
kernel loads the tile configuration when it starts (``begin``) and releases the tiles when it is done
(``end``), so that nothing between two kernels depends on tile state.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import config
from numba.extending import intrinsic

from splitspec.kernels.ir import F32, I8, I32, I64, address, c64, call, data, splat
from splitspec.kernels.ir import store as store_vector
from splitspec.quantize.packing import GROUP

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

ROWS = 16  # rows of every tile: tokens of an activation tile, rows of a product
BYTES = 64  # bytes of a tile's row: 64 int8 columns of an activation tile, 16 int32 of a product

# palette 1, all eight tiles 16 rows of 64 bytes (the 64-byte LDTILECFG record)
CONFIG = np.zeros(64, np.uint8)
CONFIG[0] = 1
CONFIG[16:32] = np.frombuffer(np.full(8, BYTES, np.uint16).tobytes(), np.uint8)
CONFIG[48:56] = ROWS


@functools.cache
def compiles() -> bool:
    """Whether numba compiles for a CPU with AMX-INT8; elsewhere the tile loops compile to nothing (and
    ``enabled`` keeps them from being called)."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return {"+amx-tile", "+amx-int8"} <= set(features.split(","))


@functools.cache
def enabled() -> bool:
    """Whether this process may use AMX-INT8: numba compiles for a CPU with it, Linux granted the tile
    state (which it does only where the CPU has it), and ``SPLITSPEC_AMX`` is not "0" (which keeps every
    product on its vector loops, to compare the two or to rule the tiles out)."""
    if os.environ.get("SPLITSPEC_AMX", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not compiles():
        return False
    # the kernel refuses (EINVAL) where the CPU has no AMX or the kernel predates it
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _tmm(index: int) -> ir.Constant:
    return ir.Constant(I8, index)


def _bytes(builder, ptr):
    return builder.bitcast(ptr, I8.as_pointer())


@njit(cache=True)
def zeros(size, dtype):
    """np.zeros(size, dtype) starting on a cache line: a tile load whose rows straddle two lines runs
    several times slower."""
    raw = np.zeros(size + BYTES, dtype)
    start = (-address(raw)) % BYTES // raw.itemsize
    return raw[start : start + size]


@intrinsic
def begin(typingctx, config):
    """Load the tile configuration (``CONFIG``) for the calling thread, before its loops use tiles."""
    sig = types.void(config)

    def codegen(context, builder, sig, args):
        if compiles():
            config_p = _bytes(builder, data(context, builder, sig.args[0], args[0]))
            call(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [config_p])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def end(typingctx):
    """Release the calling thread's tiles, after its loops are done with them."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if compiles():
            call(builder, "llvm.x86.tilerelease", ir.VoidType(), [])
        return context.get_dummy_value()

    return sig, codegen


def zero(builder, tmm: int) -> None:
    call(builder, "llvm.x86.tilezero", ir.VoidType(), [_tmm(tmm)])


def load(builder, tmm: int, ptr, stride) -> None:
    """Tile ``tmm`` = 16 rows of 64 bytes from ``ptr``, ``stride`` bytes apart."""
    call(builder, "llvm.x86.tileloadd64", ir.VoidType(), [_tmm(tmm), _bytes(builder, ptr), stride])


def store(builder, tmm: int, ptr) -> None:
    """Tile ``tmm``'s 16 rows of 64 bytes to ``ptr``, one after the other."""
    call(builder, "llvm.x86.tilestored64", ir.VoidType(), [_tmm(tmm), _bytes(builder, ptr), c64(BYTES)])


def dot(builder, signs: str, c: int, a: int, b: int) -> None:
    """c[m, n] += Σ_k a[m, k] · b[k // 4, 4n + k % 4] in int32: ``signs`` says whether a's and b's bytes
    are signed ("s") or unsigned ("u"), e.g. "su" for signed a times unsigned b."""
    call(builder, f"llvm.x86.tdpb{signs}d", ir.VoidType(), [_tmm(c), _tmm(a), _tmm(b)])


def tile_tokens(builder, t, n) -> tuple:
    """The tokens of 16-token tile t of n, k0 .. k1 - 1 (the last tile may hold fewer)."""
    k0 = builder.mul(t, c64(ROWS))
    k1 = builder.add(k0, c64(ROWS))
    return k0, builder.select(builder.icmp_unsigned("<", k1, n), k1, n)


def _group_vectors(context, builder, array_type, array, start) -> list:
    """The 128 fp32 values from element ``start`` of ``array``, as 8 vectors of 16."""
    vf = ir.VectorType(F32, 16)
    src = builder.bitcast(builder.gep(data(context, builder, array_type, array), [start]), vf.as_pointer())
    return [builder.load(builder.gep(src, [c64(v)]), align=4) for v in range(GROUP // 16)]


@intrinsic
def group_amax(typingctx, values, start):
    """max |values[start .. start + 127]| (fp32), in explicit vectors: numba's loop would not vectorize it.
    As integers: the bits of |x| (the sign cleared) order as the values do, and an integer max is one
    instruction where a float max that minds NaN is three; the eight vectors meet in a tree, not a chain.
    A group with a NaN has no meaningful codes either way (its bits exceed every number's: NaN here)."""
    sig = types.float32(values, start)

    def codegen(context, builder, sig, args):
        vi = ir.VectorType(I32, 16)
        magnitude = ir.Constant(vi, [0x7FFFFFFF] * 16)
        level = [
            builder.and_(builder.bitcast(v, vi), magnitude)
            for v in _group_vectors(context, builder, sig.args[0], args[0], args[1])
        ]
        while len(level) > 1:
            level = [call(builder, "llvm.umax.v16i32", vi, level[i : i + 2]) for i in range(0, len(level), 2)]
        return builder.bitcast(call(builder, "llvm.vector.reduce.umax.v16i32", I32, level), F32)

    return sig, codegen


@intrinsic
def split_bytes(typingctx, values, start, scale, out, at, plane):
    """values[start .. start + 127] (fp32) rounded to integers q = rint(value / scale) (as torch.round
    does; |q| < 2^15), stored as two bytes: q >> 8 at out[at + c], q's low 8 bits at out[at + plane + c];
    returns Σ q. Explicit vectors: numba's loops would not vectorize the narrowing stores."""
    sig = types.int64(values, start, scale, out, at, plane)

    def codegen(context, builder, sig, args):
        vf, vi = ir.VectorType(F32, 16), ir.VectorType(I32, 16)
        dst = data(context, builder, sig.args[3], args[3])
        divisor = splat(builder, args[2], 16)
        total = ir.Constant(vi, [0] * 16)
        for v, value in enumerate(_group_vectors(context, builder, sig.args[0], args[0], args[1])):
            rounded = call(builder, "llvm.rint.v16f32", vf, [builder.fdiv(value, divisor)])
            q = builder.fptosi(rounded, vi)
            total = builder.add(total, q)
            for byte, at in ((builder.ashr(q, ir.Constant(vi, [8] * 16)), args[4]), (q, builder.add(args[4], args[5]))):
                at = builder.add(at, c64(16 * v))
                store_vector(builder, builder.trunc(byte, ir.VectorType(I8, 16)), builder.gep(dst, [at]), align=1)
        summed = call(builder, "llvm.vector.reduce.add.v16i32", I32, [total])
        return builder.sext(summed, I64)

    return sig, codegen
