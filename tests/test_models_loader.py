"""Each loader path gives the same float32 reference; bad files fail with their name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from splitspec.config import ModelConfig
from splitspec.models.files import CorruptFileError
from splitspec.models.loader import ModelLoadError, default_gguf, load_reference, resolve

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        return model(ids).logits[0]


def test_gguf_hf_folder_and_safetensors_file_give_the_same_logits(reference, default_folder):
    from transformers import AutoModelForCausalLM

    model, tokenizer, _ = reference
    gguf = default_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    from_file = load_reference(ModelConfig(source=str(default_folder / "model.safetensors")))[0]
    expected = _logits(direct, tokenizer)
    assert expected.abs().max() > 1.0  # a real model, not zeros
    torch.testing.assert_close(_logits(model, tokenizer), expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(_logits(from_file, tokenizer), expected, rtol=0, atol=1e-4)


def test_default_source_resolves_to_the_packaged_gguf():
    src = resolve(None)
    assert src.kind == "gguf" and src.file.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_truncated_reference_keeps_the_first_layers(default_folder, reference):
    model, _, spec = load_reference(ModelConfig(source=str(default_folder), num_layers=2))
    assert len(model.model.layers) == 2 and spec.n_layers == 2
    full = reference[0]
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.weight, full.model.layers[1].mlp.down_proj.weight)


def test_truncated_safetensors_names_the_file(default_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(default_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: truncated"):
        load_reference(ModelConfig(source=str(folder)))


def test_a_bare_safetensors_file_that_is_not_the_config_s_is_refused(default_folder, tmp_path):
    """A tensor the config's model needs is missing, or one it has no place for is there: the error names the
    file and the tensors, before any weight is loaded into the model."""
    from safetensors.torch import load_file, save_file

    state = load_file(default_folder / "model.safetensors")
    dropped, extra = "model.layers.0.mlp.down_proj.weight", "model.layers.99.mlp.down_proj.weight"
    for name, tensors in (
        (dropped, {k: v for k, v in state.items() if k != dropped}),
        (extra, state | {extra: state[dropped].clone()}),
    ):
        folder = tmp_path / name.split(".")[2]
        shutil.copytree(default_folder, folder)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=rf"model\.safetensors: weights do not match config\.json .*{name}"):
            load_reference(ModelConfig(source=str(folder / "model.safetensors")))


def test_corrupt_safetensors_header_names_the_file(default_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(default_folder, folder)
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: .*corrupt safetensors header"):
        load_reference(ModelConfig(source=str(folder)))


def test_truncated_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(default_gguf().read_bytes()[:5_000_000])
    with pytest.raises(CorruptFileError, match=r"broken\.gguf: not a readable GGUF"):
        load_reference(ModelConfig(source=str(bad), cache_dir=tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_corrupt_config_names_the_file(default_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(default_folder, folder)
    (folder / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CorruptFileError, match=r"config\.json: not valid JSON"):
        load_reference(ModelConfig(source=str(folder)))


def test_missing_source_and_bare_safetensors_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file or folder"):
        resolve(tmp_path / "nope")
    lone = tmp_path / "w.safetensors"
    lone.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"needs a config\.json beside it"):
        resolve(lone)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a model folder"):
        resolve(tmp_path / "empty")


def test_config_json_records_its_gguf_source(default_folder):
    source = json.loads((default_folder / "config.json").read_text())["splitspec_source"]
    assert source["file"].endswith(".gguf") and len(source["sha256"]) == 64


def _tiny_gguf(path, architecture: str) -> None:
    """A GGUF holding one small tensor and the metadata of ``architecture``."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture", ["gpt2", "nosucharch"])
def test_unsupported_gguf_is_refused_from_its_metadata_and_caches_nothing(tmp_path, monkeypatch, architecture):
    import time

    from splitspec.models import loader
    from splitspec.models.spec import UnsupportedArchitectureError

    path = tmp_path / f"{architecture}.gguf"
    _tiny_gguf(path, architecture)

    def no_weights(*_):
        raise AssertionError("the weights were read before the architecture check")

    monkeypatch.setattr(loader, "_weights_sha256", no_weights)
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedArchitectureError, match=rf"{architecture}\.gguf: .*{architecture}.*supports llama"):
        load_reference(ModelConfig(source=str(path), cache_dir=cache))
    assert time.perf_counter() - t0 < 30
    assert not cache.exists() or not any(cache.iterdir())


def test_a_gguf_folder_another_process_published_first_is_kept(tmp_path):
    """Two processes converting one GGUF at once: the second's rename onto the first's whole folder (not
    empty, so ENOTEMPTY rather than EEXIST) keeps the first's and drops its own; a folder in the way that
    is not a converted one is refused with what to do."""
    from splitspec.models.loader import _publish

    def folder(name: str, config: bool) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "model.safetensors").write_text(name)
        if config:
            (path / "config.json").write_text("{}")
        return path

    first, second = folder("target", config=True), folder(".tmp-second", config=True)
    _publish(second, first)
    assert not second.exists() and (first / "model.safetensors").read_text() == "target"
    new = folder("new", config=True)
    _publish(new, tmp_path / "fresh")
    assert not new.exists() and (tmp_path / "fresh" / "model.safetensors").read_text() == "new"
    stray, third = folder("stray", config=False), folder(".tmp-third", config=True)
    with pytest.raises(ModelLoadError, match=r"stray: in the way of the GGUF's converted folder.*remove it"):
        _publish(third, stray)
