"""Every claimed architecture, converted end to end and run through the split verifier against transformers.

For each family a tiny random model exercises the branch it claims: Llama 3's RoPE scaling, Mistral's
sliding window, Qwen2's q/k/v biases (and its sliding layers above ``max_window_layers``), Qwen3's q/k
norm with YaRN, Gemma 3's scaled embeddings, (1 + w) norms, sandwich norms, GELU-tanh MLP,
``query_pre_attn_scalar`` and its interleaved local (sliding, own RoPE base) and global (linearly scaled
RoPE) layers, Gemma 2's soft caps on attention scores and logits; OLMo 2's norms on each block's output
and q/k norms over all heads (OLMo 3's with sliding layers and a RoPE per layer type), EXAONE 4's output
norms and global layers without RoPE, Seed-OSS's biases on q/k/v and the MLP but not on o, GLM-4's fused
gate|up, its four norms and RoPE over neighbouring pairs of half of each head, Phi-3's fused q|k|v and
RoPE over the first 3/4 of each head, Ministral 3's q scaled by position, Gemma 4's global layers with heads
of their own (V = K, proportional RoPE), V norm and layer scalars. The prompt is longer than the window,
and every norm weight, bias and layer scalar is randomised (``tiny_model``). Each model is converted by the
real converter and the verifier's logits compared with transformers' own forward of the dequantized
weights (the weights the verifier computes with). The 8-bit residual is computed by the CPU actors' shard
code: in a real CPU actor process for Gemma 4 (whose global layers' groups are shard keys of their own), in
this process for the others. It multiplies x' in fp32, so the bound is fp32 rounding, not activation
rounding. Each sliding family runs again with its sliding layers' K/V in rings (``KVCache``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from splitspec.config import BatchConfig, ConvertConfig, DataConfig, EngineConfig, ModelConfig, SpecConfig
from splitspec.cpu_actor.service import start_cpu_actor
from splitspec.deploy.inspect import describe
from splitspec.gpu_actor.batcher import Batcher, generate_many
from splitspec.gpu_actor.delta_state import FOLD_AFTER
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.kernels import cpu_step
from splitspec.gpu_actor.model import SplitModel
from splitspec.gpu_actor.residual import DeviceResidual, LocalResidual, NoResidual, RemoteResidual
from splitspec.gpu_actor.tree_fit import fit_tree_stats
from splitspec.models.layer_kwargs import layer_kwargs
from splitspec.models.loader import load_reference
from splitspec.models.spec import (
    FULL,
    GLM,
    GROUP_NAMES,
    LINEAR,
    PARALLEL,
    POST,
    PRE,
    SANDWICH,
    SLIDING,
    TEXT_AS,
    Heads,
    UnsupportedArchitectureError,
    arch_spec,
)
from splitspec.quantize.convert import convert
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.reference import dequantized_reference
from splitspec.scheduler.machine import model_from_converted, model_from_toml
from test_gpu_actor_batcher import _drain
from test_gpu_actor_graphs import check_static_step
from test_gpu_actor_model import DRAFT_LOGITS
from tiny_models import tiny_model

RTOL = 1e-5  # max |Δlogit| ≤ RTOL × max |logit|: fp32 rounding of two different orders of the same sums
# Gemma 4 multiplies unit-RMS q and k heads unscaled (attention scale 1): a tiny random model's softmax is so
# sharp that a relative 3e-7 on its embeddings moves a late logit by 1.5e-5 of the largest (in float64)
FAMILY_RTOL = {"gemma4_text": 3e-5}
WINDOW = 8
PROMPT = "Translate 'the library opens at nine and closes at five on Sundays' into French, then explain why."
NEW_TOKENS = 8
# served by a real CPU actor process: their layer types' groups have shapes of their own
ACTOR_FAMILIES = ("gemma4_text", "qwen3_5_text")

# vocab: the default tokenizer's, so that the converter calibrates on real chats
COMMON = dict(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2, head_dim=32)
COMMON |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE |= {"original_max_position_embeddings": 64, "rope_theta": 500000.0}  # Llama 3.1's, at a tiny scale
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # Qwen3's long context
ARCHS = {
    "llama": {"tie_word_embeddings": False, "rope_scaling": LLAMA3_ROPE},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},  # full, sliding
    "qwen3": {"head_dim": 64, "rope_scaling": YARN},
    "gemma3_text": {
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,  # local, global, local, global
        "query_pre_attn_scalar": 48,
        "rope_theta": 50000.0,
        "rope_local_base_freq": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "gemma2": {  # soft caps small enough to bite on a tiny model's scores and logits
        "sliding_window": WINDOW,
        "layer_types": [SLIDING, FULL],
        "query_pre_attn_scalar": 48,
        "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": 2.0,
    },
    "olmo2": {"attention_bias": True},
    "olmo3": {
        "sliding_window": WINDOW,
        "layer_types": [SLIDING, FULL],
        "rope_parameters": {
            FULL: YARN | {"rope_theta": 50000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 500.0},
        },
    },
    "exaone4": {"sliding_window": WINDOW, "layer_types": [SLIDING, FULL]},  # hybrid: its global layers have no RoPE
    "seed_oss": {"attention_bias": True, "attention_out_bias": False, "mlp_bias": True},
    "ministral3": {  # YaRN, and q scaled by position from position 8 on (Llama 4's scaling)
        "rope_parameters": YARN
        | {"original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.5, "rope_theta": 1e4},
    },
    "glm4": {"pad_token_id": 0},  # q/k/v biases, gate|up fused, RoPE over neighbouring pairs of half of each head
    "phi3": {  # Phi-4-mini's RoPE: LongRoPE over the first 3/4 of each head (its short factors: within 128)
        "pad_token_id": 0,
        "original_max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        | {"short_factor": [1.0 + i / 4 for i in range(12)], "long_factor": [8.0] * 12},
    },
    # Command R, Aya Expanse: LayerNorms, attention and MLP side by side, RoPE over neighbouring pairs, logits scaled
    "cohere": {"logit_scale": 0.25, "attention_bias": True, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1},
    "cohere2": {  # Command R7B, Command A: and its global layers without RoPE
        "sliding_window": WINDOW,
        "layer_types": [SLIDING, FULL],
        "logit_scale": 0.5,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "bos_token_id": 1,
    },
    "gemma4_text": {  # Gemma 4 31B's form: global layers with wider heads, fewer of them, V = K, proportional RoPE
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "layer_types": [SLIDING, FULL] * 2,
        "global_head_dim": 64,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0,
        "use_bidirectional_attention": "vision",  # as 31B has it: image tokens only; text alone is causal
        "final_logit_softcapping": 30.0,  # Gemma 4's: it still bends a tiny model's logits by ~1e-3
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 500.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 50000.0},
        },
    },
    "qwen3_5_text": {  # Qwen 3.5: linear-attention (gated DeltaNet) layers, then gated attention over a quarter RoPE
        "num_hidden_layers": 4,
        "layer_types": [LINEAR, FULL] * 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
        | {"mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
}
QWEN35_SHAPE = """layers = 4
hidden = 128
intermediate = 128
heads = 4
kv_heads = 2
head_dim = 32
q_gate = true
vocab = 49152
residual_bits = 8
[linear]
layers = 2
k_heads = 2
v_heads = 4
k_dim = 32
v_dim = 32
"""
MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}}
# multimodal checkpoints whose language model runs here (the vision tower is left unread): a tiny tower
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32)
WRAPPED = {
    "gemma3": {  # Gemma 3 from 4B up: its language model is ``gemma3_text``, its end of turn in the wrapper
        "text_config": COMMON | ARCHS["gemma3_text"] | {"model_type": "gemma3_text"},
        "vision_config": TOWER | {"model_type": "siglip_vision_model", "patch_size": 8},
        "mm_tokens_per_image": 4,
        "eos_token_id": [1, 106],
    },
    "mistral3": {  # Mistral Small 3.1 and 3.2
        "text_config": COMMON | ARCHS["mistral"] | {"model_type": "mistral"},
        "vision_config": TOWER | {"model_type": "pixtral", "patch_size": 8, "head_dim": 16},
        "tie_word_embeddings": False,  # the wrapper's flag is the one transformers follows: a head of its own
    },
    "qwen2_5_vl": {  # Qwen2.5-VL: Qwen2's language model, M-RoPE (plain RoPE on text alone)
        "text_config": COMMON | ARCHS["qwen2"] | {"model_type": "qwen2_5_vl_text"} | MROPE,
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
        | {"out_hidden_size": 128, "fullatt_block_indexes": [0], "window_size": 16},
    },
    "qwen3_vl": {  # Qwen3-VL: Qwen3's, M-RoPE interleaved over YaRN
        "text_config": COMMON
        | {"head_dim": 64, "model_type": "qwen3_vl_text"}
        | {"rope_parameters": YARN | {"rope_theta": 1e4, "mrope_section": [8, 12, 12], "mrope_interleaved": True}},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
        | {"out_hidden_size": 128, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
    },
    "gemma4": {  # Gemma 4 12B and 31B as Google ships them: the language model beside a vision tower
        "text_config": COMMON | ARCHS["gemma4_text"] | {"model_type": "gemma4_text"},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
        | {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16},
        "audio_config": None,
        "eos_token_id": [1, 106],
    },
    "qwen3_5": {  # Qwen 3.5 27B as Qwen ships it: the language model beside a vision tower
        "text_config": COMMON | ARCHS["qwen3_5_text"] | {"model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
        | {"out_hidden_size": 128, "num_position_embeddings": 16},
    },
    "aya_vision": {  # Aya Vision: Cohere 2's language model
        "text_config": COMMON | ARCHS["cohere2"] | {"model_type": "cohere2"},
        "vision_config": TOWER | {"model_type": "siglip_vision_model", "patch_size": 8},
        "image_token_index": 3,
    },
}


class Case:
    """One family's source folder, converted folder, verifier, dequantized reference and CPU actor."""

    def __init__(self, family: str, root: Path, tokenizer) -> None:
        self.source, out = root / "source", root / "converted"
        self.family = family
        tiny_model(family, self.source, tokenizer, **(WRAPPED[family] if family in WRAPPED else COMMON | ARCHS[family]))
        data = DataConfig(calib_sequences=2, calib_seq_len=64)
        convert(ModelConfig(source=str(self.source)), out, ConvertConfig(residual_bits=(8,), data=data))
        self.converted = ConvertedModel(out)
        self.spec = self.converted.spec
        # the stored head, x' unrounded on both sides (the actor's fp32 mode): fp32 rounding is all RTOL allows
        self.split = SplitModel(self.converted, head="fp32", activations="fp32")
        self.reference = dequantized_reference(self.converted, self.source, 8)
        self.actor = start_cpu_actor(out, 8, activations="fp32") if family in ACTOR_FAMILIES else None
        if self.actor is None:
            self.residual = LocalResidual.load(out, 8, activations="fp32")
        else:
            self.residual = RemoteResidual(self.converted, [self.actor.endpoint])

    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.reference(ids[None]).logits[0]

    def close(self) -> None:
        self.residual.close()
        if self.actor is not None:
            self.actor.stop()


