"""A CPU actor's share of the residual: the same rows of every layer's Linear groups, in its own RAM.

A group that a layer type reshapes (Gemma 4's global layers) is split as a group of its own
(``ConvertedModel.shard_keys``), so that each row range holds at every layer that has the group.

Actors split each group's rows on whole 16-row tiles, because a tile slice is one contiguous byte range
of every residual tensor: an actor reads only its share of the file and never repacks it. The share is
copied into one buffer that this (already pinned) process writes first, so its pages sit on the node
whose cores stream it on every verify pass; a read-only map of the file would leave them in the page
cache, wherever that happens to be.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numba
import numpy as np
from numba import cfunc, types
from tqdm import tqdm

from splitspec import numa
from splitspec.config import CpuActorConfig
from splitspec.kernels import head as head_kernel
from splitspec.kernels.cpu_base import arena as pages
from splitspec.kernels.cpu_base.kernel import ShareProduct, share_kernel
from splitspec.kernels.cpu_base.rows import TABLE_FLOATS
from splitspec.kernels.ir import F32_PTR, I64_PTR, c_call
from splitspec.kernels.residual import ResidualMatrix, slot_product
from splitspec.protocol import HEAD, GroupShard, ShardInfo
from splitspec.protocol.lane import MAX_SMALL
from splitspec.protocol.messages import BASE_SHARE_TOKENS
from splitspec.quantize import packing
from splitspec.quantize.format import ConvertedModel

_ALIGN = 64  # a cache line: planes start on one, so the kernel's first loads never straddle two


def held_rows(rows: Mapping[str, int], fraction: float) -> dict[str, int]:
    """The rows ``[0, r)`` of each group that the engine holds when it keeps ``fraction`` of the residual:
    the same fraction of every group, rounded down to whole tiles (the unit shards are cut in), so that
    every layer's pass splits the same way; every row from a fraction of 1."""
    if not fraction >= 0:
        raise ValueError(f"the engine's share of the residual must be >= 0, got {fraction}")
    tile = packing.TILE
    return {g: n if fraction >= 1 else int(packing.num_tiles(n) * fraction) * tile for g, n in rows.items()}


def resident_rows(model: ConvertedModel, bits: int, budget: int) -> dict[str, int]:
    """``held_rows`` for ``budget`` bytes of the ``bits``-bit residual as the folder stores it (packed planes
    and scales): the one rule by which the engine keeps its rows and the CPU actors skip them."""
    total = sum(
        packing.residual_nbytes(g.rows, g.d_in, model.residual_width(bits, i, name))
        for i, layer in enumerate(model.layers)
        for name, g in layer.items()
    )
    return held_rows({key: g.rows for key, g in model.key_layouts.items()}, budget / total)


def base_share_from(words: int, share: float) -> int:
    """A group's first code word of the base that the CPU actors multiply, of every row, when they take
    ``share`` of it (``EngineConfig.base_share``): the rows' last words, ``words`` where that is none."""
    if not 0 <= share < 1:
        raise ValueError(f"the CPU actors' share of the base must be in [0, 1), got {share}")
    return words - round(words * share)


def head_rows(vocab: int, n_shards: int, index: int, weights: Sequence[float] | None, share: float) -> tuple[int, int]:
    """Vocabulary rows ``[a, b)`` of the lm_head that shard ``index`` multiplies when the CPU actors take
    ``share`` of them (``EngineConfig.head_share``): the engine keeps the first whole tiles of the rest, the
    actors split the others as they split a group's rows (``shard_rows``, by ``weights``)."""
    if not 0 < share < 1:
        raise ValueError(f"the CPU actors' share of the lm_head must be in (0, 1), got {share}")
    return shard_rows(vocab, n_shards, index, weights, held_rows({HEAD: vocab}, 1 - share)[HEAD])


