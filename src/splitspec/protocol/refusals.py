"""Why a header was refused, told to the peer the way every splitspec version tells it.

The schema's decoder (``messages.decode``) answers accept or refuse in one compiled pass; only a refused
header comes here, where it is read again untyped to say why, in the order a peer of another version needs:
undecodable, then the protocol version, then the op, then the field, split into malformed (missing, extra
or mistyped) and invalid (out of range or inconsistent).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import IntEnum
from typing import Any

import msgspec


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

    def __reduce__(self) -> tuple:  # rebuilt from its own arguments where it crosses Ray or a process pool
        return type(self), (self.code, self.text, self.request_id)


_WHERE = re.compile(r"^(?P<what>.*?)(?: - at (?P<where>.*))?$", re.DOTALL)
_WRONG_TYPE = re.compile(r"Expected `[^`]+`, got `")
_BOUND = re.compile(r"Expected `[^`]+` (?P<bound>.*)")
_ENUM = re.compile(r"Invalid enum value (?P<value>.*)")
_FIELD = re.compile(r"\$\.(?P<field>\w+)")


def refusal(
    data: bytes | memoryview,
    error: msgspec.DecodeError | RecursionError | None,
    version: int,
    ops: Mapping[str, type[Any]],
) -> ProtocolError:
    """The ``ProtocolError`` for a header the schema refused with ``error``, or (``error`` None) accepted
    but whose version is not ``version``; ``ops`` maps each op to its message type."""
    try:
        raw = msgspec.msgpack.decode(data)
    # TypeError: a map key that cannot be hashed; RecursionError: nesting deeper than msgspec decodes
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError) as exc:
        return ProtocolError(ErrorCode.MALFORMED, f"not a msgpack header: {exc}")
    if not isinstance(raw, dict):
        return ProtocolError(ErrorCode.MALFORMED, f"header must be a map, got {type(raw).__name__}")
    rid = raw.get("id")
    if type(rid) is not int or not 0 <= rid < 2**63:
        rid = None
    sent = raw.get("v")
    if type(sent) is not int or sent != version:
        return ProtocolError(
            ErrorCode.WRONG_VERSION,
            f"protocol version {sent!r}, this side speaks {version}: run the same splitspec version on both actors",
            rid,
        )
    op = raw.get("op")
    if not isinstance(op, str) or op not in ops:
        return ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op; known ops are {sorted(ops)}", rid)
    match = _WHERE.match(str(error))
    what, where = match["what"], (match["where"] or "").replace("`", "")
    name = where.replace("key in $", "key of $").replace("$.", "").replace(" of $", "")
    if "required field" in what or "unknown field" in what:
        expected = sorted(set(ops[op].__struct_fields__) - {"v"})
        got = sorted(str(key) for key in raw if key not in ("v", "op"))
        return ProtocolError(ErrorCode.MALFORMED, f"{op} needs exactly the fields {expected}, got {got}", rid)
    field = _FIELD.search(where)
    value = raw.get(field["field"]) if field else None
    if _WRONG_TYPE.match(what):
        return ProtocolError(ErrorCode.MALFORMED, f"{op}.{name} has the wrong type: {value!r:.80}", rid)
    return ProtocolError(ErrorCode.INVALID, f"{op}: {_explain(what, name, value)}", rid)


def _explain(what: str, name: str, value: object) -> str:
    """msgspec's reason for an out-of-range value, in the words of a range a user can act on."""
    if what.startswith("Expected `str` matching regex"):  # a name outside a closed set (a Linear group's)
        return f"unknown {name} {value!r:.80}: not supported by this side"
    if bound := _BOUND.match(what):
        return f"{name} must be {bound['bound']}, got {value!r:.80}"
    if enum := _ENUM.match(what):
        return f"unknown {name} {enum['value']}: not supported by this side"
    return what  # a message's own cross-field check already says what is wrong
