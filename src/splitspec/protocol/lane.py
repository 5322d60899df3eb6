"""A shared-memory slot that compiled code drives on its own: the verifier's hand-off without Python.

A verify pass makes four round trips a layer. Through ``Client`` each costs tens of microseconds of Python
on the engine's side (a ticket, a header, the copy of x', the post, then the reply's header, its checks),
more than a small group's residual costs the CPU actor, and the interpreter runs cold after every base
product has swept the caches. A ``SlotLane`` is one slot leased from a ``Client`` for a pass, with what
compiled code needs to use it: ``post`` writes a group's request and x' into the slot and publishes it as
``SlotTransport.post`` does, ``answered`` waits on the slot's flag and checks the reply's header. The CPU
actor cannot tell: the slot carries the very bytes ``Client`` would write.

Headers stay the schema's own messages. A request's header is encoded once per (layer, group) and its
request id, token count and slot are patched in place: request ids are at least ``FIRST_ID`` (msgpack
then always spends 9 bytes on one) and token counts and slots are under 128 (one byte each), so every
header of a (layer, group) has one layout. The expected reply is made the same way, and a reply that is
not byte for byte the expected ``Result`` (an ``Error``, a broken header) goes back to Python, which
decodes it and raises as ``Client.gather`` does. So does a reply that is not in after ``spin_us``: Python
sleeps on the doorbell with the request's deadline, and compiled code resumes after it.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable, Sequence

import numba
import numpy as np
from numba import njit

from splitspec.kernels.ir import F32_PTR, I32_PTR, I64_PTR, U8_PTR, U32_PTR, c_call, load_acquire, store_release
from splitspec.protocol.messages import FIRST_ID, Compute, Message, Result, decode, encode
from splitspec.protocol.shm import REQUEST, RESULT, SlotArena

# A lane's int64 fields (``SlotLane.fields``): where its slot's parts are, the libc functions it calls,
# its template tables, and the request in flight.
SLOT, SLOTS, X_AT, Y_AT, REQUEST_AT, RESULT_AT, LENGTHS_AT, RING_AT, POSTED_AT, DONE_AT = range(10)
FD, WAKE_AT, WRITE, ERRNO_AT, CLOCK, YIELD, TIMESPEC_AT, SPIN_NS = range(10, 18)
BYTES_AT, REQUESTS_AT, REPLIES_AT, SHAPES_AT, GROUPS = range(18, 23)
NEXT_ID, SERIAL, ID, LAYER, GROUP, TOKENS, ERRNO = range(23, 30)
FIELDS = 30
# A template's row: where its bytes start in the lane's byte buffer and how many, then the positions to
# patch: the request id's 8 bytes, the token count (twice in a request: ``n`` and ``shape[0]``), the slot.
OFFSET, LENGTH, ID_AT, N_AT, N2_AT, SLOT_AT = range(6)
TEMPLATE = 6
# A group's shape row: d_in, this actor's rows, their first column in the group's output.
D_IN, ROWS, COLUMN = range(3)
SHAPE = 3
MAX_SMALL = 127  # msgpack's positive fixint: a token count or slot patched as one byte
_CLOCK_MONOTONIC = 1
_EAGAIN = errno.EAGAIN  # a full doorbell pipe: the reader will wake anyway


# the addresses of the libc functions compiled code calls (the same for every lane of this process and for
# ``answer``, so looked up once), and the lane field that holds each
_LIBC = ctypes.CDLL(None)
LIBC = {
    name: ctypes.cast(getattr(_LIBC, name), ctypes.c_void_p).value
    for name in ("write", "__errno_location", "clock_gettime", "sched_yield")
}
_LIBC_AT = {WRITE: "write", ERRNO_AT: "__errno_location", CLOCK: "clock_gettime", YIELD: "sched_yield"}


def _patched(make: Callable[[int, int, int], Message]) -> tuple[bytes, list[int]]:
    """``make(id, n, slot)`` encoded at (FIRST_ID, 1, 0), and where its id, token count(s) and slot sit: found
    by encoding it again with each changed and comparing, then checked by decoding a patched copy."""
    base = encode(make(FIRST_ID, 1, 0))

    def changed(message: Message) -> list[int]:
        other = encode(message)
        if len(other) != len(base):
            raise RuntimeError(f"{message} does not encode to a header of fixed layout")
        return [i for i, (a, b) in enumerate(zip(base, other, strict=True)) if a != b]

    ids, counts, slots = (changed(make(*a)) for a in ((FIRST_ID + 1, 1, 0), (FIRST_ID, 2, 0), (FIRST_ID, 1, 1)))
    id_at = ids[0] - 7 if len(ids) == 1 else 0
    if len(ids) != 1 or base[id_at - 1] != 0xCF or len(slots) != 1 or not 1 <= len(counts) <= 2:
        raise RuntimeError(f"{make(FIRST_ID, 1, 0)} does not encode its id, token count and slot as expected")
    slot_at = slots[0]
    positions = [id_at, counts[0], counts[-1] if len(counts) == 2 else -1, slot_at]
    sample = _patch(base, positions, FIRST_ID + 0x0102030405, 3, 5)
    if decode(sample, len(sample)) != make(FIRST_ID + 0x0102030405, 3, 5):
        raise RuntimeError(f"a patched {type(make(FIRST_ID, 1, 0)).__name__} header does not decode as built")
    return base, positions


def _patch(header: bytes, positions: list[int], ident: int, n: int, slot: int) -> bytes:
    """What ``post`` and ``answered`` do to a template, in Python: to check a template once."""
    out = bytearray(header)
    id_at, n_at, n2_at, slot_at = positions
    out[id_at : id_at + 8] = ident.to_bytes(8, "big")
    out[n_at] = n
    if n2_at >= 0:
        out[n2_at] = n
    out[slot_at] = slot
    return bytes(out)


class LaneTemplates:
    """The headers of one connection's requests for every (layer, group) and of their replies, encoded once."""

    def __init__(
        self, num_layers: int, groups: Sequence[str], shapes: Sequence[tuple[int, int, int]], dtype: str
    ) -> None:
        chunks: list[bytes] = []
        at = 0

        def add(make: Callable[[int, int, int], Message]) -> list[int]:
            nonlocal at
            header, positions = _patched(make)
            chunks.append(header)
            row = [at, len(header), *positions]
            at += len(header)
            return row

        self.requests = np.array(
            [
                [
                    add(lambda i, n, s, L=layer, G=g, D=d_in: Compute(i, L, G, n, dtype, [n, D], s))
                    for g, (d_in, _, _) in zip(groups, shapes, strict=True)
                ]
                for layer in range(num_layers)
            ],
            np.int64,
        )
        self.replies = np.array(
            [add(lambda i, n, s, R=rows: Result(i, dtype, [n, R], s)) for _, rows, _ in shapes], np.int64
        )
        self.bytes = np.frombuffer(b"".join(chunks), np.uint8).copy()
        self.shapes = np.array(shapes, np.int64)
        self.groups = tuple(groups)
        self.key = (num_layers, self.groups, tuple(shapes), dtype)  # what the templates were made for


