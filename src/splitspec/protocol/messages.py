"""The versioned msgpack schema spoken between the GPU actor (client) and a CPU actor (server).

Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "op": <name>, <fields>}``. Both transports carry
the same messages: over ZeroMQ a header is the first frame (the payload, if any, is the second); in a
shared-memory slot, compute, result and error travel as fixed binary records of the same fields
(``records``), because msgpack costs too much on the per-layer path. A receiver trusts nothing: ``decode`` checks size,
version, op, that the field set is exact and every type, then the message's own ranges, and raises a
``ProtocolError`` whose code goes back to the sender in an ``Error`` reply.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import msgpack

PROTOCOL_VERSION = 1
DTYPES = ("float32",)
GROUPS = ("qkv", "o", "gate_up", "down")
MAX_SLOTS = 256
SHM_ROOT = "/dev/shm"
SHM_PREFIX = "splitspec-"
MAX_TOKENS = 4096
MAX_DIM = 1 << 24
MAX_LAYERS = 1 << 16
_MAX_TEXT = 400  # characters; a result header must fit a shared-memory slot's header area


class ErrorCode(IntEnum):
    MALFORMED = 1  # not msgpack, not a map, a missing, extra or mistyped field
    OVERSIZED = 2  # header or payload larger than the receiver accepts
    WRONG_VERSION = 3
    UNKNOWN_OP = 4
    INVALID = 5  # well-formed but out of range or inconsistent with the session
    MISMATCH = 6  # handshake: model hash, dtype or shard ranges differ
    NO_SESSION = 7  # compute before a handshake
    COMPUTE_FAILED = 8  # the CPU actor's kernel raised


class ProtocolError(Exception):
    """A request this side refuses, with the code to reply with; ``request_id`` is echoed when readable."""

    def __init__(self, code: ErrorCode, text: str, request_id: int | None = None) -> None:
        super().__init__(f"{code.name}: {text}")
        self.code = code
        self.text = text
        self.request_id = request_id


@dataclass(frozen=True)
class GroupShard:
    """The rows ``[row_start, row_stop)`` of one Linear group that a CPU actor owns, and its input width."""

    d_in: int
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    def to_wire(self) -> list[int]:
        return [self.d_in, self.row_start, self.row_stop]


@dataclass(frozen=True)
class ShardInfo:
    """What a CPU actor serves; the handshake compares it with what the GPU actor expects."""

    model_hash: str
    num_layers: int
    shards: dict[str, GroupShard]
    dtype: str = "float32"


def shards_from_wire(wire: dict[str, list[int]]) -> dict[str, GroupShard]:
    return {group: GroupShard(*triple) for group, triple in wire.items()}


def shards_to_wire(shards: dict[str, GroupShard]) -> dict[str, list[int]]:
    return {group: shard.to_wire() for group, shard in shards.items()}


def _check_shards(wire: dict[str, list[int]]) -> None:
    if not wire:
        raise ValueError("shards must name at least one group")
    for group, triple in wire.items():
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}; groups are {GROUPS}")
        if len(triple) != 3:
            raise ValueError(f"shard of {group!r} must be [d_in, row_start, row_stop], got {triple}")
        d_in, start, stop = triple
        if not (0 < d_in <= MAX_DIM and 0 <= start < stop <= MAX_DIM):
            raise ValueError(f"shard of {group!r} = {triple} is not 0 < d_in and 0 <= row_start < row_stop")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {DTYPES}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(slots=True)
class Message:
    """Base of every message; ``id`` pairs a reply with its request (``None`` when it could not be read).

    Messages are slotted, not frozen: a frozen dataclass costs ~1 µs more to build, and compute / result
    are built on the per-layer path. Subclasses call ``Message.check(self)``: zero-argument ``super()``
    fails in a slotted dataclass's methods on Python 3.11.
    """

    OP: ClassVar[str] = ""
    id: int | None

    def check(self) -> None:
        """Range checks beyond types; raises ValueError with a sentence a user can act on."""
        if self.id is not None:
            _check_range("id", self.id, 0, 2**63 - 1)


@dataclass(slots=True)
class Hello(Message):
    """Client → server handshake. ``host_id`` is set when the client wants shared-memory slots."""

    OP: ClassVar[str] = "hello"
    model_hash: str
    dtype: str
    max_tokens: int
    slots: int
    host_id: str | None
    shards: dict[str, list[int]] | None  # what the client's plan expects; None accepts the server's

    def check(self) -> None:
        Message.check(self)
        _check_dtype(self.dtype)
        _check_range("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        _check_range("slots", self.slots, 1, MAX_SLOTS)
        if self.shards is not None:
            _check_shards(self.shards)


@dataclass(slots=True)
class Welcome(Message):
    """Server → client: what this CPU actor serves; ``shm_dir`` names the slots when granted.

    The client deletes ``shm_dir`` once attached, so it must be one of our own directories in /dev/shm.
    """

    OP: ClassVar[str] = "welcome"
    model_hash: str
    num_layers: int
    dtype: str
    shards: dict[str, list[int]]
    shm_dir: str | None

    def check(self) -> None:
        Message.check(self)
        _check_dtype(self.dtype)
        _check_range("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_shards(self.shards)
        if self.shm_dir is not None:
            parent, name = os.path.split(self.shm_dir)
            if parent != SHM_ROOT or not name.startswith(SHM_PREFIX) or "/" in name or ".." in name:
                raise ValueError(f"shm_dir must be {SHM_ROOT}/{SHM_PREFIX}*, got {self.shm_dir!r}")


@dataclass(slots=True)
class Compute(Message):
    """``out[n, rows] = R_group · x[n, d_in]`` at one layer; ``slot`` is None for an inline payload."""

    OP: ClassVar[str] = "compute"
    layer: int
    group: str
    n: int
    dtype: str
    shape: list[int]
    slot: int | None

    def check(self) -> None:
        Message.check(self)
        _check_dtype(self.dtype)
        _check_range("layer", self.layer, 0, MAX_LAYERS)
        if self.group not in GROUPS:
            raise ValueError(f"unknown group {self.group!r}; groups are {GROUPS}")
        _check_range("n", self.n, 1, MAX_TOKENS)
        if len(self.shape) != 2 or self.shape[0] != self.n or not 0 < self.shape[1] <= MAX_DIM:
            raise ValueError(f"shape must be [n={self.n}, d_in > 0], got {self.shape}")
        if self.slot is not None:
            _check_range("slot", self.slot, 0, MAX_SLOTS - 1)


@dataclass(slots=True)
class Result(Message):
    """Reply to ``Compute``: ``out`` is in the slot, or in the frame after this header."""

    OP: ClassVar[str] = "result"
    dtype: str
    shape: list[int]
    slot: int | None

    def check(self) -> None:
        Message.check(self)
        _check_dtype(self.dtype)
        if len(self.shape) != 2 or not all(0 < s <= MAX_DIM for s in self.shape):
            raise ValueError(f"shape must be [n, rows], both > 0, got {self.shape}")


@dataclass(slots=True)
class Error(Message):
    OP: ClassVar[str] = "error"
    code: int
    text: str

    def check(self) -> None:
        Message.check(self)
        ErrorCode(self.code)  # ValueError names the unknown code
        if len(self.text) > _MAX_TEXT:
            raise ValueError(f"error text is limited to {_MAX_TEXT} characters")


@dataclass(slots=True)
class Ping(Message):
    OP: ClassVar[str] = "ping"


@dataclass(slots=True)
class Pong(Message):
    """Reply to ``Ping``: liveness and the server's counters (requests, errors, compute seconds...)."""

    OP: ClassVar[str] = "pong"
    stats: dict[str, float]