@pytest.fixture(scope="module", params=[*ARCHS, *WRAPPED])
def case(request, tokenizer, tmp_path_factory):
    c = Case(request.param, tmp_path_factory.mktemp(request.param), tokenizer)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ids(tokenizer):
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    assert len(ids) > 2 * WINDOW  # the window cuts off most of what each late token could see
    return ids


def assert_close(logits: torch.Tensor, ref: torch.Tensor, family: str = "") -> None:
    err = (logits - ref).abs().max().item()
    bound = FAMILY_RTOL.get(family, RTOL) * ref.abs().max().item()
    assert err <= bound, f"max |Δlogit| {err:.3g} > {bound:.3g}"


def test_each_family_takes_its_branches(case):
    spec, family = case.spec, case.spec.family
    assert spec.qkv_bias == (family in ("qwen2", "olmo2", "seed_oss", "glm4", "cohere"))
    fused = {lin.fused for g in spec.groups for lin in g.linears} - {None}
    assert fused == {"glm4": {"mlp.gate_up_proj"}, "phi3": {"self_attn.qkv_proj", "mlp.gate_up_proj"}}.get(
        family, set()
    )
    assert (spec.rope_order is not None) == (family in ("glm4", "phi3", "cohere", "cohere2", "qwen3_5_text"))
    assert spec.group("o").linears[0].bias == (family in ("olmo2", "cohere"))
    cohere = family in ("cohere", "cohere2")
    assert spec.centered == spec.parallel == cohere
    assert spec.logit_scale == {"cohere": 0.25, "cohere2": 0.5}.get(family, 1.0)
    qk_norm = ("qwen3", "gemma3_text", "gemma4_text", "olmo2", "olmo3", "exaone4", "qwen3_5_text")
    assert spec.qk_norm == (family in qk_norm)
    assert spec.qk_norm_full == (family in ("olmo2", "olmo3"))
    assert spec.norms == {
        "glm4": GLM,
        "gemma2": SANDWICH,
        "gemma3_text": SANDWICH,
        "gemma4_text": SANDWICH,
        "olmo2": POST,
        "olmo3": POST,
        "exaone4": POST,
        "cohere": PARALLEL,
        "cohere2": PARALLEL,
    }.get(family, PRE)
    caps = {"gemma2": (0.5, 2.0), "gemma4_text": (None, 30.0)}
    assert (spec.attn_softcap, spec.final_softcap) == caps.get(family, (None, None))
    sliding = ("mistral", "qwen2", "gemma2", "gemma3_text", "gemma4_text", "olmo3", "exaone4", "cohere2")
    assert spec.sliding_window == (WINDOW if family in sliding else None)
    expected = {"mistral": (SLIDING,) * 2, "qwen2": (FULL, SLIDING), "gemma3_text": (SLIDING, FULL) * 2}
    expected |= {"gemma2": (SLIDING, FULL), "olmo3": (SLIDING, FULL), "exaone4": (SLIDING, FULL)}
    expected |= {"cohere2": (SLIDING, FULL), "gemma4_text": (SLIDING, FULL) * 2, "qwen3_5_text": (LINEAR, FULL) * 2}
    assert spec.layer_types == expected.get(family, (FULL,) * 2)
    full, local = spec.rope[FULL], spec.rope[SLIDING]
    assert (full.factor > 1.0) == (family in ("qwen3", "olmo3", "ministral3", "phi3"))  # YaRN's, LongRoPE's scaling
    assert spec.max_positions == (128 if family == "phi3" else 256)  # LongRoPE: its original context
    assert spec.q_scale == ((0.5, 8) if family == "ministral3" else None)
    assert (set(full.inv_freq) == {0.0}) == (family in ("exaone4", "cohere2"))
    assert (full == local) == (family not in ("gemma3_text", "gemma4_text", "olmo3", "exaone4", "cohere2"))
    assert (not spec.v_norm) == (not spec.layer_scale) == (family != "gemma4_text")
    assert spec.attn_gate == (spec.delta_net is not None) == (family == "qwen3_5_text")
    assert spec.uniform == (family not in ("gemma4_text", "qwen3_5_text"))
    if family == "gemma3_text":
        assert local.inv_freq[1] == pytest.approx(500.0 ** (-2 / 32), rel=1e-6)
        assert full.inv_freq[1] == pytest.approx(50000.0 ** (-2 / 32) / 4, rel=1e-6)
        assert spec.norm_offset == 1.0 and spec.activation == "gelu_tanh"
        assert spec.attn_scale == 48**-0.5 and spec.embed_scale == 128**0.5
    if family == "gemma4_text":  # global layers: 1 kv head of 64, V = K, proportional RoPE over a quarter of it
        assert spec.heads(0) == Heads(2, 32) and spec.heads(1) == Heads(1, 64, k_is_v=True)
        assert [lin.name for lin in spec.group("qkv", layer=1).linears] == ["self_attn.q_proj", "self_attn.k_proj"]
        assert spec.group("o", layer=1).d_in == 4 * 64 and spec.group("o", layer=0).d_in == 4 * 32
        assert spec.kv_token_values == 2 * (2 * 2 * 32 + 2 * 1 * 64)
        assert full.inv_freq[1] == pytest.approx(50000.0 ** (-2 / 64), rel=1e-6) and set(full.inv_freq[8:]) == {0.0}
        assert len(local.inv_freq) == 16 and len(full.inv_freq) == 32
        assert spec.norm_offset == 0.0 and spec.attn_scale == 1.0 and spec.embed_scale == 128**0.5
    if family == "qwen3_5_text":  # DeltaNet layers: no K/V, four input projections; gated q; RoPE on 8 of 32
        assert spec.heads(0).n_kv == 0 and spec.heads(1) == Heads(2, 32)
        names = [lin.name.rsplit(".", 1)[1] for lin in spec.group("qkv", layer=0).linears]
        assert names == ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        assert spec.group("qkv", layer=0).d_out == (2 * 64 + 128) + 128 + 4 + 4
        assert spec.group("qkv", layer=1).linears[0].d_out == 2 * 4 * 32 and spec.group("o", layer=0).d_in == 128
        assert spec.kv_token_values == 2 * (2 * 2 * 32) and spec.norm_offset == 1.0
        assert set(full.inv_freq[4:]) == {0.0} and 0.0 not in full.inv_freq[:4]


