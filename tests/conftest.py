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
