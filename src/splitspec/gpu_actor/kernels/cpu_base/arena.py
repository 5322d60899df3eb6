"""Memory on 2 MiB pages for the copies of the codes that the few-token loops stream.

Each product's laid-out codes and block scales are a separate tensor of tens to hundreds of KiB, on 4 KiB
pages; a pass crossed thousands of them, each a TLB miss and a restart of the hardware prefetchers. Carved
from regions that Linux backs with 2 MiB pages where it may (transparent huge pages on ``madvise``), a
pass from RAM runs faster (benchmarks/README.md). Where the kernel or the platform has no such pages, the
regions are ordinary memory: the same tensors, the same results.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line


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
        size = max(self._region_bytes, nbytes) + HUGE_PAGE  # room to start on a 2 MiB boundary
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory takes no THP
        if hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        self._free = whole[(-whole.data_ptr()) % HUGE_PAGE :]

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` (same dtype and shape) in the arena."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._free.numel():
            self._grow(nbytes)
        out = self._free[:nbytes].view(tensor.dtype).view(tensor.shape)
        self._free = self._free[min(self._free.numel(), nbytes + (-nbytes) % ALIGN) :]
        return out.copy_(tensor)


SHARED = Arena()  # the process's: every ``Product`` copies its laid-out codes and block scales here