def test_the_planner_and_inspect_count_each_familys_weights(case):
    """``splitspec plan`` streams what the folder holds, global layers' own shapes included (Gemma 4)."""
    shape = model_from_converted(case.converted.folder, 8)
    assert shape.linear_params == case.spec.linear_params
    assert shape.linear_params == sum(g.rows * g.d_in for layer in case.converted.layers for g in layer.values())
    assert shape.kv_token_values == case.spec.kv_token_values
    sliding = [i for i, kind in enumerate(case.spec.layer_types) if kind == SLIDING and case.spec.sliding_window]
    assert shape.sliding_token_values == sum(2 * case.spec.heads(i).n_kv * case.spec.heads(i).dim for i in sliding)
    if case.spec.delta_net is not None:  # the TOML a user would write for it describes what the folder streams
        described = case.source / "shape.toml"
        described.write_text(QWEN35_SHAPE)
        toml = model_from_toml(described)
        assert (toml.groups, toml.group_layers) == (shape.groups, shape.group_layers)
        assert (toml.kv_token_values, toml.state_bytes) == (shape.kv_token_values, shape.state_bytes) != (0, 0)
    lines = describe(case.converted)
    assert ("kv of 64 in global layers, V = K" in lines[1]) == (case.spec.family == "gemma4_text")
    # two fp32 copies of two layers' [4, 32, 32] states and 3 rows of 256 conv inputs: plan's count too
    state = 2 * 4 * 2 * (4 * 32 * 32 + 3 * 256)
    assert shape.state_bytes == (state if case.spec.delta_net is not None else 0)
    linear = f"2 linear-attention layers keep a state of {state:,} bytes a sequence instead (two copies)"
    assert (linear in lines[2]) == (case.spec.family == "qwen3_5_text")
    sliding = case.spec.layer_types.count(SLIDING) if case.spec.sliding_window else 0
    assert (f"{sliding} sliding layers keep their last {WINDOW} positions" in lines[2]) == bool(sliding)


