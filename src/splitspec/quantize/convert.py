"""The offline converter: calibrate, rotate, quantize the 2-bit base and the residual(s), write the folder.

Two calibration streams run through the decoder layer by layer on the whole calibration batch:

- the *reference* stream (original weights) gives each group's input Hessian for the residual's GPTQ
  (the verifier, base + residual, approximates the original model, so it sees these inputs);
- the *base* stream is fed the outputs of the already-quantized 2-bit layers. A pre-hook on a group's
  first Linear sees the whole batch's input, quantizes the group from that Hessian and swaps in the
  dequantized base before the Linear runs, so later groups of the same layer see the quantized
  earlier groups too — all in one forward pass per layer.

By default the weights are streamed (``models.stream``): a layer is read from the source's shards just
before it is converted and dropped after its base and residuals are written to part files, which are
joined into the folder's files at the end. A group is rotated one Linear at a time and quantized a block
of rows at a time (``ConvertConfig.quantize_block_mib``; GPTQ and round-to-nearest treat rows
independently), so the quantizers' float32 copies are block-sized. RAM holds about one layer, the
calibration activations and the largest dense tensor, whatever the model's size;
``ConvertConfig.stream=False`` loads the whole float32 model instead, with the same bytes out.

Each finished layer is checkpointed in the output's work folder (``quantize.partial``): an interrupted
conversion, run again with the same source and settings, resumes at the first unfinished layer and writes
the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import splitspec
from splitspec.config import ConvertConfig, ModelConfig, group_key
from splitspec.models.data import calibration_tokens, make_split
from splitspec.models.files import sha256_file
from splitspec.models.layer_kwargs import layer_kwargs
from splitspec.models.loader import hf_folder, source_hash
from splitspec.models.spec import ArchSpec, GroupSpec
from splitspec.models.stream import ResidentModel, StreamedModel, dense_names
from splitspec.quantize import format as fmt
from splitspec.quantize import packing
from splitspec.quantize.concat import PartFiles
from splitspec.quantize.gptq import GPTQResult, LloydMaxQuantizer, Quantizer, UniformQuantizer, gptq, rtn
from splitspec.quantize.hadamard import linear_seed, rot_fwd, rot_inv, rotate_hessian
from splitspec.quantize.lloyd_max import fit_levels, group_rms_normalize
from splitspec.quantize.packing import TILE, pack_residual
from splitspec.quantize.partial import FULL, WorkFolder, check_room, layer_key

Weights = ResidentModel | StreamedModel
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertReport:
    folder: Path
    seconds: float
    peak_rss_mb: float
    levels: list[float]


# The ConvertConfig fields that change how a conversion runs, not a byte it writes (GPTQ and round-to-nearest
# treat rows independently; the streamed and resident conversions are tested to write the same files).
RUN_ONLY = ("stream", "quantize_block_mib", "gptq_block_rows_per_input")


def written_settings(cfg: ConvertConfig, n_layers: int) -> dict[str, Any]:
    """The settings a conversion's bytes depend on, for its id: every ``ConvertConfig`` field but
    ``RUN_ONLY`` (a knob added to it changes the id unless it is listed there), and the layer count."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_ONLY}
    return {"n_layers": n_layers, **settings}


def group_layouts(spec: ArchSpec, seed: int) -> list[dict[str, fmt.GroupLayout]]:
    """Seeds of every rotation: the group's input side and each Linear's output side (recipe, section 1)."""
    layouts = []
    for i in range(spec.n_layers):
        layer = {}
        for g in spec.layer_groups(i):
            input_seed = linear_seed(seed, f"model.layers.{i}.{g.name}") + 1
            output_seeds = [linear_seed(seed, f"model.layers.{i}.{lin.name}") for lin in g.linears]
            layer[g.name] = fmt.group_layout(i, g, input_seed, output_seeds)
        layouts.append(layer)
    return layouts


