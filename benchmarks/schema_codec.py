"""The protocol's header codecs on the hot path: msgpack with hand-written checks (``messages``), fixed
``struct`` records (``records``, the shared-memory path), and ``msgspec`` typed Structs (validated msgpack
decoding: one schema that could serve both, if it were no slower than the records).

    .venv/bin/python benchmarks/schema_codec.py      # needs msgspec: pip install msgspec (the bench extra)

Per codec, the time to build, encode, decode and validate one compute request and one result reply (what
each side of a slot hand-off does four times per layer per CPU actor), median of several repeats of many
loops, all in this process. Writes benchmarks/results/schema_codec.json.
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
from splitspec.protocol.messages import DTYPES, GROUPS, MAX_DIM, MAX_LAYERS, MAX_SLOTS, MAX_TOKENS

RESULTS = Path(__file__).parent / "results"
LOOPS, REPEATS = 20_000, 7

Dim = Annotated[int, msgspec.Meta(gt=0, le=MAX_DIM)]


class ComputeS(msgspec.Struct, tag="compute", array_like=True):
    """``messages.Compute``'s fields and range checks as msgspec constraints (decoding validates them)."""

    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    layer: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    group: Literal[GROUPS]  # type: ignore[valid-type]
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[Dim, Dim]
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)] | None


class ResultS(msgspec.Struct, tag="result", array_like=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[Dim, Dim]
    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)] | None


def _median_us(fn) -> float:
    return statistics.median(t / LOOPS * 1e6 for t in timeit.repeat(fn, number=LOOPS, repeat=REPEATS))


def main() -> None:
    n, d_in, rows = 4, 576, 1536
    buffer = bytearray(4096)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ComputeS | ResultS)

    def msgpack_headers() -> None:
        request = messages.Compute(7, 3, "qkv", n, "float32", [n, d_in], 1)
        messages.decode(messages.encode(request), 4096)
        messages.decode(messages.encode(messages.Result(7, "float32", [n, rows], 1)), 4096)

    def struct_records() -> None:
        request = messages.Compute(7, 3, "qkv", n, "float32", [n, d_in], 1)
        records.unpack_compute(buffer, 0, records.pack_compute(buffer, 0, request))
        reply = messages.Result(7, "float32", [n, rows], 1)
        records.unpack_reply(buffer, 64, records.pack_reply(buffer, 64, reply, 512), 1)

    def msgspec_structs() -> None:
        decoder.decode(encoder.encode(ComputeS(7, 3, "qkv", n, "float32", (n, d_in), 1)))
        decoder.decode(encoder.encode(ResultS(7, "float32", (n, rows), 1)))

    for fn in (msgpack_headers, struct_records, msgspec_structs):
        fn()  # the codecs agree on what is valid: each accepts the same pair
    try:
        decoder.decode(encoder.encode(ComputeS(7, 3, "qkv", n, "float32", (n, MAX_DIM + 1), 1)))
        raise SystemExit("msgspec accepted an out-of-range shape: the schema above is wrong")
    except msgspec.ValidationError:
        pass
    rows_out = {name: _median_us(fn) for name, fn in [
        ("msgpack_headers_us", msgpack_headers),
        ("struct_records_us", struct_records),
        ("msgspec_structs_us", msgspec_structs),
    ]}  # fmt: skip
    out = {
        **rows_out,
        "what": "build + encode + decode + validate one compute request and one result reply",
        "msgspec_version": msgspec.__version__,
        "msgspec_over_records": rows_out["msgspec_structs_us"] / rows_out["struct_records_us"],
        "adopt_msgspec": rows_out["msgspec_structs_us"] <= rows_out["struct_records_us"],
        "load_avg": os.getloadavg(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "schema_codec.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
