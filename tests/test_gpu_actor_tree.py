"""Draft trees' masks and the acceptance walks: greedy follows the argmax; sampling emits the verifier's
distribution exactly (chi-square against the known distributions over many seeded walks); logit bias and
penalties as transformers' processors and OpenAI's formula define them, shaped along each node's path."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from splitspec.config import SamplingParams
from splitspec.gpu_actor.sampling import Shaping, first_token, make_generator, probabilities
from splitspec.gpu_actor.tree import DraftTree, accept_greedy, accept_sampled, ancestors

# root -> nodes 1 (token 2) and 2 (token 0); node 1 -> node 3 (token 1); node 2 -> node 4 (token 4)
TREE = DraftTree(tokens=[3, 2, 0, 1, 4], parents=[-1, 0, 0, 1, 2], depths=[0, 1, 1, 2, 2])
VOCAB = 5
# chi-square critical value at p = 0.001 for 4 degrees of freedom (5 tokens)
CHI2_CRIT_DF4 = 18.47


def test_ancestor_mask_and_positions():
    a = ancestors(TREE.parents)
    assert a.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, True, False, True],
    ]
    mask = TREE.check_mask(prefix=3)
    assert mask.shape == (5, 8) and mask[:, :3].all() and torch.equal(mask[:, 3:], a)
    assert TREE.positions(10).tolist() == [10, 11, 11, 12, 12]


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_walk_follows_the_argmax():
    # root's argmax 2 (node 1), node 1's argmax 1 (node 3), node 3's argmax 4: bonus
    logits = _logits([[0, 0, 9, 0, 0], [0, 9, 0, 0, 0], [9, 0, 0, 0, 0], [0, 0, 0, 0, 9], [0] * 5])
    assert accept_greedy(TREE, logits) == ([1, 3], 4)
    # root's argmax 1 matches no child: nothing accepted, 1 is the bonus
    logits[0] = torch.tensor([0, 9, 0, 0, 0])
    assert accept_greedy(TREE, logits) == ([], 1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 came out"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _check_sampled_walk(
    tree: DraftTree, seed: int, node: int, least: int, params: SamplingParams | None = None, prompt: list[int] = ()
) -> None:
    """Over 20,000 seeded walks of ``tree``, the first emitted token follows the root's distribution and
    the one after ``node``'s token follows ``node``'s, whether it came from a child or the bonus; at least
    ``least`` walks reached that second position. Under ``params`` that shape the logits, each
    distribution is that of the text so far: the prompt, then ``node``'s token for the second."""
    logits = torch.randn(len(tree.tokens), VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5
    params = params or SamplingParams(temperature=1.0)
    shaping = Shaping.of(params, prompt)
    rows = (logits[0], logits[node])
    if shaping is not None:
        rows = (shaping.apply(logits[0]), shaping.apply(logits[node], [tree.tokens[node]]))
    p_root, p_node = (probabilities(row, params) for row in rows)
    gen = torch.Generator().manual_seed(seed + 1)
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(20_000):
        path, bonus = accept_sampled(tree, logits, params, gen, shaping)
        emitted = [tree.tokens[i] for i in path] + [bonus]
        first[emitted[0]] += 1
        if emitted[0] == tree.tokens[node]:
            second[emitted[1]] += 1
    assert _chi2(first, p_root) < CHI2_CRIT_DF4
    assert _chi2(second, p_node) < CHI2_CRIT_DF4
    assert second.sum() > least  # the second position was tested on enough walks


def test_sampling_walk_emits_the_verifier_distribution():
    _check_sampled_walk(TREE, seed=0, node=1, least=1000)  # node 1 holds token 2


def test_graft_merges_a_chain_into_the_tree():
    # 2 then 1 are nodes 1 and 3 already; 0 under node 3 is new, and 4 below it
    grafted = TREE.graft([2, 1, 0, 4])
    assert grafted.tokens == [3, 2, 0, 1, 4, 0, 4] and grafted.parents == [-1, 0, 0, 1, 2, 3, 5]
    assert grafted.depths == [0, 1, 1, 2, 2, 3, 4]
    assert TREE.graft([]) == TREE and TREE.graft([2, 1]) == TREE  # nothing new: the same tree
    branch = TREE.graft([4, 4])  # a new child of the root, then its child
    assert branch.parents[5:] == [0, 5] and branch.depths[5:] == [1, 2]
    # with CUDA graphs only some counts of new nodes: the most that fit, from the top of the chain
    assert TREE.graft([4, 4, 4], frozenset({1, 2})) == branch
    assert TREE.graft([2, 1, 0, 4], frozenset({1})).tokens == [3, 2, 0, 1, 4, 0]
    assert TREE.graft([4], frozenset({2})) == TREE
    for tree in (grafted, branch):
        kids = tree.children()
        assert all(len({tree.tokens[c] for c in k}) == len(k) for k in kids)  # siblings stay distinct
        assert all(tree.parents[i] < i for i in range(1, len(tree.tokens)))


def test_sampling_walk_over_a_grafted_tree_emits_the_verifier_distribution():
    """A grafted branch is one more deterministic candidate to the walk."""
    grafted = TREE.graft([4, 1])  # node 5 (token 4) under the root, node 6 (token 1) under it
    _check_sampled_walk(grafted, seed=2, node=5, least=500)


def test_probabilities_apply_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = probabilities(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits.double() / 0.5, 0))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[2:].sum() == 0 and torch.allclose(p[:2], torch.softmax(logits[:2].double(), 0))
    full = torch.softmax(logits.double(), 0)  # 0.644, 0.237, 0.087, 0.032
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert p[2:].sum() == 0 and p.sum() == pytest.approx(1.0)  # 0.644 < 0.8 needs the second, not the third
    assert probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))[1:].sum() == 0
    assert torch.allclose(probabilities(logits, SamplingParams(temperature=1.0, top_p=1.0)), full)
    with pytest.raises(ValueError, match="temperature > 0"):
        probabilities(logits, SamplingParams())


