"""The product over raw addresses, and its torch-facing wrapper."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np
import torch
from numba import njit
from numba.np.ufunc import parallel as numba_parallel

from splitspec.kernels import amx
from splitspec.kernels.cpu_base import arena, nibbles
from splitspec.kernels.cpu_base.common import WORD_BYTES, WORDS
from splitspec.kernels.cpu_base.dense import DENSE_TOKENS, dense_matmul
from splitspec.kernels.cpu_base.perm import BITALG, WIDE, block_codes, tile_order
from splitspec.kernels.cpu_base.rows import ROW_BLOCK, TABLE_FLOATS, coefficients, columns, parallel, thread_rows
from splitspec.kernels.cpu_base.tiles import TILE_TOKENS, tiled_product
from splitspec.kernels.ir import F32_PTR, U8_PTR, U16_PTR
from splitspec.quantize.format import CODE_WORD, GROUP

_MIN_ROWS_PER_THREAD = 64


# whether the tile loops compile here: AMX-INT8 and AVX512-BITALG (``tiles.laid_signs``'s bit shuffle), known
# when numba compiles; an AVX2 host's LLVM aborts on that shuffle, so ``kernel`` prunes the call by it
TILES = amx.compiles() and BITALG


@njit(cache=True)
def kernel(
    codes_at, laid_at, scale_at, blocked_at, levels_at, x_at, y_at, n, rows, split, words, threads, tiled, tables_at
):
    """The product over raw addresses: codes [rows, words, 2] int32 (read as bytes) and the same laid out for
    the few-token tables (``perm.block_codes`` on an AVX-512 host, ``nibbles.nibble_codes`` on AVX2); scale
    [rows, groups] fp16 bits and the same in the laid-out codes' order (``block_scales``, in ``tile_order``
    on an AVX-512 host), levels [4] fp32, x [n, 32·words] fp32, y [n, rows] fp32, all C-contiguous. Each row
    takes its first ``split`` code words (``words``: all of it): the CPU actors multiply the rest where they
    take a share of the base (``EngineConfig.base_share``, ``ShareProduct``).
    ``threads`` comes from Python: numba.get_num_threads() inside would keep this function out of the cache.
    With ``tiled`` (AMX tiles and symmetric levels: ``Product.tiled``), products of ``TILE_TOKENS`` or more
    run on tiles. ``tables_at``: ``threads`` × ``TABLE_FLOATS`` fp32 for the byte tables (``table_scratch``)."""
    # a branch on the constant alone, which numba prunes: elsewhere the tile loops are not compiled at all
    if TILES:  # noqa: SIM102
        if tiled and n >= TILE_TOKENS and split == words:
            coef = coefficients(numba.carray(F32_PTR(levels_at), 4))
            tiled_product(laid_at, blocked_at, coef[1], coef[2], x_at, y_at, n, rows, words, threads)
            return
    d_in = words * CODE_WORD
    groups = -(-d_in // GROUP)
    c8 = numba.carray(U8_PTR(codes_at), rows * words * WORD_BYTES)
    scale = numba.carray(U16_PTR(scale_at), rows * groups)
    blocks = -(-rows // ROW_BLOCK)
    # the vpermps layout takes a short last group's own bytes, the vpshufb one 32 bytes per row and group
    row_bytes = words * WORD_BYTES if WIDE else groups * 2 * nibbles.PLANE_BYTES
    laid = numba.carray(U8_PTR(laid_at), blocks * row_bytes * ROW_BLOCK)
    blocked = numba.carray(U16_PTR(blocked_at), blocks * ROW_BLOCK * groups)
    coef = coefficients(numba.carray(F32_PTR(levels_at), 4))
    x = numba.carray(F32_PTR(x_at), (n, d_in))
    y = numba.carray(F32_PTR(y_at), (n, rows))
    general = coef[3] != 0
    chunks = min(threads, max(1, rows // _MIN_ROWS_PER_THREAD))
    tables = numba.carray(F32_PTR(tables_at), chunks * TABLE_FLOATS)
    if chunks == 1:
        thread_rows(c8, laid, scale, blocked, coef, general, x, y, split, 0, 1, tables)
    else:
        parallel(c8, laid, scale, blocked, coef, general, x, y, split, chunks, tables)


@njit(cache=True)
def share_kernel(codes_at, scale_at, levels_at, x_at, y_at, n, rows, words, d_x, first, tables_at):
    """y [n, rows] = x'·dequant(Q)ᵀ over each row's code words from ``first`` on, one thread, for a matrix of
    ``words`` code words that are x's [n, d_x] last columns (``ShareProduct``); ``tables_at``: one thread's
    byte tables (``TABLE_FLOATS`` fp32)."""
    groups = -(-words * CODE_WORD // GROUP)
    c8 = numba.carray(U8_PTR(codes_at), rows * words * WORD_BYTES)
    scale = numba.carray(U16_PTR(scale_at), rows * groups)
    coef = coefficients(numba.carray(F32_PTR(levels_at), 4))
    x = numba.carray(F32_PTR(x_at), (n, d_x))
    y = numba.carray(F32_PTR(y_at), (n, rows))
    columns(c8, scale, coef, x, y, first, numba.carray(F32_PTR(tables_at), TABLE_FLOATS))


class ShareProduct:
    """The CPU actors' share of a prompt's base for their rows of one matrix: x'·dequant(Q)ᵀ over each row's
    code words from ``first`` on (``shard.base_share_from``), which the engine leaves out
    (``EngineConfig.base_share``). It keeps the codes and scales from ``first``'s scale group on: a
    fraction of the rows' base, which is all it reads."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, first: int) -> None:
        rows, words, _ = codes.shape
        if not 0 <= first < words:
            raise ValueError(f"a share of the base starts at one of the row's {words} code words, got {first}")
        g0 = first // WORDS
        # kept: the kernel reads them by address
        self._matrix = (
            codes[:, g0 * WORDS :].contiguous(),
            scale[:, g0:].contiguous(),
            levels.to(torch.float32).contiguous(),
        )
        self.rows, self.d_x = rows, words * CODE_WORD
        self.nbytes: int = sum(t.numel() * t.element_size() for t in self._matrix)
        codes_at, scale_at, levels_at = (t.data_ptr() for t in self._matrix)
        self.fields = (codes_at, scale_at, levels_at, rows, words - g0 * WORDS, self.d_x, first - g0 * WORDS)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The share's product for x' [n, d_x] (the whole rows' input), fp32 [n, rows]."""
        x = np.ascontiguousarray(x, np.float32)
        if x.ndim != 2 or x.shape[1] != self.d_x:
            raise ValueError(f"x must be [n, {self.d_x}], got {x.shape}")
        y = np.empty((x.shape[0], self.rows), np.float32)
        codes_at, scale_at, levels_at, rows, words, d_x, first = self.fields
        tables = table_scratch(1)
        share_kernel(codes_at, scale_at, levels_at, x.ctypes.data, y.ctypes.data, x.shape[0], rows, words, d_x, first,
                     tables)  # fmt: skip
        return y


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp16 scales [rows, groups] as [blocks, groups, R] for the R-row blocks of the few-token tables
    (``ROW_BLOCK``; the last block padded with zeros): a block's scales for one group are R consecutive
    halves, which the kernel widens from loads of 8 or 16 instead of gathering R of them ``groups`` apart."""
    rows, groups = scale.shape
    block = ROW_BLOCK
    padded = scale.new_zeros(-(-rows // block) * block, groups)
    padded[:rows] = scale
    return padded.view(-1, block, groups).transpose(1, 2).contiguous()


class Product:
    """y = x · dequant(Q_base)ᵀ on the CPU for one bound matrix (``gpu_actor.kernels.BaseProduct``, which
    checks the shapes): its addresses are taken once, so a call hands numba only x's and y's. It keeps a
    block-major copy of the scales too (``block_scales``, a sixteenth of the codes' bytes or less), which the
    few-token tables read in one load per block of rows and group, and the codes laid out for those tables
    (as many bytes as the codes): by blocks of 16 rows for vpermps on an AVX-512 host (``perm.block_codes``),
    of 32 for vpshufb on AVX2 (``nibbles.nibble_codes``). Both copies live on 2 MiB pages (``arena.SHARED``).

    From ``DENSE_TOKENS`` tokens on (an AVX2 host's), a tile-by-tile decode and sgemm (``dense``); fewer, the
    tables. Where the process may use AMX tiles and the levels are symmetric (``tiled``, the default where it
    can), products of ``TILE_TOKENS`` or more run on tiles instead (``tiles``), with x' rounded to int16."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, tiled: bool | None = None
    ) -> None:
        # kept: the kernel reads them by address
        self._matrix = (codes.contiguous(), scale.contiguous(), levels.to(torch.float32).contiguous())
        c0, _, _, c3 = coefficients(self._matrix[2].numpy())
        can_tile = c0 == 0 and c3 == 0 and amx.enabled() and TILES
        if tiled and not can_tile:
            raise ValueError("tiled base products need AMX tiles (amx.enabled), AVX512-BITALG and symmetric levels")
        self.tiled = can_tile if tiled is None else tiled
        # on 2 MiB pages: the few-token loops stream these from RAM
        self._blocked = arena.SHARED.copy(tile_order(block_scales(scale)) if WIDE else block_scales(scale))
        self._laid = arena.SHARED.copy(block_codes(self._matrix[0]) if WIDE else nibbles.nibble_codes(self._matrix[0]))
        codes_at, scale_at, levels_at = (t.data_ptr() for t in self._matrix)
        self._addresses = (codes_at, self._laid.data_ptr(), scale_at, self._blocked.data_ptr(), levels_at)
        self.rows, self.words = codes.shape[0], codes.shape[1]

    @property
    def fields(self) -> tuple[int, ...]:
        """(codes, laid-out codes, scales, block-major scales, levels) addresses, rows, code words, tiled: how
        ``cpu_step`` calls the kernel for this matrix from compiled code."""
        return (*self._addresses, self.rows, self.words, int(self.tiled))

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a call reads but x: what a benchmark flushes from cache to time a pass from RAM."""
        return (*self._matrix, self._laid, self._blocked)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
        """``split``: each row's first code words to take (None: all), as ``kernel``'s."""
        if x.dtype is not torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        n, rows = x.shape[0], self.rows
        split = self.words if split is None else split
        if DENSE_TOKENS is not None and n >= DENSE_TOKENS and not self.tiled and split == self.words:
            y = out if out is not None else torch.empty(n, rows)
            dense_matmul(*self._matrix, x, y)  # sgemm writes a column slice in place
            return y
        y = out if out is not None and out.is_contiguous() else torch.empty(n, rows)
        # the thread count's first call launches the pool, which the compiled kernel needs even on one thread
        threads = thread_count()()
        kernel(
            *self._addresses,
            x.data_ptr(),
            y.data_ptr(),
            n,
            rows,
            split,
            self.words,
            threads,
            self.tiled,
            table_scratch(threads),
        )
        if out is None:
            return y
        if y is not out:  # a column slice: one kernel specialization (C layout) is worth a small copy
            out.copy_(y)
        return out


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    tiled: bool | None = None,
) -> torch.Tensor:
    """One ``Product`` call; arguments as ``gpu_actor.kernels.base_matmul``, which checks them."""
    return Product(codes, scale, levels, tiled)(x, out)


def table_scratch(threads: int) -> int:
    """The address of the calling Python thread's byte tables for ``threads`` numba threads (``arena.scratch``),
    which ``kernel`` takes."""
    return arena.scratch(threads * TABLE_FLOATS * 4)


@functools.cache
def thread_count() -> Callable[[], int]:
    """``numba.get_num_threads`` less its check, on every call, that the thread pool is up (done here,
    once): the check cost a sizeable part of a small layer's call. Still per Python thread, as numba's."""
    numba.get_num_threads()
    return numba_parallel._get_num_threads
