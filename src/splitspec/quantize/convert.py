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
joined into the folder's files at the end. RAM holds about one layer, the calibration activations and the
largest dense tensor, whatever the model's size; ``ConvertConfig.stream=False`` loads the whole float32
model instead, with the same bytes out.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import splitspec
from splitspec.config import ConvertConfig, ModelConfig
from splitspec.models.data import calibration_tokens, make_split
from splitspec.models.files import sha256_file
from splitspec.models.layer_kwargs import layer_kwargs
from splitspec.models.loader import hf_folder, source_hash
from splitspec.models.spec import ArchSpec, GroupSpec
from splitspec.models.stream import ResidentModel, StreamedModel
from splitspec.quantize import format as fmt
from splitspec.quantize.concat import PartFiles
from splitspec.quantize.gptq import GPTQResult, LloydMaxQuantizer, Quantizer, UniformQuantizer, gptq, rtn
from splitspec.quantize.hadamard import linear_seed, rot_fwd, rot_inv, rotate_hessian
from splitspec.quantize.lloyd_max import fit_levels, group_rms_normalize
from splitspec.quantize.packing import pack_residual

Weights = ResidentModel | StreamedModel


@dataclass(frozen=True)
class ConvertReport:
    folder: Path
    seconds: float
    peak_rss_mb: float
    levels: list[float]


def group_layouts(spec: ArchSpec, seed: int) -> list[dict[str, fmt.GroupLayout]]:
    """Seeds of every rotation: the group's input side and each Linear's output side (recipe, section 1)."""
    layouts = []
    for i in range(spec.n_layers):
        layer = {}
        for g in spec.groups:
            input_seed = linear_seed(seed, f"model.layers.{i}.{g.name}") + 1
            output_seeds = [linear_seed(seed, f"model.layers.{i}.{lin.name}") for lin in g.linears]
            layer[g.name] = fmt.group_layout(i, g, input_seed, output_seeds)
        layouts.append(layer)
    return layouts


def rotated_group_weight(
    layer: torch.nn.Module, group: GroupSpec, layout: fmt.GroupLayout, rotation: str
) -> torch.Tensor:
    """W~ of a group: each Linear rotated (shared S_i, own S_o), rows concatenated."""
    s_i, s_os = layout.signs()
    return torch.cat(
        [
            rot_fwd(layer.get_submodule(lin.name).weight.detach().float(), s_o, s_i, rotation)
            for lin, s_o in zip(group.linears, s_os, strict=True)
        ]
    )


def fit_base_levels(weights: Weights, layouts: list, cfg: ConvertConfig) -> torch.Tensor:
    """Lloyd–Max levels from group-RMS-normalised rotated weights, sampled evenly over all groups."""
    spec = weights.spec
    total = spec.linear_params_per_layer * spec.n_layers
    gen = torch.Generator().manual_seed(cfg.seed)
    samples = []
    for i in range(spec.n_layers):
        with weights.layer(i) as layer:
            for g in spec.groups:
                x = group_rms_normalize(rotated_group_weight(layer, g, layouts[i][g.name], cfg.rotation))
                take = max(1, round(cfg.lloyd_samples * x.numel() / total))
                samples.append(x[torch.randint(0, x.numel(), (take,), generator=gen)])
    return fit_levels(torch.cat(samples), iters=cfg.lloyd_iters, max_samples=cfg.lloyd_samples, seed=cfg.seed)


def _quantize(w: torch.Tensor, h: torch.Tensor | None, quantizer: Quantizer, cfg: ConvertConfig) -> GPTQResult:
    """GPTQ from the Hessian, or under ``quantizer="rtn"`` round-to-nearest (no Hessian: ``h`` is None)."""
    if cfg.quantizer == "rtn":
        return rtn(w, quantizer)
    return gptq(w, h, quantizer, block=cfg.gptq_block, damp=cfg.damp)


def _residual_planes(resid: torch.Tensor, h: torch.Tensor | None, bits: int, cfg: ConvertConfig) -> dict:
    """The packed planes of one residual width (the quantizer's float copies are freed on return)."""
    rc = cfg.residual
    quantizer = UniformQuantizer(bits, rc.clip_min if bits in rc.clip_bits else 1.0, rc.clip_steps)
    if cfg.quantizer == "rtn":
        r = rtn(resid, quantizer)
    else:
        r = gptq(resid, h, quantizer, block=cfg.gptq_block, damp=cfg.damp, act_order=bits in rc.act_order_bits)
    return pack_residual(r.codes.numpy().astype(np.int8), r.scales.numpy(), bits)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    return (x.T @ x) / x.shape[0]