def rotated_linears(
    layer: torch.nn.Module, group: GroupSpec, layout: fmt.GroupLayout, rotation: str
) -> Iterator[torch.Tensor]:
    """Each Linear of a group rotated (shared S_i, own S_o), one at a time: W~'s rows, in order.

    Row-major like the concatenated group: the quantizers' per-row reductions over a column-major result
    (what ``rot_fwd`` may return) sum in another order and round some scales differently.
    """
    s_i, s_os = layout.signs()
    for lin, s_o in zip(group.linears, s_os, strict=True):
        weight = lin.rows_of(layer.get_submodule(lin.module).weight.detach()).float()
        yield rot_fwd(weight, s_o, s_i, rotation).contiguous()


def rotated_group_weight(
    layer: torch.nn.Module, group: GroupSpec, layout: fmt.GroupLayout, rotation: str
) -> torch.Tensor:
    """W~ of a group: the rotated Linears' rows concatenated."""
    return torch.cat(list(rotated_linears(layer, group, layout, rotation)))


def fit_base_levels(weights: Weights, layouts: list, cfg: ConvertConfig) -> torch.Tensor:
    """Lloyd–Max levels from group-RMS-normalised rotated weights, sampled evenly over all groups."""
    spec = weights.spec
    total = spec.linear_params
    gen = torch.Generator().manual_seed(cfg.seed)
    samples = []
    for i in tqdm(range(spec.n_layers), desc="fit levels", unit="layer"):
        with weights.layer(i) as layer:
            for g in spec.layer_groups(i):
                x = group_rms_normalize(rotated_group_weight(layer, g, layouts[i][g.name], cfg.rotation))
                take = max(1, round(cfg.lloyd_samples * x.numel() / total))
                samples.append(x[torch.randint(0, x.numel(), (take,), generator=gen)])
    return fit_levels(torch.cat(samples), iters=cfg.lloyd_iters, max_samples=cfg.lloyd_samples, seed=cfg.seed)


def _quantize(
    w: torch.Tensor, h: torch.Tensor | None, quantizer: Quantizer, cfg: ConvertConfig, act_order: bool = False
) -> GPTQResult:
    """GPTQ from the Hessian, or under ``quantizer="rtn"`` round-to-nearest (no Hessian: ``h`` is None)."""
    if cfg.quantizer == "rtn":
        return rtn(w, quantizer)
    return gptq(w, h, quantizer, block=cfg.gptq_block, damp=cfg.damp, act_order=act_order)


# A tile's scale top is set before GPTQ, from the residual as it comes in, this many times over its largest
# max|group| / qm: GPTQ's updates can raise a later group's max, and a scale above the top would clip.
SCALE_HEADROOM = 2.0