class SlotLane:
    """One leased slot of a same-host channel, laid out for ``post`` and ``answered`` (``fields``, at
    ``address``). ``Client.lease`` makes it and ``Client.end_lease`` gives the slot back; in between only
    compiled code and ``Client.wait_lane`` may use the slot."""

    def __init__(
        self,
        arena: SlotArena,
        slot: int,
        bell_fd: int,
        templates: LaneTemplates,
        next_id: int,
        spin_us: float,
        generation: int,
    ) -> None:
        if slot > MAX_SMALL:
            raise ValueError(f"slot {slot} does not fit a lane's one-byte patch")
        layout, base = arena.layout, arena.address
        self.slot, self.templates, self.generation = slot, templates, generation  # the client's connection
        self._wake = np.ones(1, np.uint8)
        self._done = arena.done
        self._timespec = np.zeros(2, np.int64)
        at = base + layout.slot_base(slot)  # the slot's flag, then its header lengths (shm.py's layout)
        f = self.fields = np.zeros(FIELDS, np.int64)
        f[SLOT], f[SLOTS], f[DONE_AT], f[LENGTHS_AT] = slot, layout.slots, at, at + 8
        f[X_AT], f[Y_AT] = at + layout.x_offset, at + layout.y_offset
        f[REQUEST_AT] = base + arena.header_offset(slot, REQUEST)
        f[RESULT_AT] = base + arena.header_offset(slot, RESULT)
        f[RING_AT], f[POSTED_AT] = base + layout.ring_offset, base
        f[FD], f[WAKE_AT], f[SPIN_NS] = bell_fd, self._wake.ctypes.data, int(spin_us * 1e3)
        f[TIMESPEC_AT] = self._timespec.ctypes.data
        for field, name in _LIBC_AT.items():
            f[field] = LIBC[name]
        f[BYTES_AT], f[REQUESTS_AT] = templates.bytes.ctypes.data, templates.requests.ctypes.data
        f[REPLIES_AT], f[SHAPES_AT] = templates.replies.ctypes.data, templates.shapes.ctypes.data
        f[GROUPS] = len(templates.groups)
        f[NEXT_ID] = next_id

    @property
    def address(self) -> int:
        return self.fields.ctypes.data

    def pending(self) -> bool:
        """Whether a request posted through this lane is still the server's (its slot must not be given back
        yet); a lane that posted nothing has none (serials start at 1)."""
        serial = int(self.fields[SERIAL])
        return serial != 0 and int(self._done[self.slot]) != serial

    def in_flight(self) -> Compute:
        """The request last posted, as ``Client`` would have built it (for the slow path's checks)."""
        f = self.fields
        g, n = int(f[GROUP]), int(f[TOKENS])
        d_in = int(self.templates.shapes[g, D_IN])
        return Compute(int(f[ID]), int(f[LAYER]), self.templates.groups[g], n, "float32", [n, d_in], self.slot)