def shard_rows(
    rows: int, n_shards: int, index: int, weights: Sequence[float] | None = None, start: int = 0
) -> tuple[int, int]:
    """Rows ``[a, b)`` of shard ``index`` of ``n_shards`` of the rows from ``start`` on (those before it the
    engine holds; a whole number of tiles): whole tiles, tile counts within one, or in proportion to
    ``weights`` (one per shard: e.g. each actor's memory bandwidth, as ``splitspec plan`` sizes them), each
    shard at least one tile.

    The last shard stops at ``rows`` (the real count), so padded rows are never served.
    """
    if n_shards < 1 or not 0 <= index < n_shards:
        raise ValueError(f"need n_shards >= 1 and 0 <= index < n_shards, got index {index} of {n_shards}")
    if not 0 <= start <= rows or (start % packing.TILE and start != rows):
        raise ValueError(f"the engine's rows must be whole tiles of {packing.TILE} within {rows}, got {start}")
    tiles = packing.num_tiles(rows) - packing.num_tiles(start)
    if tiles < n_shards:
        held = f" after the {start} the engine holds (lower EngineConfig.resident_bytes)" if start else ""
        raise ValueError(
            f"a group of {rows} rows leaves {tiles} tiles of {packing.TILE} rows{held}, too few for {n_shards} "
            f"shards: run at most {tiles} CPU actors"
        )
    if weights is None:
        t0, t1 = index * tiles // n_shards, (index + 1) * tiles // n_shards
    else:
        if len(weights) != n_shards or not all(w > 0 for w in weights):
            raise ValueError(f"need {n_shards} positive row weights, one per shard, got {list(weights)}")
        edges = [round(tiles * c / sum(weights)) for c in (0, *itertools.accumulate(weights))]
        t0, t1 = edges[index], edges[index + 1]
        if min(b - a for a, b in itertools.pairwise(edges)) < 1:
            raise ValueError(f"row weights {list(weights)} leave a shard of {rows} rows without a whole tile")
    return start + t0 * packing.TILE, min(start + t1 * packing.TILE, rows)


