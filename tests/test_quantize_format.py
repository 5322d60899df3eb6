"""The converted folder: what the actors read, and the errors a bad folder gives."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.config import ConvertConfig, DataConfig, ModelConfig, ResidualConfig
from splitspec.models.files import CorruptFileError
from splitspec.models.loader import load_reference
from splitspec.quantize import format as fmt
from splitspec.quantize import packing


def test_base_codes_round_trip():
    codes = torch.randint(0, 4, (37, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    planes = fmt.pack_base_codes(codes)
    assert planes.shape == (37, 3, 2) and planes.dtype == torch.int32
    assert torch.equal(fmt.unpack_base_codes(planes), codes)
    with pytest.raises(ValueError, match="multiple of 32"):
        fmt.pack_base_codes(codes[:, :40])


def test_opened_folder_describes_the_model(converted_small):
    cm = fmt.ConvertedModel(converted_small, verify=True)
    assert cm.residual_bits == (6, 7, 8) and len(cm.layers) == 2 and cm.spec.n_layers == 2
    lv = cm.levels
    assert lv.shape == (4,) and torch.allclose(lv, -lv.flip(0)) and 0.3 < lv[2] < 0.6 and 1.3 < lv[3] < 1.7
    qkv = cm.group(1, "qkv")
    assert (qkv.d_in, qkv.rows, [lin["rows"] for lin in qkv.linears]) == (576, 960, [576, 192, 192])
    planes, scale = cm.base(1, "qkv")
    assert planes.shape == (960, 18, 2) and scale.shape == (960, 5) and scale.dtype == torch.float16
    resid = cm.residual(7, 1, "gate_up")
    assert set(resid) == {"words0", "words1", "words2", "scale", "scale_top"}
    assert [resid[f"words{i}"].shape for i in range(3)] == [(3072 // 16, 576 // 16, k, 16) for k in (4, 2, 1)]
    resid = cm.residual(6, 1, "down")
    assert [resid[f"words{i}"].shape for i in range(3)] == [(576 // 16, 1536 // 8, 1, 16)] * 3
    assert resid["words0"].dtype == np.uint16 and resid["scale"].shape == (576 // 16, 12, 16)
    assert resid["scale"].dtype == np.uint8 and resid["scale_top"].shape == (576 // 16,)
    resid = cm.residual(8, 1, "qkv")
    assert set(resid) == {"words0", "words1", "words2", "scale", "scale_top"}
    assert [resid[f"words{i}"].shape for i in range(3)] == [(960 // 16, 576 // 8, k, 16) for k in (2, 1, 1)]


def test_verifier_weights_approach_the_original_as_bits_grow(converted_small, default_folder):
    cm = fmt.ConvertedModel(converted_small)
    model = load_reference(ModelConfig(source=str(default_folder), num_layers=2))[0]
    errors = {}
    for bits in (None, 6, 7, 8):
        num = den = 0.0
        for i in range(2):
            for g in cm.spec.groups:
                for name, w in cm.linear_weights(i, g.name, bits).items():
                    ref = model.model.layers[i].get_submodule(name).weight
                    num += float((w - ref.detach()).square().sum())
                    den += float(ref.detach().square().sum())
        errors[bits] = (num / den) ** 0.5
    # 2-bit alone is coarse; each residual bit roughly halves the error.
    assert 0.2 < errors[None] < 0.6
    assert errors[6] < errors[None] / 10 and errors[7] < errors[6] * 0.7 and errors[8] < errors[7] * 0.7


def test_tile_slices_read_the_same_rows(converted_small):
    cm = fmt.ConvertedModel(converted_small)
    whole = cm.residual(6, 0, "qkv")
    part = cm.residual(6, 0, "qkv", tiles=(3, 17))
    for plane, arr in part.items():
        np.testing.assert_array_equal(arr, whole[plane][3:17])
        assert arr.flags.c_contiguous
    layout = cm.group(0, "qkv")
    full = packing.dequantize_residual(whole, 6, layout.rows, d_in=layout.d_in)
    np.testing.assert_array_equal(
        packing.dequantize_residual(part, 6, 14 * 16, d_in=layout.d_in), full[48 : 48 + 14 * 16]
    )


@pytest.fixture
def folder_copy(converted_small, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(converted_small, copy)
    return copy


def test_truncated_residual_is_named(folder_copy):
    path = folder_copy / "residual6.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CorruptFileError, match=r"residual6\.safetensors: size .* the manifest says .*truncated"):
        fmt.ConvertedModel(folder_copy)


def test_file_from_another_conversion_is_refused(folder_copy):
    path = folder_copy / "residual8.safetensors"
    tensors = load_file(path)
    manifest = json.loads((folder_copy / fmt.MANIFEST).read_text())
    other = "0" * len(manifest["conversion_id"])
    save_file(tensors, path, metadata=fmt.file_metadata(other, "residual8"))
    manifest["files"][path.name]["bytes"] = path.stat().st_size
    (folder_copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError, match=r"residual8\.safetensors: belongs to conversion '0+'"):
        fmt.ConvertedModel(folder_copy)


def test_file_of_another_role_is_refused(folder_copy):
    """The 7-bit residual copied over the 8-bit one (the manifest's size made to match) is the same
    conversion's file, but not the one that name holds: read as 8-bit planes it would be garbage."""
    path = folder_copy / "residual8.safetensors"
    shutil.copy(folder_copy / "residual7.safetensors", path)
    manifest = json.loads((folder_copy / fmt.MANIFEST).read_text())
    manifest["files"][path.name]["bytes"] = path.stat().st_size
    (folder_copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorruptFileError, match=r"residual8\.safetensors: holds the 'residual7' tensors, not"):
        fmt.ConvertedModel(folder_copy)


def test_flipped_byte_is_caught_by_verify(folder_copy):
    path = folder_copy / "base.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    fmt.ConvertedModel(folder_copy)  # a cheap open checks headers and sizes only
    with pytest.raises(CorruptFileError, match=r"base\.safetensors: sha256 differs"):
        fmt.ConvertedModel(folder_copy, verify=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: "{not json", r"manifest\.json: not valid JSON"),
        (
            lambda m: json.dumps({**m, "format_version": 99}),
            r"format_version 99, this splitspec reads 1, 2, 3, 4, 5, 6",
        ),
        (lambda m: json.dumps({**m, "rotation": "walsh"}), r"unknown rotation 'walsh'.*newer splitspec"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "layers"}), r"malformed field.*layers"),
        (lambda m: json.dumps({**m, "format": "other"}), "not a splitspec manifest"),
        (
            lambda m: json.dumps({k: v for k, v in m.items() if k != "rotation"}),
            r"no rotation kind, which every folder from format 2 on records: corrupt, re-convert the model",
        ),
        (
            lambda m: json.dumps({**m, "files": {**m["files"], "base.safetensors": {"sha256": "0"}}}),
            r"malformed field.*'bytes'",
        ),
        (lambda m: json.dumps({**m, "files": {"base.safetensors": 5}}), r"malformed field"),
        (lambda m: json.dumps({**m, "files": ["base.safetensors"]}), r"malformed field"),
        (
            lambda m: json.dumps(
                {**m, "residuals": {**m["residuals"], "6": {**m["residuals"]["6"], "widths": {"1.o": 5}}}}
            ),
            r"the 6-bit residual's widths \{'1\.o': 5\}.*re-convert",
        ),
        (
            lambda m: json.dumps(
                {**m, "residuals": {**m["residuals"], "6": {**m["residuals"]["6"], "widths": {"9.o": 7}}}}
            ),
            r"the 6-bit residual's widths \{'9\.o': 7\}.*re-convert",
        ),
    ],
)
def test_bad_manifest_errors(folder_copy, edit, message):
    path = folder_copy / fmt.MANIFEST
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(CorruptFileError, match=message):
        fmt.ConvertedModel(folder_copy)