def test_groups_a_layer_type_reshapes_split_like_the_others(case, ids):
    """Gemma 4's global qkv and o are groups of their own between the engine and the CPU actors
    (``shard_keys``): split over two shards, and with a third of the residual held by the engine, the
    verifier's logits are the one shard's."""
    if case.spec.uniform:
        pytest.skip("every layer has the same groups")
    keys, spec = case.converted.shard_keys, case.spec
    first = {g.name: (g.d_in, g.d_out) for g in spec.layer_groups(0)}
    assert keys[0] == {g: g for g in GROUP_NAMES}
    shapes = {g.name: (g.d_in, g.d_out) for g in spec.layer_groups(1)}
    assert keys[1] == {name: name + ("" if first[name] == shape else "#1") for name, shape in shapes.items()}
    assert keys[1]["qkv"] == "qkv#1" and (keys[1]["o"] == "o#1") == (spec.family == "gemma4_text")
    folder = case.converted.folder
    want = case.split.forward(ids, case.split.new_cache(64), case.residual)
    two = LocalResidual.load(folder, 8, n_shards=2, activations="fp32")
    total = sum(g.rows * g.d_in for layer in case.converted.layers for g in layer.values())
    held = DeviceResidual(case.converted, 8, resident_bytes=total // 3, activations="fp32")
    assert all(0 < held.rows[key] < g.rows for key, g in case.converted.key_layouts.items())
    for residual in (two, held):
        assert_close(case.split.forward(ids, case.split.new_cache(64), residual), want, case.spec.family)
        residual.close()


def test_the_converters_layer_inputs_reproduce_the_models_forward(case, ids):
    """The converter runs the decoder layer by layer; with ``layer_kwargs`` each layer sees what it sees in
    the model's own forward (its type's mask and RoPE), so calibration matches inference."""
    model, _, _ = load_reference(ModelConfig(source=str(case.source)))
    captured = []
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: captured.append(out))
    with torch.no_grad():
        model(ids[None])
        handle.remove()
        h = model.model.embed_tokens(ids[None])
        for layer, kw in zip(model.model.layers, layer_kwargs(model, case.spec, h), strict=True):
            h = layer(h, **kw)
    assert torch.equal(h, captured[0])