class _Arena:
    """One first-touched buffer that planes are copied into, each at a cache-line-aligned address."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.empty(nbytes, np.uint8)
        numa.first_touch(self.buffer)
        self._base = self.buffer.__array_interface__["data"][0]
        self._used = 0

    def put(self, array: np.ndarray) -> np.ndarray:
        start = -(-(self._base + self._used) // _ALIGN) * _ALIGN - self._base
        stop = start + array.nbytes
        if stop > self.buffer.size:
            raise RuntimeError(f"shard arena of {self.buffer.size} bytes is too small for {stop}: a sizing bug")
        view = self.buffer[start:stop].view(array.dtype).reshape(array.shape)
        np.copyto(view, array)
        self._used = stop
        return view


def _group_shards(
    model: ConvertedModel, n_shards: int, index: int, weights: Sequence[float] | None, held: Mapping[str, int]
) -> dict[str, GroupShard]:
    """This shard's rows of each group (by ``shard_keys``), past the ``held`` ones: one row range per key,
    valid at every layer that has it."""
    return {
        key: GroupShard(g.d_in, *shard_rows(g.rows, n_shards, index, weights, held[key]))
        for key, g in model.key_layouts.items()
    }


class ResidualShard:
    """The residual planes of this actor's rows, for every layer and group, and the product over them."""

    def __init__(
        self,
        bits: int,
        info: ShardInfo,
        planes: list[dict[str, dict[str, np.ndarray]]],
        arena: _Arena,
        width: Callable[[int, str], int],
        activations: str = CpuActorConfig.activations,
        head: tuple[np.ndarray, np.ndarray] | None = None,
        base: list[dict[str, ShareProduct]] | None = None,
    ) -> None:
        """``planes``: per layer, each group's planes by its ``shard_keys`` key; ``width(layer, key)``: the
        width of those planes (``ConvertedModel.residual_width``). ``head``: this shard's lm_head rows as
        int16 codes and scales (``kernels.head``), served as group ``HEAD`` at any layer. ``base``: per layer,
        each group's share of the base (``info.base_share``) over this shard's rows: added into the reply to
        a request of ``BASE_SHARE_TOKENS`` rows or more."""
        self.bits = bits
        self.activations = activations  # how the kernel multiplies (ResidualMatrix.matmul)
        self._info = info
        self._planes = planes
        # checked and flattened once here, so that a request costs one kernel call
        self._matrices = [
            {
                name: ResidualMatrix(group, width(i, name), info.shards[name].rows, info.shards[name].d_in)
                for name, group in layer.items()
            }
            for i, layer in enumerate(planes)
        ]
        self._arena = arena  # owns the memory every plane views
        self._head = head
        self._base = base or [{} for _ in planes]
        self._head_nbytes = 0 if head is None else head[0].nbytes + head[1].nbytes
        self.nbytes: int = sum(m.nbytes for layer in self._matrices for m in layer.values()) + self._head_nbytes
        self.nbytes += sum(p.nbytes for layer in self._base for p in layer.values())

    @classmethod
    def load(
        cls,
        folder: str | Path,
        bits: int,
        index: int,
        n_shards: int,
        verify: bool = False,
        activations: str = CpuActorConfig.activations,
        weights: Sequence[float] | None = None,
        resident_bytes: int = 0,
        head_share: float = 0.0,
        base_share: float = 0.0,
    ) -> ResidualShard:
        """Read shard ``index`` of ``n_shards`` of the ``bits``-bit residual (rows split by ``weights``, or
        evenly) past the rows an engine holding ``resident_bytes`` of it keeps (``resident_rows``), with
        ``head_share`` > 0 its rows of the lm_head (``head_rows``) as int16, and with ``base_share`` > 0 that
        share of its rows of every group's 2-bit base (``base_share_from``); call it after pinning."""
        model = ConvertedModel(folder, verify=verify)
        held = resident_rows(model, bits, resident_bytes)
        shards = _group_shards(model, n_shards, index, weights, held)
        tiles = {key: packing.tile_range(s.row_start, s.row_stop) for key, s in shards.items()}
        names = [{key: name for name, key in keys.items()} for keys in model.shard_keys]  # per layer: key -> group

        def width(layer: int, key: str) -> int:
            return model.residual_width(bits, layer, names[layer][key])

        arena = _Arena(
            sum(
                packing.residual_nbytes((t1 - t0) * packing.TILE, shards[key].d_in, width(layer, key))
                + _ALIGN * (len(packing.PLANES[width(layer, key)]) + len(packing.SCALE_PLANES))
                for layer in range(len(model.layers))
                for key, (t0, t1) in tiles.items()
                if key in names[layer]
            )
        )
        planes = [
            {
                key: {p: arena.put(a) for p, a in model.residual(bits, layer, name, tiles=tiles[key]).items()}
                for key, name in names[layer].items()
            }
            for layer in tqdm(range(len(model.layers)), desc="load residual shard", unit="layer", disable=None)
        ]
        head = None
        if head_share:
            start, stop = head_rows(model.spec.vocab, n_shards, index, weights, head_share)
            head = head_kernel.quantize_rows(model.head_weight(slice(start, stop)).float().numpy())
            shards[HEAD] = GroupShard(model.spec.hidden, start, stop)
        base = _base_share(model, shards, held, base_share)
        info = ShardInfo(model.conversion_id, len(model.layers), shards, base_share=base_share)
        return cls(bits, info, planes, arena, width, activations, head, base)

    def rows(self, group: str) -> tuple[int, int]:
        shard = self._info.shards[group]
        return shard.row_start, shard.row_stop

    def planes(self, layer: int, group: str) -> dict[str, np.ndarray]:
        return self._planes[layer][group]

    def matrix(self, layer: int, group: str) -> ResidualMatrix:
        return self._matrices[layer][group]

    def request_bytes(self, layer: int, group: str) -> int:
        """Bytes one request of ``group`` reads: its planes at ``layer``, or this shard's lm_head rows."""
        return self._head_nbytes if group == HEAD else self._matrices[layer][group].nbytes

    def buffer(self) -> np.ndarray:
        """The one buffer that holds every plane: what ``numa.page_nodes`` should be asked about."""
        return self._arena.buffer

    def shard_info(self) -> ShardInfo:
        return self._info

    def compute(self, layer: int, group: str, x: np.ndarray, out: np.ndarray) -> None:
        """``out[n, rows] = R[rows] · xᵀ`` for this shard's rows of ``group`` (or its lm_head rows' logits for
        ``HEAD``): a protocol ``ComputeFn``."""
        if group == HEAD:
            head_kernel.product(*self._head, x, out)
        elif group not in self._matrices[layer]:
            raise ValueError(f"layer {layer} has no group {group!r}: its groups are {list(self._matrices[layer])}")
        else:
            self._matrices[layer][group].matmul(x, out, self.activations)
            if group in self._base[layer] and x.shape[0] >= BASE_SHARE_TOKENS:
                out += self._base[layer][group](x)

    def slot_kernels(self) -> np.ndarray:
        """What a server answering its shared-memory slots from compiled code calls per (layer, group), in the
        order of ``shard_info().shards`` (``protocol.answer``): ``ResidualMatrix.slot_product``, its record and
        the bytes it reads; zeros for the lm_head's rows, which Python answers (once a pass)."""
        groups = list(self._info.shards)
        table = np.zeros((len(self._matrices), len(groups), 3), np.int64)
        self._calls = [
            {name: matrix.slot_call(self.activations) for name, matrix in layer.items()} for layer in self._matrices
        ]  # kept alive: the table holds their addresses
        function = slot_product()
        for i, layer in enumerate(self._calls):
            for name, call in layer.items():
                table[i, groups.index(name)] = (function, call.ctypes.data, self._matrices[i][name].nbytes)
        widest = max((p.rows for layer in self._base for p in layer.values()), default=0)
        if widest:
            # a request's base product and its byte tables, this shard's alone (compiled code serves one at a time)
            self._scratch = pages.region(4 * (MAX_SMALL * widest + TABLE_FLOATS))
            y_at = self._scratch.data_ptr()
            tables_at = y_at + 4 * MAX_SMALL * widest
            self._records = []  # kept alive: the table holds their addresses
            for i, layer in enumerate(self._base):
                for name, product in layer.items():
                    call = self._calls[i][name].ctypes.data
                    record = np.array([function, call, *product.fields, y_at, tables_at], np.int64)
                    self._records.append(record)
                    row = table[i, groups.index(name)]  # its reads: the residual's bytes and the share's
                    row[:] = (with_base(), record.ctypes.data, row[2] + product.nbytes)
        return table


