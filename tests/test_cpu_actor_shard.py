"""A residual shard holds only its rows, and the shards of a group together compute the whole product."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from splitspec import numa
from splitspec.config import ACTIVATION_MODES
from splitspec.gpu_actor.kernels import BaseProduct, base_matmul
from splitspec.kernels import head
from splitspec.kernels.shard import ResidualShard, base_share_from, head_rows, shard_rows
from splitspec.protocol import HEAD
from splitspec.protocol.messages import BASE_SHARE_TOKENS
from splitspec.quantize import packing
from splitspec.quantize.activations import LEVELS, round_activations
from splitspec.quantize.format import ConvertedModel


@pytest.mark.parametrize(("rows", "n_shards"), [(50, 3), (960, 2), (576, 7), (16, 1), (33, 3)])
def test_shard_rows_cover_the_rows_on_balanced_whole_tiles(rows, n_shards):
    spans = [shard_rows(rows, n_shards, i) for i in range(n_shards)]
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(start % packing.TILE == 0 for start, _ in spans)
    tiles = [packing.num_tiles(stop - start) for start, stop in spans]
    assert min(tiles) >= 1 and max(tiles) - min(tiles) <= 1


@pytest.mark.parametrize(("rows", "weights"), [(960, (3, 1)), (576, (1, 2, 1)), (2048, (36.0, 18.5))])
def test_weighted_shards_follow_their_weights_on_whole_tiles(rows, weights):
    spans = [shard_rows(rows, len(weights), i, weights) for i in range(len(weights))]
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] and a[1] % packing.TILE == 0 for a, b in itertools.pairwise(spans))
    tiles = packing.num_tiles(rows)
    for (start, stop), w in zip(spans, weights, strict=True):
        assert abs((stop - start) / packing.TILE - tiles * w / sum(weights)) <= 1  # within a tile of its share


@pytest.mark.parametrize(("rows", "start", "weights"), [(960, 320, None), (576, 16, (1, 2, 1)), (50, 32, None)])
def test_shards_past_the_engines_rows_tile_the_rest(rows, start, weights):
    """The rows [0, start) the engine holds are nobody's shard; the CPU actors tile the rest."""
    n = len(weights) if weights else 1
    spans = [shard_rows(rows, n, i, weights, start) for i in range(n)]
    assert spans[0][0] == start and spans[-1][1] == rows
    assert all(a[1] == b[0] and a[1] % packing.TILE == 0 for a, b in itertools.pairwise(spans))


def test_engine_rows_that_leave_too_little_are_errors():
    with pytest.raises(ValueError, match=r"lower EngineConfig\.resident_bytes"):
        shard_rows(64, 2, 0, None, 48)  # one tile left for two actors
    with pytest.raises(ValueError, match=r"lower EngineConfig\.resident_bytes"):
        shard_rows(50, 1, 0, None, 50)  # the engine holds every row
    with pytest.raises(ValueError, match="whole tiles"):
        shard_rows(64, 1, 0, None, 8)


def test_bad_row_weights_are_errors():
    with pytest.raises(ValueError, match="2 positive row weights"):
        shard_rows(960, 2, 0, (1, 0))
    with pytest.raises(ValueError, match="without a whole tile"):
        shard_rows(64, 2, 0, (100, 1))


def test_more_shards_than_tiles_is_an_error():
    with pytest.raises(ValueError, match="at most 4 CPU actors"):
        shard_rows(50, 5, 0)


def test_shard_index_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="index 2 of 2"):
        shard_rows(64, 2, 2)


@pytest.fixture(scope="module")
def model(converted_small):
    return ConvertedModel(converted_small)


def _whole_product(model: ConvertedModel, bits: int, layer: int, group: str, x: np.ndarray) -> np.ndarray:
    return x @ model.residual_weights(bits, layer, group).T


