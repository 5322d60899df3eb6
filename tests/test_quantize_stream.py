"""Streamed conversion: one layer at a time from the shards, the same bytes as the whole model in RAM."""

from __future__ import annotations

import filecmp
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MIXED_WIDTHS, SMALL_CALIB
from splitspec.config import ConvertConfig, DataConfig, ModelConfig, ResidualConfig
from splitspec.models.loader import load_reference
from splitspec.models.stream import StreamedModel
from splitspec.quantize.concat import DTYPE_ORDER, PartFiles, concat_safetensors, save_tensors
from splitspec.quantize.convert import convert
from splitspec.quantize.partial import ResumeError

WRITTEN = ["base.safetensors", "residual6.safetensors", "residual7.safetensors", "residual8.safetensors"]
TINY_CALIB = {"calib_sequences": 2, "calib_seq_len": 64}


@pytest.fixture(scope="module")
def sharded_bf16(default_folder, tmp_path_factory):
    """A random two-layer Llama with an untied head, saved in bfloat16 over several shards with an index,
    with the default model's tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("sharded") / "llama-bf16"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="4MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_folder / name, folder / name)
    return folder


def test_streamed_conversion_writes_the_bytes_of_the_resident_one(default_folder, converted_small, tmp_path):
    """``converted_small`` is streamed (the default) and quantizes its groups whole; the whole model in RAM,
    its gate and up Linears quantized by GPTQ 576 rows at a time, gives the same files."""
    blocks = {"quantize_block_mib": 0.3, "gptq_block_rows_per_input": 1}
    mixed = ResidualConfig(widths=MIXED_WIDTHS)  # converted_small's
    cfg = ConvertConfig(stream=False, data=DataConfig(**SMALL_CALIB), residual=mixed, **blocks)
    resident = convert(ModelConfig(source=str(default_folder), num_layers=2), tmp_path / "resident", cfg).folder
    names = [*WRITTEN, "dense.safetensors", "config.json"]
    _match, mismatch, errors = filecmp.cmpfiles(converted_small, resident, names, shallow=False)
    assert not mismatch and not errors


def test_sharded_bf16_source_streams_to_the_same_bytes(sharded_bf16, tmp_path):
    assert (sharded_bf16 / "model.safetensors.index.json").is_file()
    assert len(list(sharded_bf16.glob("*.safetensors"))) > 2
    model = ModelConfig(source=str(sharded_bf16))
    folders = []
    for stream in (True, False):
        cfg = ConvertConfig(residual_bits=(8,), stream=stream, lloyd_iters=3, data=DataConfig(**TINY_CALIB))
        folders.append(convert(model, tmp_path / str(stream), cfg).folder)
    names = ["base.safetensors", "residual8.safetensors", "dense.safetensors", "manifest.json"]
    _match, mismatch, errors = filecmp.cmpfiles(*folders, names, shallow=False)
    assert not mismatch and not errors


def test_a_layer_holds_its_float32_weights_only_while_in_use(sharded_bf16):
    streamed = StreamedModel(ModelConfig(source=str(sharded_bf16)))
    reference, _, _ = load_reference(ModelConfig(source=str(sharded_bf16)))
    assert all(p.is_meta for p in streamed.model.parameters())
    with streamed.layer(1) as layer:
        want = reference.model.layers[1].state_dict()
        got = layer.state_dict()
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v)
    assert all(p.is_meta for p in streamed.model.parameters())
    assert "lm_head.weight" in dict(streamed.dense())  # untied: the head is kept in the folder


def test_concat_writes_what_save_file_writes(tmp_path):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i, code in enumerate(DTYPE_ORDER):
        dtype = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
                 "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
                 "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}[code]  # fmt: skip
        for name in (f"z.{i}", f"a.{i}"):
            tensors[name] = torch.randint(0, 2, (3, i + 1), generator=gen).to(dtype)
    metadata = {"splitspec": '{"role": "base", "quote": "\\""}'}
    save_file(tensors, tmp_path / "whole.safetensors", metadata=metadata)
    save_tensors(tensors, tmp_path / "direct.safetensors", metadata)
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    names = sorted(tensors)
    parts = [tmp_path / "p0.safetensors", tmp_path / "p1.safetensors"]
    save_file({k: tensors[k] for k in names[::2]}, parts[0])
    save_file({k: tensors[k] for k in names[1::2]}, parts[1])
    concat_safetensors(parts, tmp_path / "joined.safetensors", metadata)
    assert (tmp_path / "joined.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(ValueError, match="in both"):
        concat_safetensors([parts[0], parts[0]], tmp_path / "twice.safetensors", metadata)


def test_a_join_that_fails_keeps_what_it_joined_and_resumes(tmp_path):
    """``PartFiles.join`` drops a file's pieces once the file is whole; one that fails (here two pieces
    holding one tensor) leaves no half-written file and keeps its pieces; the next join writes the rest
    and leaves the files it wrote before as they were."""
    from safetensors.torch import load_file

    parts, out = PartFiles(tmp_path / "parts"), tmp_path / "out"
    out.mkdir()
    parts.add("a.safetensors", "0", {"x": torch.arange(4.0)})
    parts.add("a.safetensors", "1", {"y": torch.ones(2)})
    parts.add("b.safetensors", "0", {"z": torch.zeros(3)})
    parts.add("b.safetensors", "1", {"z": torch.zeros(3)})
    metadata = {"a.safetensors": {"role": "a"}, "b.safetensors": {"role": "b"}}
    with pytest.raises(ValueError, match="in both"):
        parts.join(out, metadata)
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors"]
    assert sorted(p.name for p in parts.folder.iterdir()) == ["b.safetensors"]
    written = (out / "a.safetensors").stat().st_mtime_ns
    parts.discard(lambda key: key == "1")
    parts.join(out, metadata)
    assert (out / "a.safetensors").stat().st_mtime_ns == written and not parts.folder.exists()
    assert torch.equal(load_file(out / "a.safetensors")["x"], torch.arange(4.0))
    assert torch.equal(load_file(out / "b.safetensors")["z"], torch.zeros(3))


def test_a_join_killed_while_it_dropped_a_files_pieces_keeps_the_whole_file(tmp_path):
    """A file appears in ``out`` only whole, so where a join was killed while removing its pieces the next
    join drops the pieces left, rather than joining them into a file that lacks the removed ones."""
    from safetensors.torch import load_file

    parts, out = PartFiles(tmp_path / "parts"), tmp_path / "out"
    out.mkdir()
    parts.add("a.safetensors", "0", {"x": torch.arange(4.0)})
    parts.add("a.safetensors", "1", {"y": torch.ones(2)})
    parts.join(out, {"a.safetensors": {"role": "a"}})
    whole = (out / "a.safetensors").read_bytes()
    parts = PartFiles(tmp_path / "parts")
    parts.add("a.safetensors", "1", {"y": torch.ones(2)})  # what a kill after removing piece 0 leaves
    parts.join(out, {"a.safetensors": {"role": "a"}})
    assert (out / "a.safetensors").read_bytes() == whole and not parts.folder.exists()
    assert load_file(out / "a.safetensors").keys() == {"x", "y"}


def test_a_folder_without_safetensors_is_refused_with_the_way_out(tmp_path):
    from splitspec.models.loader import ModelLoadError
    from splitspec.models.stream import ShardIndex

    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors to stream layers from; convert with --no-stream"):
        ShardIndex(tmp_path)


KILL_CONVERSION = """
import os, signal, sys
from splitspec.config import ConvertConfig, DataConfig, ModelConfig, ResidualConfig
from splitspec.quantize import concat, partial
from splitspec.quantize.convert import convert
{die}
data = DataConfig(calib_sequences={calib_sequences}, calib_seq_len={calib_seq_len})
cfg = ConvertConfig(data=data, residual=ResidualConfig(widths={widths!r}))
convert(ModelConfig(source=sys.argv[1], num_layers=2), sys.argv[2], cfg)
"""
IN_SECOND_LAYER = """
add = concat.PartFiles.add

