"""Fixed shared-memory slots: the CPU kernel reads x' and writes y_r in place, no copy on either side.

Layout of one segment (every block 64-byte aligned)::

    control: posted (u64, client-written) | ring[slots] (u32 slot indices, in submission order)
    slot i:  done (u64, server-written) | request-header length | result-header length
             | request header | result header | x [max_tokens, max_d_in] f32 | y [y_floats] f32

y holds the largest reply of any group: ``max_tokens`` rows of the widest Linear group, or ``HEAD_TOKENS``
rows of the lm_head's share, whichever is larger.

Ownership hand-off, so that nobody needs a lock:

1. the client owns a free slot: it writes x' and the request header, then ``ring[posted % slots] = slot``
   and ``posted += 1`` (its last store) and rings the doorbell;
2. the server owns slots ``ring[served % slots]`` while ``served < posted``: it reads x', writes y_r and
   the result header, then ``done[slot] = served + 1`` (its last store: the request's serial, the
   ``posted`` count that published it) and rings back;
3. the client owns the slot again once ``done[slot]`` equals the serial of its post, until it releases it.

Each side publishes by one aligned 8-byte store after its data, and the other reads the flag before the
data. That is safe on x86-64 (stores are not reordered with stores, nor loads with loads); elsewhere the
channel sets the spin to zero so that the doorbell's syscalls order memory instead.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import platform
import shutil
import socket
import tempfile
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from splitspec.protocol.doorbell import Doorbell
from splitspec.protocol.messages import SHM_PREFIX, SHM_ROOT, ErrorCode, GroupShard, ProtocolError, request_tokens

HEADER_BYTES = 2048
SEGMENT_NAME = "slots"
REQUEST, RESULT = 0, 1
_ALIGN = 64
_F32 = 4
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of a segment; both sides derive it from the handshake, so it never travels. Offsets are
    computed once: they sit on the per-request path."""

    slots: int
    max_tokens: int
    max_d_in: int
    y_floats: int

    @classmethod
    def for_shards(cls, slots: int, max_tokens: int, shards: dict[str, GroupShard]) -> SlotLayout:
        return cls(
            slots=slots,
            max_tokens=max_tokens,
            max_d_in=max(s.d_in for s in shards.values()),
            y_floats=max(request_tokens(g, max_tokens) * s.rows for g, s in shards.items()),
        )

    @cached_property
    def ring_offset(self) -> int:
        return _ALIGN

    @cached_property
    def first_slot(self) -> int:
        return _ALIGN + _round_up(4 * self.slots)

    @cached_property
    def x_offset(self) -> int:
        return _ALIGN + 2 * HEADER_BYTES

    @cached_property
    def y_offset(self) -> int:
        return self.x_offset + _round_up(self.max_tokens * self.max_d_in * _F32)

    @cached_property
    def slot_stride(self) -> int:
        return self.y_offset + _round_up(self.y_floats * _F32)

    @cached_property
    def total_bytes(self) -> int:
        return self.first_slot + self.slots * self.slot_stride

    def slot_base(self, slot: int) -> int:
        return self.first_slot + slot * self.slot_stride