@pytest.mark.parametrize("loop_tokens", [cpu_step.LOOP_TOKENS, 2])
def test_prefill_logits_match_transformers(case, ids, monkeypatch, loop_tokens):
    """A prompt through the compiled layers, with their attention loops and (past ``LOOP_TOKENS`` rows, as
    a long prompt runs) with sdpa: each family's branches either way."""
    monkeypatch.setattr(cpu_step, "LOOP_TOKENS", loop_tokens)
    logits = case.split.forward(ids, case.split.new_cache(64), case.residual)
    assert_close(logits, case.reference_logits(ids), case.spec.family)


def test_decoding_and_greedy_tokens_match_transformers(case, ids):
    """A prefill, a chunk of four, single steps to the prompt's end, then greedy tokens: every row as
    transformers scores the whole prefix, and the same greedy tokens."""
    expected = ids.tolist()
    for _ in range(NEW_TOKENS):
        expected.append(int(case.reference_logits(torch.tensor(expected))[-1].argmax()))
    ref = case.reference_logits(torch.tensor(expected))
    split, cache = case.split, case.split.new_cache(64)
    split.forward(ids[:8], cache, case.residual)
    assert_close(split.forward(ids[8:12], cache, case.residual), ref[8:12], case.spec.family)
    tokens = ids.tolist()
    for t in range(12, len(ids) + NEW_TOKENS - 1):
        logits = split.forward(torch.tensor(tokens[t : t + 1]), cache, case.residual)
        assert_close(logits, ref[t : t + 1], case.spec.family)
        if t + 1 == len(tokens):  # past the prompt: the verifier's own greedy token comes next
            tokens.append(int(logits.argmax()))
    assert tokens == expected


