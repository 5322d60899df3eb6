"""Where the verifier's y_r = Q_resid · x' comes from, behind one two-call interface.

The model calls ``submit(layer, group, x')`` as soon as the group's input is rotated, computes the 2-bit
base product while the CPU actors work, and only then ``gather``\\ s: splitting the call in two is what
lets the base product and the residual overlap. Four sources:

- ``RemoteResidual``: real CPU actors over the protocol, each owning a row range of every group;
- ``LocalResidual``: the same shards computed in this process at ``submit`` (no overlap; for tests);
- ``DeviceResidual``: the residual brought to the engine's device group by group, one product each (the
  prefill path for long prompts, where the CPU actors are compute-bound; on a CPU engine, the actors'
  own kernel in the engine's threads);
- ``NoResidual``: the 2-bit draft, y_r = 0 (``gather`` returns None so nothing is added).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from splitspec.config import ChannelConfig, CpuActorConfig, check_activations
from splitspec.kernels.residual import ResidualMatrix
from splitspec.kernels.shard import ResidualShard, resident_rows
from splitspec.protocol import (
    HEAD,
    HEAD_TOKENS,
    Client,
    PeerLost,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    ShardInfo,
    Ticket,
)
from splitspec.protocol.lane import MAX_SMALL, SlotLane
from splitspec.quantize import packing
from splitspec.quantize.activations import LEVELS, round_activations
from splitspec.quantize.format import ConvertedModel


class Residual(Protocol):
    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> Any:
        """Start y_r for the rotated input ``x_rot`` [n, d_in]; returns a handle for ``gather``."""

    def gather(self, handle: Any) -> torch.Tensor | None:
        """y_r [n, rows] float32 on ``x_rot``'s device, or None where there is nothing to add."""

    def add_into(self, handle: Any, out: torch.Tensor) -> None:
        """out += y_r in place (out [n, rows] float32 on ``x_rot``'s device): ``gather`` without the copy of
        y_r that the caller would only add, at a prompt's size a pass over megabytes per group."""

    def close(self) -> None: ...


def check_coverage(
    model: ConvertedModel, ranges: dict[str, list[tuple[int, int]]], held: Mapping[str, int] | None = None
) -> None:
    """Refuse shards that leave a gap or overlap, in the order given (the order their outputs are
    concatenated in), after the ``held`` rows of each group the engine computes itself: a missing row would
    silently drop part of the residual, a swap would misplace it. By ``shard_keys`` key (a group's name
    where every layer has one shape)."""
    for name, layout in model.key_layouts.items():
        spans, start = ranges.get(name, []), (held or {}).get(name, 0)
        edges = [start] + [edge for span in spans for edge in span] + [layout.rows]
        if any(a != b for a, b in zip(edges[::2], edges[1::2], strict=True)):
            engine = f" (the engine holds rows [0, {start}): did the actors get the same resident_bytes?)" * bool(start)
            raise ValueError(
                f"the CPU actors' rows of group {name!r} are {spans}; they must tile [{start}, {layout.rows}) "
                f"exactly{engine}"
            )


