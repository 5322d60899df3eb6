"""Descriptions the planner works from: a machine (GPU, NUMA nodes, extra hosts) and a model's shape.

Both can come from a small TOML file, so that a box nobody here can run on still gets a plan and a
prediction. Every figure in the file carries its unit ("36 GB/s", "32 GB", "25 us"): a bare number is
refused, since a bandwidth in GiB/s read as GB/s would shift a prediction silently. A model's shape can
also come from a converted folder's manifest, which is what the engine will actually stream.
"""

from __future__ import annotations

import re
import tomllib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitspec.config import shape_keys
from splitspec.quantize.packing import SCALE_BITS
from splitspec.scheduler.cost import NgramStats

_UNITS = {
    "bytes": {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30},
    "bandwidth": {"B/s": 1, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "MiB/s": 2**20, "GiB/s": 2**30},
    "time": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9},
    "flops": {"GFLOP/s": 1e9, "TFLOP/s": 1e12},
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S+)\s*$")


class MachineFileError(ValueError):
    """A description file that cannot be used; the message names the file and the field."""


def quantity(value: Any, kind: str, where: str) -> float:
    """A figure with its unit ("36 GB/s") in base units (bytes, bytes/s, seconds, flop/s). Only a size may
    be 0 (a reserve of none): a rate or a time of 0 would make a transfer free or a division fail."""
    units = _UNITS[kind]
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None or match.group(2) not in units:
        raise MachineFileError(f"{where} = {value!r}: give a number with a unit, one of {', '.join(units)}")
    figure = float(match.group(1)) * units[match.group(2)]
    if kind != "bytes" and not figure > 0:
        raise MachineFileError(f"{where} = {value!r}: must be more than 0; give the measured or expected figure")
    return figure


class _Table:
    """One TOML table read field by field, so that an error names the file and the field's path."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise MachineFileError(f"{path} must be a table")
        self.data, self.path = data, path

    def _get(self, key: str, default: Any) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise MachineFileError(f"{self.path}: missing field {key!r}")
            return default
        return self.data[key]

    def quantity(self, key: str, kind: str, default: Any = None) -> float:
        value = self._get(key, _REQUIRED if default is None else default)
        return quantity(value, kind, f"{self.path}.{key}")

    def number(self, key: str, kind: type = int, default: Any = None, minimum: float = 1) -> Any:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            raise MachineFileError(f"{self.path}.{key} = {value!r}: expected a {kind.__name__}")
        if value < minimum:
            raise MachineFileError(f"{self.path}.{key} = {value!r}: must be >= {minimum}")
        return kind(value)

    def text(self, key: str, default: str) -> str:
        return str(self._get(key, default))

    def tables(self, key: str) -> list[_Table]:
        items = self._get(key, [])
        if not isinstance(items, list):
            raise MachineFileError(f"{self.path}.{key} must be an array of tables ([[{key}]])")
        return [_Table(item, f"{self.path}.{key}[{i}]") for i, item in enumerate(items)]


_REQUIRED = object()


@dataclass(frozen=True)
class Node:
    """A NUMA node as the residual kernel sees it: read bandwidth and flop rate over all its cores."""

    cores: int
    bandwidth: float
    flops: float


@dataclass(frozen=True)
class Host:
    """A machine with CPU actors; an extra host also has the link its activations cross."""

    name: str
    nodes: tuple[Node, ...]
    link_bandwidth: float | None = None
    link_latency: float | None = None


@dataclass(frozen=True)
class Engine:
    """Where the 2-bit base runs: a GPU (``memory`` and ``pcie`` set) or a CPU core of the first host.
    ``round_trip`` is one send-and-gather to a local CPU actor beyond moving the bytes, ``layer_overhead``
    the engine's fixed cost per layer (launches or Python calls, norms, attention)."""

    bandwidth: float
    flops: float
    round_trip: float
    layer_overhead: float
    memory: float | None = None
    reserve: float = 0.0
    pcie: float | None = None

    @property
    def is_gpu(self) -> bool:
        return self.memory is not None


@dataclass(frozen=True)
class Machine:
    name: str
    engine: Engine
    hosts: tuple[Host, ...]  # the first is the engine's own