def _allocate(fd: int, path: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise ProtocolError(
            ErrorCode.INVALID,
            f"no room in {os.path.dirname(os.path.dirname(path))} for the channel's slots ({size / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free): free some or give it more (df -h /dev/shm; a container's --shm-size)",
        ) from None


class SlotArena:
    """A mapped segment with typed views on its flags, headers and payloads."""

    def __init__(self, path: str, layout: SlotLayout, create: bool) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:  # allocated now: a full /dev/shm is an error here, not a SIGBUS at the first write
                _allocate(fd, path, layout.total_bytes)
            elif os.fstat(fd).st_size != layout.total_bytes:
                raise ProtocolError(
                    ErrorCode.MISMATCH,
                    f"shared-memory segment {path} has {os.fstat(fd).st_size} bytes, the handshake implies "
                    f"{layout.total_bytes}: client and server disagree on the slot layout",
                )
            self._mm = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        self.layout = layout
        self._closed = False
        base, stride, n = layout.first_slot, layout.slot_stride, layout.slots
        self.posted = np.ndarray((1,), np.uint64, self._mm, 0)
        self.address = self.posted.ctypes.data  # where the segment is mapped in this process (``lane``)
        self.ring = np.ndarray((n,), np.uint32, self._mm, layout.ring_offset)
        self.done = np.ndarray((n,), np.uint64, self._mm, base, (stride,))
        self._lengths = np.ndarray((n, 2), np.uint32, self._mm, base + 8, (stride, 4))
        self.buffer = memoryview(self._mm)  # what ``records`` packs into and unpacks from
        self._headers = [(b + _ALIGN, b + _ALIGN + HEADER_BYTES) for b in map(layout.slot_base, range(n))]
        # views of the slots' payloads, made once: a numpy view costs ~1-3 µs to build per request. ``_views``
        # holds the shaped ones asked for, a few per (slot, group, n), so it stays small.
        self._views: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._flat = [
            (
                np.ndarray(
                    layout.max_tokens * layout.max_d_in, np.float32, self._mm, layout.slot_base(i) + layout.x_offset
                ),
                np.ndarray(layout.y_floats, np.float32, self._mm, layout.slot_base(i) + layout.y_offset),
            )
            for i in range(n)
        ]

    def header_offset(self, slot: int, kind: int) -> int:
        """Where the ``kind`` (REQUEST or RESULT) header of ``slot`` starts in ``buffer``."""
        return self._headers[slot][kind]

    def header_length(self, slot: int, kind: int) -> int:
        length = int(self._lengths[slot, kind])
        if length > HEADER_BYTES:
            raise ProtocolError(ErrorCode.OVERSIZED, f"slot {slot} claims a {length}-byte header")
        return length

    def set_header_length(self, slot: int, kind: int, length: int) -> None:
        self._lengths[slot, kind] = length

    def x(self, slot: int, n: int, d_in: int) -> np.ndarray:
        return self._payload(slot, 0, n, d_in, self.layout.max_tokens * self.layout.max_d_in)

    def y(self, slot: int, n: int, rows: int) -> np.ndarray:
        return self._payload(slot, 1, n, rows, self.layout.y_floats)

    def _payload(self, slot: int, which: int, n: int, width: int, capacity: int) -> np.ndarray:
        key = (slot, which, n, width)
        view = self._views.get(key)
        if view is None:
            fits = 0 < n <= self.layout.max_tokens and width > 0 and n * width <= capacity
            if not (0 <= slot < self.layout.slots and fits):
                raise ProtocolError(
                    ErrorCode.INVALID,
                    f"[{n}, {width}] in slot {slot} does not fit the slots "
                    f"({self.layout.slots} × {capacity} floats, at most {self.layout.max_tokens} rows)",
                )
            view = self._views[key] = self._flat[slot][which][: n * width].reshape(n, width)
        return view

    def close(self) -> None:
        """Unmap, unless a caller still holds a view (then the mapping lives until that view dies)."""
        if self._closed:
            return
        self._closed = True
        del self.posted, self.ring, self.done, self._lengths, self._flat, self._views
        self.buffer.release()
        with contextlib.suppress(BufferError):
            self._mm.close()


def host_id() -> str:
    """Names this host's shared-memory domain: the server grants slots only to a client with the same id."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{socket.gethostname()}/{f.read().strip()}"


class ShmEndpoint:
    """One side of a same-host session: the mapped slots, and a doorbell each way.

    The server creates the files in a private directory under /dev/shm; the client maps them and deletes
    the directory at once, so nothing is left behind even if both processes are later killed.
    """

    def __init__(self, directory: str, layout: SlotLayout, server: bool) -> None:
        self.directory = directory
        try:
            if server:
                Doorbell.create(os.path.join(directory, "request"))
                Doorbell.create(os.path.join(directory, "done"))
            self.arena = SlotArena(os.path.join(directory, SEGMENT_NAME), layout, create=server)
            self.request_bell = Doorbell(os.path.join(directory, "request"), reader=server)
            self.done_bell = Doorbell(os.path.join(directory, "done"), reader=not server, keep_open_for_peer=server)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if not server:
            shutil.rmtree(directory, ignore_errors=True)

    @classmethod
    def create(cls, layout: SlotLayout) -> ShmEndpoint:
        return cls(tempfile.mkdtemp(prefix=SHM_PREFIX, dir=SHM_ROOT), layout, server=True)

    @classmethod
    def attach(cls, directory: str, layout: SlotLayout) -> ShmEndpoint:
        return cls(directory, layout, server=False)

    def close(self) -> None:
        self.arena.close()
        self.request_bell.close()
        self.done_bell.close()
        shutil.rmtree(self.directory, ignore_errors=True)
