"""Memory on 2 MiB pages: the copies of the codes that the few-token loops stream, and the byte tables.

Each product's laid-out codes and block scales are a separate tensor of tens to hundreds of KiB, on 4 KiB
pages; a pass crossed thousands of them, each a TLB miss and a restart of the hardware prefetchers. Carved
from regions that Linux backs with 2 MiB pages where it may (transparent huge pages on ``madvise``), a
pass from RAM runs faster (benchmarks/README.md).

The byte tables of a long pass (``rows._rows_many``: a group's 256 KiB, looked up at random from L2) had
come from malloc, on 4 KiB pages placed wherever the kernel had them: in some processes, at random, every
long pass ran slower (benchmarks/README.md). From one 2 MiB page (``scratch``) none did.

Where the kernel or the platform has no such pages, the regions are ordinary memory: the same tensors,
the same results.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line


def region(nbytes: int) -> torch.Tensor:
    """At least ``nbytes`` of uint8 from a 2 MiB boundary of an anonymous mapping advised for 2 MiB pages."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    return whole[(-whole.data_ptr()) % HUGE_PAGE :]


class Arena:
    """Tensors copied into large anonymous regions advised for 2 MiB pages, 64-byte aligned, handed out
    in order. A region lives as long as any tensor carved from it (each keeps its region's buffer), so a
    process that drops its products gets their memory back once a region's tensors are all gone."""

    def __init__(self, region_bytes: int = 64 << 20) -> None:
        if region_bytes <= 0:
            raise ValueError(f"region_bytes must be positive, got {region_bytes}")
        self._region_bytes = region_bytes
        self._free = torch.empty(0, dtype=torch.uint8)  # the current region's unused bytes

    def _grow(self, nbytes: int) -> None:
        self._free = region(max(self._region_bytes, nbytes))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` (same dtype and shape) in the arena."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._free.numel():
            self._grow(nbytes)
        out = self._free[:nbytes].view(tensor.dtype).view(tensor.shape)
        self._free = self._free[min(self._free.numel(), nbytes + (-nbytes) % ALIGN) :]
        return out.copy_(tensor)


SHARED = Arena()  # the process's: every ``Product`` copies its laid-out codes and block scales here


_THREAD = threading.local()


def scratch(nbytes: int) -> int:
    """The address of at least ``nbytes`` of this Python thread's own scratch on 2 MiB pages (grown, never
    shrunk): the byte tables' (``rows.TABLE_FLOATS`` a numba thread). A thread's own, so that no two calls
    share tables, whether or not the kernels hold the GIL."""
    buffer = getattr(_THREAD, "scratch", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _THREAD.scratch = region(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    return buffer.data_ptr()
