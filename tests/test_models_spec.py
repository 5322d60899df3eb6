"""The architecture spec matches the real modules of each supported family."""

from __future__ import annotations

import pytest
import torch

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
    pad_token_id=0,  # inside the tiny vocabulary (GLM-4's and Phi-3's defaults are not)
)


def _tiny(family: str, tmp_path, tokenizer, **extra):
    return tiny_model(family, tmp_path / family, tokenizer, **TINY, **extra)


def _assert_spec_matches_modules(model, spec) -> None:
    for layer in model.model.layers:
        rows: dict[str, int] = {}
        for group in spec.groups:
            for lin in group.linears:
                module = layer.get_submodule(lin.module)
                assert tuple(lin.rows_of(module.weight).shape) == (lin.d_out, group.d_in), lin.name
                assert (module.bias is not None) == lin.bias, lin.name
                assert lin.first_row == rows.get(lin.module, 0), lin.name  # a fused module's Linears, in order
                rows[lin.module] = lin.first_row + lin.d_out
        assert all(layer.get_submodule(m).weight.shape[0] == n for m, n in rows.items())


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
        ("glm4", {"head_dim": 16}, True, False),  # q/k/v biases, gate and up fused
        ("phi3", {}, False, False),  # q/k/v fused, gate and up fused
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

    with pytest.raises(UnsupportedArchitectureError, match="llama: rope scaling 'dynamic' is not implemented"):
        arch_spec(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))


def test_longrope_is_its_short_factors_and_bounds_the_context():
    """Phi-3.5 and Phi-4-mini: up to the original context, transformers' RoPE (short factors, and the
    attention factor of the extension); past it every position changes, so the model takes no more."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    short = [1.0 + i / 8 for i in range(16)]
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": [4.0] * 16, "rope_theta": 10000.0}
    config = Phi3Config(
        hidden_size=256, num_attention_heads=8, max_position_embeddings=4096, original_max_position_embeddings=512,
        rope_parameters=rope,
    )  # fmt: skip
    spec = arch_spec(config)
    own = Phi3RotaryEmbedding(config)
    assert spec.max_positions == 512
    assert spec.rope[FULL].inv_freq == tuple(own.inv_freq.tolist())
    assert spec.rope[FULL].factor == pytest.approx(own.attention_scaling) and spec.rope[FULL].factor > 1
    positions = torch.arange(512)[None]
    cos, _ = own(torch.zeros(1), positions)  # the rotary's own update keeps the short factors this far
    assert torch.allclose(cos[0, :, :16], (positions[0, :, None] * own.inv_freq).cos() * own.attention_scaling)


@pytest.mark.parametrize(("family", "partial"), [("glm4", 0.5), ("phi3", 0.75), ("llama", 1.0)])
def test_rope_in_the_forward_s_order_is_the_model_s_rope(family, partial):
    """GLM-4 rotates neighbouring pairs of half of each head, Phi-4-mini the first 3/4 in halves: with each
    head's dimensions in ``rope_order`` (q's and k's alike, so their products are unchanged), the forward's
    one RoPE (dimension j with j + d/2, the frequencies padded with 0) gives transformers' q·k."""
    import importlib

    from transformers import AutoConfig

    config = AutoConfig.for_model(family, head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
    config.rope_parameters["partial_rotary_factor"] = partial
    spec = arch_spec(config)
    assert (spec.rope_order is None) == (family == "llama")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding"))(config)
    positions = torch.arange(40)[None]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 4, 40, 32, generator=gen)
    cos, sin = rotary(q, positions)
    q_ref, k_ref = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    order = list(spec.rope_order or range(32))
    freqs = positions[0, :, None].float() * torch.tensor(spec.rope[FULL].inv_freq)[None]
    emb = torch.cat((freqs, freqs), dim=-1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        x = x[..., order]
        return x * emb.cos() + torch.cat((-x[..., 16:], x[..., :16]), dim=-1) * emb.sin()

    torch.testing.assert_close(rope(q) @ rope(k).transpose(-1, -2), q_ref @ k_ref.transpose(-1, -2))


def test_every_end_of_sequence_id_of_the_config_is_kept():
    from transformers import LlamaConfig

    assert arch_spec(LlamaConfig(eos_token_id=[128001, 128008, 128009])).eos_ids == (128001, 128008, 128009)
    assert arch_spec(LlamaConfig(eos_token_id=2)).eos_ids == (2,)
    assert arch_spec(LlamaConfig(eos_token_id=None)).eos_ids == ()


def test_command_r_plus_q_k_layernorms_are_refused_by_name():
    from transformers import CohereConfig

    with pytest.raises(UnsupportedArchitectureError, match=r"cohere: q/k LayerNorms \(use_qk_norm\)"):
        arch_spec(CohereConfig(use_qk_norm=True))


def test_unsupported_architecture_is_named(tmp_path, tokenizer):
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        arch_spec(GPT2Config())
    folder = _tiny("gpt2", tmp_path, tokenizer)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_reference(ModelConfig(source=str(folder)))
    families = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "olmo3", "exaone4", "seed_oss"}
    families |= {"glm4", "phi3", "ministral3", "cohere", "cohere2", "gemma4_text", "qwen3_5_text"}
    assert set(SUPPORTED_ARCHITECTURES) == families
