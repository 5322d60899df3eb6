"""Shared, session-scoped fixtures: the expensive things (the default model) are loaded once."""

from __future__ import annotations

import pytest
import torch

from splitspec.config import ModelConfig
from splitspec.models.loader import hf_folder, load_reference

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_folder():
    """The default model as a cached float32 HF folder (converted from its GGUF on first use)."""
    folder, _ = hf_folder(ModelConfig())
    return folder


@pytest.fixture(scope="session")
def reference(default_folder):
    """(float32 model, tokenizer, ArchSpec) of the whole default model."""
    return load_reference(ModelConfig(source=str(default_folder)))


@pytest.fixture(scope="session")
def tokenizer(default_folder):
    """The default tokenizer alone: tests of text handling need it without the model's weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_folder)


SMALL_CALIB = {"calib_sequences": 4, "calib_seq_len": 128}


@pytest.fixture(scope="session")
def converted_small(default_folder, tmp_path_factory):
    """The default model truncated to 2 layers, converted with 4 × 128 calibration tokens, r6/r7/r8."""
    from splitspec.config import ConvertConfig, DataConfig
    from splitspec.quantize.convert import convert

    out = tmp_path_factory.mktemp("converted") / "smollm2-2l"
    cfg = ConvertConfig(data=DataConfig(**SMALL_CALIB))
    convert(ModelConfig(source=str(default_folder), num_layers=2), out, cfg)
    return out


@pytest.fixture(scope="session")
def converted_sylvester(default_folder, tmp_path_factory):
    """One layer with the recipe's block-diagonal ``sylvester`` rotation (the default is ``kronecker``),
    r8 only: enough for every reader of the folder to show it applies the recorded kind (a wrong kind
    garbles every weight)."""
    from splitspec.config import ConvertConfig, DataConfig
    from splitspec.quantize.convert import convert

    out = tmp_path_factory.mktemp("converted") / "smollm2-1l-sylvester"
    data = DataConfig(calib_sequences=2, calib_seq_len=64)
    cfg = ConvertConfig(residual_bits=(8,), rotation="sylvester", data=data)
    convert(ModelConfig(source=str(default_folder), num_layers=1), out, cfg)
    return out