def test_a_shard_holds_only_its_tiles(model):
    bits = 7
    shards = [ResidualShard.load(model.folder, bits, i, 2) for i in range(2)]
    total = sum(packing.residual_nbytes(g.rows, g.d_in, bits) for layer in model.layers for g in layer.values())
    assert sum(s.nbytes for s in shards) == total
    assert all(abs(s.nbytes - total / 2) < 0.05 * total for s in shards)
    for shard in shards:
        info = shard.shard_info()
        assert info.model_hash == model.conversion_id and info.num_layers == len(model.layers)
        for group, layout in model.layers[1].items():
            start, stop = shard.rows(group)
            assert (info.shards[group].d_in, info.shards[group].row_start, info.shards[group].row_stop) == (
                layout.d_in,
                start,
                stop,
            )
            whole = packing.slice_tiles(model.residual(bits, 1, group), *packing.tile_range(start, stop))
            mine = shard.planes(1, group)
            assert mine.keys() == whole.keys()
            for name in whole:
                np.testing.assert_array_equal(mine[name], whole[name])


@pytest.mark.parametrize("activations", ACTIVATION_MODES)
@pytest.mark.parametrize(("bits", "n_shards"), [(6, 2), (7, 3), (8, 2), (8, 1)])
def test_shards_together_compute_the_whole_product(model, bits, n_shards, activations):
    shards = [ResidualShard.load(model.folder, bits, i, n_shards, activations=activations) for i in range(n_shards)]
    rng = np.random.default_rng(bits * 10 + n_shards)
    for group, layout in model.layers[1].items():
        x = rng.standard_normal((5, layout.d_in)).astype(np.float32)
        parts = []
        for shard in shards:
            start, stop = shard.rows(group)
            out = np.empty((5, stop - start), np.float32)
            shard.compute(1, group, x, out)
            parts.append(out)
        if activations in LEVELS:  # what that mode multiplies: quantize/activations.py
            x = round_activations(torch.from_numpy(x), LEVELS[activations]).numpy()
        ref = _whole_product(model, bits, 1, group, x)
        np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(("share", "weights"), [(0.5, None), (2 / 3, (1, 1)), (0.9, (3, 1))])
def test_head_rows_leave_the_engine_its_part_and_tile_the_rest(share, weights):
    """The engine keeps the first whole tiles of (1 - share) of the vocabulary; the actors tile the rest by
    their weights, as they tile a group."""
    vocab, n = 49152 + 7, len(weights) if weights else 1
    spans = [head_rows(vocab, n, i, weights, share) for i in range(n)]
    start = spans[0][0]
    assert start % packing.TILE == 0 and abs(start - vocab * (1 - share)) <= packing.TILE
    assert spans[-1][1] == vocab and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    with pytest.raises(ValueError, match=r"share of the lm_head must be in \(0, 1\)"):
        head_rows(vocab, 1, 0, None, 1.0)


def test_a_shards_head_rows_give_the_int16_heads_logits(model):
    """With ``head_share``, each shard serves its vocabulary rows of the lm_head as group ``HEAD`` (at any
    layer): together the last rows of the whole int16 head's logits, bit for bit, and counted in its bytes."""
    shards = [ResidualShard.load(model.folder, 8, i, 2, head_share=0.5) for i in range(2)]
    plain = ResidualShard.load(model.folder, 8, 0, 2)
    codes, scale = head.quantize_rows(model.head_weight().float().numpy())
    x = np.random.default_rng(0).standard_normal((3, model.spec.hidden)).astype(np.float32)
    want = head.product(codes, scale, x)
    spans = [(s.shard_info().shards[HEAD].row_start, s.shard_info().shards[HEAD].row_stop) for s in shards]
    assert spans[-1][1] == model.spec.vocab and spans[0][1] == spans[1][0]
    assert abs(spans[0][0] - model.spec.vocab / 2) <= packing.TILE and HEAD not in plain.shard_info().shards
    for shard, (start, stop) in zip(shards, spans, strict=True):
        out = np.empty((3, stop - start), np.float32)
        shard.compute(1, HEAD, x, out)
        np.testing.assert_array_equal(out, want[:, start:stop])
        assert shard.request_bytes(0, HEAD) == (stop - start) * (2 * model.spec.hidden + 4)
    assert shards[0].nbytes == plain.nbytes + shards[0].request_bytes(0, HEAD)


