"""The residual product's Python face: a group's planes checked and flattened once, then one call per
product."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numba
import numpy as np
from numba import cfunc, types

from splitspec.config import CpuActorConfig, check_activations
from splitspec.kernels import amx
from splitspec.kernels.ir import F32_PTR, I64_PTR
from splitspec.kernels.residual.drivers import D_IN, MATRIX, ROWS, residual_kernel, serial_kernel
from splitspec.kernels.residual.params import MIN_WORK_PER_THREAD
from splitspec.kernels.residual.tiled import AMX_TOKENS
from splitspec.quantize.activations import LEVELS
from splitspec.quantize.packing import PLANES, SCALE_PLANES, check_planes, pack_residual


def _kernel_args(planes: dict[str, np.ndarray], bits: int) -> tuple:
    """The planes as the flat arrays the kernel takes, without copying any of them."""
    names = (*PLANES[bits], *SCALE_PLANES)
    stray = [name for name in names if not planes[name].flags.c_contiguous]
    if stray:
        raise ValueError(f"planes {stray} are not C-contiguous (slice whole tiles with slice_tiles)")
    return tuple(planes[name].reshape(-1) for name in names)


class ResidualMatrix:
    """One Linear group's planes, checked and flattened once: a request then costs one kernel call.

    ``planes`` is (a tile slice of) the layout of ``splitspec.quantize.packing``, ``rows`` its real
    rows, which must fall in the last tile, so padded rows are never written, and ``d_in`` its real
    columns (the planes pad them to whole steps).
    The arrays are viewed, never copied: the shard's first-touched memory is what the kernel streams.
    The product runs on up to numba's thread count at construction (``numba.set_num_threads``): asking
    again would cost every call. ``tiled``: whether integer passes of many tokens may multiply on AMX
    tiles (the same result, bit for bit); by default where this process may (``amx.enabled``).
    """

    def __init__(
        self, planes: dict[str, np.ndarray], bits: int, rows: int, d_in: int, tiled: bool | None = None
    ) -> None:
        _, self.d_in = check_planes(planes, bits, rows, d_in=d_in)
        self._args = _kernel_args(planes, bits)  # kept alive: ``fields`` holds their addresses
        self.tiled = amx.enabled() if tiled is None else tiled and amx.enabled()
        self.fields = np.array(
            [bits, self.d_in, rows, *(v for a in self._args for v in (a.ctypes.data, a.size)), self.tiled], np.int64
        )
        self._fields_at = self.fields.ctypes.data
        self.bits, self.rows = bits, rows
        self.nbytes: int = sum(planes[p].nbytes for p in (*PLANES[bits], *SCALE_PLANES))
        self.threads = numba.get_num_threads()

    def matmul(self, x: np.ndarray, out: np.ndarray, activations: str = CpuActorConfig.activations) -> None:
        """Write ``dequant(Q) · xᵀ`` into ``out`` [n, rows] (float32, in place) for ``x`` [n, d_in].

        ``activations``: "int16" / "int8" multiply ``round_activations(x, levels)`` in integers (see
        ``quantize/activations.py``), "fp32" multiplies x as it is.
        """
        _check_out(out, self.rows)
        check_activations(activations)
        want = (out.shape[0], self.d_in)
        if x.shape != want:
            raise ValueError(f"x must be [n, d_in] = {want} for these planes and out, got {x.shape}")
        if out.shape[0]:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if not x.flags.writeable:  # numba would compile the kernel anew for a read-only array
                x = x.copy()
            # both kernels run the same compiled loops (_tiles); the serial one only saves a parallel region's
            # start, which pays for work too small for two threads
            parallel = self.rows * self.d_in * out.shape[0] >= 2 * MIN_WORK_PER_THREAD
            self._run(residual_kernel if parallel else serial_kernel, x, LEVELS.get(activations, 0), out)

    def _run(self, kernel: Callable, x: np.ndarray, levels: int, out: np.ndarray) -> None:
        kernel(self._fields_at, x, levels, self.threads, out)

    def slot_call(self, activations: str) -> np.ndarray:
        """The int64 record that ``slot_product`` takes for this matrix: ``matmul`` with ``activations``."""
        check_activations(activations)
        return np.array([self._fields_at, LEVELS.get(activations, 0), self.threads], np.int64)


@functools.cache
def slot_product() -> int:
    """The address of ``ResidualMatrix.matmul`` as a C function of addresses, ``int64 (record, x, n, out)``
    with the record from ``slot_call``: what a server that answers its shared-memory slots from compiled
    code calls (``protocol.answer``). Compiled on first use, not on import."""

    @cfunc(types.int64(types.int64, types.int64, types.int64, types.int64), cache=True)
    def product(record_at, x_at, n, out_at):
        call = numba.carray(I64_PTR(record_at), 3)
        f = numba.carray(I64_PTR(call[0]), MATRIX)
        x = numba.carray(F32_PTR(x_at), (n, f[D_IN]))
        out = numba.carray(F32_PTR(out_at), (n, f[ROWS]))
        if f[ROWS] * f[D_IN] * n >= 2 * MIN_WORK_PER_THREAD:  # as matmul chooses
            residual_kernel(call[0], x, call[1], call[2], out)
        else:
            serial_kernel(call[0], x, call[1], call[2], out)
        return 0

    return product.address


def _check_out(out: np.ndarray, rows: int | None = None) -> None:
    if out.ndim != 2 or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 [n, rows] array, got {out.shape}")
    if rows is not None and out.shape[1] != rows:
        raise ValueError(f"out must have {rows} columns (the planes' rows), got {out.shape}")


def residual_matmul(
    planes: dict[str, np.ndarray],
    bits: int,
    x: np.ndarray,
    out: np.ndarray,
    activations: str = CpuActorConfig.activations,
) -> None:
    """``ResidualMatrix(planes, bits, rows, d_in).matmul(x, out, activations)`` with ``rows`` and ``d_in``
    taken from ``out`` and ``x``, for one product; a server builds its matrices once."""
    _check_out(out)
    if np.ndim(x) != 2:
        raise ValueError(f"x must be a 2-D [n, d_in] array, got shape {np.shape(x)}")
    ResidualMatrix(planes, bits, out.shape[1], np.shape(x)[1]).matmul(x, out, activations)


def warmup() -> float:
    """Compile (or load from the cache) both kernels (parallel and serial) and ``slot_product`` now; return the
    seconds it took.

    One specialisation of each serves all layouts, token counts and activation modes, as long as the planes
    are writeable arrays (read-only ones, e.g. a read-only memmap, get a second specialisation on first use).
    """
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    for bits in PLANES:
        q = rng.integers(-31, 32, (17, 130)).astype(np.int8)
        matrix = ResidualMatrix(pack_residual(q, np.ones((17, 2), np.float32), bits), bits, 17, 130)
        for levels in (*LEVELS.values(), 0):
            for kernel in (residual_kernel, serial_kernel):
                for n in (AMX_TOKENS - 1, AMX_TOKENS):  # the vector loops, then the tiles (where allowed)
                    matrix._run(kernel, np.ones((n, 130), np.float32), levels, np.empty((n, 17), np.float32))
    slot_product()
    return time.perf_counter() - start