@dataclass(frozen=True)
class ModelShape:
    """What a verify pass streams: per layer the Linear groups (rows, d_in), the dense lm_head, and the
    draft's rank statistics p_d(r) and the n-gram draft's replayed acceptance where known. A group that a
    layer type reshapes is a group of its own (``ConvertedModel.shard_keys``), in the layers that have it
    (``group_layers``)."""

    name: str
    layers: int
    groups: tuple[tuple[str, int, int], ...]
    hidden: int
    vocab: int
    residual_bits: int
    rank_stats: tuple[tuple[float, ...], ...] | None = None
    # a residual weight's bits as a folder stores it (codes, scale bytes, padding, mixed widths), or 0 for
    # residual_bits plus the scale bytes
    stored_bits: float = 0.0
    ngram: NgramStats | None = None
    kv_token_values: int = 0  # one token's K and V elements over every layer (``KVCache``)
    group_layers: tuple[tuple[str, int], ...] = ()  # the layers a group is in, where not every one (Gemma 4)
    sliding_token_values: int = 0  # the part of kv_token_values in sliding-window layers
    sliding_window: int = 0  # their window (0: none), which a GPU engine's K/V rings hold (``KVCache``)
    state_bytes: int = 0  # one sequence's recurrent state in linear-attention layers (Qwen 3.5; ``DeltaState``)

    def context_tokens(self, kv_bytes: float, element: int, ring_slack: int) -> int:
        """The tokens one sequence's K/V holds in ``kv_bytes`` (elements of ``element`` bytes) beside its
        recurrent state: the sliding layers' rings (``ring_slack`` > 0) stop growing past their window and
        ``ring_slack`` slots."""
        values = max(kv_bytes - self.state_bytes, 0) / element
        ring = self.sliding_window + ring_slack if self.sliding_window and ring_slack else 0
        if not ring or values < ring * self.kv_token_values:
            return int(values // self.kv_token_values)
        return ring + int((values - ring * self.kv_token_values) // (self.kv_token_values - self.sliding_token_values))

    def layers_of(self, group: str) -> int:
        return dict(self.group_layers).get(group, self.layers)

    def weights(self, rows: Mapping[str, int]) -> int:
        """The weights of the first ``rows`` rows of each group, over the layers that have it."""
        d_in = {name: d for name, _, d in self.groups}
        return sum(self.layers_of(g) * r * d_in[g] for g, r in rows.items())

    @property
    def linear_params(self) -> int:
        return self.weights({g: rows for g, rows, _ in self.groups})

    @property
    def residual_weight_bits(self) -> float:
        return self.stored_bits or self.residual_bits + SCALE_BITS

    def residual_bytes(self) -> float:
        """What the residual's planes take (``residual_weight_bits`` a weight)."""
        return self.linear_params * self.residual_weight_bits / 8

    def base_bytes(self) -> float:
        """2 bits a weight plus an fp16 scale per 128 (recipe, section 2)."""
        return self.linear_params * (2 + 16 / 128) / 8

    def head_bytes(self, bytes_per_weight: float) -> float:
        return self.vocab * self.hidden * bytes_per_weight


def _read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MachineFileError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise MachineFileError(f"{path}: not valid TOML ({e})") from None


def _node(t: _Table) -> Node:
    return Node(t.number("cores"), t.quantity("bandwidth", "bandwidth"), t.quantity("flops", "flops"))


def _host(t: _Table, name: str, extra: bool) -> Host:
    nodes = tuple(_node(n) for n in t.tables("numa"))
    if not nodes:
        raise MachineFileError(f"{t.path}: needs at least one [[numa]] node")
    if not extra:
        return Host(name, nodes)
    return Host(name, nodes, t.quantity("link", "bandwidth"), t.quantity("link_latency", "time"))


def _engine(t: _Table, gpu: bool) -> Engine:
    """The engine's figures; a GPU adds its memory, what to keep free of it, and its PCIe bandwidth."""
    common = [t.quantity(key, kind) for key, kind in _ENGINE_FIELDS]
    if not gpu:
        return Engine(*common)
    memory, reserve = t.quantity("memory", "bytes"), t.quantity("reserve", "bytes", "0 B")
    return Engine(*common, memory=memory, reserve=reserve, pcie=t.quantity("pcie", "bandwidth"))


_ENGINE_FIELDS = (("bandwidth", "bandwidth"), ("flops", "flops"), ("round_trip", "time"), ("layer_overhead", "time"))


def machine_from_toml(path: str | Path) -> Machine:
    top = _Table(_read(path), str(path))
    kind = next((k for k in ("gpu", "engine") if k in top.data), None)
    if kind is None:
        raise MachineFileError(f"{path}: needs a [gpu] table, or an [engine] table for an engine on a CPU core")
    engine = _engine(_Table(top.data[kind], f"{path}: {kind}"), gpu=kind == "gpu")
    name = top.text("name", Path(path).stem)
    hosts = [_host(top, "main", extra=False)]
    hosts += [_host(h, h.text("name", f"host{i + 1}"), extra=True) for i, h in enumerate(top.tables("hosts"))]
    return Machine(name, engine, tuple(hosts))


def llama_groups(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    """The four groups that share an input (qkv, o, gate_up, down) as (name, rows, d_in)."""
    return (
        ("qkv", heads * head_dim + 2 * kv_heads * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * intermediate, hidden),
        ("down", hidden, intermediate),
    )


def _rank_stats(t: _Table) -> tuple[tuple[float, ...], ...] | None:
    """From ``top = [P(top-1), P(top-2), P(top-4), P(top-8)]`` (the recipe's recall@P table): one row of
    p(r) used at every depth, the probability of each bucket spread evenly over its ranks."""
    if "acceptance" not in t.data:
        return None
    a = _Table(t.data["acceptance"], f"{t.path}: acceptance")
    top = a._get("top", _REQUIRED)
    if not isinstance(top, list) or len(top) != 4 or any(not isinstance(x, int | float) for x in top):
        raise MachineFileError(f"{a.path}.top must be 4 numbers: P(top-1), P(top-2), P(top-4), P(top-8)")
    if not all(0 <= x <= 1 for x in top) or list(top) != sorted(top):
        raise MachineFileError(f"{a.path}.top = {top}: must rise and lie in [0, 1]")
    p = [top[0], top[1] - top[0], *[(top[2] - top[1]) / 2] * 2, *[(top[3] - top[2]) / 4] * 4]
    return (tuple(p),)


def _keyed(kinds: Sequence[tuple[int, tuple]]) -> tuple[tuple, tuple[tuple[str, int], ...]]:
    """The groups of several layer types, (layers of the type, its groups), keyed as a converted folder's
    are (``config.shape_keys``), in the order the types come; and the layers of each key that not every
    layer has."""
    layers = [groups for n, groups in kinds for _ in range(n)]
    keys = shape_keys([(name, (rows, d_in)) for name, rows, d_in in groups] for groups in layers)
    shapes = {}
    for groups, row in zip(layers, keys, strict=True):
        for key, (_, rows, d_in) in zip(row, groups, strict=True):
            shapes.setdefault(key, (key, rows, d_in))
    counts = Counter(k for row in keys for k in row)
    return tuple(shapes.values()), tuple((key, n) for key, n in counts.items() if n < len(layers))


def _linear_layers(t: _Table, layers: int, hidden: int, mlp: tuple) -> tuple[int, tuple, int]:
    """A ``[linear]`` table's layers (Qwen 3.5's gated DeltaNet: ``layers``, ``k_heads``, ``v_heads``,
    ``k_dim``, ``v_dim``, ``conv``): how many, their groups, and one sequence's state in bytes."""
    from splitspec.models.spec import DeltaNet

    lin = _Table(t.data["linear"], f"{t.path}: linear")
    n = lin.number("layers")
    if n > layers:
        raise MachineFileError(f"{lin.path}: needs layers <= {layers}")
    net = DeltaNet(*(lin.number(k) for k in ("k_heads", "v_heads", "k_dim", "v_dim")), lin.number("conv", default=4))
    v_rows = net.n_v * net.v_dim
    groups = (("qkv", net.conv_dim + v_rows + 2 * net.n_v, hidden), ("o", hidden, v_rows), *mlp)
    return n, groups, net.sequence_bytes(n)


def model_from_toml(path: str | Path) -> ModelShape:
    """A model's shape from TOML: a Llama-like layer (``llama_groups``); with a ``[global]`` table the
    layers whose attention has heads of its own (Gemma 4's: ``layers``, ``head_dim``, ``kv_heads``, and
    ``v_proj = false`` where V is K's projection), whose qkv and o are groups of their own; with a
    ``[linear]`` table the linear-attention layers that come first (Qwen 3.5's, ``_linear_layers``) and
    ``q_gate = true`` where q_proj puts out a gate beside each head's q."""
    t = _Table(_read(path), str(path))
    hidden, heads = t.number("hidden"), t.number("heads")
    head_dim, kv_heads = t.number("head_dim", default=hidden // heads), t.number("kv_heads", default=heads)
    q_gate = t._get("q_gate", False)
    if not isinstance(q_gate, bool):
        raise MachineFileError(f"{path}: q_gate = {q_gate!r}: must be true or false")
    groups = llama_groups(hidden, t.number("intermediate"), heads, kv_heads, head_dim)
    if q_gate:
        groups = ((groups[0][0], groups[0][1] + heads * head_dim, hidden), *groups[1:])
    bits = t.number("residual_bits")
    if bits not in (6, 7, 8):
        raise MachineFileError(f"{path}: residual_bits = {bits}: must be 6, 7 or 8")
    name, layers = t.text("name", Path(path).stem), t.number("layers")
    kv, group_layers = 2 * layers * kv_heads * head_dim, ()
    window = t.number("sliding_window", default=0, minimum=0)  # with [global]: the other layers slide over it
    sliding = state = 0
    if "linear" in t.data and "global" in t.data:
        raise MachineFileError(f"{path}: a [linear] and a [global] table: no model has both")
    if "linear" in t.data:
        n, linear, state = _linear_layers(t, layers, hidden, groups[2:])
        groups, group_layers = _keyed([(n, linear), (layers - n, groups)])
        kv = 2 * (layers - n) * kv_heads * head_dim
    if "global" in t.data:
        g = _Table(t.data["global"], f"{path}: global")
        n, g_dim, g_kv = (
            g.number("layers"),
            g.number("head_dim", default=head_dim),
            g.number("kv_heads", default=kv_heads),
        )
        v_proj = g._get("v_proj", True)
        if n > layers or not isinstance(v_proj, bool):
            raise MachineFileError(f"{g.path}: needs layers <= {layers} and v_proj true or false")
        full = (("qkv", (heads + (1 + v_proj) * g_kv) * g_dim, hidden), ("o", hidden, heads * g_dim), *groups[2:])
        groups, group_layers = _keyed([(layers - n, groups), (n, full)])
        kv = 2 * ((layers - n) * kv_heads * head_dim + n * g_kv * g_dim)
        sliding = 2 * (layers - n) * kv_heads * head_dim if window else 0
    elif window:
        raise MachineFileError(f"{path}: sliding_window needs a [global] table: the layers that do not slide")
    rank, vocab = _rank_stats(t), t.number("vocab")
    shape = (name, layers, groups, hidden, vocab, bits, rank, 0.0, None, kv, group_layers, sliding, window, state)
    return ModelShape(*shape)


def model_from_converted(folder: str | Path, bits: int) -> ModelShape:
    """The shape the engine streams for this folder's ``bits``-bit residual, with its rank statistics."""
    import json

    from splitspec.quantize.format import ConvertedModel

    converted = ConvertedModel(folder)
    if bits not in converted.residual_bits:
        raise ValueError(f"{folder} has no {bits}-bit residual, only {converted.residual_bits}")
    groups = tuple((key, g.rows, g.d_in) for key, g in converted.key_layouts.items())
    counts = Counter(key for keys in converted.shard_keys for key in keys.values())
    group_layers = tuple((key, n) for key, n in counts.items() if n < len(converted.layers))
    vocab = json.loads((converted.folder / "config.json").read_text())["vocab_size"]
    fitted = converted.tree_stats()
    stats = tuple(tuple(row) for row in fitted["p"]) if fitted else None
    ngram = NgramStats.fitted(fitted)
    name = converted.folder.name
    stored = converted.residual_bits_per_weight(bits)
    spec = converted.spec
    args = (name, len(converted.layers), groups, spec.hidden, vocab, bits, stats, stored, ngram)
    kv = (spec.kv_token_values, group_layers, spec.sliding_token_values, spec.sliding_window or 0)
    net = spec.delta_net
    state = 0 if net is None else net.sequence_bytes(spec.linear_layers)
    return ModelShape(*args, *kv, state)