def test_sliding_layers_in_rings_give_the_full_caches_logits(case, ids):
    """``ring_slack``: each sliding layer keeps its window plus a check's slots (``KVCache`` rings). A prompt
    in chunks, single steps, a tree checked and compacted, all past the window: the full caches' logits (op
    by op, as the rings run), in less memory; a rollback of more slots than the slack is refused."""
    if case.spec.sliding_window is None:
        pytest.skip("no sliding layers")
    full = SplitModel(case.converted, head="fp32", activations="fp32")
    full._compiled = None
    ring = SplitModel(case.converted, head="fp32", activations="fp32", ring_slack=4)
    caches = {model: model.new_cache(64) for model in (full, ring)}
    assert caches[ring].ring == WINDOW + 4 and caches[ring].nbytes < caches[full].nbytes
    assert ring.cache_bytes(64) == caches[ring].nbytes and full.cache_bytes(64) == caches[full].nbytes  # admission
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    blocks = [(0, 6, None, None), (6, 10, None, None), *[(t, t + 1, None, None) for t in range(10, 16)]]
    blocks.append((16, 20, torch.tensor([0, 1, 1, 2]) + 16, torch.cat((torch.ones(4, 16, dtype=torch.bool), tree), 1)))
    blocks += [(t, t + 1, None, None) for t in range(20, len(ids))]
    for a, b, positions, mask in blocks:
        logits = {m: m.forward(ids[a:b], c, case.residual, positions, mask) for m, c in caches.items()}
        assert_close(logits[ring], logits[full], case.spec.family)
        if mask is not None:  # the tree's root, its second child and grandchild are kept, then the text goes on
            for c in caches.values():
                c.keep(16, [0, 2, 3])
    ring_cache = caches[ring]
    length = ring_cache.length
    ring.forward(ids[:6], ring_cache, NoResidual())  # a check of 6 slots, rolled back: 2 past the slack
    ring_cache.truncate(length)
    with pytest.raises(RuntimeError, match="no longer holds a slot this pass sees"):
        ring.forward(ids[:1], ring_cache, NoResidual())


def test_speculation_over_rings_gives_the_verifiers_text(case, ids):
    """A chain drafted and checked over ring caches (``EngineConfig.kv_window="ring"``), each check rolled
    back and compacted past the window: the verifier's greedy text over full caches, token for token."""
    if case.spec.sliding_window is None:
        pytest.skip("no sliding layers")
    texts = {}
    for window in ("full", "ring"):
        config = EngineConfig(max_seq_len=64, kv_window=window, spec=SpecConfig(mode="chain", draft_max=3))
        model = SplitModel(case.converted, head="fp32", activations="fp32", ring_slack=config.ring_slack)
        texts[window] = SplitEngine(model, case.residual, config).generate(ids.tolist(), 12)[0]
    assert texts["ring"] == texts["full"]


