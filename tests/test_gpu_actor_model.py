"""The engine's own forward pass against transformers with the same (dequantized) weights.

The reference is the float32 source model truncated to the converted layers, with every decoder Linear's
weight replaced by ``ConvertedModel.linear_weights`` (W_v = rot⁻¹(Q_base + Q_resid), or the base alone):
the split verifier must give its logits up to fp32 rounding, however the residual reaches it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitspec.config import ChannelConfig
from splitspec.cpu_actor.service import start_cpu_actor
from splitspec.gpu_actor.kernels import cpu_step
from splitspec.gpu_actor.kv_cache import KVCache
from splitspec.gpu_actor.model import GROUPS, PassStats, SplitModel, add_chunks
from splitspec.gpu_actor.prefix_cache import PrefixCache
from splitspec.gpu_actor.residual import Lanes, LocalResidual, NoResidual, RemoteResidual, check_coverage
from splitspec.kernels import amx
from splitspec.protocol import HEAD, ErrorCode, RemoteError
from splitspec.quantize.format import ConvertedModel
from splitspec.quantize.reference import dequantized_reference

RTOL = 1e-3  # max |Δlogit| ≤ RTOL × max |logit|
PROMPT = "Explain in two sentences why the sky is blue, then write a haiku about it."

# The draft's logits come from its int8 head, which rounds each hidden state to int16 per 128 columns: hidden
# states equal up to the order of fp32 sums can land a rounding step apart, so those logits are held to 1e-4
# of the largest (the layers' own outputs, K/V, to 1e-5).
DRAFT_LOGITS = 1e-4
# The verifier's logits from the compiled layers against the op-by-op path's, several sequences in one pass:
# the same sums in other orders (attention's blocks, a Paley II rotation by pairs of rows, sdpa) through 30
# layers, which land 0.3e-5 to 1.1e-5 of the largest logit apart (a real fault is off by far more).
ORDER_LOGITS = 2e-5


def assert_close(logits: torch.Tensor, ref: torch.Tensor) -> None:
    err = (logits - ref).abs().max().item()
    bound = RTOL * ref.abs().max().item()
    assert err <= bound, f"max |Δlogit| {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def converted(converted_small):
    return ConvertedModel(converted_small)


@pytest.fixture(scope="module")
def split(converted):
    return SplitModel(converted)


@pytest.fixture(scope="module")
def ids(tokenizer):
    """16 tokens of a chat-templated prompt the converter never calibrated on."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False)
    return torch.tensor(tokenizer(text)["input_ids"][:16])


@pytest.fixture(scope="module")
def reference_logits(converted, default_folder, ids):
    """bits -> reference logits [16, vocab] of ``ids`` (one model at a time: each holds the 113 MB embedding)."""
    out = {}
    for bits in (None, 7, 8):
        with torch.no_grad():
            out[bits] = dequantized_reference(converted, default_folder, bits)(ids[None]).logits[0]
    return out


def _check(split, residual, ids, ref) -> None:
    """One token alone, and 16 at once (a fresh cache each)."""
    assert_close(split.forward(ids[:1], split.new_cache(32), residual), ref[:1])
    assert_close(split.forward(ids, split.new_cache(32), residual), ref)


def _check_add_into(converted, residual) -> None:
    """``add_into`` (a prompt's path: each group's y_r added into the base's output) adds exactly what
    ``gather`` returns, the engine's held rows and every actor's, into their columns."""
    for name, group in converted.layers[0].items():
        x, out = torch.randn(5, group.d_in), torch.randn(5, group.rows)
        want = out + residual.gather(residual.submit(0, name, x))
        residual.add_into(residual.submit(0, name, x), out)
        assert torch.equal(out, want), name


@pytest.mark.parametrize("bits", [7, 8])
def test_local_residual_matches_reference(converted_small, split, ids, reference_logits, bits):
    _check(split, LocalResidual.load(converted_small, bits, n_shards=2), ids, reference_logits[bits])


