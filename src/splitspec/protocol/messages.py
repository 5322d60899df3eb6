"""The versioned schema spoken between the GPU actor (client) and a CPU actor (server).

Every message is a ``msgspec.Struct`` that travels as a msgpack map ``{"v": PROTOCOL_VERSION, "op": <name>,
<fields>}``, over ZeroMQ (the header frame; a payload, if any, is the next frame) and in a shared-memory
slot's header area (``records``) alike, so both transports share one schema and one validator. The types
carry the ranges (``msgspec.Meta``) and ``__post_init__`` the checks across fields, so decoding validates
in one compiled pass. A receiver trusts nothing: ``decode`` raises a ``ProtocolError`` whose code goes back
to the sender in an ``Error`` reply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from splitspec.protocol.refusals import ErrorCode, ProtocolError, refusal

__all__ = ["ErrorCode", "ProtocolError"]  # re-exported: the schema's callers import them from here

# 2: the lm_head group; 3: a group a layer type reshapes goes by a name of its own; 4: base_share (rows); 5:
# base_share by code words
PROTOCOL_VERSION = 5
DTYPES = ("float32",)
HEAD = "lm_head"  # a share of the lm_head's vocabulary rows: normed hidden states in, logits out (layer 0)
HEAD_TOKENS = 16  # the most rows one lm_head request carries: its logits fill a slot fast
# A request of a Linear group of at least this many rows (a prompt's) has the CPU actor's share of the 2-bit base
# product added into its reply (``ShardInfo.base_share``); fewer (a decode step's), the residual alone.
BASE_SHARE_TOKENS = 32
GROUPS = ("qkv", "o", "gate_up", "down", HEAD)
MAX_SLOTS = 256
SHM_ROOT = "/dev/shm"
SHM_PREFIX = "splitspec-"
MAX_TOKENS = 4096
MAX_DIM = 1 << 24
MAX_LAYERS = 1 << 16
# A client's first request id. From here msgpack spends 9 bytes on every id, so that all the headers of one
# (layer, group) share a layout and compiled code can patch their ids in place (``protocol.lane``).
FIRST_ID = 1 << 32
_MAX_TEXT = 400  # characters; an error reply must fit a shared-memory slot's header area


def request_tokens(group: str, max_tokens: int) -> int:
    """The most rows one request of ``group`` carries under the handshake's ``max_tokens``."""
    return min(max_tokens, HEAD_TOKENS) if group == HEAD else max_tokens


Id = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Layer = Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
Layers = Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Slots = Annotated[int, msgspec.Meta(ge=1, le=MAX_SLOTS)]
Slot = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
Dim = Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)]
Row = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
# a Linear group, or one a layer type reshapes ("qkv#1": Gemma 4's global layers, ``ConvertedModel.shard_keys``)
Group = Annotated[str, msgspec.Meta(pattern=f"^({'|'.join(GROUPS[:-1])})(#[1-9])?$|^{HEAD}$")]
Shape = Annotated[list[Dim], msgspec.Meta(min_length=2, max_length=2)]
ShardTriple = Annotated[list[Row], msgspec.Meta(min_length=3, max_length=3)]  # [d_in, row_start, row_stop]
Shards = Annotated[dict[Group, ShardTriple], msgspec.Meta(min_length=1)]
Share = Annotated[float, msgspec.Meta(ge=0, lt=1)]


class _Unversioned(int):
    """The type of ``Message.v``'s default. msgspec fills a field the header lacks with its default, and a
    header without a version must be refused like one of another version: decoding yields a plain ``int``
    for a version that was sent, so the default's own type says that none was."""


