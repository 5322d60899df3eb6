"""Where the verifier's y_r = Q_resid · x' comes from, behind one two-call interface.

The model calls ``submit(layer, group, x')`` as soon as the group's input is rotated, computes the 2-bit
base product while the CPU actors work, and only then ``gather``\\ s: splitting the call in two is what
lets the base product and the residual overlap. Three sources:

- ``RemoteResidual``: real CPU actors over the protocol, each owning a row range of every group;
- ``LocalResidual``: the same shards computed in this process at ``submit`` (no overlap; for tests);
- ``NoResidual``: the 2-bit draft, y_r = 0 (``gather`` returns None so nothing is added).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from splitspec.config import ChannelConfig
from splitspec.cpu_actor.shard import ResidualShard
from splitspec.protocol import Client, Ticket
from splitspec.quantize.format import ConvertedModel


class Residual(Protocol):
    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> Any:
        """Start y_r for the rotated input ``x_rot`` [n, d_in]; returns a handle for ``gather``."""

    def gather(self, handle: Any) -> torch.Tensor | None:
        """y_r [n, rows] float32 on ``x_rot``'s device, or None where there is nothing to add."""

    def close(self) -> None: ...


def check_coverage(model: ConvertedModel, ranges: dict[str, list[tuple[int, int]]]) -> None:
    """Refuse shards that leave a gap or overlap, in the order given (the order their outputs are
    concatenated in): a missing row would silently drop part of the residual, a swap would misplace it."""
    for name, layout in model.layers[0].items():
        spans = ranges.get(name, [])
        edges = [0] + [edge for span in spans for edge in span] + [layout.rows]
        if any(a != b for a, b in zip(edges[::2], edges[1::2], strict=True)):
            raise ValueError(
                f"the CPU actors' rows of group {name!r} are {spans}; they must tile [0, {layout.rows}) exactly"
            )


def _assemble(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Concatenate the shards' partial outputs (already in row order) into one tensor on ``device``."""
    y = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return torch.from_numpy(y).to(device, copy=True)


class NoResidual:
    """The 2-bit draft: the base product alone."""

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> None:
        return None

    def gather(self, handle: None) -> None:
        return None

    def close(self) -> None:
        pass


class LocalResidual:
    """In-process residual shards, computed synchronously at ``submit``: exact, but nothing overlaps."""

    def __init__(self, model: ConvertedModel, shards: Sequence[ResidualShard]) -> None:
        first = next(iter(model.layers[0]))
        self._shards = sorted(shards, key=lambda s: s.rows(first)[0])
        check_coverage(model, {name: [s.rows(name) for s in self._shards] for name in model.layers[0]})

    @classmethod
    def load(cls, folder: str | Path, bits: int, n_shards: int = 1) -> LocalResidual:
        shards = [ResidualShard.load(folder, bits, i, n_shards) for i in range(n_shards)]
        return cls(ConvertedModel(folder), shards)

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> torch.Tensor:
        x = x_rot.detach().to("cpu", torch.float32).numpy()
        parts = []
        for shard in self._shards:
            start, stop = shard.rows(group)
            out = np.empty((x.shape[0], stop - start), np.float32)
            shard.compute(layer, group, x, out)
            parts.append(out)
        return _assemble(parts, x_rot.device)

    def gather(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def close(self) -> None:
        pass


@dataclass
class _Pending:
    device: torch.device
    tickets: list[tuple[Client, Ticket]]


class RemoteResidual:
    """One protocol client per CPU actor; x' is written straight into each request's slot (zero-copy on the
    same host) and the partial outputs are concatenated by row range at ``gather``."""

    def __init__(self, model: ConvertedModel, endpoints: Sequence[str], config: ChannelConfig | None = None) -> None:
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
            check_coverage(model, {name: [(s[name].row_start, s[name].row_stop) for s in shards] for name in shards[0]})
        except BaseException:
            for client in clients:
                client.close()
            raise
        self._clients = clients

    @property
    def transports(self) -> list[str]:
        """Per CPU actor, in row order: shared-memory slots ("shm", same host) or frames ("tcp")."""
        return [c.transport for c in self._clients]

    def submit(self, layer: int, group: str, x_rot: torch.Tensor) -> _Pending:
        pending = _Pending(x_rot.device, [])
        for client in self._clients:
            ticket = client.request(layer, group, x_rot.shape[0])
            torch.from_numpy(ticket.x).copy_(x_rot)
            client.submit(ticket)
            pending.tickets.append((client, ticket))
        return pending

    def gather(self, handle: _Pending) -> torch.Tensor:
        try:
            return _assemble([client.gather(ticket) for client, ticket in handle.tickets], handle.device)
        finally:
            for client, ticket in handle.tickets:
                if ticket.state != "submitted":
                    client.release(ticket)

    def actor_compute_s(self) -> list[float]:
        """Seconds each CPU actor has spent computing so far (a ping round trip each): what separates
        their work from the channel's latency in a measured wait."""
        return [client.ping()["compute_s"] for client in self._clients]

    def close(self) -> None:
        for client in self._clients:
            client.close()