def _base_share(
    model: ConvertedModel, shards: Mapping[str, GroupShard], held: Mapping[str, int], share: float
) -> list[dict[str, ShareProduct]]:
    """Per layer, each group's share of the base (``base_share_from``) over this shard's rows."""
    base: list[dict[str, ShareProduct]] = [{} for _ in model.layers]
    if not share:
        return base
    if any(held.values()):
        raise ValueError(
            f"the CPU actors' share {share} of the base takes every row's last code words, but the engine holds "
            f"rows of the residual (resident_bytes), whose base it must take whole: set base_share or "
            f"resident_bytes to 0"
        )
    for i, names in enumerate(model.shard_keys):
        for name, key in names.items():
            codes, scale = model.base(i, name)
            first = base_share_from(codes.shape[1], share)
            if first < codes.shape[1]:
                rows = slice(shards[key].row_start, shards[key].row_stop)
                base[i][key] = ShareProduct(codes[rows], scale[rows], model.levels, first)
    return base


@functools.cache
def with_base() -> int:
    """The address of a C function ``int64 (record, x, n, out)`` that answers a slot's request as
    ``slot_product`` does and, for ``BASE_SHARE_TOKENS`` rows or more, adds the shard's share of the base
    into ``out``. The record: ``slot_product``'s address and record, the share's ``ShareProduct.fields``,
    a scratch of ``MAX_SMALL`` × its rows fp32, and its byte tables (``TABLE_FLOATS`` fp32)."""

    @cfunc(types.int64(types.int64, types.int64, types.int64, types.int64), cache=True)
    def answer(record_at, x_at, n, out_at):
        r = numba.carray(I64_PTR(record_at), 11)
        if c_call(r[0], r[1], x_at, n, out_at):
            return 1
        if n >= BASE_SHARE_TOKENS:
            rows, y_at = r[5], r[9]
            share_kernel(r[2], r[3], r[4], x_at, y_at, n, rows, r[6], r[7], r[8], r[10])
            y = numba.carray(F32_PTR(y_at), n * rows)
            out = numba.carray(F32_PTR(out_at), n * rows)  # the shard's rows, the share's too
            for i in range(n * rows):
                out[i] += y[i]
        return 0

    return answer.address