def add_then_die(self, name, key, tensors):
    add(self, name, key, tensors)
    if key.startswith("layer000001."):  # the second layer's first part is on disk: die mid-layer
        os.kill(os.getpid(), signal.SIGKILL)

concat.PartFiles.add = add_then_die
"""
BEFORE_THE_LAST_STATE = """
write_state = partial.WorkFolder._write_state

def die_before_the_state_of_two_layers(self):
    if self.layers_done == 2:  # the activations after the last layer are on disk, the state says 1 layer
        os.kill(os.getpid(), signal.SIGKILL)
    write_state(self)

partial.WorkFolder._write_state = die_before_the_state_of_two_layers
"""


def _kill_conversion(die: str, source: Path, out: Path) -> None:
    """Run the conversion of ``converted_small``'s settings from ``source`` into ``out`` in a child process
    that ``die`` SIGKILLs."""
    script = KILL_CONVERSION.format(die=die, **SMALL_CALIB, widths=MIXED_WIDTHS)
    child = [sys.executable, "-c", script, str(source), str(out)]
    assert subprocess.run(child, capture_output=True, timeout=600).returncode == -9


def test_a_killed_conversion_resumes_to_the_same_bytes(default_folder, converted_small, tmp_path, caplog, capsys):
    """A conversion SIGKILLed in its second layer keeps its first; the same command resumes there and writes
    the bytes of ``converted_small`` (an uninterrupted run of the same settings); other settings are refused."""
    out = tmp_path / "out"
    _kill_conversion(IN_SECOND_LAYER, default_folder, out)
    partial = tmp_path / ".out.partial"
    assert not out.exists() and json.loads((partial / "state.json").read_text())["layers_done"] == 1
    model = ModelConfig(source=str(default_folder), num_layers=2)
    mixed = ResidualConfig(widths=MIXED_WIDTHS)
    with pytest.raises(ResumeError, match=r"other settings \(convert\.seed differ\).*remove .*\.out\.partial"):
        convert(model, out, ConvertConfig(seed=1, data=DataConfig(**SMALL_CALIB), residual=mixed))
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="splitspec.quantize.convert"):
        convert(model, out, ConvertConfig(data=DataConfig(**SMALL_CALIB), residual=mixed))
    assert "at layer 1 of 2" in caplog.text
    assert "convert: 100%" in capsys.readouterr().err  # the progress bar, started at 1 of 2 layers
    names = [*WRITTEN, "dense.safetensors", "config.json", "manifest.json"]
    _match, mismatch, errors = filecmp.cmpfiles(converted_small, out, names, shallow=False)
    assert not mismatch and not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_conversion_killed_between_its_activations_and_its_state_resumes_to_the_same_bytes(
    default_folder, converted_small, tmp_path, caplog
):
    """Killed after writing the activations after its last layer but before the state that says so, a
    conversion resumes after that layer (its parts were written before the activations), not at it: that
    layer converted again would be fed its own output."""
    out = tmp_path / "out"
    _kill_conversion(BEFORE_THE_LAST_STATE, default_folder, out)
    assert json.loads((tmp_path / ".out.partial" / "state.json").read_text())["layers_done"] == 1
    with caplog.at_level(logging.WARNING, logger="splitspec.quantize.convert"):
        cfg = ConvertConfig(data=DataConfig(**SMALL_CALIB), residual=ResidualConfig(widths=MIXED_WIDTHS))
        convert(ModelConfig(source=str(default_folder), num_layers=2), out, cfg)
    assert "at layer 2 of 2" in caplog.text
    names = [*WRITTEN, "dense.safetensors", "config.json", "manifest.json"]
    _match, mismatch, errors = filecmp.cmpfiles(converted_small, out, names, shallow=False)
    assert not mismatch and not errors


def test_an_edited_config_json_is_not_resumed_into(default_folder, tmp_path):
    """The source's config.json shapes the bytes as its weights do: a conversion interrupted before it was
    edited is refused, naming it, rather than finished under the new one."""
    source = tmp_path / "source"
    source.mkdir()
    for f in default_folder.iterdir():
        if f.name == "config.json":
            shutil.copy(f, source / f.name)
        else:
            (source / f.name).symlink_to(f)
    out = tmp_path / "out"
    _kill_conversion(IN_SECOND_LAYER, source, out)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    cfg = ConvertConfig(data=DataConfig(**SMALL_CALIB), residual=ResidualConfig(widths=MIXED_WIDTHS))
    with pytest.raises(ResumeError, match=r"other settings \(config_sha256 differ\)"):
        convert(ModelConfig(source=str(source), num_layers=2), out, cfg)


# Run in a user and mount namespace of its own (no privileges needed): $1 becomes a tmpfs, first too small
# for the folder, then large enough but filled up (to 50 MB free) once the conversion has started.
FULL_DISK = """\
set -e
disk=$1 python=$2 source=$3 widths=$4 seen=$5
mount -t tmpfs -o size=100M tmpfs "$disk"
convert() {{ "$python" -m splitspec.deploy.cli convert "$source" "$disk/out" --num-layers 2 --no-fit-tree \
    --calib-sequences {calib_sequences} --calib-seq-len {calib_seq_len} --residual-widths "$widths" \
    2> "$seen/$1.err"; }}