def _row_tops(resid: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row's tile top (``packing`` "scale_top") for the quantizer, with ``SCALE_HEADROOM``."""
    peak = resid.abs().amax(dim=1, keepdim=True) / (2 ** (bits - 1) - 1) * SCALE_HEADROOM
    tops = packing.tile_tops(peak.numpy())
    return torch.from_numpy(tops).repeat_interleave(TILE)[: resid.shape[0]]


def _residual_planes(resid: torch.Tensor, h: torch.Tensor | None, bits: int, cfg: ConvertConfig) -> dict:
    """The packed planes of one residual width (the quantizer's float copies are freed on return)."""
    rc = cfg.residual
    clip = rc.clip_min if bits in rc.clip_bits else 1.0
    quantizer = UniformQuantizer(bits, clip, rc.clip_steps, top=_row_tops(resid, bits))
    r = _quantize(resid, h, quantizer, cfg, act_order=bits in rc.act_order_bits)
    return pack_residual(r.codes.numpy().astype(np.int8), r.scales.numpy(), bits)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    return (x.T @ x) / x.shape[0]


class _LayerConverter:
    """Quantizes one decoder layer's groups from the two streams' inputs."""

    def __init__(
        self, layer: torch.nn.Module, index: int, spec: ArchSpec, layouts: dict, levels, parts: PartFiles, cfg
    ) -> None:
        self.layer, self.index, self.spec, self.layouts, self.cfg = layer, index, spec, layouts, cfg
        self.base_q = LloydMaxQuantizer(levels)
        self.ref_hessians: dict[str, torch.Tensor] = {}
        self.parts = parts  # each group's base and residuals are written as soon as it is quantized

    def _run_hooked(self, h: torch.Tensor, fn, **kw) -> torch.Tensor:
        """Run the layer with ``fn(group, input)`` called before each group's first Linear."""
        groups = self.spec.layer_groups(self.index)
        modules = [self.layer.get_submodule(g.linears[0].module) for g in groups]
        handles = [
            m.register_forward_pre_hook(lambda _m, args, g=g: fn(g, args[0]))
            for m, g in zip(modules, groups, strict=True)
        ]
        try:
            return self.layer(h, **kw)
        finally:
            for handle in handles:
                handle.remove()

    def run_reference(self, h: torch.Tensor, **kw) -> torch.Tensor:
        if self.cfg.quantizer == "rtn":  # round-to-nearest reads no Hessian; skip its d_in² products
            return self.layer(h, **kw)
        return self._run_hooked(h, lambda g, x: self.ref_hessians.__setitem__(g.name, _hessian(x)), **kw)

    def run_base(self, h: torch.Tensor, **kw) -> torch.Tensor:
        return self._run_hooked(h, self._quantize_group, **kw)

    def _quantize_group(self, g: GroupSpec, x: torch.Tensor) -> None:
        """Base and residuals of one group, a Linear at a time and a block of rows at a time: a gate_up group
        is half a layer, and whole-group copies (the quantizers' float32 dequant, their codes widened to
        int64 for packing) would each be that big."""
        layout = self.layouts[g.name]
        s_i, s_os = layout.signs()
        cfg = self.cfg
        with_h = cfg.quantizer == "gptq"
        h_base = rotate_hessian(_hessian(x), s_i, cfg.rotation) if with_h else None
        h_ref = rotate_hessian(self.ref_hessians.pop(g.name), s_i, cfg.rotation) if with_h else None
        step = _block_rows(g.d_in, cfg)
        codes, scales = [], []
        # each file's width for this group: a group the width map widens is stored, in the 6-bit file, with
        # the planes of its wider width, so its 6-bit planes are never quantized
        stored = {bits: cfg.residual.width(bits, self.index, g.name) for bits in cfg.residual_bits}
        resid = _ResidualRows(g.d_out, h_ref, cfg, tuple(sorted(set(stored.values()))))
        w_linears = rotated_linears(self.layer, g, layout, cfg.rotation)
        for lin, s_o, w in zip(g.linears, s_os, w_linears, strict=True):
            dequant = torch.empty_like(w)
            for r0 in range(0, lin.d_out, step):
                block = w[r0 : r0 + step]
                base = _quantize(block, h_base, self.base_q, cfg)
                codes.append(fmt.pack_base_codes(base.codes))
                scales.append(base.scales)
                dequant[r0 : r0 + step] = base.dequant
                resid.add(block - base.dequant)
                del base, block
            del w
            # The base stream continues through the quantized weights.
            weight = lin.rows_of(self.layer.get_submodule(lin.module).weight.data)
            weight.copy_(rot_inv(dequant, s_o, s_i, cfg.rotation))
            del dequant
        key = layer_key(self.index, g.name)
        base_tensors = {"codes": torch.cat(codes), "scale": torch.cat(scales).to(torch.float16)}
        self.parts.add(fmt.BASE_FILE, key, {fmt.base_name(self.index, g.name, k): v for k, v in base_tensors.items()})
        joined = dict(resid.planes())
        for bits, width in stored.items():
            named = {fmt.resid_name(self.index, g.name, p): torch.from_numpy(a) for p, a in joined[width].items()}
            self.parts.add(fmt.residual_file(bits), key, named)


def _block_rows(d_in: int, cfg: ConvertConfig) -> int:
    """Rows quantized at a time: ``quantize_block_mib`` of float32 (at least ``gptq_block_rows_per_input``
    rows per column under GPTQ), whole 16-row tiles."""
    rows = int(cfg.quantize_block_mib * 2**20) // (4 * d_in)
    if cfg.quantizer == "gptq":
        rows = max(rows, int(cfg.gptq_block_rows_per_input * d_in))
    return max(TILE, rows // TILE * TILE)


class _ResidualRows:
    """A group's residual at ``widths``, quantized as its rows come in, in whole 16-row tiles: the residual's tiles are
    packed block by block and concatenated, which is the packing of the whole group only if every block
    but the last is whole tiles (a Linear's rows need not be)."""

    def __init__(self, rows: int, h: torch.Tensor | None, cfg: ConvertConfig, widths: tuple[int, ...]) -> None:
        self.left, self.h, self.cfg, self.widths = rows, h, cfg, widths
        self.pending: list[torch.Tensor] = []
        self.blocks: dict[int, list[dict[str, np.ndarray]]] = {b: [] for b in widths}

    def add(self, rows: torch.Tensor) -> None:
        self.pending.append(rows)
        self.left -= rows.shape[0]
        have = sum(p.shape[0] for p in self.pending)
        take = have if self.left == 0 else have - have % TILE
        if not take:
            return
        resid = torch.cat(self.pending)
        for bits in self.widths:
            self.blocks[bits].append(_residual_planes(resid[:take], self.h, bits, self.cfg))
        self.pending = [resid[take:].clone()] if take < have else []

    def planes(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Each width's planes of the whole group, joined along the tiles; a width's blocks go as it is joined."""
        for bits in self.widths:
            blocks = self.blocks.pop(bits)
            yield bits, {plane: np.concatenate([b[plane] for b in blocks]) for plane in blocks[0]}
            del blocks


def _convert_layers(weights: Weights, calib: torch.Tensor, layouts: list, levels, work: WorkFolder, cfg) -> None:
    """Both calibration streams through every layer not done yet; each group's base and residuals go to
    files of their own as soon as it is quantized, so only one layer's weights are held at a time, and each
    finished layer is checkpointed with the streams' states after it."""
    spec = weights.spec
    start = work.layers_done
    with torch.no_grad():
        if start:
            h_ref, h_base = work.activations()
            log.warning("resuming the conversion in %s at layer %d of %d", work.path, start, spec.n_layers)
        else:
            h_ref = weights.embed(calib)
            h_base = h_ref.clone()
        kws = layer_kwargs(weights.model, spec, h_ref)
        for i in tqdm(range(start, spec.n_layers), desc="convert", unit="layer", initial=start, total=spec.n_layers):
            with weights.layer(i) as layer:
                conv = _LayerConverter(layer, i, spec, layouts[i], levels, work.parts, cfg)
                h_ref_next = conv.run_reference(h_ref, **kws[i])
                h_base = conv.run_base(h_base, **kws[i])
                h_ref = h_ref_next
            work.checkpoint(i + 1, h_ref, h_base)


def planned_bytes(model: torch.nn.Module, spec: ArchSpec, cfg: ConvertConfig) -> dict[str, int]:
    """What each file of the folder will hold at least: the codes, the base's fp16 scale per 128 weights,
    the float32 dense tensors (headers, residual scales and padding not counted)."""
    weights = {group_key(i, g.name): g.d_out * g.d_in for i in range(spec.n_layers) for g in spec.layer_groups(i)}
    n = sum(weights.values())
    files = {fmt.BASE_FILE: n * 2 // 8 + n // fmt.GROUP * 2}
    for b in cfg.residual_bits:
        widths = cfg.residual.widths if b == 6 else {}
        files[fmt.residual_file(b)] = sum(w * widths.get(k, b) for k, w in weights.items()) // 8
    dense = set(dense_names(model, spec))
    files[fmt.DENSE_FILE] = sum(t.numel() * 4 for name, t in model.state_dict().items() if name in dense)
    return files


def convert(model_cfg: ModelConfig, out: str | Path, cfg: ConvertConfig | None = None) -> ConvertReport:
    """Convert a model into ``out`` (written in a temporary folder beside it, renamed at the end)."""
    cfg = cfg or ConvertConfig()
    out = Path(out).resolve()
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it or choose another output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    weights = StreamedModel(model_cfg) if cfg.stream else ResidentModel.load(model_cfg)
    model, tokenizer, spec = weights.model, weights.tokenizer, weights.spec
    for g in {g for i in range(spec.n_layers) for g in spec.layer_groups(i)}:
        if g.d_in % fmt.CODE_WORD:
            raise ValueError(f"group {g.name}: d_in {g.d_in} is not a multiple of {fmt.CODE_WORD}; unsupported")
    names = {group_key(i, g.name) for i in range(spec.n_layers) for g in spec.layer_groups(i)}
    unknown = sorted(set(cfg.residual.widths) - names)
    if unknown:
        groups = [g.name for g in spec.groups]
        raise ValueError(
            f"residual widths name groups this model lacks: {unknown} (layers 0..{spec.n_layers - 1}, groups {groups})"
        )
    folder, src = hf_folder(model_cfg)
    calib = calibration_tokens(make_split(cfg.data), tokenizer, cfg.data)
    layouts = group_layouts(spec, cfg.seed)
    source_sha = source_hash(src)
    config_sha = sha256_file(folder / "config.json")  # the weights' hash does not cover it
    settings = {
        "source_sha256": source_sha,
        "config_sha256": config_sha,
        "n_layers": spec.n_layers,
        "convert": dataclasses.asdict(cfg),
        "splitspec": splitspec.__version__,
    }
    check_room(out, planned_bytes(weights.model, spec, cfg))
    work = WorkFolder(out, settings)
    try:
        if work.levels is None:
            work.save_levels(fit_base_levels(weights, layouts, cfg).tolist())
        levels = torch.tensor(work.levels, dtype=torch.float32)
        calib_info = {"sequences": int(calib.shape[0]), "seq_len": int(calib.shape[1]), "data_seed": cfg.data.seed}
        cid = fmt.conversion_id(source_sha, config_sha, levels.tolist(), written_settings(cfg, spec.n_layers))
        _convert_layers(weights, calib, layouts, levels, work, cfg)
        tmp = work.folder
        if not (tmp / fmt.DENSE_FILE).exists():  # else an interrupted run joined them already
            for j, (name, tensor) in enumerate(weights.dense()):
                work.parts.add(fmt.DENSE_FILE, f"{j:06d}", {name: tensor})
                del tensor
        tmp.mkdir(exist_ok=True)
        roles = {fmt.DENSE_FILE: "dense", fmt.BASE_FILE: "base"}
        roles |= {fmt.residual_file(b): f"residual{b}" for b in cfg.residual_bits}
        work.parts.join(tmp, {name: fmt.file_metadata(cid, role) for name, role in roles.items()})
        model.config.to_json_file(tmp / "config.json")
        tokenizer.save_pretrained(tmp)
        manifest = {
            "format": "splitspec",
            "format_version": fmt.FORMAT_VERSION,
            "conversion_id": cid,
            "created_by": f"splitspec {splitspec.__version__}",
            "source": {"kind": src.kind, "path": str(src.file or src.folder), "sha256": source_sha},
            "arch": {"family": spec.family, "n_layers": spec.n_layers, "hidden": spec.hidden},
            "seed": cfg.seed,
            "rotation": cfg.rotation,
            "group_size": fmt.GROUP,
            "tile_rows": 16,
            "base": {"bits": 2, "levels": levels.tolist(), "file": fmt.BASE_FILE},
            "residuals": {
                str(b): {"bits": b, "file": fmt.residual_file(b), **({"widths": cfg.residual.widths} if b == 6 else {})}
                for b in cfg.residual_bits
            },
            "calibration": calib_info,
            "gptq": {"block": cfg.gptq_block, "damp": cfg.damp, "quantizer": cfg.quantizer},
            "layers": [{name: lay.to_json() for name, lay in layer.items()} for layer in layouts],
            "files": {
                p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(tmp.iterdir())
                if p.suffix == ".safetensors"
            },
        }
        (tmp / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
        # Actors may run as another user than the converter.
        for p in tmp.iterdir():
            p.chmod(0o644)
        tmp.chmod(0o755)
        work.finish(out)
    except BaseException as e:
        if isinstance(e, OSError) and e.errno in FULL:
            raise work.disk_full(e) from e
        log.warning(
            "conversion stopped with %d of %d layers done, kept in %s: run the same command again to resume",
            work.layers_done,
            spec.n_layers,
            work.path,
        )
        raise
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return ConvertReport(out, time.perf_counter() - t0, peak, levels.tolist())