def test_linear_attention_drafts_checks_and_batches_give_the_verifiers_text(case, ids, monkeypatch):
    """Qwen 3.5's recurrent state through speculation: chains, trees (statistics fitted by walking the
    state), n-gram drafts and a draft with its own cache (its root pending under the path it appends), rolled
    back and compacted, several sequences in one pass, a kept prefix resumed, a prompt in several blocks;
    every text the verifier's greedy text and every logit transformers', through a real CPU actor."""
    if case.spec.delta_net is None:
        pytest.skip("no linear-attention layers")
    folder = case.converted.folder
    stats = fit_tree_stats(folder, prompts=[ids[:10].tolist()], new_tokens=6, write=False)
    texts, prompts = {}, [ids.tolist(), ids[:14].tolist(), ids[3:].tolist()]
    drafts = {mode: SpecConfig(mode=mode, draft_max=6) for mode in ("off", "chain", "tree", "ngram")}
    drafts["draft2bit"] = SpecConfig(mode="chain", draft_max=6, kv="draft2bit")
    for name, spec in drafts.items():
        model = SplitModel(case.converted, head="fp32", activations="fp32")
        engine = SplitEngine(model, case.residual, EngineConfig(max_seq_len=96, spec=spec), tree_stats=stats["p"])
        texts[name] = [engine.generate(p, 12)[0] for p in prompts]
        assert [tokens for tokens, _ in generate_many(engine, prompts, 12)] == texts[name]
    assert texts["chain"] == texts["tree"] == texts["ngram"] == texts["draft2bit"] == texts["off"]
    # a chat's next turn resumes the first turn's state from the prefix cache, and says what a fresh one does
    engine = SplitEngine(model, case.residual, EngineConfig(max_seq_len=96, spec=drafts["chain"]))
    reuse, scratch = Batcher(engine), Batcher(engine, BatchConfig(prefix_cache_bytes=0))
    first = reuse.submit(prompts[1], 12)
    _drain(reuse)
    second_prompt = prompts[1] + first.tokens + ids[:5].tolist()
    second, fresh = reuse.submit(second_prompt, 12), scratch.submit(second_prompt, 12)
    _drain(reuse)
    _drain(scratch)
    assert second.reused == len(prompts[1]) + len(first.tokens) - 1 and fresh.reused == 0
    assert second.tokens == fresh.tokens
    split = case.split
    want = case.reference_logits(ids[:20])[13:]
    for fold_after in (FOLD_AFTER, 1):  # the kept root pending, or folded at once
        monkeypatch.setattr("splitspec.gpu_actor.delta_state.FOLD_AFTER", fold_after)
        cache = split.new_cache(64)
        split.forward(ids[:12], cache, case.residual)  # a prompt: final, folded in
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        mask = torch.cat((torch.ones(3, 12, dtype=torch.bool), tree), 1)
        split.forward(ids[12:15], cache, case.residual, torch.tensor([12, 13, 13]), mask)
        cache.truncate(13)  # a check's unverified slots roll back
        cache.keep(12, [0])  # the check's root verified
        floor = 12 if fold_after > 1 else 13
        assert cache.floor == floor and all(cache.resumable(n) == (floor <= n <= 13) for n in (11, 12, 13, 14))
        with pytest.raises(ValueError, match=f"cannot roll back to {floor - 1}"):
            cache.truncate(floor - 1)
        resumed = split.new_cache(64)
        resumed.load_prefix(cache, 13)
        for c in (cache, resumed):
            assert_close(split.forward(ids[13:20], c, case.residual), want, case.spec.family)
    monkeypatch.setattr("splitspec.gpu_actor.model.CHAIN_BLOCK", 5)  # a prompt in blocks, each folded in turn
    assert_close(split.forward(ids, split.new_cache(64), case.residual), case.reference_logits(ids), case.spec.family)
    assert (torch.tensor([1e-39]) * 1.0).item() != 0  # the passes flushed subnormals, and no longer do


