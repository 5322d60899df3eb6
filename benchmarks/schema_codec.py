"""The protocol's header codec on the hot path: the schema's msgspec Structs as the shared-memory slots
carry them (``records``: encode into the slot's header area, decode from a view of it) and as a ZeroMQ
header frame carries them (``messages.encode`` / ``decode``), next to array-like Structs of the same fields
(a format the schema does not use: see ``benchmarks/README.md``).

    .venv/bin/python benchmarks/schema_codec.py

Per row, the time to build, encode, decode and validate one compute request and one result reply (what
each side of a slot hand-off does four times per layer per CPU actor), median of several repeats of many
loops, all in this process. Writes benchmarks/results/schema_codec.json; the run before the schema moved
to msgspec (hand-checked msgpack maps, and fixed ``struct`` records in the slots) stays under ``history``.
"""

from __future__ import annotations

import json
import os
import statistics
import timeit
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from splitspec.protocol import messages, records
from splitspec.protocol.messages import DTYPES, GROUPS, MAX_DIM, MAX_LAYERS, MAX_SLOTS, MAX_TOKENS, Compute, Result

RESULTS = Path(__file__).parent / "results"
LOOPS, REPEATS = 20_000, 7

Dim = Annotated[int, msgspec.Meta(gt=0, le=MAX_DIM)]


class ComputeArray(msgspec.Struct, tag="compute", array_like=True):
    """``messages.Compute``'s fields and limits, encoded as an array instead of a map."""

    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    layer: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    group: Literal[GROUPS]  # type: ignore[valid-type]
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[Dim, Dim]
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)] | None


class ResultArray(msgspec.Struct, tag="result", array_like=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[Dim, Dim]
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)] | None


def _median_us(fn) -> float:
    return statistics.median(t / LOOPS * 1e6 for t in timeit.repeat(fn, number=LOOPS, repeat=REPEATS))


def main() -> None:
    n, d_in, rows = 4, 576, 1536
    buffer = memoryview(bytearray(4096))  # a slot's header areas are a view of the mapped segment
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ComputeArray | ResultArray)

    def slot_headers() -> None:
        request = Compute(7, 3, "qkv", n, "float32", [n, d_in], 1)
        records.unpack_compute(buffer, 0, records.pack_compute(buffer, 0, request))
        reply = Result(7, "float32", [n, rows], 1)
        records.unpack_reply(buffer, 2048, records.pack_reply(buffer, 2048, reply, 2048), 1)

    def frame_headers() -> None:
        messages.decode(messages.encode(Compute(7, 3, "qkv", n, "float32", [n, d_in], 1)), 4096)
        messages.decode(messages.encode(Result(7, "float32", [n, rows], 1)), 4096)

    def array_like() -> None:
        decoder.decode(encoder.encode(ComputeArray(7, 3, "qkv", n, "float32", (n, d_in), 1)))
        decoder.decode(encoder.encode(ResultArray(7, "float32", (n, rows), 1)))

    for fn in (slot_headers, frame_headers, array_like):
        fn()  # each accepts the same valid pair
    rows_out = {name: _median_us(fn) for name, fn in [
        ("records_us", slot_headers),
        ("msgspec_us", frame_headers),
        ("msgspec_array_like_us", array_like),
    ]}  # fmt: skip
    previous = json.loads((RESULTS / "schema_codec.json").read_text())
    history = previous.get("history") or {k: v for k, v in previous.items() if k != "history"}
    out = {
        **rows_out,
        "what": "build + encode + decode + validate one compute request and one result reply",
        "msgspec_version": msgspec.__version__,
        "records_over_old_records": rows_out["records_us"] / history["struct_records_us"],
        "msgspec_over_old_msgpack": rows_out["msgspec_us"] / history["msgpack_headers_us"],
        "load_avg": os.getloadavg(),
        "history": history,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "schema_codec.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
