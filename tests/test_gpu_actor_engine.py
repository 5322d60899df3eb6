"""Greedy decoding with the split verifier through a real CPU actor process, against transformers.

Greedy text must equal transformers' greedy text from the dequantized model. fp32 rounding differs
between the two forward passes, so where the reference's top-2 logits are closer than ``NEAR_TIE``
either token is right: the comparison of that prompt stops there, and such near-ties are counted.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from splitspec.config import BASE_SHARE, ChannelConfig, EngineConfig, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.gpu_actor.model import PassStats, SplitModel
from splitspec.gpu_actor.prefill import choose_prefill
from splitspec.kernels import amx
from splitspec.quantize.format import ConvertedModel
from test_gpu_actor_model import dequantized_reference  # pytest puts tests/ on sys.path

BITS = 8
NEW_TOKENS = 20
NEAR_TIE = 1e-4


def _reference_greedy(model, prompt: list[int], eos_id: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the gap between its two largest raw logits."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            repetition_penalty=1.0,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in out.logits)]
    return tokens, gaps


def test_greedy_text_equals_dequantized_reference(engine, converted_small, default_folder, prompts, tokenizer):
    reference = dequantized_reference(ConvertedModel(converted_small), default_folder, BITS)
    eos = tokenizer.eos_token_id
    near_ties, compared = 0, 0
    for prompt in prompts:
        ours, stats = engine.generate(prompt, NEW_TOKENS, eos_id=eos)
        theirs, gaps = _reference_greedy(reference, prompt, eos)
        for t, gap in enumerate(gaps):
            if gap < NEAR_TIE:
                near_ties += 1
                break
            assert ours[t] == theirs[t], f"step {t} of {prompt[-8:]}: {ours[t]} != {theirs[t]} (gap {gap:.3g})"
            compared += 1
        else:
            assert ours == theirs
        assert stats.prefill_path in ("split", "device")
        assert sum(c.accepted + 1 for c in stats.checks) >= len(ours) - 1
    print(f"greedy: {compared} tokens equal, {near_ties} near-ties (top-2 gap < {NEAR_TIE}) of {len(prompts)} prompts")
    assert compared >= len(prompts) * NEW_TOKENS // 2


def test_check_stats_add_up(engine, prompts):
    alone = SplitEngine(engine.model, engine.residual, EngineConfig(spec=SpecConfig(mode="off")))
    _, stats = alone.generate(prompts[0], 4)
    for check in stats.checks:
        assert check.drafted == check.accepted == check.draft_steps == 0
        parts = check.base_ms + check.residual_wait_ms + check.channel_ms + check.attention_ms + check.head_ms
        assert check.base_ms > 0 and check.residual_wait_ms >= 0 and check.channel_ms > 0
        assert parts <= check.verify_ms <= check.total_ms
    assert stats.summary()["checks"] == 3 and stats.summary()["tokens_per_check"] == 1


def _forced(engine: SplitEngine, path: str, chunk: int = 64) -> SplitEngine:
    """The same model and residuals under a config that forces the prefill path."""
    config = EngineConfig(prefill=path, prefill_chunk=chunk)
    return SplitEngine(
        engine.model, engine.residual, config, device_residual=engine.device_residual, tree_stats=engine.tree_stats
    )


def test_device_prefill_equals_split_prefill(engine, prompts):
    """One forward with the residual on the device leaves the same logits and cache as the CPU actors'
    chunked forwards (5 tokens each, so several chunks)."""
    split, device = _forced(engine, "split", chunk=5), _forced(engine, "device")
    logits = {}
    for eng in (split, device):
        logits[eng.config.prefill], _, path = eng.prefill(torch.tensor(prompts[1]), eng.new_cache())
        assert path == eng.config.prefill
    err = (logits["device"] - logits["split"]).abs().max().item()
    assert err <= 1e-4 * logits["split"].abs().max().item(), f"max |Δlogit| {err:.3g}"
    ours, stats = device.generate(prompts[1], 6)
    assert stats.prefill_path == "device" and stats.prefill.tokens == len(prompts[1])
    assert ours == split.generate(prompts[1], 6)[0]


def test_split_prefill_returns_the_last_chunks_logits(engine, prompts):
    """Chunks before the last write their K/V with no head; the logits are the prompt's last row's whether
    the prompt ends a chunk exactly (7), raggedly (5) or a token at a time (1)."""
    prompt = torch.tensor(prompts[1][:14])
    logits, caches = {}, {}
    for chunk in (14, 7, 5, 1):
        caches[chunk] = _forced(engine, "split", chunk).new_cache()
        logits[chunk], _, _ = _forced(engine, "split", chunk).prefill(prompt, caches[chunk])
    for chunk in (7, 5, 1):
        assert logits[chunk].shape == logits[14].shape == (1, logits[14].shape[1])
        assert (logits[chunk] - logits[14]).abs().max() <= 1e-4 * logits[14].abs().max()
        assert caches[chunk].length == 14


def test_split_prefill_chunk_longer_than_one_request(engine, prompts, monkeypatch):
    """A split-path forward of more rows than one channel request carries sends each group's rows as
    several requests, all in flight before the gather (here three, the last one short), and leaves the
    logits and cache of forwards that fit one request; in ``prefill_parts`` parts, each part's rows go
    in requests of their own (here one a part)."""
    per_request = engine.residual.max_tokens
    prompt = torch.cat([torch.tensor(p) for p in prompts] * 4)[: 2 * per_request + 9]
    long, short = _forced(engine, "split", chunk=len(prompt)), _forced(engine, "split", chunk=16)
    caches = [long.new_cache(), short.new_cache()]
    (want, _, _), (got, _, _) = short.prefill(prompt, caches[1]), long.prefill(prompt, caches[0])
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"max |Δlogit| {err:.3g}"
    assert caches[0].length == caches[1].length == len(prompt)
    n = caches[0].length
    assert (caches[0].k[:, :n] - caches[1].k[:, :n]).abs().max() <= 1e-4 * caches[1].k[:, :n].abs().max()
    for parts, requests in ((1, 3), (4, 4)):
        monkeypatch.setattr(engine.model, "prefill_parts", parts)
        stats = PassStats()
        engine.model.forward(prompt, engine.new_cache(), engine.residual, last_only=True, stats=stats)
        assert stats.round_trips == requests * 4 * len(engine.model.layers)


def test_auto_prefill_takes_the_measured_cheaper_path(engine, prompts):
    costs = engine.prefill_costs()
    assert engine.prefill_costs() is costs  # measured once
    for cost in (costs.split, costs.device):
        seconds = [s for _, s in cost.points]
        assert cost.points[0][0] == 1 and seconds == sorted(seconds) and seconds[0] > 0
    for tokens in (1, 64, 1000):
        assert engine.prefill_path(tokens) == choose_prefill(tokens, costs, engine.config.prefill_chunk)
    # one token: what a prompt reused up to its last token prefills; the device path pays its transfer and
    # dequantization of every group whatever the count, which a line through long forwards would miss
    one, took = torch.tensor(prompts[0][-1:]), {}
    for path in ("split", "device"):
        forced = _forced(engine, path)
        took[path] = min(_seconds(lambda f=forced: f.prefill(one, f.new_cache())) for _ in range(3))
    assert engine.prefill_path(1) == min(took, key=took.get), (took, costs)
    print(f"measured prefill costs: {costs}; 1 token took {took}; 1000 tokens take {engine.prefill_path(1000)}")


def _seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def test_engine_and_actor_run_on_different_cores(engine):
    allowed = os.sched_getaffinity(0)
    cpus = engine.actors[0].ready["cpus"]
    if len(set(cpus) | allowed) < 2:
        pytest.skip("one CPU: nothing to separate")
    assert not set(cpus) & allowed, f"engine on {allowed}, CPU actor on {cpus}"


def test_engine_config_is_validated(engine):
    with pytest.raises(ValueError, match=r"min\(ChannelConfig.max_tokens, 127\) × slots = 72 × 8"):
        EngineConfig(prefill_chunk=72 * 8 + 1)
    assert EngineConfig(prefill_chunk=72 * 8).prefill_chunk == 72 * 8
    with pytest.raises(ValueError, match="= 127 × 8"):  # a request carries at most 127 rows, whatever max_tokens
        EngineConfig(prefill_chunk=127 * 8 + 1, channel=ChannelConfig(max_tokens=256))
    with pytest.raises(ValueError, match="draft_max = 80 nodes"):
        EngineConfig(spec=SpecConfig(draft_max=80))
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill must be one of auto, split, device"):
        EngineConfig(prefill="gpu")
    with pytest.raises(ValueError, match="resident_bytes"):
        EngineConfig(resident_bytes=-1)
    with pytest.raises(ValueError, match="needs a DeviceResidual"):
        SplitEngine(engine.model, engine.residual, EngineConfig(prefill="device"))
    assert EngineConfig(prefill_chunk=100, channel=ChannelConfig(max_tokens=128)).prefill_chunk == 100


def test_the_actors_share_of_the_head_is_validated_and_defaults_to_equal_parts():
    """``head_share``: by default each process (engine and actors) multiplies an equal part of the int16
    head on a CPU engine, none on CUDA or with another head; a share outside [0, 1) or one the actors
    cannot serve is refused."""
    assert EngineConfig().actor_head_share(1) == 0.5
    assert EngineConfig().actor_head_share(3) == 0.75
    assert EngineConfig(head="fp32").actor_head_share(2) == 0.0
    assert EngineConfig(device="cuda").actor_head_share(1) == 0.0
    assert EngineConfig(head_share=0.25).actor_head_share(4) == 0.25
    with pytest.raises(ValueError, match=r"head_share must be in \[0, 1\)"):
        EngineConfig(head_share=1.0)
    with pytest.raises(ValueError, match="needs the int16 head on a CPU engine"):
        EngineConfig(head="bf16", head_share=0.5)
    with pytest.raises(ValueError, match="needs the int16 head on a CPU engine"):
        EngineConfig(device="cuda", head_share=0.5)


def test_the_actors_share_of_the_base_and_the_prompts_parts_are_validated():
    """``base_share``: by default ``BASE_SHARE`` on a CPU engine whose base runs the byte tables (none where
    AMX tiles run it) and holding none of the residual, none on CUDA (whose base costs it next to nothing); a
    share outside [0, 1), or any share of a GPU's base or beside resident rows, is refused; so is a prompt in
    no parts."""
    assert EngineConfig().actor_base_share() == (0.0 if amx.enabled() else BASE_SHARE)
    assert EngineConfig(activations="fp32").actor_base_share() == BASE_SHARE
    assert EngineConfig(device="cuda").actor_base_share() == 0.0
    assert EngineConfig(base_share=0.0).actor_base_share() == 0.0
    assert EngineConfig(activations="fp32", resident_bytes=1 << 20).actor_base_share() == 0.0
    with pytest.raises(ValueError, match="set base_share=0 or resident_bytes=0"):
        EngineConfig(base_share=0.2, resident_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"base_share must be in \[0, 1\)"):
        EngineConfig(base_share=-0.1)
    with pytest.raises(ValueError, match="a part of the base of a CPU engine"):
        EngineConfig(device="cuda", base_share=0.2)
    with pytest.raises(ValueError, match="prefill_parts must be >= 1"):
        EngineConfig(prefill_parts=0)


def test_cuda_graphs_need_a_cuda_device(converted_small):
    with pytest.raises(ValueError, match="cuda_graphs records CUDA graphs: it needs device cuda, not 'cpu'"):
        EngineConfig(cuda_graphs=True)
    assert EngineConfig(device="cuda", cuda_graphs=True).cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs records CUDA graphs: it needs a CUDA device, not cpu"):
        SplitModel(ConvertedModel(converted_small), cuda_graphs=True)


def test_sliding_layers_keep_rings_on_a_gpu_and_every_slot_on_a_cpu():
    """``kv_window``: "auto" gives a CUDA engine rings of the window plus a check's slots (its drafts, the
    n-grams grafted on them, the root), recorded steps too, and a CPU engine (whose compiled layers read
    full caches) every slot."""
    assert EngineConfig().ring_slack == 0
    assert EngineConfig(device="cuda").ring_slack == SpecConfig().draft_max + 2
    assert EngineConfig(device="cuda", cuda_graphs=True).ring_slack == EngineConfig(device="cuda").ring_slack
    assert EngineConfig(kv_window="ring", spec=SpecConfig(draft_max=4)).ring_slack == 6
    # an n-gram branch grafts up to draft_max more nodes on the tree
    assert EngineConfig(kv_window="ring", spec=SpecConfig(draft_max=4, ngram_branch=True)).ring_slack == 10
    with pytest.raises(ValueError, match="grafted n-grams carries up to 129 positions"):
        EngineConfig(spec=SpecConfig(draft_max=64, ngram_branch=True))
    assert EngineConfig(device="cuda", kv_window="full").ring_slack == 0
    with pytest.raises(ValueError, match="kv_window must be one of auto, ring, full"):
        EngineConfig(kv_window="window")


def test_generate_refuses_what_does_not_fit(engine):
    with pytest.raises(ValueError, match="exceed the context of 2048 tokens"):
        engine.generate([1] * 10, engine.config.max_seq_len)
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([], 4)


def test_a_context_past_the_model_s_positions_is_refused(engine):
    """SmolLM2 takes 8192 positions: an engine for a longer context is refused before it serves anything."""
    positions = engine.model.spec.max_positions
    assert positions == 8192
    SplitEngine(engine.model, engine.residual, EngineConfig(max_seq_len=positions))  # its whole context: fine
    with pytest.raises(ValueError, match=f"a context of {positions + 1} tokens .* exceeds the {positions} positions"):
        SplitEngine(engine.model, engine.residual, EngineConfig(max_seq_len=positions + 1))


def test_a_pass_of_more_rows_than_a_request_carries_is_split(engine):
    """A verify pass over several sequences can hold more rows than one channel request: the group's
    rows go out as several requests, and the logits equal those of passes that fit. Both compare relative to
    their largest value: x' is rounded to int16 codes (the residual's, and on AMX tiles the base's too), and
    an ulp between the two passes' x' can move a code by one step (2^-15 of its group's largest |x'|)."""
    tokens = torch.arange(100) % 500 + 20
    assert engine.residual.max_tokens < 100
    whole, parts = engine.new_cache(), engine.new_cache()
    logits = engine.model.forward(tokens, whole, engine.residual, last_only=True)
    engine.model.forward(tokens[:50], parts, engine.residual)
    expected = engine.model.forward(tokens[50:], parts, engine.residual, last_only=True)
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    keys = whole.k[:, :100]
    assert (keys - parts.k[:, :100]).abs().max() <= 1e-4 * keys.abs().max()
