"""The architecture spec matches the real modules of each supported family."""

from __future__ import annotations

import pytest

from splitspec.config import ModelConfig
from splitspec.models.loader import load_reference
from splitspec.models.spec import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, arch_spec
from tiny_models import tiny_model

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _tiny(family: str, tmp_path, tokenizer, **extra):
    return tiny_model(family, tmp_path / family, tokenizer, **TINY, **extra)


def _assert_spec_matches_modules(model, spec) -> None:
    for layer in model.model.layers:
        for group in spec.groups:
            for lin in group.linears:
                module = layer.get_submodule(lin.name)
                assert tuple(module.weight.shape) == (lin.d_out, group.d_in), lin.name
                assert (module.bias is not None) == lin.bias, lin.name


def test_smollm2_spec(reference):
    model, _, spec = reference
    assert (spec.family, spec.hidden, spec.intermediate, spec.n_layers) == ("llama", 576, 1536, 30)
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.vocab) == (9, 3, 64, 49152)
    assert spec.rope_theta == 100000.0 and spec.tie_embeddings and not spec.qkv_bias and not spec.qk_norm
    assert [g.name for g in spec.groups] == ["qkv", "o", "gate_up", "down"]
    assert spec.group("qkv").d_out == 576 + 2 * 192 and spec.group("qkv").row_offsets() == [0, 576, 768]
    _assert_spec_matches_modules(model, spec)


@pytest.mark.parametrize(
    ("family", "extra", "qkv_bias", "qk_norm"),
    [
        ("mistral", {"sliding_window": 64, "head_dim": 16}, False, False),
        ("qwen2", {}, True, False),
        ("qwen3", {"head_dim": 32}, False, True),
    ],
)
def test_tiny_family_specs(family, extra, qkv_bias, qk_norm, tmp_path, tokenizer):
    model, _, spec = load_reference(ModelConfig(source=str(_tiny(family, tmp_path, tokenizer, **extra))))
    assert spec.family == family and spec.qkv_bias == qkv_bias and spec.qk_norm == qk_norm
    assert spec.head_dim == extra.get("head_dim", 64 // 4)
    assert spec.sliding_window == (64 if family == "mistral" else None)
    _assert_spec_matches_modules(model, spec)


def test_unimplemented_rope_scaling_is_refused_before_any_weight_is_read():
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedArchitectureError, match="llama: rope scaling 'yarn' is not implemented"):
        arch_spec(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert arch_spec(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 4.0})).rope_scaling["factor"] == 4.0


def test_every_end_of_sequence_id_of_the_config_is_kept():
    from transformers import LlamaConfig

    assert arch_spec(LlamaConfig(eos_token_id=[128001, 128008, 128009])).eos_ids == (128001, 128008, 128009)
    assert arch_spec(LlamaConfig(eos_token_id=2)).eos_ids == (2,)
    assert arch_spec(LlamaConfig(eos_token_id=None)).eos_ids == ()


def test_unsupported_architecture_is_named(tmp_path, tokenizer):
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        arch_spec(GPT2Config())
    folder = _tiny("gpt2", tmp_path, tokenizer)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_reference(ModelConfig(source=str(folder)))
    assert set(SUPPORTED_ARCHITECTURES) == {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