def test_missing_file_and_folder(folder_copy, tmp_path):
    (folder_copy / "residual7.safetensors").unlink()
    with pytest.raises(CorruptFileError, match=r"residual7\.safetensors: missing"):
        fmt.ConvertedModel(folder_copy)
    with pytest.raises(CorruptFileError, match=r"manifest\.json: missing: not a splitspec converted folder"):
        fmt.ConvertedModel(tmp_path)


def test_mixed_widths_are_read_at_each_groups_width(converted_small):
    """The 6-bit residual stores the groups its manifest widens at their wider width, byte for byte the
    planes of that width's own file (the same GPTQ of the same base), and the rest at 6 bits; the 7- and
    8-bit residuals are uniform."""
    from conftest import MIXED_WIDTHS

    cm = fmt.ConvertedModel(converted_small)
    assert cm.widths[6] == MIXED_WIDTHS and cm.widths[7] == cm.widths[8] == {}
    for layer in range(2):
        for group in ("qkv", "o", "gate_up", "down"):
            width = MIXED_WIDTHS.get(f"{layer}.{group}", 6)
            assert cm.residual_width(6, layer, group) == width and cm.residual_width(7, layer, group) == 7
            got, want = cm.residual(6, layer, group), cm.residual(width, layer, group)
            assert set(got) == set(want) and all(np.array_equal(got[p], want[p]) for p in got)
    weights = [cm.residual_bits_per_weight(b) for b in (6, 7, 8)]
    assert 6 < weights[0] < weights[1] < weights[2] < 8.1


def test_missing_residual_width_is_a_clear_error(converted_small):
    cm = fmt.ConvertedModel(converted_small)
    with pytest.raises(ValueError, match="no 5-bit residual"):
        cm.residual(5, 0, "qkv")


