"""The row loops: a thread's rows through every group, by whichever kind of table suits the token count."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from splitspec.kernels.cpu_base import nibbles
from splitspec.kernels.cpu_base.byte_tables import build, group_dot, transpose
from splitspec.kernels.cpu_base.common import WORD_BYTES, WORDS, half
from splitspec.kernels.cpu_base.nibbles import build_tables, rows_nibbles
from splitspec.kernels.cpu_base.perm import (
    SHAPE,
    TILE,
    TOKENS,
    WIDE,
    build_tri,
    laid_group,
    rows_perm,
)
from splitspec.kernels.ir import prefetch_at
from splitspec.quantize.format import CODE_WORD, GROUP

# rows ahead whose codes ``_rows_many`` prefetches: left to the hardware prefetchers, a pass with its codes in
# RAM took well longer than one with them in cache (the distance is the best measured at one token)
_PF_ROWS = 24

_ZERO = np.float32(0.0)


# bytes ahead of the laid-out codes in use that the AVX2 loops (``_rows_nibbles``) prefetch into L1 (measured on
# AVX2 code)
_PF_NIBBLES = 16384

ROW_BLOCK = SHAPE[0] if WIDE else nibbles.BLOCK  # rows per block of the few-token tables

# up to this many tokens take the few-token tables (vpermps on AVX-512, vpshufb on AVX2), more the byte
# tables: the faster for SmolLM2's shapes on one core, measured for each
FEW = 16 if WIDE else 5

# tokens per entry of the 8-column byte tables: one register of fp32 (on AVX-512, twice the tokens a lookup
# for the same instructions; the tables, 256 KiB a group, still sit in L2)
LANES = 16 if WIDE else 8

# a group's byte tables, fp32 (``_rows_many``'s ``table``): a numba thread's share of the caller's scratch
TABLE_FLOATS = WORDS * 4 * 256 * LANES


@njit(inline="always", cache=True)
def coefficients(levels: np.ndarray) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """(c0, c1, c2, c3) of the bilinear form; sums of opposite levels first, so that exactly symmetric
    levels give c0 = c3 = 0 exactly."""
    l0, l1, l2, l3 = np.float64(levels[0]), np.float64(levels[1]), np.float64(levels[2]), np.float64(levels[3])
    outer, inner = l0 + l3, l1 + l2
    c0 = (outer + inner) / 4
    c1 = ((l3 - l0) + (l2 - l1)) / 4
    c2 = ((l3 - l0) - (l2 - l1)) / 4
    c3 = (outer - inner) / 4
    return np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3)


@njit(inline="always", cache=True)
def _perm_tokens(tri, laid, y, scale, offsets, coef, where, general, tokens):
    if tokens == 4:
        rows_perm(tri, laid, y, scale, offsets, coef, where, general, 4)
    elif tokens == 3:
        rows_perm(tri, laid, y, scale, offsets, coef, where, general, 3)
    elif tokens == 2:
        rows_perm(tri, laid, y, scale, offsets, coef, where, general, 2)
    else:
        rows_perm(tri, laid, y, scale, offsets, coef, where, general, 1)


@njit(inline="always", cache=True)
def _perm_call(tri, laid, y, scale, offsets, coef, where, general, tokens):
    """``rows_perm`` for a run-time count of tokens (1 .. 4) and ``general``, as literals."""
    if general:
        _perm_tokens(tri, laid, y, scale, offsets, coef, where, True, tokens)
    else:
        _perm_tokens(tri, laid, y, scale, offsets, coef, where, False, tokens)


@njit(cache=True)
def _rows_few(c8, laid, scale, blocked, coef, x, y, r_lo, r_hi, general):
    """y[:, r] for rows r_lo .. r_hi - 1: blocks of 16 rows (``SHAPE``) by ``rows_perm``, a tile's blocks and
    up to 4 tokens a call, their codes laid out by ``block_codes``, the block's scales from ``blocked``
    (``block_scales`` in ``tile_order``); the rows left over by one-token byte tables, from the codes as they
    are and their scales from ``scale``.

    A tile of ``TILE`` blocks goes through one group at a time, so that a group's tables serve the whole
    tile from L1 (from 4 tokens a matrix's tables outgrow L1, and re-reading them from L2 bounded the loop),
    and the codes, laid out in that order, stream in memory order at every token count (from RAM, 2 and 4
    tokens ran faster this way than block by block through all groups, or tile by tile over codes stored
    block by block). A row's groups are added in the same order either way."""
    block, _, chunks, entries = SHAPE
    n, d_in = x.shape
    rows = y.shape[1]
    words, groups = d_in // CODE_WORD, -(-d_in // GROUP)
    size = WORDS * chunks * entries  # one token's tables for a group
    tri = np.empty(groups * n * size, np.float32)  # [group, token, word, chunk, entry]
    offsets = np.empty(groups * n, np.float32)
    for g in range(groups):
        w0 = g * WORDS
        nw = min(WORDS, words - w0)
        for t in range(n):
            base = (g * n + t) * size
            build_tri(x[t], w0 * CODE_WORD, nw, tri, base)
            offsets[g * n + t] = _ZERO
            # c0·Σx, a chain of dependent adds a group: symmetric levels (the converter's) have c0 = 0 exactly
            if coef[0] != 0:
                total = _ZERO
                for k in range(nw * chunks):
                    total += tri[base + (k + 1) * entries - 1]
                offsets[g * n + t] = coef[0] * total
    y[:, r_lo:r_hi] = 0
    whole = r_lo + (r_hi - r_lo) // block * block  # the end of the whole blocks
    b_lo, b_hi, blocks = r_lo // block, whole // block, -(-rows // block)
    for t0 in range(b_lo - b_lo % TILE, b_hi, TILE):
        lo, hi = max(b_lo, t0), min(b_hi, t0 + TILE)  # this thread's blocks of the tile
        for g in range(groups):
            nw = min(WORDS, words - g * WORDS)
            at, si = laid_group(lo, g, words, blocks)  # the layout's tile, whatever this thread's share
            for t in range(0, n, TOKENS):
                where = ((g * n + t) * size, at, nw, rows, t * rows + lo * block, si, g * n + t, hi - lo)
                _perm_call(tri, laid, y, blocked, offsets, coef, where, general, min(TOKENS, n - t))
    table = np.empty(WORDS * 4 * 256, np.float32)
    for g in range(groups if whole < r_hi else 0):
        w0 = g * WORDS
        nw = min(WORDS, words - w0)
        for t in range(n):
            for q in range(nw * 4):
                build(x[t], w0 * CODE_WORD + 8 * q, table, q * 256, 1)
            for i in range(whole, r_hi):
                at, s, og = (i * words + w0) * WORD_BYTES, half(scale[i * groups + g]), offsets[g * n + t :]
                if general:
                    group_dot(table, c8, at, nw, y[t], i, s, coef, og, True, 1)
                else:
                    group_dot(table, c8, at, nw, y[t], i, s, coef, og, False, 1)


@njit(inline="always", cache=True)
def _nibble_call(tables, nib, out, blocked, offsets, where, general, tokens):
    """``rows_nibbles`` for a run-time ``general`` and count of tokens (1 or 2), as literals."""
    if general:
        if tokens == 2:
            rows_nibbles(tables, nib, out, blocked, offsets, where, True, 2)
        else:
            rows_nibbles(tables, nib, out, blocked, offsets, where, True, 1)
    elif tokens == 2:
        rows_nibbles(tables, nib, out, blocked, offsets, where, False, 2)
    else:
        rows_nibbles(tables, nib, out, blocked, offsets, where, False, 1)


@njit(cache=True)
def _rows_nibbles(nib, blocked, coef, x, y, r_lo, r_hi, general):
    """y[:, r] for rows r_lo .. r_hi - 1 (r_lo on a 32-row block) on an AVX2 host: per block of 32 rows
    (``nibbles``) and group, two tokens at a time; a block goes through all groups before the next, so
    that the laid-out codes stream in memory order."""
    n, d_in = x.shape
    words, groups = d_in // CODE_WORD, -(-d_in // GROUP)
    planes = 3 if general else 2
    per_token = planes * nibbles.CHUNKS * nibbles.TABLE
    tables = np.empty(groups * n * per_token, np.uint8)
    offsets = np.zeros(groups * n, np.float32)
    plane_coef = (coef[2], coef[1], coef[3])
    for g in range(groups):
        w0 = g * WORDS
        nw = min(WORDS, words - w0)
        for t in range(n):
            at = (g * n + t) * per_token
            for p in range(planes):
                build_tables(
                    x[t],
                    w0 * CODE_WORD,
                    nw * CODE_WORD // 4,
                    plane_coef[p],
                    tables,
                    at + p * nibbles.CHUNKS * nibbles.TABLE,
                )
            if general:
                offsets[g * n + t] = coef[0] * x[t, w0 * CODE_WORD : (w0 + nw) * CODE_WORD].sum()
    block = nibbles.BLOCK
    b_lo, b_hi = r_lo // block, -(-r_hi // block)
    count = (b_hi - b_lo) * block
    out = np.zeros(n * count, np.float32)
    group_bytes = 2 * nibbles.PLANE_BYTES * block
    for k in range(b_lo, b_hi):
        for g in range(groups):
            nw = min(WORDS, words - g * WORDS)
            code_at, scale_at = (k * groups + g) * group_bytes, (k * groups + g) * block
            for line in range(0, group_bytes, 64):
                prefetch_at(nib, code_at + _PF_NIBBLES + line)
            for t0 in range(0, n, nibbles.TOKENS):
                tokens = min(nibbles.TOKENS, n - t0)
                where = (
                    (g * n + t0) * per_token,
                    code_at,
                    nw * 4,
                    count,
                    t0 * count + (k - b_lo) * block,
                    scale_at,
                    g * n + t0,
                    per_token,
                )
                _nibble_call(tables, nib, out, blocked, offsets, where, general, tokens)
    first = r_lo - b_lo * block
    for t in range(n):
        y[t, r_lo:r_hi] = out[t * count + first : t * count + first + r_hi - r_lo]


@njit(cache=True)
def _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general, stop, table, w_lo, w_hi, col0):
    """y[:stop, r] for rows r_lo .. r_hi - 1 over their code words w_lo .. w_hi - 1 (0 .. words: whole rows),
    the matrix's columns x's from ``col0`` on, tokens in blocks of LANES (the last zero-padded): per block and
    group, 8-column tables of the block's tokens (in ``table``, ``TABLE_FLOATS``), then every row's lookups
    into them. Blocks outermost, so that a block's sums (a register a row) stay in cache across the groups.
    A prompt's base splits between the engine and the CPU actors by words (``EngineConfig.base_share``): a
    split by rows built every table on both sides."""
    d_x, rows = x.shape[1], y.shape[1]
    d_in = d_x - col0
    words, groups = d_in // CODE_WORD, -(-d_in // GROUP)
    xs = np.empty((d_in, LANES), np.float32)  # token fastest: a table entry's lanes; each block writes its words'
    flat = xs.reshape(-1)
    acc = np.empty((r_hi - r_lo) * LANES, np.float32)
    offset = np.empty(LANES, np.float32)
    for t0 in range(0, stop, LANES):
        m = min(LANES, stop - t0)
        for c in range(w_lo * CODE_WORD, w_hi * CODE_WORD, LANES):  # whole code words: whole registers of columns
            transpose(x, t0 * d_x + col0 + c, d_x, m, flat, c * LANES, LANES, LANES, LANES)
        acc[:] = 0.0
        for g in range(w_lo // WORDS, -(-w_hi // WORDS)):
            w0 = max(w_lo, g * WORDS)
            nw = min(w_hi, g * WORDS + WORDS) - w0
            for q in range(nw * 4):
                build(flat, (w0 * CODE_WORD + 8 * q) * LANES, table, q * 256 * LANES, LANES)
            for i in range(LANES):
                total = _ZERO
                for q in range(nw * 4):
                    total += table[(q * 256 + 255) * LANES + i]
                offset[i] = coef[0] * total
            for r in range(r_lo, r_hi):
                prefetch_at(c8, ((r + _PF_ROWS) * words + w0) * WORD_BYTES)
                at, ai, s = (r * words + w0) * WORD_BYTES, (r - r_lo) * LANES, half(scale[r * groups + g])
                if general:
                    group_dot(table, c8, at, nw, acc, ai, s, coef, offset, True, LANES)
                else:
                    group_dot(table, c8, at, nw, acc, ai, s, coef, offset, False, LANES)
        full = r_lo + (r_hi - r_lo) // LANES * LANES
        for r in range(r_lo, full, LANES):
            transpose(acc, (r - r_lo) * LANES, LANES, LANES, y, t0 * rows + r, rows, m, LANES)
        for r in range(full, r_hi):
            for t in range(m):
                y[t0 + t, r] = acc[(r - r_lo) * LANES + t]


@njit(cache=True)
def columns(c8, scale, coef, x, y, w_lo, table):
    """y = x'·dequant(Q)ᵀ over each row's code words from ``w_lo`` on, every row, one thread, for a matrix of
    x's last columns: the CPU actors' share of a prompt's base (``EngineConfig.base_share``)."""
    rows = y.shape[1]
    words = c8.size // (rows * WORD_BYTES)
    _rows_many(c8, scale, coef, x, y, 0, rows, coef[3] != 0, x.shape[0], table, w_lo, words,
               x.shape[1] - words * CODE_WORD)  # fmt: skip


@njit(inline="always", cache=True)
def thread_rows(c8, laid, scale, blocked, coef, general, x, y, split, chunk, chunks, tables):
    """One thread's share of the rows (whole row blocks but the last) over their first ``split`` code words
    (all of them: the whole product), its byte tables ``chunk``'s of ``tables``."""
    block = ROW_BLOCK
    rows = y.shape[1]
    blocks = -(-rows // block)
    r_lo = min(rows, chunk * blocks // chunks * block)
    r_hi = min(rows, (chunk + 1) * blocks // chunks * block)
    n = x.shape[0]
    table = tables[chunk * TABLE_FLOATS : (chunk + 1) * TABLE_FLOATS]
    if split < x.shape[1] // CODE_WORD:  # the CPU actors take the rest: every token through the byte tables
        _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general, n, table, 0, split, 0)
    elif n <= FEW:
        if WIDE:
            _rows_few(c8, laid, scale, blocked, coef, x, y, r_lo, r_hi, general)
        else:
            _rows_nibbles(laid, blocked, coef, x, y, r_lo, r_hi, general)
    elif WIDE:  # the byte tables take whole blocks of tokens, the few-token tables the rest (a part block
        # costs the byte tables a whole one)
        whole = n // LANES * LANES
        _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general, whole, table, 0, x.shape[1] // CODE_WORD, 0)
        if whole < n:
            _rows_few(c8, laid, scale, blocked, coef, x[whole:], y[whole:], r_lo, r_hi, general)
    else:
        _rows_many(c8, scale, coef, x, y, r_lo, r_hi, general, n, table, 0, x.shape[1] // CODE_WORD, 0)


@njit(cache=True, parallel=True)
def parallel(c8, laid, scale, blocked, coef, general, x, y, split, chunks, tables):
    for chunk in prange(chunks):
        thread_rows(c8, laid, scale, blocked, coef, general, x, y, split, chunk, chunks, tables)
