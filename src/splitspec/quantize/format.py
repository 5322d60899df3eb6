"""The converted-model folder: the contract between the converter, the GPU actor and the CPU actors.

Every writer and reader imports this module; nothing else knows a tensor name or a file name.

A converted folder holds::

    manifest.json            versioned; source model + hash, rotation kind, seeds, dims, bits, levels, files
    config.json, tokenizer*  copied from the source (the engine's forward pass reads config.json)
    dense.safetensors        float32 embeddings, norms, lm_head (if untied), biases: HF names
    base.safetensors         the 2-bit base of every decoder Linear group (the GPU actor's half)
    residual{b}.safetensors  the b-bit residual for b in 6/7/8 (the CPU actors' half), one per width; the
                             manifest may widen some groups of the 6-bit one (its "widths")
    tree_stats.json          the draft's rank statistics p_d(r) (``splitspec fit-tree``; format 5 on)

Tensors are per Linear *group* of each decoder layer (qkv, o, gate_up, down): the group's Linears'
output rows concatenated in the order of ``ArchSpec``, all in the rotated basis
(W~ = H_o·S_o·W·S_i·H_iᵀ, one S_i per group, one S_o per Linear; the signs are regenerated from the
seeds recorded in the manifest, see ``hadamard.random_signs``; H is of the manifest's ``rotation`` kind,
see ``hadamard``):

- ``layers.{i}.{group}.base.codes``: int32 ``[rows, d_in/32, 2]``: two bit planes of the 2-bit codes;
  bit j of ``codes[r, w, p]`` is bit p of the code of column 32·w + j. Code c in 0..3 stands for
  ``levels[c]`` (sorted), times the scale. d_in must be a multiple of 32.
- ``layers.{i}.{group}.base.scale``: float16 ``[rows, G]``, one per (row, 128-column group).
- ``layers.{i}.{group}.resid.{plane}``: the residual in 16-row tiles (rows padded to a multiple of
  16), laid out as ``quantize.packing`` documents: planes ``words0``-``words2`` (the 6/7/8-bit codes in
  uint16 words, one layout for every width), ``scale`` and ``scale_top``; any whole-tile slice is one
  contiguous byte range, so a CPU actor reads its rows with ``safetensors`` slices and no repacking. A
  group's planes are of the width ``residual_width(bits, layer, group)`` says: ``bits`` but where the
  manifest's ``residuals["6"]["widths"]`` stores a 6-bit residual's group at 7 or 8 bits (mixed widths).

Format versions: 2 added the manifest's ``rotation``; a version-1 folder has none and means
``"sylvester"``, the only kind there was (the bump makes an older reader refuse a kronecker folder
instead of rotating it the wrong way). 3 stored the 6/7-bit residual codes in uint16 words instead of bit
planes; 4 stores the codes of every width, 8 bits included, in ``packing``'s current words layout (its
"pair map"). This reader refuses every residual of a folder older than 4 (re-convert it) and still reads
its base and dense tensors, which did not change. 5 adds ``tree_stats.json``: the rank statistics of
this conversion's draft against its verifier (recipe, section 6), fitted after the conversion and kept
outside the manifest's checksummed files so that a refit does not rewrite the manifest; the file carries
the conversion id and is refused if it belongs to another conversion. An older folder has none: fit one
with ``splitspec fit-tree``. 6 stores the residual's scales as bytes relative to a power-of-two top per
tile (``packing``) instead of fp16, and adds the 6-bit residual's ``widths``; this reader refuses the
residuals of older folders (re-convert them) and reads their base and dense tensors.

``tree_stats.json`` has a version of its own (``TREE_STATS_VERSION``, its ``version`` field; a file with
none is 1), since a refit rewrites it in a folder of any format: 2 adds ``ngram``, the draft copied from the
text replayed over the same continuations (``cost.NgramStats``). A version-1 file still loads; the cost
model then weighs only the 2-bit drafts until ``splitspec fit-tree`` is run again.

Each safetensors file's ``__metadata__["splitspec"]`` holds JSON {format_version, conversion_id, role}: a file from
another conversion or of the wrong role is refused, as is a file whose size differs from the manifest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.config import group_key, shape_keys
from splitspec.models.files import CorruptFileError, safetensors_header, sha256_file
from splitspec.models.spec import ArchSpec, GroupSpec, arch_spec
from splitspec.quantize import packing
from splitspec.quantize.hadamard import SYLVESTER, check_rotation, random_signs

FORMAT_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
RESIDUAL_LAYOUT_VERSION = 6  # the first version whose residuals, all bits, are in packing's current layout
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
BASE_FILE = "base.safetensors"
TREE_STATS_FILE = "tree_stats.json"
TREE_STATS_VERSION = 2
GROUP = packing.GROUP  # one scale per 128 columns, for the base as for the residual
CODE_WORD = 32  # columns per int32 word of a 2-bit bit plane


def residual_file(bits: int) -> str:
    return f"residual{bits}.safetensors"


def base_name(layer: int, group: str, part: str) -> str:
    return f"layers.{layer}.{group}.base.{part}"


def resid_name(layer: int, group: str, plane: str) -> str:
    return f"layers.{layer}.{group}.resid.{plane}"


def conversion_id(source_sha256: str, config_sha256: str, levels: list[float], settings: dict[str, Any]) -> str:
    """Identifies one conversion: every file of the folder must carry the same id, and caches keyed by it
    (CPU actor shards) must not take another conversion's bytes, so it covers all that the bytes depend on:
    the source's weights and config.json, the fitted levels, and ``settings``, every setting that changes
    them (``convert.written_settings``). Readers compare the id a folder stores and never recompute it, so
    what it covers may grow without a format version."""
    key = json.dumps([source_sha256, config_sha256, levels, settings], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def file_metadata(cid: str, role: str) -> dict[str, str]:
    """One key: safetensors writes a multi-key metadata map in hash order, which breaks byte determinism."""
    return {"splitspec": json.dumps({"format_version": FORMAT_VERSION, "conversion_id": cid, "role": role})}


def read_file_metadata(header: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(header.get("__metadata__", {}).get("splitspec", "{}"))
    except json.JSONDecodeError:
        return {}


# --------------------------------------------------------------------------- 2-bit base codes


def pack_base_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..3 ``[rows, d_in]`` -> int32 bit planes ``[rows, d_in/32, 2]``."""
    rows, d_in = codes.shape
    if d_in % CODE_WORD:
        raise ValueError(f"the 2-bit base needs d_in to be a multiple of {CODE_WORD}, got {d_in}")
    c = codes.to(torch.int64).reshape(rows, d_in // CODE_WORD, CODE_WORD)
    weights = torch.ones(CODE_WORD, dtype=torch.int64) << torch.arange(CODE_WORD)
    planes = torch.stack([((c >> p) & 1) @ weights for p in (0, 1)], dim=-1)
    return torch.from_numpy(planes.numpy().astype(np.uint32).view(np.int32))


def unpack_base_codes(planes: torch.Tensor) -> torch.Tensor:
    """int32 bit planes ``[rows, d_in/32, 2]`` -> uint8 codes ``[rows, d_in]``."""
    rows, words, _ = planes.shape
    p = planes.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(CODE_WORD)
    lo = (p[..., 0, None] >> shifts) & 1
    hi = (p[..., 1, None] >> shifts) & 1
    return (lo | (hi << 1)).reshape(rows, words * CODE_WORD).to(torch.uint8)


def dequantize_base(planes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Q_base in the rotated basis, float32 ``[rows, d_in]``: the reference the kernels are tested against."""
    codes = unpack_base_codes(planes).long()
    d_in = codes.shape[1]
    s = scale.float().repeat_interleave(GROUP, dim=1)[:, :d_in]
    return levels.float()[codes] * s


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class GroupLayout:
    """One Linear group of one layer as stored: dims, seeds and where each Linear's rows are."""

    layer: int
    name: str
    d_in: int
    rows: int
    input_seed: int
    linears: tuple[dict[str, Any], ...]  # {"name", "rows", "row_offset", "output_seed"}

    @property
    def padded_rows(self) -> int:
        return packing.num_tiles(self.rows) * packing.TILE

    def signs(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(S_i shared by the group, [S_o of each Linear]) as float32 ±1 vectors."""
        s_i = random_signs(self.input_seed, self.d_in)
        return s_i, [random_signs(lin["output_seed"], lin["rows"]) for lin in self.linears]

    def to_json(self) -> dict[str, Any]:
        return {"d_in": self.d_in, "rows": self.rows, "input_seed": self.input_seed, "linears": list(self.linears)}


def group_layout(layer: int, group: GroupSpec, input_seed: int, output_seeds: list[int]) -> GroupLayout:
    linears = tuple(
        {"name": lin.name, "rows": lin.d_out, "row_offset": off, "output_seed": seed}
        for lin, off, seed in zip(group.linears, group.row_offsets(), output_seeds, strict=True)
    )
    return GroupLayout(layer, group.name, group.d_in, group.d_out, input_seed, linears)


def _require(cond: bool, path: Path, problem: str) -> None:
    if not cond:
        raise CorruptFileError(path, problem)


def folder_spec(folder: str | Path, layers: int | None = None) -> ArchSpec:
    """The spec of a converted folder's model from its config.json alone (no manifest read), with
    ``layers`` decoder layers where the folder holds fewer than the config names."""
    from transformers import AutoConfig

    config_path = Path(folder) / "config.json"
    _require(config_path.is_file(), config_path, "missing from the converted folder")
    config = AutoConfig.from_pretrained(folder)
    if layers is not None:
        config.num_hidden_layers = layers
    return arch_spec(config)


class ConvertedModel:
    """A validated converted folder. Opening checks the manifest and every file's header and size
    (cheap); ``verify=True`` also checks each file's sha256 (reads everything)."""

    def __init__(self, folder: str | Path, verify: bool = False) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        _require(path.is_file(), path, "missing: not a splitspec converted folder (run `splitspec convert`)")
        try:
            m = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptFileError(path, f"not valid JSON ({e})") from None
        _require(isinstance(m, dict) and m.get("format") == "splitspec", path, "not a splitspec manifest")
        version = m.get("format_version")
        _require(
            version in READABLE_VERSIONS,
            path,
            f"format_version {version!r}, this splitspec reads {', '.join(map(str, READABLE_VERSIONS))}: "
            "re-convert the model",
        )
        _require(
            version == 1 or "rotation" in m,
            path,
            "no rotation kind, which every folder from format 2 on records: corrupt, re-convert the model",
        )
        try:
            self.rotation: str = check_rotation(m.get("rotation", SYLVESTER))
        except ValueError as e:
            raise CorruptFileError(path, f"{e}: written by a newer splitspec? re-convert the model") from None
        self.format_version: int = version
        try:
            self.manifest = m
            self.conversion_id: str = m["conversion_id"]
            self.levels = torch.tensor(m["base"]["levels"], dtype=torch.float32)
            self.residual_bits: tuple[int, ...] = tuple(sorted(int(b) for b in m["residuals"]))
            self.widths: dict[int, dict[str, int]] = {
                int(b): {str(k): int(w) for k, w in r.get("widths", {}).items()} for b, r in m["residuals"].items()
            }
            self.layers: list[dict[str, GroupLayout]] = [
                {name: GroupLayout(i, name, **g) for name, g in layer.items()} for i, layer in enumerate(m["layers"])
            ]
            files = {str(name): (int(info["bytes"]), str(info["sha256"])) for name, info in m["files"].items()}
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CorruptFileError(path, f"manifest is missing or has a malformed field ({e!r})") from None
        groups = {group_key(i, name) for i, layer in enumerate(self.layers) for name in layer}
        for bits, widths in self.widths.items():
            bad = {k: w for k, w in widths.items() if k not in groups or w not in packing.PLANES or w <= bits}
            _require(
                not bad,
                path,
                f"the {bits}-bit residual's widths {bad} name no group of this folder or no wider width: re-convert "
                "the model",
            )
        self.spec: ArchSpec = self._spec()
        for name, (size, sha256) in files.items():
            self._check_file(name, size, sha256, verify)

    def _spec(self) -> ArchSpec:
        return folder_spec(self.folder, len(self.layers))

    def _check_file(self, name: str, size: int, sha256: str, verify: bool) -> None:
        path = self.folder / name
        _require(path.is_file(), path, "missing: the converted folder is incomplete, re-convert it")
        have = path.stat().st_size
        _require(have == size, path, f"size {have} bytes, the manifest says {size}: truncated?")
        if name.endswith(".safetensors"):
            meta = read_file_metadata(safetensors_header(path))
            _require(
                meta.get("conversion_id") == self.conversion_id,
                path,
                f"belongs to conversion {meta.get('conversion_id')!r}, not {self.conversion_id!r} "
                "of this manifest: files from different conversions were mixed",
            )
            role = name.removesuffix(".safetensors")  # every writer has named a file by its role
            _require(
                meta.get("role") == role,
                path,
                f"holds the {meta.get('role')!r} tensors, not the {role!r} ones its name says: a file was renamed "
                "or copied over another; put the right one back or re-convert the model",
            )
        if verify:
            _require(sha256_file(path) == sha256, path, "sha256 differs from the manifest: corrupt")

    # ------------------------------------------------------------------ readers

    def group(self, layer: int, group: str) -> GroupLayout:
        return self.layers[layer][group]

    @cached_property
    def shard_keys(self) -> list[dict[str, str]]:
        """Per layer, the key each group's rows go by between the engine and the CPU actors
        (``config.shape_keys``: "qkv", or "qkv#1" where a layer type reshapes it)."""
        shapes = [[(name, (g.d_in, g.rows)) for name, g in layer.items()] for layer in self.layers]
        keys = shape_keys(shapes)
        return [dict(zip(layer, row, strict=True)) for layer, row in zip(self.layers, keys, strict=True)]

    @cached_property
    def key_layouts(self) -> dict[str, GroupLayout]:
        """Each ``shard_keys`` key's group, as the first layer that has it stores it (its d_in and rows)."""
        out: dict[str, GroupLayout] = {}
        for layer, keys in zip(self.layers, self.shard_keys, strict=True):
            for name, key in keys.items():
                out.setdefault(key, layer[name])
        return out

    def _open(self, file: str):
        from safetensors import safe_open

        return safe_open(self.folder / file, framework="pt")

    def dense(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.folder / DENSE_FILE)

    @property
    def head_name(self) -> str:
        """The dense tensor that is the lm_head's weight: the embeddings where they are tied."""
        return "model.embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"

    def head_weight(self, rows: slice = slice(None)) -> torch.Tensor:
        """The lm_head's fp32 weight [vocab, hidden], or its ``rows``, read alone."""
        with self._open(DENSE_FILE) as f:
            return f.get_slice(self.head_name)[rows]

    def base(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(bit planes int32 [rows, d_in/32, 2], scales fp16 [rows, G])."""
        with self._open(BASE_FILE) as f:
            return f.get_tensor(base_name(layer, group, "codes")), f.get_tensor(base_name(layer, group, "scale"))

    def check_residual(self, bits: int) -> None:
        """Raise unless this splitspec can read the folder's ``bits``-bit residual: call it before the first
        read, so that a reader fails at startup rather than at its first request."""
        if bits not in self.residual_bits:
            raise ValueError(f"{self.folder}: no {bits}-bit residual; this conversion has {list(self.residual_bits)}")
        if self.format_version < RESIDUAL_LAYOUT_VERSION:
            raise CorruptFileError(
                self.folder / residual_file(bits),
                f"the folder is format_version {self.format_version}: its {bits}-bit residual is in an older "
                f"layout, which this splitspec (format {FORMAT_VERSION}) no longer reads; re-convert the model "
                "(`splitspec convert`)",
            )

    def residual_width(self, bits: int, layer: int, group: str) -> int:
        """The width of a group's planes in the ``bits``-bit residual: ``bits``, or the wider width the
        manifest's mixed-width map stores it at."""
        return self.widths.get(bits, {}).get(group_key(layer, group), bits)

    def residual_bits_per_weight(self, bits: int) -> float:
        """The ``bits``-bit residual's file bits per decoder weight (codes, scales, padding, mixed widths)."""
        params = sum(g.rows * g.d_in for layer in self.layers for g in layer.values())
        return 8 * (self.folder / residual_file(bits)).stat().st_size / params

    def tree_stats(self) -> dict[str, Any] | None:
        """The fitted rank statistics (``write_tree_stats``), or None when none were fitted."""
        path = self.folder / TREE_STATS_FILE
        if not path.is_file():
            return None
        try:
            stats = json.loads(path.read_text())
            tables = [stats["p"], *([stats["p_draft2bit"]] if "p_draft2bit" in stats else [])]
            ok = all(
                isinstance(p, list)
                and p
                and all(isinstance(row, list) and row and all(0 <= v <= 1 for v in row) for row in p)
                and all(sum(row) <= 1 + 1e-6 for row in p)
                for p in tables
            )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CorruptFileError(path, f"unreadable ({e!r}): run `splitspec fit-tree {self.folder}` again") from None
        _require(ok, path, f"p must be rows of probabilities: run `splitspec fit-tree {self.folder}` again")
        version = stats.get("version", 1)
        _require(
            version in (1, TREE_STATS_VERSION),
            path,
            f"version {version!r}: this splitspec reads versions 1 to {TREE_STATS_VERSION}; upgrade it, or run "
            f"`splitspec fit-tree {self.folder}` again",
        )
        if "ngram" in stats:
            from splitspec.scheduler.cost import NgramStats

            try:
                NgramStats.fitted(stats)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptFileError(
                    path, f"bad ngram counts ({e}): run `splitspec fit-tree {self.folder}` again"
                ) from None
        _require(
            stats.get("conversion_id") == self.conversion_id,
            path,
            f"fitted for conversion {stats.get('conversion_id')!r}, not this folder's {self.conversion_id!r}: "
            f"run `splitspec fit-tree {self.folder}`",
        )
        return stats

    def residual(
        self, bits: int, layer: int, group: str, tiles: tuple[int, int] | None = None
    ) -> dict[str, np.ndarray]:
        """The residual planes of one group (of width ``residual_width``), or only tiles [t0, t1): read as
        contiguous ranges."""
        self.check_residual(bits)
        out = {}
        width = self.residual_width(bits, layer, group)
        with self._open(residual_file(bits)) as f:
            for plane in (*packing.PLANES[width], *packing.SCALE_PLANES):
                sl = f.get_slice(resid_name(layer, group, plane))
                out[plane] = (sl[tiles[0] : tiles[1]] if tiles else sl[:]).numpy()
        return out

    def rotated_weights(self, layer: int, group: str, bits: int | None) -> torch.Tensor:
        """Q_base (+ Q_resid) of a group in the rotated basis, float32 [rows, d_in]."""
        planes, scale = self.base(layer, group)
        w = dequantize_base(planes, scale, self.levels)
        if bits is not None:
            w += torch.from_numpy(self.residual_weights(bits, layer, group))
        return w

    def residual_weights(self, bits: int, layer: int, group: str) -> np.ndarray:
        """Q_resid of a group in the rotated basis, float32 [rows, d_in], read at the group's own width: the
        reference that the kernels are tested against."""
        g = self.group(layer, group)
        width = self.residual_width(bits, layer, group)
        return packing.dequantize_residual(self.residual(bits, layer, group), width, g.rows, d_in=g.d_in)

    def linear_weights(self, layer: int, group: str, bits: int | None) -> dict[str, torch.Tensor]:
        """Each Linear's dequantized weight in the original basis: W_v = rot⁻¹(Q_base + Q_resid)."""
        from splitspec.quantize.hadamard import rot_inv

        layout = self.group(layer, group)
        w = self.rotated_weights(layer, group, bits)
        s_i, s_os = layout.signs()
        return {
            lin["name"]: rot_inv(w[lin["row_offset"] : lin["row_offset"] + lin["rows"]], s_o, s_i, self.rotation)
            for lin, s_o in zip(layout.linears, s_os, strict=True)
        }


def write_tree_stats(folder: str | Path, stats: dict[str, Any]) -> Path:
    """Write ``tree_stats.json`` atomically (a reader never sees half a file)."""
    from splitspec.quantize.concat import whole_file

    path = Path(folder) / TREE_STATS_FILE
    with whole_file(path) as f:
        f.write(json.dumps(stats, indent=1).encode())
    return path