convert refused || echo $? > "$seen/refused.rc"
ls -A "$disk" > "$seen/refused.ls"
mount -o remount,size=400M "$disk"
convert full & pid=$!
for i in $(seq 600); do [ -e "$disk/.out.partial/state.json" ] && break; sleep 0.05; done
fallocate -l $(( $(df --output=avail -B1 "$disk" | tail -1) - 50000000 )) "$disk/filler"
wait $pid || echo $? > "$seen/full.rc"
find "$disk/.out.partial" > "$seen/kept.txt"
cp "$disk/.out.partial/state.json" "$seen/state.json"
rm "$disk/filler"
convert resumed
cp -r "$disk/out" "$seen/out"
"""


def test_a_full_disk_ends_the_conversion_in_one_line_and_loses_nothing(
    default_folder, converted_small, tmp_path, own_mounts
):
    """A disk too small for the folder refuses the conversion before any work; a disk that fills up while
    converting ends it in one line that says where, what is kept and what to do, exit status 2, no
    half-written file left taking room; once there is room the same command resumes and writes the bytes
    of ``converted_small``."""
    disk, seen = tmp_path / "disk", tmp_path / "seen"
    disk.mkdir()
    seen.mkdir()
    widths = tmp_path / "widths.json"
    widths.write_text(json.dumps(MIXED_WIDTHS))
    script = FULL_DISK.format(**SMALL_CALIB)
    cmd = [*own_mounts, "sh", "-c", script, "sh"]
    cmd += [str(disk), sys.executable, str(default_folder), str(widths), str(seen)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]

    def error(step: str) -> str:
        assert (seen / f"{step}.rc").read_text().strip() == "2"
        err = (seen / f"{step}.err").read_text()
        assert "Traceback" not in err, err
        return err.strip().splitlines()[-1]

    refused = error("refused")
    assert refused.startswith(f"splitspec convert: error: converting into {disk}/out needs at least 0.2"), refused
    assert "GB more on its disk (a 0.13 GB folder, its largest file twice while it is assembled)" in refused
    assert (seen / "refused.ls").read_text() == ""  # nothing written
    full = error("full")
    assert full.startswith(f"splitspec convert: error: no space left on the disk of {disk} ("), full
    assert f"2 of 2 layers are done and kept in {disk}/.out.partial; free space there and run the same" in full
    assert json.loads((seen / "state.json").read_text())["layers_done"] == 2
    assert not [line for line in (seen / "kept.txt").read_text().splitlines() if line.endswith(".tmp")]
    names = [*WRITTEN, "dense.safetensors", "config.json", "manifest.json"]
    _match, mismatch, errors = filecmp.cmpfiles(converted_small, seen / "out", names, shallow=False)
    assert not mismatch and not errors


@pytest.mark.parametrize("quantizer", ["gptq", "rtn"])
def test_residual_rows_arriving_in_pieces_pack_like_the_whole_group(quantizer):
    """A group's residual quantized as its Linears' rows come in, the pieces not whole 16-row tiles (a
    Linear of 10 or 22 rows), gives the planes of the whole group at once."""
    import numpy as np

    from splitspec.quantize.convert import _residual_planes, _ResidualRows

    gen = torch.Generator().manual_seed(3)
    resid = torch.randn(53, 256, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    h = x.T @ x / 512 if quantizer == "gptq" else None
    cfg = ConvertConfig(quantizer=quantizer, residual_bits=(6, 8))
    rows = _ResidualRows(53, h, cfg, cfg.residual_bits)
    for a, b in ((0, 10), (10, 32), (32, 37), (37, 53)):
        rows.add(resid[a:b])
    widths = []
    for bits, planes in rows.planes():
        want = _residual_planes(resid, h, bits, cfg)
        assert planes.keys() == want.keys() and all(np.array_equal(planes[k], want[k]) for k in want)
        widths.append(bits)
    assert widths == [6, 8]
