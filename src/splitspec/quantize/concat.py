"""Join safetensors files into one, copying their bytes a tensor at a time.

A streamed conversion writes each layer's base and residual tensors to files of their own as soon as they
are made, so RAM never holds more than a group of them; the folder's format still wants one file per role.
The joined file is byte for byte what ``safetensors.torch.save_file`` writes for the union of the parts
(tensors ordered by dtype, widest first, then by name; a compact JSON header padded with spaces to a
multiple of eight bytes), so a conversion's bytes do not depend on how it was written. ``save_tensors``
writes that same layout straight from the tensors' memory: ``save_file`` first copies every tensor into a
bytes object, a second copy of a float32 embedding that may be gigabytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from splitspec.models.files import safetensors_header

# The order of safetensors' Rust ``Dtype`` enum, which ``save_file`` sorts by (descending).
DTYPE_ORDER = ("BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
TORCH_DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}  # fmt: skip
ALIGN = 8
COPY_CHUNK = 1 << 24


class PartFiles:
    """Tensors written in pieces as they are made, joined at the end into one file per output name.

    A piece is ``folder / name / key``; the pieces are found again by listing the folder, so a resumed
    conversion joins what an interrupted process wrote, and a piece written again under its key replaces
    the old one. A piece only appears under its key once it is whole (written beside it, then renamed).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        (self.folder / name).mkdir(exist_ok=True)
        save_tensors(tensors, self.folder / name / key)

    def discard(self, drop: Callable[[str], bool]) -> None:
        """Remove every piece whose key ``drop`` selects (an unfinished layer's), and any half-written one."""
        for piece in self.folder.glob("*/*"):
            if piece.name.startswith(".") or drop(piece.name):
                piece.unlink()

    def join(self, out: Path, metadata: dict[str, dict[str, str]]) -> None:
        """Write ``out / name`` for every name given pieces, with its ``metadata[name]``, and drop that name's
        pieces as soon as its file is whole: the disk holds a name's pieces and its file at once only while
        it is joined. A name an interrupted run joined already has its file in ``out``, whole (it appears
        only so): the pieces a run killed while removing them left are dropped, not joined over it."""
        for folder in sorted(p for p in self.folder.iterdir() if p.is_dir()):
            if not (out / folder.name).exists():
                concat_safetensors(sorted(folder.iterdir()), out / folder.name, metadata[folder.name])
            shutil.rmtree(folder)
        shutil.rmtree(self.folder)


@contextlib.contextmanager
def whole_file(path: Path) -> Iterator[BinaryIO]:
    """A file written beside ``path`` that appears under it only once whole; a write that fails (a full
    disk) leaves nothing behind, so that the space it took is free again."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as f:
            yield f
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a write's error names no file: name the one it was for
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write what ``save_file(tensors, path, metadata)`` writes, without its copy of the data; the file
    appears under ``path`` only once it is whole."""
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    entries = {
        name: {"dtype": TORCH_DTYPES[t.dtype], "shape": list(t.shape), "size": t.numel() * t.element_size()}
        for name, t in tensors.items()
    }
    head, order = _header(entries, metadata)
    with whole_file(path) as dst:
        dst.write(head)
        for name in order:
            if tensors[name].numel():
                dst.write(tensors[name].reshape(-1).view(torch.uint8).numpy())


def concat_safetensors(parts: list[Path], out: Path, metadata: dict[str, str]) -> None:
    """Write ``out`` holding every tensor of ``parts`` (names must not repeat) with ``metadata``."""
    entries: dict[str, dict[str, Any]] = {}
    for part in parts:
        header = safetensors_header(part)
        data_start = _data_start(part)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise ValueError(f"tensor {name} is in both {entries[name]['part']} and {part}")
            if info["dtype"] not in DTYPE_ORDER:
                raise ValueError(f"{part}: tensor {name} has dtype {info['dtype']}, which concat does not order")
            begin, end = info["data_offsets"]
            entries[name] = {"dtype": info["dtype"], "shape": info["shape"], "size": end - begin}
            entries[name] |= {"part": part, "begin": data_start + begin}
    head, order = _header(entries, metadata)
    with whole_file(out) as dst:
        dst.write(head)
        for name in order:
            with entries[name]["part"].open("rb") as src:
                src.seek(entries[name]["begin"])
                _copy(src, dst, entries[name]["size"])


def _header(entries: dict[str, dict[str, Any]], metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The length-prefixed header of ``entries`` ({dtype, shape, size} by name) and the order of the data."""
    order = sorted(entries, key=lambda n: (-DTYPE_ORDER.index(entries[n]["dtype"]), n))
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in order:
        info = entries[name]
        header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + info["size"]]}
        offset += info["size"]
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, order


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