def _assemble(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Concatenate the shards' partial outputs (already in row order) into one new tensor on ``device``
    (on the CPU a numpy copy: torch's ``to`` costs twice as much at a layer's size)."""
    if device.type == "cpu":
        return torch.from_numpy(parts[0].copy() if len(parts) == 1 else np.concatenate(parts, axis=1))
    y = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return torch.from_numpy(y).to(device, copy=True)


class NoResidual:
    """The 2-bit draft: the base product alone."""

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> None:
        return None

    def gather(self, handle: None) -> None:
        return None

    def add_into(self, handle: None, out: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass


class LocalResidual:
    """In-process residual shards, computed synchronously at ``submit``: exact, but nothing overlaps."""

    def __init__(self, model: ConvertedModel, shards: Sequence[ResidualShard]) -> None:
        first = next(iter(model.layers[0]))
        self._shards = sorted(shards, key=lambda s: s.rows(first)[0])
        check_coverage(model, {key: [s.rows(key) for s in self._shards] for key in model.key_layouts})
        self._keys = model.shard_keys
        self.base_share = _base_share([s.shard_info() for s in self._shards])
        self.max_tokens = MAX_SMALL  # requests as the CPU actors' slots carry them: where the base's share applies

    @classmethod
    def load(
        cls, folder: str | Path, bits: int, n_shards: int = 1, activations: str = CpuActorConfig.activations,
        base_share: float = 0.0,
    ) -> LocalResidual:  # fmt: skip
        shards = [
            ResidualShard.load(folder, bits, i, n_shards, activations=activations, base_share=base_share)
            for i in range(n_shards)
        ]
        return cls(ConvertedModel(folder), shards)

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> torch.Tensor:
        x = x_rot.detach().to("cpu", torch.float32).numpy()
        parts, key = [], self._keys[layer][group]
        for shard in self._shards:
            start, stop = shard.rows(key)
            out = np.empty((x.shape[0], stop - start), np.float32)
            shard.compute(layer, key, x, out)
            parts.append(out)
        return _assemble(parts, x_rot.device)

    def gather(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def add_into(self, handle: torch.Tensor, out: torch.Tensor) -> None:
        out.add_(handle)

    def close(self) -> None:
        pass


class Lanes:
    """The CPU actors' leased slots for one pass (``RemoteResidual.lanes``): for each ``chunk`` rows of the
    pass in turn (``chunks`` of them), one per actor in row order. ``address`` is their table for
    ``cpu_step.verify_layers``, ``wait`` the slow path it returns to. ``held_at`` is the table of the rows
    the engine keeps (``DeviceResidual.fields_table``; 0: none), which that code multiplies itself with x'
    rounded to ``levels``; ``held`` takes the seconds it spent on them."""

    def __init__(self, leased: list[tuple[Client, SlotLane]], chunk: int, chunks: int,
                 held: DeviceResidual | None = None, held_table: np.ndarray | None = None) -> None:  # fmt: skip
        self._leased, self._held, self.chunk, self.chunks = leased, held, chunk, chunks
        self.table = np.array([lane.address for _, lane in leased], np.int64)
        self.address, self.count = self.table.ctypes.data, len(leased)
        self.held_at = 0 if held_table is None else held_table.ctypes.data
        self.levels = 0 if held is None else held.levels

    def held(self, seconds: float) -> None:
        if self._held is not None:
            self._held.held_s += seconds

    def wait(self) -> None:
        """Wait in Python for every lane's reply (the doorbell, the deadline), raising what ``gather`` would."""
        for client, lane in self._leased:
            client.wait_lane(lane)


@dataclass
class _Pending:
    device: torch.device
    tickets: list[tuple[Client, Ticket]]
    held: tuple[int, str, torch.Tensor] | None = None  # (layer, group, x') where the engine holds rows


class RemoteResidual:
    """One protocol client per CPU actor; x' is written straight into each request's slot (zero-copy on the
    same host) and the partial outputs are concatenated by row range at ``gather``.

    With ``held`` (a ``DeviceResidual`` keeping the first rows of every group, ``EngineConfig.resident_bytes``)
    the actors own only the rows after those, and ``gather`` multiplies the held ones on the engine's device
    before it waits for the actors: the plan's VRAM share of the residual, streamed by the GPU's bandwidth
    beside the CPUs'."""

    def __init__(
        self,
        model: ConvertedModel,
        endpoints: Sequence[str],
        config: ChannelConfig | None = None,
        held: DeviceResidual | None = None,
    ) -> None:
        self._held = held if held is not None and any(held.rows.values()) else None
        clients = [Client(model.conversion_id, config, endpoint) for endpoint in endpoints]
        try:
            for client in clients:
                if client.info.num_layers != len(model.layers):
                    raise ValueError(
                        f"the CPU actor at {client.endpoint} serves {client.info.num_layers} layers, "
                        f"the model has {len(model.layers)}"
                    )
            first = next(iter(model.layers[0]))
            clients.sort(key=lambda c: c.info.shards[first].row_start)
            shards = [c.info.shards for c in clients]
            spans = {key: [(s[key].row_start, s[key].row_stop) for s in shards] for key in model.key_layouts}
            check_coverage(model, spans, self._held.rows if self._held else None)
        except BaseException:
            for client in clients:
                client.close()
            raise
        self._clients = clients
        self._num_layers = len(model.layers)
        self._keys = model.shard_keys
        # the most rows one request carries, on either path (``lane``'s one-byte token counts)
        self.max_tokens = min((config or ChannelConfig()).max_tokens, MAX_SMALL)
        self.base_share = _base_share([c.info for c in clients])
        self.head_start = _head_start(model, clients)
        self.max_head_rows = HEAD_TOKENS * (config or ChannelConfig()).slots  # one pass's lm_head requests

    @property
    def transports(self) -> list[str]:
        """Per CPU actor, in row order: shared-memory slots ("shm", same host) or frames ("tcp")."""
        return [c.transport for c in self._clients]

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> _Pending:
        pending = _Pending(x_rot.device, [], (layer, group, x_rot) if self._held and group != HEAD else None)
        key = group if group == HEAD else self._keys[layer][group]
        try:
            for client in self._clients:
                ticket = client.request(layer, key, x_rot.shape[0])
                pending.tickets.append((client, ticket))
                torch.from_numpy(ticket.x).copy_(x_rot)
                client.submit(ticket)
        except BaseException:
            self._settle(pending)
            raise
        return pending

    @contextmanager
    def lanes(self, n: int, groups: Sequence[str], d_in: Sequence[int]) -> Iterator[Lanes | None]:
        """Slots of every CPU actor leased to compiled code for one pass of ``n`` tokens through ``groups``
        (x' of widths ``d_in``), one per actor for each request's worth of rows (``Lanes.chunk``), given back
        on exit; None where a pass cannot take them: an actor on another host, rows the engine holds off the
        CPU, more requests than an actor has free slots."""
        chunk = self.max_tokens
        chunks = -(-n // chunk)
        held = self._held.fields_table(self._num_layers, groups, d_in) if self._held is not None else None
        fits = (self._held is None or held is not None) and set(self.transports) == {"shm"}
        fits = fits and all(
            c.info.shards[g].d_in == d for c in self._clients for g, d in zip(groups, d_in, strict=True)
        )
        leased: list[tuple[Client, SlotLane]] = []
        try:
            for _, client in itertools.product(range(chunks if fits else 0), self._clients):
                lane = client.lease(self._num_layers, groups, [client.info.shards[g].row_start for g in groups])
                if lane is None:
                    fits = False
                    break
                leased.append((client, lane))
            yield Lanes(leased, chunk, chunks, self._held, held) if fits else None
        finally:
            for client, lane in leased:
                client.end_lease(lane)

    @contextmanager
    def _replies(self, handle: _Pending) -> Iterator[tuple[torch.Tensor | None, list[np.ndarray]]]:
        """The engine's held rows' product (None without them) and each actor's reply in row order, views of
        their slots until the slots are released on exit."""
        try:
            mine = self._held.held(*handle.held) if self._held and handle.held else None
            yield mine, [client.gather(ticket) for client, ticket in handle.tickets]
        finally:
            self._settle(handle)

    @staticmethod
    def _settle(handle: _Pending) -> None:
        """Wait out the tickets still with their actors, then give every slot back: where one actor's reply
        (or the held rows' product) fails, the others' slots would otherwise stay taken for good, one per
        failure, until every request is refused. A second error while waiting says nothing new: the first
        is the one raised, and a lost connection has no slot to give back."""
        for client, ticket in handle.tickets:
            if ticket.state == "submitted":
                with suppress(RemoteError, ProtocolError, PeerLost, RequestTimeout):
                    client.gather(ticket)
        for client, ticket in handle.tickets:
            client.release(ticket)

    def gather(self, handle: _Pending) -> torch.Tensor:
        with self._replies(handle) as (mine, replies):
            theirs = _assemble(replies, handle.device)
            return theirs if mine is None else torch.cat((mine, theirs), dim=1)

    def add_into(self, handle: _Pending, out: torch.Tensor) -> None:
        with self._replies(handle) as (mine, replies):
            first = 0
            for part in ([] if mine is None else [mine]) + [torch.from_numpy(r) for r in replies]:
                out[:, first : first + part.shape[1]].add_(part.to(out.device))
                first += part.shape[1]

    def actor_compute_s(self) -> list[float]:
        """Seconds each CPU actor has spent computing so far (a ping round trip each): what separates
        their work from the channel's latency in a measured wait."""
        return [client.ping()["compute_s"] for client in self._clients]

    def close(self) -> None:
        for client in self._clients:
            client.close()


def _base_share(infos: Sequence[ShardInfo]) -> float:
    """The share of the base that every shard takes (``ShardInfo.base_share``): one for all of them, since
    the engine leaves the same rows of every group to them."""
    shares = {info.base_share for info in infos}
    if len(shares) > 1:
        raise ValueError(
            f"the CPU actors take different shares of the base, {sorted(shares)}: start them all with the "
            "engine's EngineConfig.base_share"
        )
    return shares.pop()


def _head_start(model: ConvertedModel, clients: Sequence[Client]) -> int | None:
    """The first vocabulary row of the lm_head that the CPU actors (in row order) multiply, or None where
    they serve none of it; they must tile [start, vocab) exactly, as they tile a group's rows."""
    heads = [c.info.shards.get(HEAD) for c in clients]
    if all(h is None for h in heads):
        return None
    vocab = model.spec.vocab
    if any(h is None for h in heads) or heads[-1].row_stop != vocab or heads[0].row_start < 1:
        raise ValueError(
            f"the CPU actors serve lm_head rows {[h and (h.row_start, h.row_stop) for h in heads]}: all of them must "
            f"serve a part, together the last rows up to the vocabulary's {vocab} (start them with one head_share)"
        )
    if any(a.row_stop != b.row_start for a, b in itertools.pairwise(heads)):
        raise ValueError(f"the CPU actors' lm_head rows {[(h.row_start, h.row_stop) for h in heads]} leave a gap")
    return heads[0].row_start


class _Staging:
    """Host arrays to the device through two page-locked buffers kept from call to call, taken in turn: the
    copy is a DMA that does not hold the host thread, and ``pin_memory()`` (page-locked memory allocated per
    call, which costs milliseconds a group) is paid once. A buffer is written again only after its last copy
    has ended. On the CPU an array is only viewed, no copy."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(array)
        if self._device.type != "cuda":
            return src.to(self._device)
        i, self._turn = self._turn, 1 - self._turn
        if self._done[i] is not None:
            self._done[i].synchronize()
        nbytes = src.numel() * src.element_size()
        if self._buffers[i] is None or self._buffers[i].numel() < nbytes:
            self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self._buffers[i][:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        out = staged.to(self._device, non_blocking=True)
        self._done[i] = torch.cuda.Event()
        self._done[i].record()
        return out


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [rows, d_in] times their (row, 128-column group) scale [rows, G], as float32, on
    the codes' device: one fresh buffer scaled in place (the last group may be shorter than 128)."""
    w = codes.float()
    s = scale.float()
    full = w.shape[1] // packing.GROUP
    w[:, : full * packing.GROUP].unflatten(1, (full, packing.GROUP)).mul_(s[:, :full, None])
    if full < s.shape[1]:
        w[:, full * packing.GROUP :].mul_(s[:, full:])
    return w


_Rows = ResidualMatrix | tuple[torch.Tensor, torch.Tensor]  # a group's rows as ``DeviceResidual`` multiplies them


@dataclass
class _DeviceJob:
    layer: int
    group: str
    x_rot: torch.Tensor


class DeviceResidual:
    """y_r = x'·dequant(R)ᵀ on the engine's device, one product per group.

    The engine keeps the first rows of every group (``resident_rows`` for ``resident_bytes`` of the residual
    as stored, the same rule the CPU actors skip them by): ``held`` multiplies those alone, in decoding
    beside the CPU actors (``RemoteResidual``); ``gather`` multiplies all of a group's rows, the rest read
    from the converted folder per call (the prefill path for long prompts, where the CPU actors are
    compute-bound). On an accelerator the packed tiles are unpacked to int8 codes on the host
    (``packing.unpack_residual``), copied to the device with their scales, dequantized there to fp32
    and multiplied: only one group is ever dequantized at a time. On the CPU the packed planes go straight
    to the CPU actors' own kernel (``kernels.residual``), in the engine's threads: no unpacking, no fp32
    copy of the weights, and the very numbers a CPU actor returns. All the work happens at ``gather`` (and
    ``held``), after the model has issued the base product, which so never waits behind a group's
    host-side unpacking. x' is rounded as the CPU actors round it (``activations``), so that a prompt's
    logits do not depend on which path ran.
    """

    def __init__(
        self,
        model: ConvertedModel,
        bits: int,
        device: str | torch.device = "cpu",
        resident_bytes: int = 0,
        activations: str = CpuActorConfig.activations,
    ) -> None:
        model.check_residual(bits)
        check_activations(activations)
        self._model, self._bits, self._device = model, bits, torch.device(device)
        self._activations = activations
        self._levels = LEVELS.get(activations)  # multiply what the CPU actors multiply, whichever path runs
        self.rows = resident_rows(model, bits, resident_bytes)  # rows [0, r) of each group's key, kept here
        self._keys = model.shard_keys
        self._stage = _Staging(self._device)
        self._held = {
            (layer, name): self._fetch(layer, name, 0, self.rows[key])
            for layer, keys in enumerate(self._keys)
            for name, key in keys.items()
            if self.rows[key]
        }
        self.held_s = 0.0  # seconds ``held`` has spent: the engine's share of the residual, for the cost model
        self._tables: dict[tuple, np.ndarray | None] = {}  # fields_table's, by groups and widths

    def _fetch(self, layer: int, group: str, start: int, stop: int) -> _Rows:
        """Rows [start, stop) of one group (``start`` on a tile) as its product takes them: on the CPU the
        packed planes (``ResidualMatrix``), elsewhere (int8 codes [rows, d_in], fp32 scales [rows, G]) on
        the device."""
        planes = self._model.residual(self._bits, layer, group, tiles=packing.tile_range(start, stop))
        d_in = self._model.group(layer, group).d_in
        width = self._model.residual_width(self._bits, layer, group)
        if self._device.type == "cpu":
            return ResidualMatrix(planes, width, stop - start, d_in)
        codes, scale = packing.unpack_residual(planes, width, stop - start, d_in=d_in)
        return self._stage(codes), self._stage(scale)

    def _product(self, kept: _Rows, x_rot: torch.Tensor) -> torch.Tensor:
        if isinstance(kept, ResidualMatrix):
            x = x_rot.detach().to(torch.float32).numpy()
            out = np.empty((x.shape[0], kept.rows), np.float32)
            kept.matmul(x, out, self._activations)
            return torch.from_numpy(out)
        codes, scale = kept
        x = x_rot.to(self._device, torch.float32)
        return (round_activations(x, self._levels) if self._levels else x) @ dequantize(codes, scale).T

    @property
    def levels(self) -> int:
        """What x' is rounded to for the CPU actors' kernel (``ResidualMatrix``'s levels; 0: fp32)."""
        return self._levels or 0

    def fields_table(self, num_layers: int, groups: Sequence[str], d_in: Sequence[int]) -> np.ndarray | None:
        """Per layer and group (in ``groups`` order, x' of widths ``d_in``), the address of the kept rows'
        ``ResidualMatrix.fields``, 0 where there are none: the table by which compiled code multiplies them
        (``cpu_step.held``). None off the CPU, or where a group's x' is not as wide as its rows' columns."""
        key = (tuple(groups), tuple(d_in))
        if key not in self._tables:
            kept = [[self._held.get((layer, g)) for g in groups] for layer in range(num_layers)]
            on_cpu = all(isinstance(k, ResidualMatrix) and k.d_in == d for row in kept
                         for k, d in zip(row, d_in, strict=True) if k is not None)  # fmt: skip
            self._tables[key] = (
                np.array([0 if k is None else k.fields.ctypes.data for row in kept for k in row], np.int64)
                if on_cpu
                else None
            )
        return self._tables[key]

    def is_resident(self, layer: int) -> bool:
        """Whether every row of ``layer`` is kept on the device (such a layer costs no transfer)."""
        return all(self.rows[self._keys[layer][name]] == g.rows for name, g in self._model.layers[layer].items())

    @property
    def resident_nbytes(self) -> int:
        return sum(
            kept.nbytes if isinstance(kept, ResidualMatrix) else kept[0].nbytes + kept[1].nbytes
            for kept in self._held.values()
        )

    def held(self, layer: int, group: str, x_rot: torch.Tensor) -> torch.Tensor | None:
        """y_r of the rows kept here [n, r], or None where the engine keeps none of ``group``'s."""
        kept = self._held.get((layer, group))
        if kept is None:
            return None
        start = time.perf_counter()
        y = self._product(kept, x_rot)
        self.held_s += time.perf_counter() - start
        return y

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> _DeviceJob:
        return _DeviceJob(layer, group, x_rot)

    def gather(self, handle: _DeviceJob) -> torch.Tensor:
        layer, group, x = handle.layer, handle.group, handle.x_rot
        start, rows = self.rows[self._keys[layer][group]], self._model.group(layer, group).rows
        rest = self._product(self._fetch(layer, group, start, rows), x) if start < rows else None
        mine = self.held(layer, group, x)
        return rest if mine is None else mine if rest is None else torch.cat((mine, rest), dim=1)

    def add_into(self, handle: _DeviceJob, out: torch.Tensor) -> None:
        out.add_(self.gather(handle))

    def close(self) -> None:
        self._held.clear()
        self._tables.clear()