def test_too_many_shards_for_the_model_is_an_error(model):
    tiles = min(packing.num_tiles(g.rows) for g in model.layers[0].values())
    with pytest.raises(ValueError, match=f"at most {tiles} CPU actors"):
        ResidualShard.load(model.folder, 8, 0, tiles + 1)


def test_shard_pages_are_resident_after_load(model):
    shard = ResidualShard.load(model.folder, 6, 0, 2)
    try:
        resident = numa.page_nodes(shard.buffer())
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert sum(resident.values()) >= shard.nbytes


@pytest.mark.parametrize(("words", "share", "first"), [(18, 1 / 6, 15), (48, 1 / 6, 40), (18, 0.3, 13), (2, 0.2, 2)])
def test_the_base_share_is_every_rows_last_code_words(words, share, first):
    """The CPU actors' share of a group's base is the same last code words of every row; a share too small
    for one word is none."""
    assert base_share_from(words, share) == first
    assert base_share_from(words, 0.0) == words
    with pytest.raises(ValueError, match=r"share of the base must be in \[0, 1\)"):
        base_share_from(words, 1.0)


def test_a_shards_base_share_is_added_into_its_replies_to_a_prompts_requests(model):
    """A shard started with ``base_share`` adds its rows' share of the base, x'·dequant(Q_base)ᵀ over their
    last code words, into its reply to a request of ``BASE_SHARE_TOKENS`` rows or more, through Python's
    answer and the compiled one (``slot_kernels``) alike; a decode step's fewer rows get the residual alone.
    What the engine takes of the same rows (their first words) and the share add up to the whole base."""
    share = 0.3
    shards = [ResidualShard.load(model.folder, 8, i, 2, base_share=share) for i in range(2)]
    plain = [ResidualShard.load(model.folder, 8, i, 2) for i in range(2)]
    kernels = [s.slot_kernels() for s in shards]
    groups = list(shards[0].shard_info().shards)
    rng = np.random.default_rng(7)
    for group, layout in model.layers[1].items():
        codes, scale = model.base(1, group)
        first = base_share_from(codes.shape[1], share)
        assert first < codes.shape[1]
        product = BaseProduct(codes, scale, model.levels)
        for n in (BASE_SHARE_TOKENS - 1, BASE_SHARE_TOKENS + 9):
            x = rng.standard_normal((n, layout.d_in)).astype(np.float32)
            whole_base = base_matmul(codes, scale, model.levels, torch.from_numpy(x)).numpy()
            engines = product(torch.from_numpy(x), split=first).numpy()
            for shard, bare, table in zip(shards, plain, kernels, strict=True):
                start, stop = shard.rows(group)
                assert shard.shard_info().base_share == share
                want = np.empty((n, stop - start), np.float32)
                bare.compute(1, group, x, want)
                if n >= BASE_SHARE_TOKENS:
                    want += whole_base[:, start:stop] - engines[:, start:stop]
                got = np.empty_like(want)
                shard.compute(1, group, x, got)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
                function, argument, _ = table[1, groups.index(group)]
                answer = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int64] * 4)(int(function))
                compiled = np.empty_like(want)
                assert answer(int(argument), x.ctypes.data, n, compiled.ctypes.data) == 0
                np.testing.assert_allclose(compiled, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            # the engine's part alone is not the whole: the share is a real part of the product
            assert np.abs(engines - whole_base).max() > 1e-2 * np.abs(whole_base).max()
    for shard, bare in zip(shards, plain, strict=True):
        assert shard.nbytes > bare.nbytes  # the share's codes and scales it holds


def test_a_base_share_beside_the_engines_residual_rows_is_an_error(model):
    """The share takes every row's last words, but the engine multiplies the rows it holds with their whole
    base: the two cannot be combined."""
    total = sum(packing.residual_nbytes(g.rows, g.d_in, 8) for layer in model.layers for g in layer.values())
    with pytest.raises(ValueError, match="set base_share or resident_bytes to 0"):
        ResidualShard.load(model.folder, 8, 0, 1, resident_bytes=total // 3, base_share=0.2)
