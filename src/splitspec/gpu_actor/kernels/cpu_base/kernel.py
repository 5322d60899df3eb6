"""The product over raw addresses, and its torch-facing wrapper."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import torch
from numba import njit
from numba.np.ufunc import parallel as numba_parallel

from splitspec.gpu_actor.kernels.cpu_base.common import F32_PTR, U8_PTR, U16_PTR, WORD_BYTES
from splitspec.gpu_actor.kernels.cpu_base.dense import DENSE_TOKENS, dense_matmul
from splitspec.gpu_actor.kernels.cpu_base.rows import coefficients, parallel, thread_rows
from splitspec.quantize.format import CODE_WORD, GROUP

_MIN_ROWS_PER_THREAD = 64


@njit(cache=True)
def kernel(codes_at, scale_at, levels_at, x_at, y_at, n, rows, words, threads):
    """The product over raw addresses: codes [rows, words, 2] int32 (read as bytes), scale [rows, groups]
    fp16 bits, levels [4] fp32, x [n, 32·words] fp32, y [n, rows] fp32, all C-contiguous. ``threads`` comes
    from Python: numba.get_num_threads() inside would keep this function out of the cache."""
    d_in = words * CODE_WORD
    groups = -(-d_in // GROUP)
    c8 = numba.carray(U8_PTR(codes_at), rows * words * WORD_BYTES)
    scale = numba.carray(U16_PTR(scale_at), rows * groups)
    coef = coefficients(numba.carray(F32_PTR(levels_at), 4))
    x = numba.carray(F32_PTR(x_at), (n, d_in))
    y = numba.carray(F32_PTR(y_at), (n, rows))
    general = coef[3] != 0
    chunks = min(threads, max(1, rows // _MIN_ROWS_PER_THREAD))
    if chunks == 1:
        thread_rows(c8, scale, coef, general, x, y, 0, 1)
    else:
        parallel(c8, scale, coef, general, x, y, chunks)


def base_matmul(
    codes: torch.Tensor,
    scale: torch.Tensor,
    levels: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · dequant(Q_base)ᵀ on the CPU; arguments as ``gpu_actor.kernels.base_matmul``, which checks them.

    From ``DENSE_TOKENS`` tokens on, a tile-by-tile decode and sgemm (``dense``); fewer, the tables."""
    n, rows = x.shape[0], codes.shape[0]
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    if levels.dtype is not torch.float32 or not levels.is_contiguous():
        levels = levels.to(torch.float32).contiguous()
    codes, scale = codes.contiguous(), scale.contiguous()  # the tensors stay alive through the call
    if n >= DENSE_TOKENS:
        y = out if out is not None else torch.empty(n, rows)
        dense_matmul(codes, scale, levels, x, y)  # sgemm writes a column slice in place
        return y
    y = out if out is not None and out.is_contiguous() else torch.empty(n, rows)
    kernel(
        codes.data_ptr(),
        scale.data_ptr(),
        levels.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        n,
        rows,
        codes.shape[1],
        _thread_count()(),  # first launches the pool, which the compiled kernel needs even on one thread
    )
    if out is None:
        return y
    if y is not out:  # a column slice: one kernel specialization (C layout) is worth a small copy
        out.copy_(y)
    return out


@functools.cache
def _thread_count() -> Callable[[], int]:
    """``numba.get_num_threads`` less its check, on every call, that the thread pool is up (done here,
    once): the check cost a sizeable part of a small layer's call. Still per Python thread, as numba's."""
    numba.get_num_threads()
    return numba_parallel._get_num_threads
