"""A slot's request answered by compiled code: the server's side of ``lane``.

In Python, answering one slot costs the CPU actor tens of microseconds beside its kernel (the spin's
clock and yield, decoding the header, checking it, the result's header encoded and packed, the doorbell),
and a verify pass makes four round trips a layer. ``serve`` does what ``Server._answer_slot`` does for the
requests it recognises, with no Python in between: it matches the header byte for byte against the
template ``lane`` encodes for each (layer, group) (so the id, the token count and the slot are the only
bytes that vary), calls the shard's kernel for that group as a C function of addresses, writes the reply
from its template, hands the slot back and rings the doorbell. Whatever it does not recognise (another
encoding, a broken header, a bad slot or token count, a group without a kernel such as the lm_head's
rows, a ``posted`` count further ahead than there are slots) it leaves to Python, which decodes it and
answers or refuses it as before.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

from splitspec.kernels.ir import I64_PTR, U8_PTR, U32_PTR, c_call, load_acquire, store_release
from splitspec.protocol.lane import (
    ID_AT,
    LENGTH,
    LIBC,
    MAX_SMALL,
    N2_AT,
    N_AT,
    OFFSET,
    SLOT_AT,
    TEMPLATE,
    LaneTemplates,
    clock_ns,
)
from splitspec.protocol.messages import GroupShard, request_tokens
from splitspec.protocol.shm import HEADER_BYTES, REQUEST, RESULT, SlotArena

# A session's int64 fields (``SlotAnswers.fields``).
POSTED_AT, RING_AT, SLOTS, SLOT_TABLE_AT, SERVED, FD, WAKE_AT, WRITE, CLOCK, TIMESPEC_AT, YIELD = range(11)
BYTES_AT, REQUESTS_AT, REPLIES_AT, CELLS, GROUPS, LIMITS_AT, KERNELS_AT, GUESS = range(11, 19)
ANSWERED, COMPUTE_NS, STREAMED = range(19, 22)
FIELDS = 22
# A slot's row of addresses: its flag, its header lengths, its two headers, x and y.
DONE, LENGTHS, REQUEST_HEADER, RESULT_HEADER, X, Y = range(6)
SLOT = 6
# A (layer, group)'s kernel row: a C function ``int64 (argument, x, n, y)`` (0: Python answers), its
# argument, and the bytes one call reads (the actor's counters).
FUNCTION, ARGUMENT, READS = range(3)
KERNEL = 3
# What ``serve`` returns: it stopped at its deadline with nothing posted, or the next request is Python's.
IDLE, PYTHON = 0, 1
_LIBC_AT = {WRITE: "write", CLOCK: "clock_gettime", YIELD: "sched_yield"}


class SlotAnswers:
    """One shared-memory session's slots as ``serve`` reads them, and its served count (which Python's own
    answers advance too). ``kernels`` is int64 [layers, groups, KERNEL] in the order of ``shards``."""

    def __init__(
        self,
        arena: SlotArena,
        bell_fd: int,
        num_layers: int,
        shards: dict[str, GroupShard],
        dtype: str,
        max_tokens: int,
        kernels: np.ndarray,
    ) -> None:
        groups = list(shards)
        if kernels.shape != (num_layers, len(groups), KERNEL) or kernels.dtype != np.int64:
            raise ValueError(f"kernels must be int64 [{num_layers}, {len(groups)}, {KERNEL}], got {kernels.shape}")
        self._templates = LaneTemplates(
            num_layers, groups, [(s.d_in, s.rows, s.row_start) for s in shards.values()], dtype
        )
        self._kernels = np.ascontiguousarray(kernels)
        # a template has one byte for the token count: a larger count is msgpack's to encode otherwise, and a
        # byte past ``MAX_SMALL`` there is no count at all (0x80 an empty map, 0xc0 nil), for the schema to refuse
        self._limits = np.array([min(request_tokens(g, max_tokens), MAX_SMALL) for g in groups], np.int64)
        layout, base = arena.layout, arena.address
        self._slots = np.zeros((layout.slots, SLOT), np.int64)
        for slot in range(layout.slots):
            at = base + layout.slot_base(slot)  # its flag, then its header lengths (shm.py's layout)
            self._slots[slot] = (
                at,
                at + 8,
                base + arena.header_offset(slot, REQUEST),
                base + arena.header_offset(slot, RESULT),
                at + layout.x_offset,
                at + layout.y_offset,
            )
        self._wake = np.ones(1, np.uint8)
        self._timespec = np.zeros(2, np.int64)
        f = self.fields = np.zeros(FIELDS, np.int64)
        f[POSTED_AT], f[RING_AT], f[SLOTS] = base, base + layout.ring_offset, layout.slots
        f[SLOT_TABLE_AT], f[FD], f[WAKE_AT] = self._slots.ctypes.data, bell_fd, self._wake.ctypes.data
        f[TIMESPEC_AT] = self._timespec.ctypes.data
        for field, name in _LIBC_AT.items():
            f[field] = LIBC[name]
        f[BYTES_AT], f[REQUESTS_AT] = self._templates.bytes.ctypes.data, self._templates.requests.ctypes.data
        f[REPLIES_AT], f[CELLS], f[GROUPS] = self._templates.replies.ctypes.data, num_layers * len(groups), len(groups)
        f[LIMITS_AT], f[KERNELS_AT] = self._limits.ctypes.data, self._kernels.ctypes.data

    @property
    def served(self) -> int:
        return int(self.fields[SERVED])

    @served.setter
    def served(self, value: int) -> None:
        self.fields[SERVED] = value

    def serve(self, until_ns: int) -> int:
        """``serve`` on this session: ``IDLE`` or ``PYTHON``."""
        return serve(self.fields.ctypes.data, until_ns)

    def counters(self) -> tuple[int, float, int]:
        """(requests, compute seconds, bytes read) of the requests compiled code answered."""
        f = self.fields
        return int(f[ANSWERED]), int(f[COMPUTE_NS]) * 1e-9, int(f[STREAMED])


def warm() -> None:
    """Compile ``serve`` (or load it from numba's cache) now, with nothing posted, so that a server's first
    request does not wait for it."""
    posted, timespec = np.zeros(1, np.int64), np.zeros(2, np.int64)
    f = np.zeros(FIELDS, np.int64)
    f[POSTED_AT], f[CLOCK], f[TIMESPEC_AT] = posted.ctypes.data, LIBC["clock_gettime"], timespec.ctypes.data
    serve(f.ctypes.data, 0)


@njit(inline="always", cache=True)
def _now_ns(f):
    return clock_ns(f[CLOCK], f[TIMESPEC_AT])


@njit(inline="always", cache=True)
def _template(table_at, index):
    return numba.carray(I64_PTR(table_at + 8 * TEMPLATE * index), TEMPLATE)


@njit(cache=True)
def _matches(f, index, header, length, slot):
    """The token count of the request in ``header`` where it is (layer, group) ``index``'s template with an id,
    a count within the group's limit and this ``slot`` patched in; 0 where it is not."""
    t = _template(f[REQUESTS_AT], index)
    if t[LENGTH] != length:
        return 0
    n = header[t[N_AT]]
    limit = numba.carray(I64_PTR(f[LIMITS_AT]), f[GROUPS])[index % f[GROUPS]]
    if n < 1 or n > limit or (t[N2_AT] >= 0 and header[t[N2_AT]] != n) or header[t[SLOT_AT]] != slot:
        return 0
    if header[t[ID_AT]] >= 0x80:  # an id past 2^63 - 1: the schema refuses it, so Python does
        return 0
    expected = numba.carray(U8_PTR(f[BYTES_AT] + t[OFFSET]), length)
    for i in range(length):
        if t[ID_AT] <= i < t[ID_AT] + 8 or i == t[N_AT] or i == t[N2_AT] or i == t[SLOT_AT]:
            continue
        if header[i] != expected[i]:
            return 0
    return n


@njit(cache=True)
def _answer(f, served):
    """Answer the request ``served`` in the ring; False where Python must."""
    slot = numba.carray(U32_PTR(f[RING_AT]), f[SLOTS])[served % f[SLOTS]]
    if slot >= f[SLOTS] or slot > MAX_SMALL:  # a slot past one byte: as a token count past it (``_limits``)
        return False
    s = numba.carray(I64_PTR(f[SLOT_TABLE_AT] + 8 * SLOT * slot), SLOT)
    lengths = numba.carray(U32_PTR(s[LENGTHS]), 2)
    length = lengths[REQUEST]
    if length > HEADER_BYTES:
        return False
    header = numba.carray(U8_PTR(s[REQUEST_HEADER]), length)
    index = f[GUESS]  # requests come in layer and group order: the one after the last is tried first
    n = _matches(f, index, header, length, slot)
    if n == 0:  # then every (layer, group) in turn
        index = -1
        while n == 0 and index + 1 < f[CELLS]:
            index += 1
            n = _matches(f, index, header, length, slot)
    if n == 0:
        return False
    kernel = numba.carray(I64_PTR(f[KERNELS_AT] + 8 * KERNEL * index), KERNEL)
    if kernel[FUNCTION] == 0:
        return False
    t0 = _now_ns(f)
    if c_call(kernel[FUNCTION], kernel[ARGUMENT], s[X], n, s[Y]) != 0:
        return False
    t1 = _now_ns(f)
    t = _template(f[REQUESTS_AT], index)
    r = _template(f[REPLIES_AT], index % f[GROUPS])
    reply = numba.carray(U8_PTR(s[RESULT_HEADER]), r[LENGTH])
    reply[:] = numba.carray(U8_PTR(f[BYTES_AT] + r[OFFSET]), r[LENGTH])
    for k in range(8):
        reply[r[ID_AT] + k] = header[t[ID_AT] + k]
    reply[r[N_AT]] = n
    if r[N2_AT] >= 0:
        reply[r[N2_AT]] = n
    reply[r[SLOT_AT]] = slot
    lengths[RESULT] = r[LENGTH]
    f[SERVED] = served + 1
    f[GUESS] = (index + 1) % f[CELLS]
    f[ANSWERED] += 1
    f[COMPUTE_NS] += t1 - t0
    f[STREAMED] += kernel[READS]
    store_release(s[DONE], served + 1)  # hands the slot back: the client's flag
    # the server holds its end of the pipe read-write, so a write fails only on a full pipe, which already
    # holds a wake-up (``Doorbell.ring``)
    c_call(f[WRITE], f[FD], f[WAKE_AT], 1)
    return True


@njit(cache=True)
def serve(fields_at, until_ns):
    """Answer the session's posted requests in order until the clock passes ``until_ns`` with none waiting
    (``IDLE``; 0 answers what is posted and returns), or the next one is Python's (``PYTHON``), yielding the
    core at every idle turn as the Python spin does. A ``posted`` further ahead than there are slots is
    Python's too: the client wrote it, and the ring's stale entries would keep this loop answering them."""
    f = numba.carray(I64_PTR(fields_at), FIELDS)
    while True:
        served = f[SERVED]
        posted = load_acquire(f[POSTED_AT])
        if posted > served:
            if posted - served > f[SLOTS] or not _answer(f, served):
                return PYTHON
        elif _now_ns(f) >= until_ns:
            return IDLE
        else:
            c_call(f[YIELD])
