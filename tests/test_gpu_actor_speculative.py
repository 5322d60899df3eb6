"""Speculative decoding through real CPU actor processes: lossless against the verifier alone.

Greedy text with any draft shape (chains γ = 1…8, best-first trees of 4…64 nodes, p_min pruning, the
2-bit-KV draft, 1 and 2 CPU actors) must equal the verifier alone token for token. A tree pass sums in
another order than a one-token pass, so where the verifier alone's top-2 logits are closer than
``NEAR_TIE`` either token is right: that prompt's comparison stops there and the near-tie is counted.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIT_PROMPTS
from splitspec.config import EngineConfig, SamplingParams, SpecConfig
from splitspec.gpu_actor.engine import SplitEngine
from splitspec.models.files import CorruptFileError
from splitspec.quantize.format import TREE_STATS_FILE, TREE_STATS_VERSION, ConvertedModel
from splitspec.scheduler.cost import Choice, CostCurve, Costs, NgramStats
from splitspec.scheduler.local import start_local
from test_gpu_actor_engine import NEAR_TIE  # pytest puts tests/ on sys.path

NEW_TOKENS = 24
SHAPES = [("chain", g) for g in range(1, 9)] + [("tree", n) for n in (4, 16, 64)]


def _with(engine: SplitEngine, **spec) -> SplitEngine:
    """The same model, residual and statistics under another draft configuration."""
    config = EngineConfig(prefill="split", spec=SpecConfig(**spec))
    return SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats, ngram=engine.ngram)


def _top2_gap(engine: SplitEngine, ids: list[int]) -> float:
    cache = engine.new_cache()
    logits, _, _ = engine.prefill(torch.tensor(ids), cache)
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


def _compare(alone: SplitEngine, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """ "equal", or "near-tie" where they part at a near-tie of the verifier alone; fails otherwise."""
    for t, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            gap = _top2_gap(alone, prompt + theirs[:t])
            assert gap < NEAR_TIE, f"token {t}: speculative {a} != verifier alone {b} (top-2 gap {gap:.3g})"
            return "near-tie"
    assert len(ours) == len(theirs)
    return "equal"


@pytest.fixture(scope="module")
def alone_text(engine, prompts, tokenizer):
    alone = _with(engine, mode="off")
    return alone, [alone.generate(p, NEW_TOKENS, tokenizer.eos_token_id)[0] for p in prompts]


@pytest.mark.parametrize(("mode", "size"), SHAPES)
def test_greedy_speculation_equals_the_verifier_alone(engine, prompts, alone_text, tokenizer, mode, size):
    alone, expected = alone_text
    spec = _with(engine, mode=mode, draft_max=size)
    # a best-first tree of few nodes may be a chain, by the folder's fitted statistics: named as one
    shape = spec.draft_shape()
    assert shape.nodes == size and (mode == "tree" or shape.name() == f"chain{size}")
    outcomes, accepted = [], 0
    for prompt, theirs in zip(prompts, expected, strict=True):
        ours, stats = spec.generate(prompt, NEW_TOKENS, tokenizer.eos_token_id)
        outcomes.append(_compare(alone, prompt, ours, theirs))
        assert stats.shape == shape.name() and stats.checks
        assert all(c.drafted <= size and 0 <= c.accepted <= c.drafted for c in stats.checks)
        assert sum(c.accepted + 1 for c in stats.checks) + 1 >= len(ours)
        accepted += sum(c.accepted for c in stats.checks)
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    assert accepted > 0  # the draft is right some of the time, so the test exercised acceptance


def test_p_min_pruning_and_the_2bit_kv_draft_stay_lossless(engine, prompts, alone_text, tokenizer):
    alone, expected = alone_text
    for spec in ({"mode": "tree", "draft_max": 16, "p_min": 0.3}, {"mode": "tree", "draft_max": 16, "kv": "draft2bit"}):
        eng = _with(engine, **spec)
        ours, stats = eng.generate(prompts[0], NEW_TOKENS, tokenizer.eos_token_id)
        assert _compare(alone, prompts[0], ours, expected[0]) in ("equal", "near-tie")
        if "p_min" in spec:
            assert min(c.drafted for c in stats.checks) < 16  # something was pruned


def test_two_cpu_actors_give_the_same_text(engine, converted_small, prompts, alone_text, tokenizer):
    alone, expected = alone_text
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="tree", draft_max=16))
    with start_local(converted_small, 8, n_cpu_actors=2, config=config) as two:
        ours, _ = two.generate(prompts[1], NEW_TOKENS, tokenizer.eos_token_id)
    assert _compare(alone, prompts[1], ours, expected[1]) in ("equal", "near-tie")


def test_sampling_is_reproducible_by_seed(engine, prompts):
    tree = _with(engine, mode="tree", draft_max=8)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    a, _ = tree.generate(prompts[2], 16, params=params)
    b, _ = tree.generate(prompts[2], 16, params=params)
    c, _ = tree.generate(prompts[2], 16, params=SamplingParams(temperature=0.9, top_p=0.95, seed=12))
    assert a == b and len(a) == 16
    assert a != c  # 16 sampled tokens of a 2-layer model at temperature 0.9: another seed differs


def test_auto_picks_from_measured_costs(engine, prompts):
    auto = _with(engine, mode="auto", draft_max=16)
    choice = auto.draft_shape()
    assert isinstance(choice, Choice) and auto.draft_shape() is choice
    costs = auto.check_costs()
    assert costs.verify(1) > 0 and costs.draft(1) > 0 and costs.overhead_ms >= 0
    _, stats = auto.generate(prompts[0], 8)
    assert stats.shape == choice.name and stats.predicted_tok_s == pytest.approx(choice.tok_s)


def test_tree_statistics_are_checked(engine, converted_small, tmp_path):
    stats = ConvertedModel(converted_small).tree_stats()
    assert stats is not None and len(stats["p"]) == 8 and all(sum(row) <= 1 + 1e-9 for row in stats["p"])
    bare = SplitEngine(engine.model, engine.residual, EngineConfig(spec=SpecConfig(mode="tree")))
    with pytest.raises(ValueError, match="fit-tree"):
        bare.draft_shape()
    assert bare.__class__(engine.model, engine.residual, EngineConfig(spec=SpecConfig(mode="chain"))).draft_shape()
    copy = tmp_path / "folder"
    copy.mkdir()
    for f in converted_small.iterdir():
        (copy / f.name).symlink_to(f)
    (copy / TREE_STATS_FILE).unlink()
    (copy / TREE_STATS_FILE).write_text(json.dumps({**stats, "conversion_id": "another"}))
    with pytest.raises(CorruptFileError, match="fit-tree"):
        ConvertedModel(copy).tree_stats()
    (copy / TREE_STATS_FILE).write_text('{"p": [[0.5, 0.7]]')
    with pytest.raises(CorruptFileError, match="fit-tree"):
        ConvertedModel(copy).tree_stats()
    (copy / TREE_STATS_FILE).write_text(json.dumps({**stats, "version": TREE_STATS_VERSION + 1}))
    with pytest.raises(CorruptFileError, match="upgrade it"):
        ConvertedModel(copy).tree_stats()
    bad = {**stats, "ngram": {**stats["ngram"], "counts": [[1, 2], [0, 0]]}}  # kept more than it found
    (copy / TREE_STATS_FILE).write_text(json.dumps(bad))
    with pytest.raises(CorruptFileError, match="ngram counts"):
        ConvertedModel(copy).tree_stats()
    # a version-1 file (before the n-gram replay) still loads: "auto" weighs only the model's drafts
    old = {k: v for k, v in stats.items() if k not in ("version", "ngram")}
    (copy / TREE_STATS_FILE).write_text(json.dumps(old))
    assert ConvertedModel(copy).tree_stats() == old


def test_an_ngram_branch_on_the_2bit_tree_stays_lossless(engine, prompts, alone_text, tokenizer):
    """``ngram_branch``: the tree of every check also holds what the n-gram lookup finds; on a text that
    repeats itself the checks verify more nodes than the tree's, the greedy text is the verifier alone's,
    and a seed still fixes a sampled text."""
    alone, expected = alone_text
    branched = _with(engine, mode="tree", draft_max=16, ngram_branch=True)
    # a tree shallower than the n-gram's longest proposal (16), which a path found in the text can leave (a
    # best-first tree of few nodes may be a chain as deep as that, by the folder's fitted statistics)
    assert branched.draft_shape().depth < 16
    repeated = prompts[0] + expected[0] + prompts[0][1:]
    ours, stats = branched.generate(repeated, NEW_TOKENS, tokenizer.eos_token_id)
    theirs, _ = alone.generate(repeated, NEW_TOKENS, tokenizer.eos_token_id)
    assert _compare(alone, repeated, ours, theirs) in ("equal", "near-tie")
    assert max(c.drafted for c in stats.checks) > 16 and all(c.draft_steps > 0 for c in stats.checks)
    plain = _with(engine, mode="tree", draft_max=16)
    _, plain_stats = plain.generate(repeated, NEW_TOKENS, tokenizer.eos_token_id)
    assert len(stats.checks) < len(plain_stats.checks)  # the branch decided more tokens a check
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    assert branched.generate(repeated, 16, params=params)[0] == branched.generate(repeated, 16, params=params)[0]
    # a batch sizes each sequence's cache for the longest check: a chain of 16 and as many grafted n-grams
    from splitspec.gpu_actor.batcher import generate_many

    long = _with(engine, mode="chain", draft_max=16, ngram_branch=True)
    [(batched, batch_stats)] = generate_many(long, [repeated], 20, tokenizer.eos_token_id)
    assert max(c.drafted for c in batch_stats.checks) > 16  # the branch grafted on the chain
    assert _compare(alone, repeated, batched, alone.generate(repeated, 20, tokenizer.eos_token_id)[0]) in (
        "equal", "near-tie"
    )  # fmt: skip


def test_auto_weighs_ngram_drafts_and_stays_lossless(engine, converted_small, prompts, alone_text, tokenizer):
    """The fitted replay covers each fitting continuation; a replay where the text always went on as found
    makes "auto" copy drafts from the text, which keeps the verifier alone's text, alone and in a batch; a
    replay where nothing was found leaves the choice as it was."""
    from splitspec.gpu_actor.batcher import generate_many

    fitted = ConvertedModel(converted_small).tree_stats()
    counts = fitted["ngram"]["counts"]
    assert fitted["version"] == TREE_STATS_VERSION and engine.ngram == NgramStats.of(counts)
    assert sum(c * (a + 1) for row in counts for a, c in enumerate(row)) == len(FIT_PROMPTS) * (24 - 1)
    alone, expected = alone_text
    config = EngineConfig(prefill="split", spec=SpecConfig(mode="auto", draft_max=8))
    sure = NgramStats.of([[10, 0, 0, 0, 0], [0] * 5, [0] * 5, [0] * 5, [0, 0, 0, 0, 90]])
    auto = SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats, ngram=sure)
    # a CPU engine's shape of costs, fixed: what this test checks must not hang on a busy machine's timings
    auto._check_costs = Costs(CostCurve.of({1: 10.0, 17: 12.0}), CostCurve.of({1: 9.0, 16: 100.0}), 0.5)
    choice = auto.draft_shape()
    assert choice.ngram and auto.draft_name(choice) == "ngram"
    outcomes = []
    for prompt, theirs in zip(prompts, expected, strict=True):
        ours, stats = auto.generate(prompt, NEW_TOKENS, tokenizer.eos_token_id)
        outcomes.append(_compare(alone, prompt, ours, theirs))
        assert stats.shape == "ngram" and stats.predicted_tok_s == pytest.approx(choice.tok_s)
        assert all(c.draft_steps == 0 for c in stats.checks)
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    together = generate_many(auto, prompts, NEW_TOKENS, tokenizer.eos_token_id)
    outcomes = [_compare(alone, p, o, t) for p, (o, _), t in zip(prompts, together, expected, strict=True)]
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    never = NgramStats.of([[50, 0], [0, 0]])
    views = [
        SplitEngine(engine.model, engine.residual, config, tree_stats=engine.tree_stats, ngram=n) for n in (never, None)
    ]
    for view in views:
        view._check_costs = auto.check_costs()  # the same costs: the choices differ by the statistics alone
    assert views[0].draft_shape() == views[1].draft_shape() and not views[0].draft_shape().ngram


def test_sequences_sharing_checks_get_their_own_text(engine, prompts, alone_text, tokenizer):
    """Three prompts decoded together (one verify pass per check for all of them) give each the text it
    gets alone; a sequence that ends early leaves the others going."""
    from splitspec.gpu_actor.batcher import generate_many

    alone, expected = alone_text
    tree = _with(engine, mode="tree", draft_max=8)
    results = generate_many(tree, prompts, NEW_TOKENS, tokenizer.eos_token_id)
    outcomes = [
        _compare(alone, p, ours, theirs) for p, (ours, _), theirs in zip(prompts, results, expected, strict=True)
    ]
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    first = results[0][1].checks[0]
    assert first.tokens <= 9 and all(s.checks for _, s in results)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_many(tree, [prompts[0]], tree.config.max_seq_len)


def test_ngram_drafts_from_the_text_and_stay_lossless(engine, prompts, alone_text, tokenizer):
    """Drafts copied from the text (``mode="ngram"``): the verifier alone's text, one sequence at a time and
    three sharing each check, with tokens accepted where the text repeats itself; and a seed still fixes
    a sampled text."""
    from splitspec.gpu_actor.batcher import generate_many

    alone, expected = alone_text
    ngram = _with(engine, mode="ngram", draft_max=8)
    outcomes, drafted, accepted = [], 0, 0
    for prompt, theirs in zip(prompts, expected, strict=True):
        ours, stats = ngram.generate(prompt, NEW_TOKENS, tokenizer.eos_token_id)
        outcomes.append(_compare(alone, prompt, ours, theirs))
        assert stats.shape == "ngram" and all(c.draft_steps == 0 and c.drafted <= 8 for c in stats.checks)
        drafted += sum(c.drafted for c in stats.checks)
        accepted += sum(c.accepted for c in stats.checks)
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    repeated = prompts[0] + expected[0] + prompts[0][1:]  # a text that goes on as it went before
    ours, stats = ngram.generate(repeated, NEW_TOKENS, tokenizer.eos_token_id)
    theirs, _ = alone.generate(repeated, NEW_TOKENS, tokenizer.eos_token_id)
    assert _compare(alone, repeated, ours, theirs) in ("equal", "near-tie")
    accepted += sum(c.accepted for c in stats.checks)
    assert drafted > 0 and accepted > 0
    together = generate_many(ngram, prompts, NEW_TOKENS, tokenizer.eos_token_id)
    outcomes = [_compare(alone, p, o, t) for p, (o, _), t in zip(prompts, together, expected, strict=True)]
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    assert ngram.generate(repeated, 16, params=params)[0] == ngram.generate(repeated, 16, params=params)[0]


def test_shaped_logits_stay_lossless_and_follow_the_reference(engine, prompts, alone_text, tokenizer):
    """Logit bias and penalties: the verifier alone's greedy text is, token by token, the argmax of its
    logits after the text before it, shaped as transformers' processors and OpenAI's formula shape them;
    a tree, a chain and three sequences sharing checks (each with its own shaping, or none) give the same
    text, drafting and accepting along their paths."""
    from splitspec.gpu_actor.batcher import generate_many
    from test_gpu_actor_tree import _reference_shaping

    alone, plain = alone_text
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={plain[0][0]: -100.0}
    )

    def shaped_top(prompt: list[int], text: list[int]) -> tuple[int, float]:
        """The reference's next token after ``text`` and its lead over the second."""
        logits, _, _ = alone.prefill(torch.tensor(prompt + text), alone.new_cache())
        top = _reference_shaping(logits[-1], params, prompt, text).topk(2)
        return int(top.indices[0]), float(top.values[0] - top.values[1])

    def agrees(prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
        cut = next((t for t, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        return ours == theirs or (cut is not None and shaped_top(prompt, theirs[:cut])[1] < NEAR_TIE)

    alone_shaped = [alone.generate(p, NEW_TOKENS, eos, params)[0] for p in (prompts[0], prompts[2])]
    theirs = alone_shaped[0]
    assert theirs != plain[0] and plain[0][0] not in theirs
    for t, token in enumerate(theirs):
        best, gap = shaped_top(prompts[0], theirs[:t])
        assert token == best or gap < NEAR_TIE, f"token {t}: {token} is not the shaped argmax {best} (gap {gap:.3g})"
    accepted = 0
    for mode, size in (("tree", 16), ("chain", 4)):
        ours, stats = _with(engine, mode=mode, draft_max=size).generate(prompts[0], NEW_TOKENS, eos, params)
        assert agrees(prompts[0], ours, theirs), (mode, ours, theirs)
        accepted += sum(c.accepted for c in stats.checks)
    assert accepted > 0
    tree = _with(engine, mode="tree", draft_max=8)
    together = generate_many(tree, prompts, NEW_TOKENS, eos, [params, SamplingParams(), params])
    assert agrees(prompts[0], together[0][0], theirs) and agrees(prompts[2], together[2][0], alone_shaped[1])
    assert _compare(alone, prompts[1], together[1][0], plain[1]) in ("equal", "near-tie")
    with pytest.raises(ValueError, match="vocabulary"):
        alone.generate(prompts[0], 4, eos, SamplingParams(logit_bias={10**7: 1.0}))


def test_the_first_of_several_end_tokens_ends_the_text(engine, prompts, alone_text):
    """A model may end a text with any of several tokens (Llama 3's end of turn and end of text): alone,
    through a tree and in shared checks, the text ends at the first of them."""
    from splitspec.gpu_actor.batcher import generate_many

    alone, plain = alone_text
    text = plain[0]
    ends = {text[9], text[5]}
    first = min(text.index(t) for t in ends)
    assert alone.generate(prompts[0], NEW_TOKENS, ends)[0] == text[: first + 1]
    tree = _with(engine, mode="tree", draft_max=16)
    ours, _ = tree.generate(prompts[0], NEW_TOKENS, sorted(ends))
    assert _compare(alone, prompts[0], ours, text[: first + 1]) in ("equal", "near-tie")
    shared = generate_many(tree, prompts[:2], NEW_TOKENS, frozenset(ends))
    assert _compare(alone, prompts[0], shared[0][0], text[: first + 1]) in ("equal", "near-tie")


def test_min_tokens_holds_the_end_back_alone_and_through_a_tree(engine, prompts):
    """A bias that ends the text at once, and min_tokens: the text ends at its first chance, after that many
    tokens, the same alone as through a tree (whose drafts are shaped alike) and in shared checks."""
    from splitspec.gpu_actor.batcher import generate_many

    end = 2
    params = SamplingParams(logit_bias={end: 100.0}, min_tokens=5)
    alone, tree = _with(engine, mode="off"), _with(engine, mode="tree", draft_max=16)
    theirs, _ = alone.generate(prompts[0], NEW_TOKENS, end, params)
    assert len(theirs) == 6 and theirs[-1] == end and end not in theirs[:-1]
    assert tree.generate(prompts[0], NEW_TOKENS, end, params)[0] == theirs
    shared = generate_many(tree, prompts[:2], NEW_TOKENS, end, [params, SamplingParams(logit_bias={end: 100.0})])
    assert shared[0][0] == theirs and shared[1][0] == [end]


def test_a_half_precision_cache_halves_k_v_and_speculation_stays_lossless(engine, converted_small, prompts, tokenizer):
    """``EngineConfig.kv_dtype = "bfloat16"`` (a GPU's longer context): half the bytes a token's K/V takes,
    attention near the float32 cache's (bf16's rounding of K, V and q), and a tree's text that of the
    verifier alone over the same cache: speculation is lossless whatever the cache holds."""
    from splitspec.gpu_actor.model import SplitModel
    from splitspec.quantize.format import ConvertedModel

    model = SplitModel(ConvertedModel(converted_small), kv_dtype="bfloat16")
    full, half = engine.model.new_cache(64), model.new_cache(64)
    assert half.k.dtype == torch.bfloat16 and half.k.nbytes + half.v.nbytes == (full.k.nbytes + full.v.nbytes) // 2
    with pytest.raises(ValueError, match=r"kv_dtype is float32; the model's caches: torch\.bfloat16"):
        SplitEngine(model, engine.residual, EngineConfig())
    ids = torch.tensor(prompts[0])
    exact = engine.model.forward(ids, engine.model.new_cache(len(ids)), engine.residual)
    rounded = model.forward(ids, model.new_cache(len(ids)), engine.residual)
    gap = float((rounded - exact).abs().max() / exact.abs().max())
    assert 0 < gap < 0.02, gap  # bf16's rounding, and not more
    config = {"prefill": "split", "kv_dtype": "bfloat16"}
    alone = SplitEngine(model, engine.residual, EngineConfig(**config, spec=SpecConfig(mode="off")))
    tree_config = EngineConfig(**config, spec=SpecConfig(mode="tree", draft_max=16))
    tree = SplitEngine(model, engine.residual, tree_config, tree_stats=engine.tree_stats)
    outcomes = []
    for prompt in prompts:
        theirs = alone.generate(prompt, NEW_TOKENS, tokenizer.eos_token_id)[0]
        ours, stats = tree.generate(prompt, NEW_TOKENS, tokenizer.eos_token_id)
        outcomes.append(_compare(alone, prompt, ours, theirs))
        assert len(stats.checks) < len(ours)  # the tree's drafts were taken
    assert outcomes.count("equal") >= len(prompts) - 1, outcomes