def test_first_token_and_seeded_generators():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert first_token(logits, SamplingParams(), None) == 1 and make_generator(SamplingParams()) is None
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        gen = make_generator(params)
        runs.append([first_token(logits, params, gen) for _ in range(50)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1  # same seed, same draws; and they do vary
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _reference_shaping(logits: torch.Tensor, params: SamplingParams, prompt: list[int], new: list[int]) -> torch.Tensor:
    """transformers' processors for the bias and the repetition penalty (over prompt and new text), then
    OpenAI's formula for the others: logit - count·frequency - [count > 0]·presence."""
    x = logits.double()[None].clone()
    ids = torch.tensor([prompt + new])
    if params.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()})(ids, x)
    x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)[0]
    for t in set(new):
        x[t] -= new.count(t) * params.frequency_penalty + params.presence_penalty
    return x


def test_shaping_matches_the_reference_processors():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=gen) * 3
    params = SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7, logit_bias={5: 4.0, 11: -100.0, 3: 0.5}
    )
    prompt, new, path = [1, 2, 2, 9, 30], [3, 3, 7, 2], [7, 40]
    shaping = Shaping(params, prompt)
    shaping.add(new)
    assert torch.allclose(shaping.apply(logits), _reference_shaping(logits, params, prompt, new))
    assert torch.allclose(shaping.apply(logits, path), _reference_shaping(logits, params, prompt, new + path))
    assert torch.equal(shaping.apply(logits[None][0]), shaping.apply(logits))  # the row itself is left alone
    assert Shaping.of(SamplingParams(temperature=1.0, min_p=0.1), prompt) is None  # min_p shapes no logits
    for only in ({"repetition_penalty": 0.8}, {"frequency_penalty": 1.0}, {"logit_bias": {0: 1.0}}):
        p = SamplingParams(**only)
        one = Shaping(p, prompt)
        one.add(new)
        assert torch.allclose(one.apply(logits, path), _reference_shaping(logits, p, prompt, new + path))


def test_min_tokens_holds_the_ends_back_until_the_text_is_long_enough():
    """vLLM's min_tokens: the tokens that end the text are masked while the new text and the node's path
    hold fewer than that many; the other logits are left as they were."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(5))
    ends = frozenset({7, 9})
    shaping = Shaping(SamplingParams(min_tokens=3), [1, 2], ends=ends)
    shaping.add([4])
    held = shaping.apply(logits, [5])  # 2 tokens: held back
    assert torch.isinf(held[[7, 9]]).all() and torch.equal(held[[0, 8]], logits[[0, 8]].double())
    assert torch.equal(shaping.apply(logits, [5, 6]), logits.double())  # 3: free
    shaping.add([5, 6])
    assert torch.equal(shaping.apply(logits), logits.double())
    with pytest.raises(ValueError, match="min_tokens must be >= 0 and 0 with json_schema"):
        SamplingParams(min_tokens=2, regex="a+")


def test_min_p_keeps_what_transformers_keeps():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 2
    for min_p in (0.02, 0.1, 0.5):
        p = probabilities(logits, SamplingParams(temperature=0.7, min_p=min_p))
        kept = MinPLogitsWarper(min_p)(None, (logits.double() / 0.7)[None])[0] > float("-inf")
        assert torch.equal(p > 0, kept) and p.sum() == pytest.approx(1.0)
        assert torch.allclose(p[kept], torch.softmax(logits.double()[kept] / 0.7, 0))


def test_greedy_walk_shapes_each_node_by_its_path():
    # unshaped: root -> token 2 (node 1) -> token 1 (node 3) -> bonus 4, as above
    logits = _logits([[0, 0, 9, 0, 0], [0, 9, 0, 0, 8], [9, 0, 0, 0, 1.5], [0, 0, 0, 0, 9], [0] * 5])
    assert accept_greedy(TREE, logits) == ([1, 3], 4)
    # presence penalty 2, the new text holding token 1 already: node 1's 9 for token 1 drops under 8 for 4
    shaping = Shaping(SamplingParams(presence_penalty=2.0), [0])
    shaping.add([1])
    assert accept_greedy(TREE, logits, shaping) == ([1], 4)
    # a bias turns the root to token 0 (node 2); there the path's own token 0 is what the repetition
    # penalty cuts (10 / 10 < 1.5), so 4 (node 4) follows, and below it 0 again (0.1 > 0)
    biased = Shaping(SamplingParams(logit_bias={2: -50.0, 0: 1.0}, repetition_penalty=10.0), [])
    assert accept_greedy(TREE, logits, biased) == ([2, 4], 0)
    shaping_path_free = Shaping(SamplingParams(logit_bias={2: -50.0, 0: 1.0}), [])
    assert accept_greedy(TREE, logits, shaping_path_free) == ([2], 0)  # without the path's penalty: 0 again


def test_sampled_walk_with_shaping_emits_the_shaped_distribution():
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.6, logit_bias={1: 1.0})
    _check_sampled_walk(TREE, seed=8, node=1, least=1000, params=params, prompt=[0, 3])