def test_no_residual_matches_base_reference(split, ids, reference_logits):
    _check(split, NoResidual(), ids, reference_logits[None])


@pytest.mark.parametrize("n_actors", [1, 2])
def test_remote_residual_matches_reference(
    converted_small, converted, split, ids, reference_logits, n_actors, monkeypatch
):
    actors = [start_cpu_actor(converted_small, 8, i, n_actors) for i in range(n_actors)]
    try:
        residual = RemoteResidual(converted, [a.endpoint for a in reversed(actors)])  # any order: sorted by rows
        try:
            assert residual.transports == ["shm"] * n_actors  # same host: x' is written into shared memory
            stats = PassStats()
            assert_close(split.forward(ids, split.new_cache(32), residual, stats=stats), reference_logits[8])
            assert stats.round_trips == 4 * len(converted.layers)
            assert_close(split.forward(ids[:1], split.new_cache(32), residual), reference_logits[8][:1])
            _check_add_into(converted, residual)
        finally:
            residual.close()
        # no spin: compiled code hands nearly every reply to Python's wait and resumes after it
        residual = RemoteResidual(converted, [a.endpoint for a in actors], ChannelConfig(spin_us=0))
        waits = []
        real_wait = Lanes.wait
        monkeypatch.setattr(Lanes, "wait", lambda self: waits.append(1) or real_wait(self))
        try:
            with residual.lanes(1, GROUPS, split._compiled.d_in) as lanes:
                assert lanes is not None and lanes.count == n_actors  # the pass below takes the leased slots
            _check(split, residual, ids, reference_logits[8])
            assert waits, "no reply went through Python's wait"
        finally:
            residual.close()
        # requests of at most 6 rows: a 16-row pass posts three to each actor, and (as a prompt's pass of more
        # rows than the compiled attention takes) attends in Python between its compiled stretches
        monkeypatch.setattr(cpu_step, "LOOP_TOKENS", 8)
        residual = RemoteResidual(converted, [a.endpoint for a in actors], ChannelConfig(max_tokens=6))
        try:
            with residual.lanes(16, GROUPS, split._compiled.d_in) as lanes:
                assert lanes is not None and lanes.count == 3 * n_actors and (lanes.chunk, lanes.chunks) == (6, 3)
            stats = PassStats()
            assert_close(split.forward(ids, split.new_cache(32), residual, stats=stats), reference_logits[8])
            assert stats.round_trips == 3 * 4 * len(converted.layers) and stats.attention_s > 0
        finally:
            residual.close()
    finally:
        for actor in actors:
            actor.stop()


def test_refused_requests_give_every_actors_slot_back(converted_small, converted):
    """Requests that fail, more of them than an actor has slots, cost no slot of any actor: one the actors
    refuse (an lm_head request past the last layer, an error reply from each, after which the channel
    stays up) and one whose x' does not fit a slot (raised at ``submit``). After them a full set of
    requests in flight still fits, and each gives what the in-process shards give."""
    slots = ChannelConfig().slots
    actors = [start_cpu_actor(converted_small, 8, i, 2, head_share=0.5) for i in range(2)]
    residual = RemoteResidual(converted, [a.endpoint for a in actors])
    try:
        hidden = converted.spec.hidden
        for _ in range(slots + 1):
            with pytest.raises(RemoteError, match="num_layers") as info:
                residual.gather(residual.submit(len(converted.layers), HEAD, torch.randn(1, hidden)))
            assert info.value.code == ErrorCode.INVALID
            with pytest.raises(RuntimeError, match="must match"):
                residual.submit(0, "qkv", torch.randn(1, hidden + 1))
            # a group's rows in several requests, the first refused: the later one is still added, its slots back
            x = torch.randn(1, hidden)
            pending = [(slice(0, 1), residual.submit(len(converted.layers), HEAD, x))]
            pending.append((slice(1, 2), residual.submit(0, "qkv", x)))
            out = torch.zeros(2, converted.layers[0]["qkv"].rows)
            with pytest.raises(RemoteError, match="num_layers"):
                add_chunks(residual, pending, out)
            assert out[0].abs().sum() == 0 and out[1].abs().sum() > 0
        local = LocalResidual.load(converted_small, 8, n_shards=2)
        torch.manual_seed(0)
        names = list(converted.layers[0])
        xs = [torch.randn(3, converted.layers[0][names[i % len(names)]].d_in) for i in range(slots)]
        handles = [residual.submit(0, names[i % len(names)], x) for i, x in enumerate(xs)]  # every slot in flight
        for i, (x, handle) in enumerate(zip(xs, handles, strict=True)):
            want = local.gather(local.submit(0, names[i % len(names)], x))
            got = residual.gather(handle)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), names[i % len(names)]
    finally:
        residual.close()
        for actor in actors:
            actor.stop()


