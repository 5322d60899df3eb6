"""The architecture spec matches the real modules of each supported family."""

from __future__ import annotations

import pytest

from splitspec.config import ModelConfig
from splitspec.models.loader import load_reference
from splitspec.models.spec import FULL, SLIDING, SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError, arch_spec
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
    assert spec.rope[FULL] == spec.rope[SLIDING] and spec.rope[FULL].factor == 1.0
    assert spec.rope[FULL].inv_freq[1] == pytest.approx(100000.0 ** (-2 / 64), rel=1e-6)
    assert spec.tie_embeddings and not spec.qkv_bias and not spec.qk_norm
    assert [g.name for g in spec.groups] == ["qkv", "o", "gate_up", "down"]
    assert spec.group("qkv").d_out == 576 + 2 * 192 and spec.group("qkv").row_offsets() == [0, 576, 768]
    _assert_spec_matches_modules(model, spec)


@pytest.mark.parametrize(
    ("family", "extra", "qkv_bias", "qk_norm"),
    [
        ("mistral", {"sliding_window": 64, "head_dim": 16}, False, False),
        ("qwen2", {}, True, False),
        ("qwen3", {"head_dim": 32}, False, True),
        ("olmo2", {}, False, True),
        ("exaone4", {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}, False, True),
        ("seed_oss", {"head_dim": 16, "attention_bias": True, "attention_out_bias": False}, True, False),
    ],
)
def test_tiny_family_specs(family, extra, qkv_bias, qk_norm, tmp_path, tokenizer):
    model, _, spec = load_reference(ModelConfig(source=str(_tiny(family, tmp_path, tokenizer, **extra))))
    assert spec.family == family and spec.qkv_bias == qkv_bias and spec.qk_norm == qk_norm
    assert spec.head_dim == extra.get("head_dim", 64 // 4)
    assert spec.sliding_window == (64 if family in ("mistral", "exaone4") else None)
    _assert_spec_matches_modules(model, spec)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        | {"original_max_position_embeddings": 8192, "rope_theta": 500000.0},  # Llama 3.1's
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's long context
    ],
)
def test_each_static_rope_kind_is_transformers_own(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(rope_scaling=rope)
    own = LlamaRotaryEmbedding(config)
    spec = arch_spec(config)
    assert spec.rope[FULL] == spec.rope[SLIDING]
    assert spec.rope[FULL].inv_freq == tuple(own.inv_freq.tolist()) and spec.rope[FULL].factor == own.attention_scaling


def test_rope_that_the_forward_pass_lacks_is_refused_before_any_weight_is_read():
    from transformers import LlamaConfig

    longrope = {"short_factor": [1.0] * 64, "long_factor": [2.0] * 64, "original_max_position_embeddings": 1024}
    for rope in ({"rope_type": "dynamic", "factor": 4.0}, {"rope_type": "longrope"} | longrope):
        named = f"llama: rope scaling '{rope['rope_type']}' is not implemented"
        with pytest.raises(UnsupportedArchitectureError, match=named):
            arch_spec(LlamaConfig(rope_scaling=rope))
    with pytest.raises(UnsupportedArchitectureError, match="llama: partial rotary embeddings is not implemented"):
        arch_spec(LlamaConfig(partial_rotary_factor=0.5))


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
    families = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "olmo3", "exaone4", "seed_oss"}
    assert set(SUPPORTED_ARCHITECTURES) == families
