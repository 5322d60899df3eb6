"""Shared, session-scoped fixtures: the expensive things (the default model) are loaded once."""

from __future__ import annotations

import subprocess

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


# Token ids for fitting a small folder's tree statistics quickly (what a draft of 2 layers predicts is
# noise either way; the tests need the statistics to exist and to shape trees).
FIT_PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365], [1, 4093, 198, 19161, 260, 1345, 28, 2]]


MIXED_WIDTHS = {"1.qkv": 7, "0.down": 8}  # the 6-bit residual's wider groups in ``converted_small``


@pytest.fixture(scope="session")
def converted_small(default_folder, tmp_path_factory):
    """The default model truncated to 2 layers, converted with 4 × 128 calibration tokens, r6/r7/r8, with
    tree statistics fitted on two short prompts. Its 6-bit residual has mixed widths (``MIXED_WIDTHS``),
    so every reader of it also reads groups wider than the file's nominal width."""
    from splitspec.config import ConvertConfig, DataConfig, ResidualConfig
    from splitspec.gpu_actor.tree_fit import fit_tree_stats
    from splitspec.quantize.convert import convert

    out = tmp_path_factory.mktemp("converted") / "smollm2-2l"
    cfg = ConvertConfig(data=DataConfig(**SMALL_CALIB), residual=ResidualConfig(widths=MIXED_WIDTHS))
    convert(ModelConfig(source=str(default_folder), num_layers=2), out, cfg)
    fit_tree_stats(out, prompts=FIT_PROMPTS, new_tokens=24)
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


HELD_OUT = [
    "What should I pack for a three-day hiking trip in the Alps in late September?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Translate 'the library opens at nine' into French and explain the grammar.",
]


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """Chat-templated ids of three held-out questions (chat, code, translation)."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"]
        for p in HELD_OUT
    ]


@pytest.fixture(scope="session")
def engine(converted_small):
    """The split engine on ``converted_small`` with its 8-bit residual on one real CPU actor process."""
    from splitspec.scheduler.local import start_local

    with start_local(converted_small, 8, n_cpu_actors=1) as eng:
        yield eng


@pytest.fixture(scope="session")
def own_mounts() -> list[str]:
    """The command prefix that runs a command in a user and mount namespace of its own, where it may mount a
    small tmpfs (a full disk, a full /dev/shm) without privileges; skips where namespaces are off."""
    prefix = ["unshare", "--user", "--map-root-user", "--mount"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("no user namespaces here to mount a small filesystem in")
    return prefix
