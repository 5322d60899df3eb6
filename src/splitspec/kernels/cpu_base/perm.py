"""Few tokens on an AVX-512 host: 16 rows at a time, tables of 4 columns indexed by vpermps."""

from __future__ import annotations

import functools

import numba
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.kernels.cpu_base.common import WORD_BYTES, WORDS, epilogue, lanes_at, widen
from splitspec.kernels.ir import F32, I16, I32, c64, data, literals, prefetch, splat, switch
from splitspec.quantize.format import CODE_WORD


def _host_has(feature: str) -> bool:
    """Whether numba compiles for a host with ``feature``. Code compiled for a named CPU (NUMBA_CPU_NAME)
    keeps to AVX2, which every target of this project has."""
    if numba.config.CPU_NAME:
        return False
    return feature in llvm.get_host_cpu_features().flatten().split(",")


WIDE = _host_has("+avx512f")  # 16-lane vpermps, 16-entry tables
BITALG = _host_has("+avx512bitalg")  # vpshufbitqmb, which the AMX loops' signs take (``tiles.laid_signs``)

# rows per block, bits (columns) per table, tables per 32-column word, entries per table
SHAPE = (16, 4, 8, 16)

TOKENS = 4  # tokens whose sums one rows_perm call keeps in registers


TILE = 16  # row blocks that go through one group together (``rows._rows_few``), and the layouts' unit


def tile_order(blocks: torch.Tensor) -> torch.Tensor:
    """A per-(block, group) layout [blocks, groups, ...] flattened in the order ``rows._rows_few`` visits it:
    tiles of ``TILE`` row blocks (the last maybe fewer), each group by group, each group block by block."""
    tiles = [blocks[t : t + TILE].transpose(0, 1).reshape(-1) for t in range(0, blocks.shape[0], TILE)]
    return torch.cat(tiles) if tiles else blocks.reshape(-1)


@njit(inline="always", cache=True)
def laid_group(b: int, g: int, words: int, blocks: int) -> tuple[int, int]:
    """Where block b's group g lies in the laid-out layouts (``block_codes``; ``block_scales`` in
    ``tile_order``): the byte of its first code register and the index of its first row's scale."""
    block, groups = SHAPE[0], (words + WORDS - 1) // WORDS
    t0 = b - b % TILE
    count = min(TILE, blocks - t0)  # the tile's blocks
    nw = min(WORDS, words - g * WORDS)  # the group's words: a short last group takes only its own
    at = (t0 * words + g * count * WORDS + (b - t0) * nw) * WORD_BYTES * block
    return at, (t0 * groups + g * count + b - t0) * block