@njit(inline="always", cache=True)
def _fields(lane_at):
    return numba.carray(I64_PTR(lane_at), FIELDS)


@njit(inline="always", cache=True)
def _template(table_at, index):
    return numba.carray(I64_PTR(table_at + 8 * TEMPLATE * index), TEMPLATE)


@njit(inline="always", cache=True)
def clock_ns(clock_at, timespec_at):
    """CLOCK_MONOTONIC in ns (what ``time.perf_counter`` reads), through libc's ``clock_gettime`` at
    ``clock_at`` into the two int64 at ``timespec_at``."""
    c_call(clock_at, _CLOCK_MONOTONIC, timespec_at)
    t = numba.carray(I64_PTR(timespec_at), 2)
    return t[0] * 1_000_000_000 + t[1]


@njit(cache=True)
def now_ns(lane_at):
    """``clock_ns`` with the lane's clock and buffer."""
    f = _fields(lane_at)
    return clock_ns(f[CLOCK], f[TIMESPEC_AT])


@njit(cache=True)
def post(lane_at, layer, g, x_at, n):
    """Group ``g``'s request at ``layer`` for x' [n, d_in] at ``x_at``: header and x' into the slot, then the
    slot published (ring, ``posted``: the release store) and the doorbell rung. 0, or the doorbell's errno
    (also in the lane's ERRNO) where it failed for another reason than being full."""
    f = _fields(lane_at)
    t = _template(f[REQUESTS_AT], layer * f[GROUPS] + g)
    header = numba.carray(U8_PTR(f[REQUEST_AT]), t[LENGTH])
    header[:] = numba.carray(U8_PTR(f[BYTES_AT] + t[OFFSET]), t[LENGTH])
    ident = f[NEXT_ID]
    f[NEXT_ID] = ident + 1
    for k in range(8):
        header[t[ID_AT] + k] = (ident >> (56 - 8 * k)) & 0xFF
    header[t[N_AT]] = n
    if t[N2_AT] >= 0:
        header[t[N2_AT]] = n
    header[t[SLOT_AT]] = f[SLOT]
    numba.carray(U32_PTR(f[LENGTHS_AT]), 2)[REQUEST] = t[LENGTH]
    size = n * numba.carray(I64_PTR(f[SHAPES_AT] + 8 * SHAPE * g), SHAPE)[D_IN]
    numba.carray(F32_PTR(f[X_AT]), size)[:] = numba.carray(F32_PTR(x_at), size)
    serial = load_acquire(f[POSTED_AT]) + 1
    numba.carray(U32_PTR(f[RING_AT]), f[SLOTS])[(serial - 1) % f[SLOTS]] = f[SLOT]
    store_release(f[POSTED_AT], serial)
    f[SERIAL], f[ID], f[LAYER], f[GROUP], f[TOKENS] = serial, ident, layer, g, n
    if c_call(f[WRITE], f[FD], f[WAKE_AT], 1) < 0:
        code = numba.carray(I32_PTR(c_call(f[ERRNO_AT])), 1)[0]
        if code != _EAGAIN:
            f[ERRNO] = code
            return code
    return 0


@njit(cache=True)
def answered(lane_at):
    """Whether the reply to the request in flight is in and is the expected ``Result``, after watching the
    slot's flag for at most the lane's spin (yielding the core at every turn, as ``SlotTransport.wait``)."""
    f = _fields(lane_at)
    if load_acquire(f[DONE_AT]) != f[SERIAL]:
        until = now_ns(lane_at) + f[SPIN_NS]
        while load_acquire(f[DONE_AT]) != f[SERIAL]:
            if now_ns(lane_at) > until:
                return False
            c_call(f[YIELD])
    t = _template(f[REPLIES_AT], f[GROUP])
    if numba.carray(U32_PTR(f[LENGTHS_AT]), 2)[RESULT] != t[LENGTH]:
        return False
    header = numba.carray(U8_PTR(f[RESULT_AT]), t[LENGTH])
    expected = numba.carray(U8_PTR(f[BYTES_AT] + t[OFFSET]), t[LENGTH])
    ident = f[ID]
    for i in range(t[LENGTH]):
        want = expected[i]
        if t[ID_AT] <= i < t[ID_AT] + 8:
            want = (ident >> (56 - 8 * (i - t[ID_AT]))) & 0xFF
        elif i == t[N_AT]:
            want = f[TOKENS]
        elif i == t[SLOT_AT]:
            want = f[SLOT]
        if header[i] != want:
            return False
    return True


@njit(inline="always", cache=True)
def reply(lane_at):
    """(address, rows, first column) of the reply's y_r [n, rows] in the slot, for the group in flight."""
    f = _fields(lane_at)
    shape = numba.carray(I64_PTR(f[SHAPES_AT] + 8 * SHAPE * f[GROUP]), SHAPE)
    return f[Y_AT], shape[ROWS], shape[COLUMN]
