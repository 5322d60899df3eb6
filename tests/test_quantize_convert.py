"""The converter itself: deterministic bytes, refusal to overwrite, the CLI."""

from __future__ import annotations

import filecmp
import json

import pytest

from splitspec.config import ConvertConfig, DataConfig, ModelConfig
from splitspec.deploy.cli import main
from splitspec.quantize.convert import convert

ONE_LAYER = {"calib_sequences": 2, "calib_seq_len": 64}


def test_same_input_and_seed_give_the_same_bytes(default_folder, tmp_path):
    cfg = ConvertConfig(residual_bits=(6,), data=DataConfig(**ONE_LAYER))
    model = ModelConfig(source=str(default_folder), num_layers=1)
    a = convert(model, tmp_path / "a", cfg).folder
    b = convert(model, tmp_path / "b", cfg).folder
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "residual6.safetensors" in names
    _match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors
    # nothing but the two folders was left behind (no temporary folders)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_existing_output_is_refused(default_folder, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        convert(ModelConfig(source=str(default_folder), num_layers=1), tmp_path / "out")


def test_too_little_calibration_text_fails_before_writing(default_folder, tmp_path):
    cfg = ConvertConfig(data=DataConfig(calib_sequences=10_000, calib_seq_len=2048, max_conversations_read=50))
    with pytest.raises(ValueError):
        convert(ModelConfig(source=str(default_folder), num_layers=1), tmp_path / "out", cfg)
    assert list(tmp_path.iterdir()) == []


def test_cli_converts(default_folder, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [
        "convert", str(default_folder), str(out), "--residual-bits", "8", "--num-layers", "1",
        "--calib-sequences", "2", "--calib-seq-len", "64", "--rotation", "sylvester",
    ]  # fmt: skip
    assert main(args) == 0
    assert str(out) in capsys.readouterr().out
    assert (out / "residual8.safetensors").is_file() and not (out / "residual6.safetensors").exists()
    assert json.loads((out / "manifest.json").read_text())["rotation"] == "sylvester"


def test_bad_residual_bits_rejected():
    with pytest.raises(ValueError, match="among 6, 7, 8"):
        ConvertConfig(residual_bits=(4,))


def test_default_and_bad_rotation():
    assert ConvertConfig().rotation == "kronecker"
    with pytest.raises(ValueError, match="rotation must be one of sylvester, kronecker; got 'walsh'"):
        ConvertConfig(rotation="walsh")


def test_cli_generates_through_cpu_actor_processes(converted_small, capsys):
    import glob

    shm_before = set(glob.glob("/dev/shm/splitspec-*"))
    assert main(["generate", "--converted", str(converted_small), "--bits", "6", "--max-new-tokens", "4", "Hi"]) == 0
    err = capsys.readouterr().err
    assert "6-bit residual on 1 CPU actor process(es)" in err and "4 tokens" in err
    assert set(glob.glob("/dev/shm/splitspec-*")) <= shm_before  # the actor and its slots are gone


def test_rtn_quantizer_rounds_base_and_residual_to_nearest(default_folder, tmp_path):
    """The quick conversion for timing runs: each group's stored base and residual equal round-to-nearest
    of the rotated weight and of what the base left, recomputed here from the reference."""
    import torch

    from splitspec.models.loader import load_reference
    from splitspec.quantize.convert import _row_tops, rotated_group_weight
    from splitspec.quantize.format import ConvertedModel
    from splitspec.quantize.gptq import LloydMaxQuantizer, UniformQuantizer, rtn

    cfg = ConvertConfig(residual_bits=(8,), quantizer="rtn", lloyd_iters=3, data=DataConfig(**ONE_LAYER))
    model_cfg = ModelConfig(source=str(default_folder), num_layers=1)
    folder = convert(model_cfg, tmp_path / "rtn", cfg).folder
    converted = ConvertedModel(folder)
    assert converted.manifest["gptq"]["quantizer"] == "rtn"
    model, _, spec = load_reference(model_cfg)
    for g in spec.groups:
        w = rotated_group_weight(model.model.layers[0], g, converted.group(0, g.name), converted.rotation)
        base = rtn(w, LloydMaxQuantizer(converted.levels)).dequant
        want = base + rtn(w - base, UniformQuantizer(8, top=_row_tops(w - base, 8))).dequant
        torch.testing.assert_close(converted.rotated_weights(0, g.name, None)[: w.shape[0]], base)
        torch.testing.assert_close(converted.rotated_weights(0, g.name, 8)[: w.shape[0]], want)
    with pytest.raises(ValueError, match="quantizer must be gptq or rtn"):
        ConvertConfig(quantizer="awq")


def test_residual_config_applies_to_its_widths_only():
    """ResidualConfig's MSE clip and act-order reach the 6-bit planes; a width outside clip_bits is byte-identical."""
    import dataclasses

    import numpy as np
    import torch

    from splitspec.config import ResidualConfig
    from splitspec.quantize.convert import _residual_planes, _row_tops
    from splitspec.quantize.gptq import LloydMaxQuantizer, UniformQuantizer, gptq, rtn
    from splitspec.quantize.packing import dequantize_residual, pack_residual

    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 256, generator=g)
    h = x.T @ x / 512
    w = torch.randn(40, 256, generator=g)
    resid = w - rtn(w, LloydMaxQuantizer(torch.tensor([-1.51, -0.45, 0.45, 1.51]))).dequant  # what a base leaves
    plain = ConvertConfig()
    clipped = dataclasses.replace(plain, residual=ResidualConfig(clip_min=0.5, clip_steps=16, clip_bits=(6,)))
    for bits in (6, 7):
        got = _residual_planes(resid, h, bits, clipped)
        top = _row_tops(resid, bits)
        quantizer = UniformQuantizer(bits, 0.5, 16, top=top) if bits == 6 else UniformQuantizer(bits, top=top)
        r = gptq(resid, h, quantizer)
        want = pack_residual(r.codes.numpy().astype(np.int8), r.scales.numpy(), bits)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        same = all(np.array_equal(got[k], v) for k, v in _residual_planes(resid, h, bits, plain).items())
        assert same == (bits == 7)
        dq = dequantize_residual(got, bits, 40, d_in=256)
        assert np.isfinite(dq).all()
    with pytest.raises(ValueError, match="clip_min"):
        ResidualConfig(clip_min=0)
    ordered = dataclasses.replace(plain, residual=ResidualConfig(act_order_bits=(6,)))
    got = _residual_planes(resid, h, 6, ordered)
    r = gptq(resid, h, UniformQuantizer(6, top=_row_tops(resid, 6)), act_order=True)
    want = pack_residual(r.codes.numpy().astype(np.int8), r.scales.numpy(), 6)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_width_map_must_name_groups_and_widths_the_conversion_has(default_folder, tmp_path):
    """A mixed-width map is checked before any work: its groups must exist and its wider widths be
    converted too (the 6-bit file copies their planes)."""
    from splitspec.config import ResidualConfig

    cfg = ConvertConfig(residual=ResidualConfig(widths={"5.qkv": 7}), data=DataConfig(**ONE_LAYER))
    with pytest.raises(ValueError, match=r"residual widths name groups this model lacks: \['5\.qkv'\]"):
        convert(ModelConfig(source=str(default_folder), num_layers=1), tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"lack \[7\]"):
        ConvertConfig(residual_bits=(6, 8), residual=ResidualConfig(widths={"0.o": 7}))
    with pytest.raises(ValueError, match=r"lack \[6\]"):
        ConvertConfig(residual_bits=(7,), residual=ResidualConfig(widths={"0.o": 7}))