@dataclass(slots=True)
class Shutdown(Message):
    OP: ClassVar[str] = "shutdown"


@dataclass(slots=True)
class Bye(Message):
    """Reply to ``Shutdown``, sent before the server closes."""

    OP: ClassVar[str] = "bye"


MESSAGES: dict[str, type[Message]] = {
    cls.OP: cls for cls in (Hello, Welcome, Compute, Result, Error, Ping, Pong, Shutdown, Bye)
}


def _type_check(hint: Any) -> Callable[[Any], bool]:
    """Compile a field's annotation into a predicate once, so decoding a header stays a few µs."""
    # msgpack yields exact builtin types, so ``type(v) is int`` is right (and rejects bools).
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner,) = (_type_check(arg) for arg in get_args(hint) if arg is not type(None))
        return lambda v: v is None or inner(v)
    if origin is list:
        item = _type_check(get_args(hint)[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict:
        key, value = (_type_check(arg) for arg in get_args(hint))
        return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    return lambda v: type(v) is hint


_FIELDS: dict[type[Message], dict[str, Callable[[Any], bool]]] = {
    cls: {f.name: _type_check(get_type_hints(cls)[f.name]) for f in fields(cls)} for cls in MESSAGES.values()
}


def encode(message: Message) -> bytes:
    fields_ = {name: getattr(message, name) for name in _FIELDS[type(message)]}
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": message.OP, **fields_})


def decode(data: bytes | memoryview, max_bytes: int) -> Message:
    """Parse and fully validate one header; raises ProtocolError with the code to reply with."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.OVERSIZED, f"header of {len(data)} bytes exceeds {max_bytes}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for garbage; all mean the same here
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack header: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"header must be a map, got {type(raw).__name__}")
    request_id = raw.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < 2**63:
        request_id = None
    version = raw.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION,
            f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}: run the same splitspec "
            "version on both actors",
            request_id,
        )
    cls = MESSAGES.get(raw.pop("op", None))
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op; known ops are {sorted(MESSAGES)}", request_id)
    checks = _FIELDS[cls]
    if raw.keys() != checks.keys():
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"{cls.OP} needs exactly the fields {sorted(checks)}, got {sorted(map(str, raw))}",
            request_id,
        )
    for name, ok in checks.items():
        if not ok(raw[name]):
            raise ProtocolError(
                ErrorCode.MALFORMED, f"{cls.OP}.{name} has the wrong type: {raw[name]!r:.80}", request_id
            )
    message = cls(**raw)
    try:
        message.check()
    except ValueError as exc:
        raise ProtocolError(ErrorCode.INVALID, f"{cls.OP}: {exc}", request_id) from None
    return message