class _Versioned(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    """Carries the protocol version, keyword-only so that every message's own fields stay positional."""

    v: int = _Unversioned(PROTOCOL_VERSION)

    @property
    def OP(self) -> str:
        """The op is the Struct's tag: kept as an attribute, the name every caller reads it by."""
        return self.__struct_config__.tag


class Message(_Versioned):
    """Base of every message; ``id`` pairs a reply with its request (``None`` when it could not be read)."""

    id: Id | None


def _check_shards(shards: dict[str, list[int]]) -> None:
    for group, (d_in, start, stop) in shards.items():
        if not (d_in > 0 and start < stop):
            raise ValueError(f"shard of {group!r} = {[d_in, start, stop]} is not 0 < d_in and row_start < row_stop")


class Hello(Message, tag="hello"):
    """Client → server handshake. ``host_id`` is set when the client wants shared-memory slots."""

    model_hash: str
    dtype: Dtype
    max_tokens: Tokens
    slots: Slots
    host_id: str | None
    shards: Shards | None  # what the client's plan expects; None accepts the server's

    def __post_init__(self) -> None:
        if self.shards is not None:
            _check_shards(self.shards)


class Welcome(Message, tag="welcome"):
    """Server → client: what this CPU actor serves; ``shm_dir`` names the slots when granted.

    The client deletes ``shm_dir`` once attached, so it must be one of our own directories in /dev/shm.
    """

    model_hash: str
    num_layers: Layers
    dtype: Dtype
    shards: Shards
    shm_dir: str | None
    base_share: Share = 0.0  # ``ShardInfo.base_share``

    def __post_init__(self) -> None:
        _check_shards(self.shards)
        if self.shm_dir is not None:
            parent, name = os.path.split(self.shm_dir)
            if parent != SHM_ROOT or not name.startswith(SHM_PREFIX) or "/" in name or ".." in name:
                raise ValueError(f"shm_dir must be {SHM_ROOT}/{SHM_PREFIX}*, got {self.shm_dir!r}")


class Compute(Message, tag="compute"):
    """``out[n, rows] = R_group · x[n, d_in]`` at one layer; ``slot`` is None for an inline payload."""

    layer: Layer
    group: Group
    n: Tokens
    dtype: Dtype
    shape: Shape
    slot: Slot | None

    def __post_init__(self) -> None:
        if self.shape[0] != self.n:
            raise ValueError(f"shape must be [n={self.n}, d_in], got {self.shape}")


class Result(Message, tag="result"):
    """Reply to ``Compute``: ``out`` is in the slot, or in the frame after this header."""

    dtype: Dtype
    shape: Shape
    slot: Slot | None


class Error(Message, tag="error"):
    code: ErrorCode
    text: Annotated[str, msgspec.Meta(max_length=_MAX_TEXT)]


class Ping(Message, tag="ping"):
    pass


class Pong(Message, tag="pong"):
    """Reply to ``Ping``: liveness and the server's counters (requests, errors, compute seconds...)."""

    stats: dict[str, float]


class Shutdown(Message, tag="shutdown"):
    pass


class Bye(Message, tag="bye"):
    """Reply to ``Shutdown``, sent before the server closes."""


MESSAGES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls for cls in (Hello, Welcome, Compute, Result, Error, Ping, Pong, Shutdown, Bye)
}
_ENCODER = msgspec.msgpack.Encoder(enc_hook=int)  # ``int`` writes the default version (see ``_Unversioned``)
_DECODER = msgspec.msgpack.Decoder(Hello | Welcome | Compute | Result | Error | Ping | Pong | Shutdown | Bye)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes | memoryview, max_bytes: int) -> Message:
    """Parse and fully validate one header; raises ProtocolError with the code to reply with."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.OVERSIZED, f"header of {len(data)} bytes exceeds {max_bytes}")
    try:
        message = _DECODER.decode(data)
    # ValidationError included: ``refusal`` sorts them by cause. RecursionError: nesting too deep to decode,
    # met where msgspec skips a value before the op
    except (msgspec.DecodeError, RecursionError) as exc:
        raise refusal(data, exc, PROTOCOL_VERSION, MESSAGES) from None
    if type(message.v) is not int or message.v != PROTOCOL_VERSION:
        raise refusal(data, None, PROTOCOL_VERSION, MESSAGES)
    return message


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
    # the part of every Linear group's base (each of this actor's rows' last code words,
    # ``kernels.shard.base_share_from``) whose product it adds into its replies to requests of
    # ``BASE_SHARE_TOKENS`` rows or more
    base_share: float = 0.0


def shards_from_wire(wire: dict[str, list[int]]) -> dict[str, GroupShard]:
    return {group: GroupShard(*triple) for group, triple in wire.items()}


def shards_to_wire(shards: dict[str, GroupShard]) -> dict[str, list[int]]:
    return {group: shard.to_wire() for group, shard in shards.items()}