class _LayerConverter:
    """Quantizes one decoder layer's groups from the two streams' inputs."""

    def __init__(self, layer: torch.nn.Module, index: int, spec: ArchSpec, layouts: dict, levels, cfg) -> None:
        self.layer, self.index, self.spec, self.layouts, self.cfg = layer, index, spec, layouts, cfg
        self.base_q = LloydMaxQuantizer(levels)
        self.ref_hessians: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] = {}
        self.residual: dict[int, dict[str, torch.Tensor]] = {b: {} for b in cfg.residual_bits}

    def _run_hooked(self, h: torch.Tensor, fn, **kw) -> torch.Tensor:
        """Run the layer with ``fn(group, input)`` called before each group's first Linear."""
        handles = [
            self.layer.get_submodule(g.linears[0].name).register_forward_pre_hook(lambda _m, args, g=g: fn(g, args[0]))
            for g in self.spec.groups
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
        layout = self.layouts[g.name]
        s_i, s_os = layout.signs()
        cfg = self.cfg
        w = rotated_group_weight(self.layer, g, layout, cfg.rotation)
        with_h = cfg.quantizer == "gptq"
        h_base = rotate_hessian(_hessian(x), s_i, cfg.rotation) if with_h else None
        base = _quantize(w, h_base, self.base_q, cfg)
        self.base[fmt.base_name(self.index, g.name, "codes")] = fmt.pack_base_codes(base.codes)
        self.base[fmt.base_name(self.index, g.name, "scale")] = base.scales.contiguous()
        resid = w - base.dequant
        del w  # a gate_up group is half a layer: free it before the residuals' own copies
        h_ref = rotate_hessian(self.ref_hessians.pop(g.name), s_i, cfg.rotation) if with_h else None
        for bits in cfg.residual_bits:
            planes = _residual_planes(resid, h_ref, bits, cfg)
            for plane, arr in planes.items():
                self.residual[bits][fmt.resid_name(self.index, g.name, plane)] = torch.from_numpy(arr)
        del resid
        # The base stream continues through the quantized weights.
        for lin, s_o, off in zip(g.linears, s_os, g.row_offsets(), strict=True):
            module = self.layer.get_submodule(lin.name)
            w_base = rot_inv(base.dequant[off : off + lin.d_out], s_o, s_i, cfg.rotation)
            module.weight.data = w_base.to(module.weight.dtype)


def _convert_layers(weights: Weights, calib: torch.Tensor, layouts: list, levels, parts: PartFiles, cfg) -> None:
    """Both calibration streams through every layer; each layer's base and residuals go to files of their
    own as soon as it is done, so only one layer's weights and codes are held at a time."""
    spec = weights.spec
    with torch.no_grad():
        h_ref = weights.embed(calib)
        kws = layer_kwargs(weights.model, spec, h_ref)
        h_base = h_ref.clone()
        for i in tqdm(range(spec.n_layers), desc="convert", unit="layer"):
            with weights.layer(i) as layer:
                conv = _LayerConverter(layer, i, spec, layouts[i], levels, cfg)
                h_ref_next = conv.run_reference(h_ref, **kws[i])
                h_base = conv.run_base(h_base, **kws[i])
                h_ref = h_ref_next
            parts.add(fmt.BASE_FILE, conv.base)
            for b in cfg.residual_bits:
                parts.add(fmt.residual_file(b), conv.residual[b])


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
    for g in spec.groups:
        if g.d_in % fmt.CODE_WORD:
            raise ValueError(f"group {g.name}: d_in {g.d_in} is not a multiple of {fmt.CODE_WORD}; unsupported")
    _, src = hf_folder(model_cfg)
    calib = calibration_tokens(make_split(cfg.data), tokenizer, cfg.data)
    layouts = group_layouts(spec, cfg.seed)
    levels = fit_base_levels(weights, layouts, cfg)
    calib_info = {"sequences": int(calib.shape[0]), "seq_len": int(calib.shape[1]), "data_seed": cfg.data.seed}
    source_sha = source_hash(src)
    cid = fmt.conversion_id(source_sha, cfg.seed, levels.tolist(), calib_info, cfg.rotation)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        parts = PartFiles(tmp / "parts")
        _convert_layers(weights, calib, layouts, levels, parts, cfg)
        for name, tensor in weights.dense():
            parts.add(fmt.DENSE_FILE, {name: tensor})
        roles = {fmt.DENSE_FILE: "dense", fmt.BASE_FILE: "base"}
        roles |= {fmt.residual_file(b): f"residual{b}" for b in cfg.residual_bits}
        parts.join(tmp, {name: fmt.file_metadata(cid, role) for name, role in roles.items()})
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
            "residuals": {str(b): {"bits": b, "file": fmt.residual_file(b)} for b in cfg.residual_bits},
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
        # mkdtemp and safetensors create owner-only modes; actors may run as another user.
        for p in tmp.iterdir():
            p.chmod(0o644)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return ConvertReport(out, time.perf_counter() - t0, peak, levels.tolist())