def block_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [rows, words, 2] int32 (bit j of a word is column 32w + j) laid out for ``rows_perm``: for each
    block of R = 16 rows and group, 2 registers a code word of the group, register k plane k % 2 of word
    k // 2 of every row of the block, in ``tile_order`` (flat int32), so that the loop reads them in memory
    order. A short last group takes only its own words' registers: padded to whole groups, a 576-column
    matrix was 10% zeros, which the loop streamed from RAM with the rest. Rows past the last are zero, and
    so is one register past the end, which ``rows_perm``'s loads at byte offsets 1-3 of the last register
    reach into."""
    rows, words, _ = codes.shape
    block, groups = SHAPE[0], -(-words // WORDS)
    padded = codes.new_zeros(-(-rows // block) * block, groups * WORDS, 2)
    padded[:rows, :words] = codes
    blocks = padded.view(-1, block, groups, 2 * WORDS).permute(0, 2, 3, 1)  # [blocks, groups, registers, rows]
    last = 2 * (words - (groups - 1) * WORDS)  # the last group's registers
    parts = []
    for t in range(0, blocks.shape[0], TILE):
        tile = blocks[t : t + TILE]
        parts += [tile[:, :-1].transpose(0, 1).reshape(-1), tile[:, -1, :last].reshape(-1)]
    return torch.cat([*parts, codes.new_zeros(block)])


# bytes ahead of the laid-out codes in use that ``rows_perm`` prefetches into L1 and, further, into L2, a line
# of each for every register it reads: the hardware prefetchers stop at page ends, and a pass with its codes in
# RAM took about its memory time plus its in-cache time. A prefetch into L1 holds one of the core's few
# line-fill buffers until its line arrives, so one distance into L1 kept too few lines in flight; the far ones
# into L2 keep more. One line at a time through the loop hid more of a pass's memory time than a block's lines
# at once (the pair is the best measured at one token, the codes flushed from cache).
PF_L1, PF_L2 = 512, 4096


@intrinsic
def rows_perm(typingctx, tri, laid, y, scale, offset, coef, where, general, tokens):
    """y[yi + rows·t + R·k + (0 .. R-1)] += scale · (c2·Σ s0·x + c1·Σ s1·x [+ c3·Σ s1·s0·x] + offset[oi + t])
    over one group of ``count`` consecutive blocks k of R = 16 rows, for each of ``tokens`` (a literal)
    tokens t; ``where`` is (ti, at, words, rows, yi, si, oi, count). Block k's codes for the group are 8
    registers from byte ``at`` + k · (the group's bytes a block) of ``laid`` (``block_codes``: in each
    group, a tile's blocks lie one after the other), each one plane word of the R rows, and every B = 4 bits
    of it index, by vpermps, a 2^B-entry table of signed sums of x (``tri`` [t, word, chunk, 2^B] from
    element ti); a short last group has fewer than 4 words, and only its own registers. Scales are fp16
    bits laid out as the codes (``block_scales`` in ``tile_order``): block k's R scales of the group are the
    R consecutive elements from ``si`` + R·k, one load.

    The blocks are a loop here, in IR, so that the next block costs an add to each pointer: with a call per
    block, the scalar work between blocks took issue slots from the permutes, and a pass of one token was
    slower (benchmarks/README.md, run 38). The tokens are not a loop: on codes already in registers, a loop
    over token blocks let LLVM hoist the shifted indices out of it and spill them. Nor is the first group a
    case of its own (its sums stored instead of added to zeroed rows): the branch made two tokens slower."""
    if not literals(general, tokens):
        return None
    sig = types.void(tri, laid, y, scale, offset, coef, where, general, tokens)

    def codegen(context, builder, sig, args):
        nt, mixed = tokens.literal_value, general.literal_value
        block, bits, chunks, entries = SHAPE
        vi, vf = ir.VectorType(I32, block), ir.VectorType(F32, block)
        tri_t, laid_t, y_t, scale_t, offset_t = sig.args[:5]
        tri_v, laid_v, y_v, scale_v, offset_v, coef_v = args[:6]
        tri_at, at_v, words_v, rows_v, yi_v, si_v, offset_at_v, count_v = (
            builder.extract_value(args[6], i) for i in range(8)
        )
        planes = 3 if mixed else 2
        codes = builder.gep(data(context, builder, laid_t, laid_v), [at_v])
        offsets = data(context, builder, offset_t, offset_v)
        offset = [
            splat(builder, builder.load(builder.gep(offsets, [builder.add(offset_at_v, c64(t))])), block)
            for t in range(nt)
        ]
        slots = 2 if nt * planes < 8 else 1  # independent add chains enough to keep both ports busy
        sums = [[[cgutils.alloca_once(builder, vf) for _ in range(slots)] for _ in range(planes)] for _ in range(nt)]
        permute = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx512.permvar.sf.512"
        )

        def blocks(nw: int) -> None:
            """The loop over the blocks of a group of ``nw`` words."""
            with cgutils.for_range(builder, count_v) as loop:
                k = loop.index
                first = builder.gep(codes, [builder.mul(k, c64(nw * WORD_BYTES * block))])

                def from_byte(r: int, byte: int):
                    """Register r's lanes from byte ``byte`` on: the low nibble of lane i is bits 8·byte ..
                    8·byte + 3 of register r's lane i. A load at a byte offset costs no shift, and the shifts
                    are what share the vector ports with the permutes and adds (the three loads per register
                    that cross a cache line measured no slower than the shifts they replace at 1-2 tokens,
                    faster from 4 on)."""
                    ptr = builder.bitcast(builder.gep(first, [c64(64 * r + byte)]), vi.as_pointer())
                    return builder.load(ptr, align=1 if byte else 4)

                def word(w: int) -> None:
                    for r in (2 * w, 2 * w + 1):
                        for ahead, locality in ((PF_L1, 3), (PF_L2, 2)):
                            prefetch(builder, builder.gep(first, [c64(ahead + 64 * r)]), locality)
                    for c in range(chunks):  # two chunks (nibbles) a byte
                        planes_bits = [from_byte(2 * w, c // 2), from_byte(2 * w + 1, c // 2)]
                        if mixed:  # + where the two bits agree
                            planes_bits.append(builder.not_(builder.xor(planes_bits[0], planes_bits[1])))
                        for p, plane in enumerate(planes_bits):
                            index = builder.lshr(plane, ir.Constant(vi, [bits] * block)) if c % 2 else plane
                            for t in range(nt):
                                entry = builder.add(tri_at, c64(((w + t * WORDS) * chunks + c) * entries))
                                table = builder.load(lanes_at(context, builder, tri_t, tri_v, entry, block), align=4)
                                slot = sums[t][p][c % slots]
                                value = builder.call(permute, [table, index])
                                # a chain starts at its first value: LLVM keeps a 0.0 + v, as it may not drop
                                # -0.0's sign
                                if w > 0 or c >= slots:
                                    value = builder.fadd(builder.load(slot), value)
                                builder.store(value, slot)

                for w in range(nw):
                    word(w)
                row = builder.mul(k, c64(block))
                scale_at = builder.gep(data(context, builder, scale_t, scale_v), [builder.add(si_v, row)])
                scale_bits = builder.load(builder.bitcast(scale_at, ir.VectorType(I16, block).as_pointer()), align=2)
                scales = widen(builder, scale_bits)
                for t in range(nt):
                    parts = [functools.reduce(builder.fadd, map(builder.load, chains)) for chains in sums[t]]
                    dot = epilogue(builder, coef_v, parts, offset[t], block)
                    yi = builder.add(builder.add(yi_v, row), builder.mul(rows_v, c64(t)))
                    out = lanes_at(context, builder, y_t, y_v, yi, block)
                    builder.store(builder.fadd(builder.load(out, align=4), builder.fmul(scales, dot)), out, align=4)

        # a loop for each count of words, none checked per word: a check (a branch) per word made a pass of one
        # token slower
        switch(builder, words_v, range(1, WORDS + 1), blocks)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def build_tri(typingctx, x, col, words, tri, base):
    """tri[base + (w·chunks + c)·2^B + v] = Σ_j ±x[col + 32w + B·c + j] over the chunk's B = 4 columns, +
    where bit j of v is set: a table in one register, as the sum of the columns' x times constant sign
    vectors."""
    sig = types.void(x, col, words, tri, base)

    def codegen(context, builder, sig, args):
        _, bits, chunks, entries = SHAPE
        signs = [
            ir.Constant(ir.VectorType(F32, entries), [1.0 if v >> j & 1 else -1.0 for v in range(entries)])
            for j in range(bits)
        ]
        x_data = data(context, builder, sig.args[0], args[0])
        with cgutils.for_range(builder, args[2]) as loop:
            word = builder.add(args[1], builder.mul(loop.index, c64(CODE_WORD)))
            first = builder.add(args[4], builder.mul(loop.index, c64(chunks * entries)))
            for c in range(chunks):
                table = None
                for j in range(min(bits, CODE_WORD - bits * c)):
                    xj = builder.load(builder.gep(x_data, [builder.add(word, c64(bits * c + j))]))
                    term = builder.fmul(signs[j], splat(builder, xj, entries))
                    table = term if table is None else builder.fadd(table, term)
                out = lanes_at(context, builder, sig.args[3], args[3], builder.add(first, c64(c * entries)), entries)
                builder.store(table, out, align=4)
        return context.get_dummy_value()

    return sig, codegen