def test_rows_the_engine_keeps_are_multiplied_in_the_compiled_pass(
    converted_small, converted, split, ids, reference_logits
):
    """An engine that keeps the first third of every group's residual rows (``resident_bytes``) multiplies them
    in the compiled pass itself, beside the leased slots of a CPU actor started with the same figure, and
    its logits still match the reference."""
    from splitspec.gpu_actor.residual import DeviceResidual
    from splitspec.quantize.packing import residual_nbytes

    total = sum(residual_nbytes(g.rows, g.d_in, 8) for layer in converted.layers for g in layer.values())
    actor = start_cpu_actor(converted_small, 8, resident_bytes=total // 3)
    held = DeviceResidual(converted, 8, resident_bytes=total // 3)
    residual = RemoteResidual(converted, [actor.endpoint], held=held)
    try:
        with residual.lanes(1, GROUPS, split._compiled.d_in) as lanes:
            assert lanes is not None and lanes.held_at and lanes.levels == held.levels > 0
        _check(split, residual, ids, reference_logits[8])
        assert held.held_s > 0
        _check_add_into(converted, residual)
    finally:
        residual.close()
        actor.stop()


def test_incremental_decoding_and_rollback(split, ids, reference_logits):
    """Token by token equals all at once; truncating and re-forwarding gives the same logits again."""
    ref = reference_logits[None]
    cache = split.new_cache(32)
    split.forward(ids[:12], cache, NoResidual())
    first = split.forward(ids[12:16], cache, NoResidual())
    assert_close(first, ref[12:16])
    cache.truncate(12)
    split.forward(torch.tensor([5, 6]), cache, NoResidual())  # a branch that is thrown away
    cache.truncate(12)
    for t in range(12, 16):
        assert_close(split.forward(ids[t : t + 1], cache, NoResidual()), ref[t : t + 1])
    assert cache.length == 16


def test_tree_mask_and_keep_compacts_the_accepted_path(split, ids, reference_logits):
    """Siblings at one position under a tree mask score like their linear sequences; ``keep`` of one
    path leaves a cache that continues exactly as if only that path had been decoded."""
    ref = reference_logits[None]
    cache = split.new_cache(32)
    split.forward(ids[:12], cache, NoResidual())
    other = int(ids[13]) + 1
    block = torch.tensor([int(ids[12]), other, int(ids[13])])  # node 0, then two children of node 0
    mask = torch.ones(3, 15, dtype=torch.bool)
    mask[:, 12:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    logits = split.forward(block, cache, NoResidual(), positions=torch.tensor([12, 13, 13]), mask=mask)
    assert_close(logits[[0, 2]], ref[12:14])
    cache.keep(12, [0, 2])
    assert cache.length == 14
    assert cache.positions[:14].tolist() == list(range(14))
    assert_close(split.forward(ids[14:16], cache, NoResidual()), ref[14:16])


def test_the_drafts_one_call_layers_equal_its_op_by_op_layers(split, ids, monkeypatch):
    """``cpu_step`` runs the draft's layers as one call; its logits and K/V are the op-by-op path's up to
    the order of fp32 sums, for one token after a prompt and for a tree level of siblings under a mask."""
    assert split._compiled is not None  # the default model's widths and rotation take the one call
    mask = torch.ones(3, 15, dtype=torch.bool)
    mask[:, 12:] = torch.eye(3, dtype=torch.bool)  # three siblings at one position, each seeing itself
    steps = [(ids[12:13], None, None), (ids[12:15], torch.tensor([12, 12, 12]), mask)]
    outs = {}
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(split, "_compiled", None)
        cache = split.new_cache(32)
        split.forward(ids[:12], cache, NoResidual())
        outs[one_call] = []
        for tokens, positions, m in steps:
            cache.truncate(12)
            logits = split.forward(tokens, cache, NoResidual(), positions, m, draft=True)
            written = slice(12, 12 + len(tokens))
            outs[one_call] += [logits, cache.k[:, written].clone(), cache.v[:, written].clone()]
    for i, (fast, slow) in enumerate(zip(outs[True], outs[False], strict=True)):
        tolerance = DRAFT_LOGITS if i % 3 == 0 else 1e-5
        assert (fast - slow).abs().max() <= tolerance * slow.abs().max()


@pytest.mark.parametrize("loop_tokens", [cpu_step.LOOP_TOKENS, 2])
def test_several_sequences_in_the_compiled_layers_equal_op_by_op(converted, split, ids, monkeypatch, loop_tokens):
    """One pass over three sequences (different cached lengths, one a tree level under a mask), through the
    verifier with the 8-bit residual and through the draft: ``cpu_step`` gives each sequence's logits and
    K/V as the op-by-op path does, with its own attention loops and, past ``LOOP_TOKENS`` rows (a prompt's
    path, here from 3 rows), with sdpa; the prompts before it (from an empty cache: sdpa's causal form) too."""
    from splitspec.gpu_actor.model import Segment

    monkeypatch.setattr(cpu_step, "LOOP_TOKENS", loop_tokens)
    residual = LocalResidual.load(converted.folder, 8)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[:, 7:] = torch.eye(2, dtype=torch.bool)
    outs = {}
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(split, "_compiled", None)
        outs[one_call] = []
        for source, draft in ((residual, False), (NoResidual(), True)):
            caches = [split.new_cache(32) for _ in range(3)]
            for cache, length in zip(caches, (4, 7, 10), strict=True):
                outs[one_call].append(split.forward(ids[:length], cache, residual, last_only=True))
            segments = [
                Segment(ids[4:5], caches[0]),
                Segment(ids[7:9], caches[1], torch.tensor([7, 7]), mask),
                Segment(ids[10:13], caches[2], last_only=True),
            ]
            outs[one_call] += split.forward_many(segments, source, draft=draft)
            outs[one_call] += [torch.cat([c.k[:, : c.length].flatten(), c.v[:, : c.length].flatten()]) for c in caches]
    tolerances = [ORDER_LOGITS] * 6 + [1e-5] * 3 + [ORDER_LOGITS] * 3 + [DRAFT_LOGITS] * 3 + [1e-5] * 3
    for fast, slow, tolerance in zip(outs[True], outs[False], tolerances, strict=True):
        assert fast.shape == slow.shape
        assert (fast - slow).abs().max() <= tolerance * slow.abs().max()


def test_a_ring_holds_its_last_slots_and_says_what_a_sequence_can_resume_from():
    """A sliding layer's ring (window 4, slack 2: 6 entries) beside a full layer: each slot's K/V at its
    entry, ``ring_slots`` naming it; a prefix can be resumed only while the ring holds the window before it,
    and a copy of it keeps none of the slots past the prefix; a prefix cache passes over the others."""
    cache = KVCache([(1, 2), (1, 2)], max_seq=32, rings=[True, False], window=4, slack=2)
    assert cache.ring == 6 and cache.is_ring(0) and not cache.is_ring(1)
    with pytest.raises(ValueError, match="several shapes or rings"):
        _ = cache.k
    for start in range(0, 10, 2):
        block = torch.arange(start, start + 2, dtype=torch.float32)[:, None, None].expand(2, 1, 2)
        cache.ring_write(0, cache.reserve(2), block, -block)
        cache.commit(start, torch.arange(start, start + 2))
    keys, values = cache.view(0, 10)
    assert keys[:, 0, 0].tolist() == [6, 7, 8, 9, 4, 5] and torch.equal(values, -keys)
    assert cache.ring_slots.tolist() == [6, 7, 8, 9, 4, 5]
    assert cache.resumable(10) and cache.resumable(8) and not cache.resumable(6)
    copy = KVCache([(1, 2), (1, 2)], max_seq=32, rings=[True, False], window=4, slack=2)
    copy.load_prefix(cache, 8)
    assert copy.ring_slots.tolist() == [6, 7, -1, -1, 4, 5] and copy.length == 8
    mask = torch.ones(1, 9, dtype=torch.bool)  # slot 8's row sees every slot: the ring has lost 0..3
    with pytest.raises(RuntimeError, match="no longer holds a slot this pass sees"):
        copy.ring_mask(8, mask)
    mask[0, :5] = False  # its window (4) reaches slot 5 on
    assert copy.ring_mask(8, mask).tolist() == [[True, True, False, False, False, True, True]]
    kept = PrefixCache(1 << 20)
    kept.put(list(range(10)), cache)
    assert kept.lookup([*range(8), 99]) == (cache, 8)
    assert kept.lookup([*range(6), 99]) == (None, 0)  # slots 2..5 are gone from the ring
    with pytest.raises(ValueError, match="a window and slack of at least one slot each"):
        KVCache([(1, 2)], max_seq=32, rings=[True], window=4)


def test_kv_cache_refuses_bad_use():
    cache = KVCache([(1, 2)], max_seq=4)
    cache.commit(cache.reserve(3), torch.arange(3))
    with pytest.raises(ValueError, match="raise EngineConfig"):
        cache.reserve(2)
    with pytest.raises(ValueError, match="must increase"):
        cache.keep(1, [1, 0])
    with pytest.raises(ValueError, match="must increase"):
        cache.keep(1, [0, 2])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(4)


def test_coverage_gap_is_refused(converted):
    rows = {name: [(0, g.rows)] for name, g in converted.layers[0].items()}
    check_coverage(converted, rows)
    rows["o"] = [(0, 16), (32, converted.group(0, "o").rows)]
    with pytest.raises(ValueError, match="must tile"):
        check_coverage(converted, rows)


def test_sylvester_rotation_matches_reference(converted_sylvester, default_folder, ids):
    """The other rotation kind goes through the forward pass right too (the default, kronecker, with a
    non-symmetric Paley factor on 1536, is what every test above runs)."""
    converted = ConvertedModel(converted_sylvester)
    assert converted.rotation == "sylvester"
    with torch.no_grad():
        ref = dequantized_reference(converted, default_folder, 8)(ids[None]).logits[0]
    _check(SplitModel(converted), LocalResidual.load(converted_sylvester, 8), ids, ref)


def test_rope_table_grows_past_its_initial_size(split):
    """Positions past the precomputed table (it starts at 1024 and doubles) rotate as transformers' formula
    does: q·cos + rotate_half(q)·sin, with cos/sin computed for that position; q's with the attention scale
    folded in. Both forms: per-token matrices for a few positions, tables from ROPE_TABLE_TOKENS on."""
    from splitspec.gpu_actor.model import ROPE_TABLE_TOKENS, _apply_rope
    from splitspec.models.spec import FULL

    scale = split._attn_scale
    for positions in (torch.tensor([0, 7, 1023, 1024, 5000]), torch.arange(ROPE_TABLE_TOKENS) * 400 + 3):
        q_rope, k_rope = split._rope(positions)[FULL]
        assert isinstance(k_rope, torch.Tensor) == (len(positions) < ROPE_TABLE_TOKENS)
        assert split._rope_size > int(positions.max())
        freqs = positions.float()[:, None] * torch.tensor(split.spec.rope[FULL].inv_freq)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(len(positions), split.spec.n_heads, split.spec.head_dim, generator=gen)
        half = q.shape[-1] // 2
        want = q * emb.cos() + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * emb.sin()
        torch.testing.assert_close(_apply_rope(q, k_rope), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(_apply_rope(q, q_rope), want * scale, rtol=0, atol=1e-5)
        out = torch.empty_like(q)
        assert _apply_rope(q, k_rope, out=out) is out


@pytest.mark.parametrize(("n", "start"), [(200, 0), (256, 0), (130, 70)])
def test_long_causal_attention_in_query_blocks_matches_softmax(n: int, start: int) -> None:
    """A long pass on the CPU whose rows see no later slot takes sdpa a block of query rows at a time, each
    against the slots up to its last row's: the float64 softmax's output, from the cache's start (sdpa's
    causal form) or after a prefix (the explicit mask); a mask in which a row sees a later slot keeps every
    slot, and gives the softmax's output too."""
    from splitspec.gpu_actor.model import CAUSAL, SDPA_BLOCK, sdpa

    assert n >= 2 * SDPA_BLOCK
    g = torch.Generator().manual_seed(n + start)
    heads, kv, dim, slots = 6, 2, 16, start + n
    q, k, v = (
        torch.randn(n, heads, dim, generator=g) / 4,
        torch.randn(slots, kv, dim, generator=g),
        torch.randn(slots, kv, dim, generator=g),
    )
    causal = torch.ones(n, slots, dtype=torch.bool).tril(start)
    later = causal.clone()
    later[1, -1] = True

    def softmax_attention(mask: torch.Tensor) -> torch.Tensor:
        kk, vv = (t.double().repeat_interleave(heads // kv, 1).transpose(0, 1) for t in (k, v))
        scores = (q.double().transpose(0, 1) @ kk.transpose(1, 2)).masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, -1) @ vv).transpose(0, 1).reshape(n, heads * dim).float()

    forms = [(causal, causal), (later, later)] + ([(CAUSAL, causal)] if start == 0 else [])
    for form, mask in forms:
        torch.testing.assert_close(sdpa(q, k, v, form), softmax_attention(mask), atol=1e-5, rtol=1e-5)


def test_long_blocks_take_the_causal_mask_and_rope_tables(split, ids, reference_logits, monkeypatch):
    """Op by op (a prompt's path), a block of ROPE_TABLE_TOKENS or more takes RoPE tables, and sdpa's own
    causal mask where it starts the cache; after a prefix, the explicit mask. Both give the reference's
    logits, and the same K as a token-by-token pass (per-token matrices)."""
    from splitspec.gpu_actor.model import CAUSAL, ROPE_TABLE_TOKENS

    monkeypatch.setattr(split, "_compiled", None)
    ref = reference_logits[None]
    n = len(ids)
    assert n >= ROPE_TABLE_TOKENS
    whole = split.new_cache(2 * n)
    assert set(split._mask_forms(split._masks(whole, 0, torch.arange(n), None), 0).values()) == {CAUSAL}
    assert_close(split.forward(ids, whole, NoResidual()), ref)
    stepwise = split.new_cache(n)
    for t in range(n):
        split.forward(ids[t : t + 1], stepwise, NoResidual())
    assert (whole.k[:, :n] - stepwise.k[:, :n]).abs().max() <= 1e-4 * stepwise.k[:, :n].abs().max()
    whole.truncate(n)
    after = split._mask_forms(split._masks(whole, n, torch.arange(n, 2 * n), None), n)
    assert all(isinstance(m, torch.Tensor) for m in after.values())
    again = split.forward(ids, whole, NoResidual())  # the same tokens again, after themselves: a new context
    cold = split.new_cache(2 * n)
    split.forward(ids, cold, NoResidual())
    for t in range(n):
        step = split.forward(ids[t : t + 1], cold, NoResidual())
        assert_close(again[t : t + 1], step)


def test_bf16_head_keeps_the_logits_of_the_fp32_head(converted, split, ids):
    """``head="bf16"``: logits within bf16 rounding of the fp32 head's, and the same greedy token but where
    fp32's best two are closer than that rounding can tell apart; an unknown precision is refused by the
    model and the config, and bf16 by a CPU whose oneDNN has no bf16 products. The bound per logit is the
    rounding's own, so that it holds for any order of the sums (AMX tiles and AVX512-BF16 sum differently):
    h and W rounded to bf16 (2⁻⁸ of each product's size, summed in fp32), then the logit (2⁻⁹ of it, taken
    twice)."""
    from splitspec.config import EngineConfig

    with pytest.raises(ValueError, match="head must be one of int16, fp32, bf16"):
        SplitModel(converted, head="fp16")
    with pytest.raises(ValueError, match=r"EngineConfig\.head must be one of int16, fp32, bf16"):
        EngineConfig(head="int8")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with pytest.raises(ValueError, match='head = "bf16" needs a CPU with bf16 support in oneDNN; use "fp32"'):
            SplitModel(converted, head="bf16")
        pytest.skip("this CPU's oneDNN has no bf16 products: the bf16 head is refused (checked)")
    bf16, fp32 = SplitModel(converted, head="bf16"), SplitModel(converted, head="fp32")
    seen = []  # the normed hidden states the fp32 head is given, for the bound
    fp32_head = fp32.head
    fp32.head = lambda x: (seen.append(x.clone()), fp32_head(x))[1]
    want = fp32.forward(ids, fp32.new_cache(32), NoResidual())
    got = bf16.forward(ids, bf16.new_cache(32), NoResidual())
    assert got.dtype == torch.float32
    bound = (2**-8 + 2**-12) * (seen[0].abs() @ split.lm_head.abs().T) + 2**-8 * want.abs()
    assert ((got - want).abs() <= bound).all()
    picked, best, rows = got.argmax(-1), want.argmax(-1), torch.arange(len(want))
    gap = want[rows, best] - want[rows, picked]  # 0 where the greedy tokens agree
    assert (gap <= bound[rows, picked] + bound[rows, best]).all()
    assert bf16.head.nbytes == split.lm_head.numel() * 2
    # ``logits`` (what prefill.time_head times) takes the configured head, not the stored fp32 weight
    h = torch.randn(2, split.spec.hidden, generator=torch.Generator().manual_seed(0))
    normed = F.rms_norm(h, split.norm.shape, split.norm, split.spec.rms_eps)
    assert torch.equal(bf16.logits(h), bf16.head(normed))
    want = normed @ split.lm_head.T
    torch.testing.assert_close(fp32.logits(h), want, rtol=0, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(bf16.logits(h), fp32.logits(h))


@pytest.mark.parametrize("kind", ["kronecker", "sylvester"])
def test_stacked_output_rotation_is_one_unrotate_per_linear(kind):
    """Linears of one width (k and v, gate and up) are rotated back in one ``Rotation`` call over a
    [n, count, width] view with their signs stacked: the same as ``unrotate_output`` per Linear."""
    from splitspec.gpu_actor.kernels import unrotate_output
    from splitspec.gpu_actor.kernels.rotation import Rotation
    from splitspec.quantize.hadamard import random_signs

    for width, n in ((192, 1), (1536, 3)):
        signs = [random_signs(seed, width) for seed in (1, 2)]
        y = torch.randn(n, 3 * width, generator=torch.Generator().manual_seed(width))
        got = Rotation(width, kind, True, torch.stack(signs))(y[:, width:].view(n, 2, width))
        for j, s in enumerate(signs):
            want = unrotate_output(y[:, (j + 1) * width : (j + 2) * width], s, kind)
            torch.testing.assert_close(got[:, j], want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_the_default_int16_head_keeps_the_fp32_heads_logits(converted, split, ids):
    """The default verifier head (int16 codes under a per-row scale) reads half fp32's bytes and gives the
    fp32 head's logits to within 1e-4 of the largest (the codes' rounding: half a step of each row's largest
    magnitude / 32767 per weight), the same greedy token at every position, through a whole forward and
    through ``logits``."""
    fp32 = SplitModel(converted, head="fp32")
    want = fp32.forward(ids, fp32.new_cache(32), NoResidual())
    got = split.forward(ids, split.new_cache(32), NoResidual())
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    vocab, hidden = split.lm_head.shape
    assert split.head.nbytes == vocab * hidden * 2 + vocab * 4
    h = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    normed = F.rms_norm(h, split.norm.shape, split.norm, split.spec.rms_eps)
    assert torch.equal(split.logits(h), split.head(normed))


def test_the_base_rounds_x_only_where_the_residual_does(converted):
    """The base's AMX tiles round x' to int16 as the residual's int16 mode does; with the residual in fp32 or
    int8 the base keeps its fp32 paths, so that a Linear never mixes two roundings of x'."""
    for activations, tiled in (("int16", amx.enabled()), ("int8", False), ("fp32", False)):
        model = SplitModel(converted, activations=activations)
        flags = {group.base.cpu_fields[-1] for layer in model.layers for group in layer.groups.values()}
        assert flags == {int(tiled)}, activations
    with pytest.raises(ValueError, match="activations must be one of"):
        SplitModel(converted, activations="bf16")


def test_a_prompt_in_parts_with_the_actors_base_share_matches_reference(
    converted_small, converted, default_folder, ids, monkeypatch
):
    """A prompt of ``prefill_parts`` × ``PART_ROWS`` rows or more runs in parts, and the CPU actors (started
    with ``base_share``) add their share of the base into their replies to its requests: through the leased
    slots, through Python's requests (tcp) and op by op, its logits match the reference's, and so do a
    decode step's after it (a request too small for the share). Actors started with different shares are
    refused."""
    prompt = torch.cat([ids] * 9)[:141]
    with torch.no_grad():
        ref = dequantized_reference(converted, default_folder, 8)(prompt[None]).logits[0]
    split = SplitModel(converted, prefill_parts=4)
    in_parts = []
    run_parts = SplitModel._run_parts
    monkeypatch.setattr(SplitModel, "_run_parts", lambda self, *args: in_parts.append(1) or run_parts(self, *args))
    actors = [start_cpu_actor(converted_small, 8, i, 2, base_share=0.3) for i in range(2)]
    try:
        for config, compiled in ((ChannelConfig(), True), (ChannelConfig(transport="tcp"), True), (None, False)):
            residual = RemoteResidual(converted, [a.endpoint for a in actors], config)
            try:
                assert residual.base_share == 0.3
                with monkeypatch.context() as m:
                    if not compiled:
                        m.setattr(split, "_compiled", None)
                    cache = split.new_cache(160)
                    assert_close(split.forward(prompt[:140], cache, residual), ref[:140])
                    assert_close(split.forward(prompt[140:], cache, residual), ref[140:])
            finally:
                residual.close()
            assert bool(in_parts) == (config is not None and config.transport == "auto"), config
            in_parts.clear()
        unshared = start_cpu_actor(converted_small, 8, 1, 2)
        try:
            with pytest.raises(ValueError, match="different shares of the base"):
                RemoteResidual(converted, [actors[0].endpoint, unshared.endpoint])
        finally:
            unshared.stop()
    finally:
        for actor in actors:
            actor.stop()
