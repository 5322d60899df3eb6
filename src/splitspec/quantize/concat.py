"""Join safetensors files into one, copying their bytes a tensor at a time.

A streamed conversion writes each layer's base and residual tensors to a file of their own as soon as the
layer is done, so RAM never holds more than a layer of them; the folder's format still wants one file per
role. The joined file is byte for byte what ``safetensors.torch.save_file`` writes for the union of the
parts (tensors ordered by dtype, widest first, then by name; a compact JSON header padded with spaces to
a multiple of eight bytes), so a conversion's bytes do not depend on how it was written.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from splitspec.models.files import safetensors_header

# The order of safetensors' Rust ``Dtype`` enum, which ``save_file`` sorts by (descending).
DTYPE_ORDER = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
ALIGN = 8
COPY_CHUNK = 1 << 24


class PartFiles:
    """Tensors written in pieces as they are made, joined at the end into one file per output name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        self.files: dict[str, list[Path]] = {}

    def add(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        files = self.files.setdefault(name, [])
        files.append(self.folder / f"{name}.{len(files)}")
        save_file({k: v.contiguous() for k, v in tensors.items()}, files[-1])

    def join(self, out: Path, metadata: dict[str, dict[str, str]]) -> None:
        """Write ``out / name`` for every name given pieces, with its ``metadata[name]``; drop the pieces."""
        for name, files in self.files.items():
            concat_safetensors(files, out / name, metadata[name])
        shutil.rmtree(self.folder)


def concat_safetensors(parts: list[Path], out: Path, metadata: dict[str, str]) -> None:
    """Write ``out`` holding every tensor of ``parts`` (names must not repeat) with ``metadata``."""
    entries: dict[str, tuple[Path, int, dict]] = {}
    for part in parts:
        header = safetensors_header(part)
        data_start = _data_start(part)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise ValueError(f"tensor {name} is in both {entries[name][0]} and {part}")
            if info["dtype"] not in DTYPE_ORDER:
                raise ValueError(f"{part}: tensor {name} has dtype {info['dtype']}, which concat does not order")
            entries[name] = (part, data_start, info)
    order = sorted(entries, key=lambda n: (-DTYPE_ORDER.index(entries[n][2]["dtype"]), n))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        info = entries[name][2]
        size = info["data_offsets"][1] - info["data_offsets"][0]
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % ALIGN)
    with out.open("wb") as dst:
        dst.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            part, data_start, info = entries[name]
            begin, end = info["data_offsets"]
            with part.open("rb") as src:
                src.seek(data_start + begin)
                _copy(src, dst, end - begin)


def _data_start(path: Path) -> int:
    with path.open("rb") as f:
        return ALIGN + struct.unpack("<Q", f.read(ALIGN))[0]


def _copy(src: BinaryIO, dst: BinaryIO, n: int) -> None:
    while n:
        chunk = src.read(min(n, COPY_CHUNK))
        if not chunk:
            raise ValueError(f"{src.name}: truncated safetensors data")
        dst.write(chunk)
        n -= len(chunk)