def test_the_drafts_one_call_layers_equal_its_op_by_op_layers(case, ids, monkeypatch):
    """Each family's branches (biases, q/k norm, sandwich norms, GELU, sliding windows and their RoPE) in
    ``cpu_step``'s one-call draft: every draft step's logits as the op-by-op draft's, past the window."""
    if not case.spec.uniform:  # Gemma 4: its layer types' heads differ; the compiled layers take one shape
        assert case.split._compiled is None
        pytest.skip("runs op by op")
    assert case.split._compiled is not None
    steps = {}
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(case.split, "_compiled", None)
        cache = case.split.new_cache(64)
        case.split.forward(ids[:12], cache, NoResidual())
        steps[one_call] = [case.split.forward(ids[t : t + 1], cache, NoResidual(), draft=True) for t in range(12, 20)]
    for fast, slow in zip(steps[True], steps[False], strict=True):
        assert (fast - slow).abs().max() <= DRAFT_LOGITS * slow.abs().max()


def test_a_static_draft_step_equals_the_draft_forward(case, ids):
    """Each family's branches in ``graphs.StaticStep`` (test_gpu_actor_graphs), past the sliding window; a
    sliding family's again with its sliding layers in rings, which a recorded step writes, then reads whole."""
    check_static_step(case.split, ids)
    if case.spec.delta_net is not None:  # and the verifier's, its state's entries read under a mask
        check_static_step(case.split, ids, case.residual)
    if case.spec.sliding_window is not None:
        check_static_step(SplitModel(case.converted, ring_slack=4), ids)


def test_a_multimodal_checkpoint_is_read_as_its_language_model(case, ids, tmp_path):
    """The text model built from a wrapper's checkpoint, as transformers saves it now and as it did before
    4.52 (``language_model.model.…``), gives the wrapper's own logits for a text without images."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    if case.family not in WRAPPED:
        pytest.skip("not a multimodal checkpoint")
    text_type = WRAPPED[case.family]["text_config"]["model_type"]
    assert case.spec.family == TEXT_AS.get(text_type, text_type)
    assert case.spec.eos_ids == tuple(WRAPPED[case.family].get("eos_token_id", ()) or case.spec.eos_ids)
    wrapper = AutoModelForImageTextToText.from_pretrained(case.source, dtype=torch.float32).eval()
    with torch.no_grad():
        want = wrapper(input_ids=ids[None]).logits[0]
    old = tmp_path / "old"
    shutil.copytree(case.source, old)
    for f in old.glob("*.safetensors"):
        renamed = {}
        for name, t in load_file(f).items():
            for new, before in (
                ("model.language_model.", "language_model.model."),
                ("lm_head.", "language_model.lm_head."),
            ):
                name = before + name.removeprefix(new) if name.startswith(new) else name
            renamed[name] = t
        save_file(renamed, f, metadata={"format": "pt"})
    for folder in (case.source, old):
        model, _, spec = load_reference(ModelConfig(source=str(folder)))
        assert spec == case.spec
        with torch.no_grad():
            assert_close(model(ids[None]).logits[0], want)


def test_gemma_features_the_forward_pass_lacks_are_refused():
    from transformers import Gemma3TextConfig

    with pytest.raises(UnsupportedArchitectureError, match="gemma3_text: bidirectional attention is not implemented"):
        arch_spec(Gemma3TextConfig(use_bidirectional_attention=True))


@pytest.mark.parametrize(
    ("field", "what"),
    [
        ({"hidden_size_per_layer_input": 256}, "per-layer input embeddings"),
        ({"num_kv_shared_layers": 2}, "K/V shared across layers"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64}, "mixture-of"),
        ({"use_bidirectional_attention": "all"}, "bidirectional attention"),
    ],
)
def test_gemma4_features_the_forward_pass_lacks_are_refused_by_name(field, what):
    """Gemma 4 E2B/E4B (per-layer inputs, shared K/V) and 26B-A4B (MoE): refused before any weight is read."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(**(COMMON | ARCHS["gemma4_text"] | {"hidden_size_per_layer_input": 0} | field))
    with pytest.raises(UnsupportedArchitectureError, match=f"gemma4_text: {what}"):
        arch_spec(config)


@pytest.mark.parametrize("field", [{"linear_num_value_heads": 3}, {"linear_conv_kernel_dim": 1}])
def test_qwen3_5_shapes_the_forward_pass_cannot_take_are_refused(field):
    """Value heads that the key heads do not divide, or a convolution over no past, are refused by name."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5_text", **(COMMON | ARCHS["qwen3_5_text"] | field))
    with pytest.raises(UnsupportedArchitectureError, match=r"qwen3_5_text: .* value heads over 2 key heads"):
        arch_spec(config)
