"""Cheap integrity checks of weight files, so a bad file fails at the door with its name.

A truncated safetensors or GGUF file otherwise fails deep inside a library with an error that names
neither the file nor the problem, or worse, loads garbage through a memory map.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


class CorruptFileError(ValueError):
    """A weight or converted-model file is unreadable, truncated or inconsistent."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def safetensors_header(path: Path | str) -> dict:
    """Parse and bounds-check a safetensors header without reading the tensor data."""
    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(path, "file not found")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFileError(path, f"truncated: {size} bytes, not even a safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CorruptFileError(path, f"truncated or not safetensors: header claims {n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFileError(path, f"corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CorruptFileError(path, "corrupt safetensors header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            raise CorruptFileError(path, f"corrupt safetensors header entry {name!r}") from None
    if 8 + n + end > size:
        raise CorruptFileError(
            path, f"truncated: tensors need {8 + n + end} bytes, the file has {size}; re-create the file"
        )
    return header


def check_gguf(path: Path | str) -> None:
    """Parse a GGUF file's metadata and tensor table; a short or foreign file raises CorruptFileError."""
    import gguf  # imported here: only GGUF sources need it

    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(path, "file not found")
    try:
        gguf.GGUFReader(path)
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise CorruptFileError(path, f"not a readable GGUF file, truncated or corrupt ({e})") from None


def sha256_file(path: Path | str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