@pytest.mark.parametrize("kind", ["kronecker", "sylvester"])
def test_rotation_kind_round_trips(converted_small, converted_sylvester, default_folder, kind):
    """The manifest records the kind, the reader applies it (read with the other kind, every weight is
    garbage), and the conversion id tells kinds apart. converted_small has the default kind."""
    cm = fmt.ConvertedModel(converted_small if kind == "kronecker" else converted_sylvester)
    assert (cm.manifest["rotation"], cm.rotation) == (kind, kind)
    assert cm.manifest["format_version"] == fmt.FORMAT_VERSION == 6
    from splitspec.quantize.convert import written_settings

    key = ("0" * 64, "1" * 64, [0.5])
    sylvester = written_settings(ConvertConfig(rotation="sylvester"), 1)
    assert fmt.conversion_id(*key, sylvester) != fmt.conversion_id(*key, written_settings(ConvertConfig(), 1))
    model = load_reference(ModelConfig(source=str(default_folder), num_layers=1))[0]
    for name, group in (("mlp.down_proj", "down"), ("self_attn.k_proj", "qkv")):
        ref = model.model.layers[0].get_submodule(name).weight.detach()
        w = cm.linear_weights(0, group, 8)[name]
        assert float((w - ref).norm() / ref.norm()) < 0.01
        cm.rotation = "sylvester" if kind == "kronecker" else "kronecker"
        w = cm.linear_weights(0, group, 8)[name]
        assert float((w - ref).norm() / ref.norm()) > 1
        cm.rotation = kind


def test_conversion_id_covers_every_setting_that_changes_the_bytes():
    """Two conversions differing only in how they quantize must not share an id (a CPU actor would take the
    other one's residual shard); the settings that change only how the conversion runs do not change it."""
    from splitspec.quantize.convert import written_settings

    plain = ConvertConfig()
    others = [
        dataclasses.replace(plain, quantizer="rtn"),
        dataclasses.replace(plain, damp=0.02),
        dataclasses.replace(plain, gptq_block=64),
        dataclasses.replace(plain, residual=ResidualConfig(clip_min=0.5)),
        dataclasses.replace(plain, residual=ResidualConfig(act_order_bits=(6,))),
        dataclasses.replace(plain, residual=ResidualConfig(widths={"0.o": 7})),
        dataclasses.replace(plain, data=DataConfig(calib_chars_per_token=5.0)),
    ]
    key = ("0" * 64, "1" * 64, [0.5])
    ids = {fmt.conversion_id(*key, written_settings(cfg, 2)) for cfg in [plain, *others]}
    ids |= {fmt.conversion_id(*key, written_settings(plain, 3)), fmt.conversion_id("0" * 64, "2" * 64, [0.5], {})}
    assert len(ids) == len(others) + 3
    same = dataclasses.replace(plain, stream=False, quantize_block_mib=1.0, gptq_block_rows_per_input=1.0)
    assert fmt.conversion_id(*key, written_settings(same, 2)) == fmt.conversion_id(*key, written_settings(plain, 2))


def test_version_1_manifest_means_sylvester(folder_copy):
    """Folders from before the rotation kind existed stay readable, as what they are (sylvester), even
    though the default is now kronecker."""
    path = folder_copy / fmt.MANIFEST
    m = json.loads(path.read_text())
    del m["rotation"]
    path.write_text(json.dumps({**m, "format_version": 1}))
    assert fmt.ConvertedModel(folder_copy).rotation == "sylvester"


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_older_folder_refuses_every_residual(folder_copy, converted_small, version):
    """Before version 6 every residual width was in another layout (bit planes, format 3's 4 × 4 word map,
    an int8 plane for 8 bits, fp16 scales): read as today's planes they would be garbage, so all are
    refused with the fix; the base and dense tensors did not change and still read."""
    path = folder_copy / fmt.MANIFEST
    m = json.loads(path.read_text())
    if version == 1:
        del m["rotation"]
    path.write_text(json.dumps({**m, "format_version": version}))
    old, current = fmt.ConvertedModel(folder_copy), fmt.ConvertedModel(converted_small)
    assert old.residual_bits == (6, 7, 8)
    for bits in (6, 7, 8):
        message = (
            rf"residual{bits}\.safetensors: the folder is format_version {version}: its {bits}-bit residual is in "
            rf"an older layout, which this splitspec \(format {fmt.FORMAT_VERSION}\) no longer reads; re-convert "
            r"the model \(`splitspec convert`\)"
        )
        with pytest.raises(CorruptFileError, match=message):
            old.check_residual(bits)
        with pytest.raises(CorruptFileError, match=message):
            old.residual(bits, 0, "qkv")
        with pytest.raises(CorruptFileError, match=message):
            old.rotated_weights(0, "o", bits)
    for name in ("qkv", "down"):
        for a, b in zip(old.base(1, name), current.base(1, name), strict=True):
            assert torch.equal(a, b)
    dense, current_dense = old.dense(), current.dense()
    assert dense.keys() == current_dense.keys()
    assert all(torch.equal(t, current_dense[k]) for k, t in dense.items())
    assert torch.equal(old.rotated_weights(0, "o", None), current.rotated_weights(0, "o", None))
