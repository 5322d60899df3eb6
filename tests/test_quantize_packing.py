"""The residual's tile/plane layout: exact byte formulas, round trips, tile slices, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.quantize.gptq import to_scale_grid
from splitspec.quantize.packing import (
    PLANES,
    STEP,
    WORD_SPLIT,
    WORDS,
    bytes_per_weight,
    check_planes,
    dequantize_residual,
    num_groups,
    num_steps,
    pack_residual,
    residual_nbytes,
    slice_tiles,
    tile_range,
    unpack_residual,
)


def random_residual(rows: int, d_in: int, bits: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    qm = 2 ** (bits - 1) - 1
    q = rng.integers(-qm, qm + 1, (rows, d_in)).astype(np.int8)
    scales = to_scale_grid(rng.random((rows, num_groups(d_in))) * 0.01 + 1e-5)
    return q, scales


@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize(
    ("rows", "d_in"), [(37, 576), (1, 130), (17, 131), (32, 128), (16, 5), (33, 1000), (3, 20), (5, 1)]
)
def test_round_trip(bits, rows, d_in):
    q, scales = random_residual(rows, d_in, bits)
    planes = pack_residual(q, scales, bits)
    assert set(planes) == {*PLANES[bits], "scale", "scale_top"}
    q2, scales2 = unpack_residual(planes, bits, rows, d_in=d_in)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(scales2, scales)
    assert q2.flags.c_contiguous and scales2.flags.c_contiguous


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([6, 7, 8]), rows=st.integers(1, 40), d_in=st.integers(1, 300), seed=st.integers(0, 99))
def test_round_trip_any_shape(bits, rows, d_in, seed):
    q, scales = random_residual(rows, d_in, bits, seed)
    q2, scales2 = unpack_residual(pack_residual(q, scales, bits), bits, rows, d_in=d_in)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(scales2, scales)


def test_extreme_codes_round_trip():
    """The ends of each range, where u = q + 2^(b-1) reaches 1 and 2^b - 1 (255 for 8 bits: past int8)."""
    for bits in (6, 7, 8):
        qm = 2 ** (bits - 1) - 1
        q = np.array([[-qm, qm, 0, -1, 1] * 4] * 3, np.int8)
        scales = np.ones((3, 1), np.float32)
        q2, _ = unpack_residual(pack_residual(q, scales, bits), bits, 3, d_in=20)
        np.testing.assert_array_equal(q2, q)


@pytest.mark.parametrize(
    ("bits", "step", "words", "split"), [(6, 8, 3, (1, 1, 1)), (7, 16, 7, (4, 2, 1)), (8, 8, 4, (2, 1, 1))]
)
def test_words_match_the_layout_formula(bits, step, words, split):
    """Spell out the decided layout (the "pair map") element by element, one lane integer at a time, for
    2 tiles (the second 4 real rows + 12 pad) and 21 columns (the last step partly padding): code j of
    lane i in step s is tile row 8·(j % 2) + i // 2, column s·step + 2·(j // 2) + i % 2; the words are
    split in order over the three planes."""
    rows, d_in = 20, 21
    qm = 2 ** (bits - 1) - 1
    q, scales = random_residual(rows, d_in, bits, seed=3)
    q[0, 0], q[1, 1], q[2, 2] = qm, -qm, -1  # the extremes of u, and one code past int8 for 8 bits
    planes = pack_residual(q, scales, bits)
    n_steps = -(-d_in // step)
    assert (STEP[bits], WORDS[bits], WORD_SPLIT[bits], num_steps(d_in, bits)) == (step, words, split, n_steps)
    assert set(planes) == {"words0", "words1", "words2", "scale", "scale_top"}
    for name, k in zip(("words0", "words1", "words2"), split, strict=True):
        assert planes[name].dtype == np.uint16 and planes[name].shape == (2, n_steps, k, 16)
    plane = np.concatenate([planes["words0"], planes["words1"], planes["words2"]], axis=2)

    def u(row: int, col: int) -> int:  # the unsigned code, padding included
        return (int(q[row, col]) if row < rows and col < d_in else 0) + 2 ** (bits - 1)

    for t in range(2):
        for s in range(n_steps):
            for i in range(16):
                v = 0
                for j in range(step):
                    row = 16 * t + 8 * (j % 2) + i // 2
                    col = s * step + 2 * (j // 2) + i % 2
                    assert 1 <= u(row, col) < 2**bits
                    v += u(row, col) << (bits * j)
                assert v < 2 ** (16 * words)
                for w in range(words):
                    assert plane[t, s, w, i] == (v >> (16 * w)) & 0xFFFF, (t, s, w, i)


def test_code_vectors_are_column_pairs_of_eight_rows():
    """What the map is for: in an 8-bit step, code vector j = 2p + h (low byte of word p for h = 0, high
    byte for h = 1) holds rows 8h .. 8h+7 of column pair p, lanes 2r and 2r + 1 being row 8h + r."""
    q, scales = random_residual(16, 8, 8, seed=5)
    words = np.concatenate([v for k, v in pack_residual(q, scales, 8).items() if k.startswith("words")], axis=2)[0, 0]
    for p in range(4):
        for h in range(2):
            codes = ((words[p] >> (8 * h)) & 0xFF).astype(np.int16) - 128
            np.testing.assert_array_equal(codes.reshape(8, 2), q[8 * h : 8 * h + 8, 2 * p : 2 * p + 2])


def test_scale_plane_matches_the_formula():
    """The scale bytes of a 2-tile residual: byte e·64 + m is top · 2^(e-3) · (1 + m/64), top the least
    power of two whose grid reaches the tile's largest scale; padded rows hold byte 0."""
    q, scales = random_residual(20, 130, 8, seed=3)  # 20 rows: tile 1 has 4 real rows + 12 pad
    planes = pack_residual(q, scales, 8)
    assert planes["scale"].shape == (2, 2, 16) and planes["scale"].dtype == np.uint8
    assert planes["scale_top"].shape == (2,) and planes["scale_top"].dtype == np.float32
    for t, rows in ((0, slice(0, 16)), (1, slice(16, 20))):
        top = planes["scale_top"][t]
        assert np.log2(top) == np.round(np.log2(top))  # a power of two
        assert scales[rows].max() <= top * (2 - 1 / 64) and scales[rows].max() > top * (2 - 1 / 64) / 2
        b = planes["scale"][t].T[: rows.stop - rows.start].astype(np.float64)  # [rows, G]
        want = top * 2.0 ** (b // 64 - 3) * (1 + (b % 64) / 64)
        np.testing.assert_array_equal(want, scales[rows])
    assert not planes["scale"][1, :, 4:].any()  # padded rows


def test_scale_grid_refuses_what_it_cannot_hold():
    """A scale off the 6-bit-mantissa grid, or more than four octaves under its tile's largest, is refused
    rather than rounded behind the caller's back; ``to_scale_grid`` rounds and raises to the floor."""
    q = np.zeros((4, 200), np.int8)
    with pytest.raises(ValueError, match="off the residual's scale grid"):
        pack_residual(q, np.full((4, 2), 0.3, np.float32), 6)  # 0.3 needs more than 6 mantissa bits
    wide = np.array([[1.0, 2.0**-5]] * 4, np.float32)  # 5 octaves apart in one tile
    with pytest.raises(ValueError, match="4 octaves"):
        pack_residual(q, wide, 6)
    grid = to_scale_grid(wide)
    assert grid[0, 1] == 2.0**-3  # raised to the floor top/8 (top 1: least power of 2 with 1.0 <= 1.984 top)
    assert to_scale_grid(np.array([[0.3]], np.float32))[0, 0] == np.float32(77 / 256)
    _, back = unpack_residual(pack_residual(q, grid, 6), 6, 4, d_in=200)
    np.testing.assert_array_equal(back, grid)


def test_padding_is_code_zero():
    """Columns past d_in and rows past the last real one hold u = 2^(b-1) (q = 0), so the words of a
    residual of zeros padded to whole tiles and steps equal those of its unpadded zero-extension."""
    for bits in (6, 7, 8):
        q, scales = random_residual(20, 130, bits, seed=7)
        step = STEP[bits]
        wide = np.zeros((32, num_steps(130, bits) * step), np.int8)
        wide[:20, :130] = q
        padded = pack_residual(q, scales, bits)
        full = pack_residual(wide, np.ones((32, num_groups(wide.shape[1])), np.float32), bits)
        for name in PLANES[bits]:
            np.testing.assert_array_equal(padded[name], full[name])


@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize(("rows", "d_in"), [(37, 576), (1, 130), (16, 5), (100, 1000)])
def test_sizes(bits, rows, d_in):
    planes = pack_residual(*random_residual(rows, d_in, bits), bits)
    assert residual_nbytes(rows, d_in, bits) == sum(p.nbytes for p in planes.values())


def test_bytes_per_weight_and_padding():
    assert [bytes_per_weight(b) for b in (6, 7, 8)] == [0.75, 0.875, 1.0]
    tiles, scale_bytes = 3, 3 * 16 * 5 + 3 * 4  # 48 rows, 5 scale groups of a byte, a float32 top per tile
    assert residual_nbytes(48, 576, 6) == tiles * 16 * 576 * 0.75 + scale_bytes  # 576 = 72 steps of 8
    assert residual_nbytes(48, 576, 7) == tiles * 16 * 576 * 0.875 + scale_bytes  # 36 steps of 16
    assert residual_nbytes(48, 576, 8) == tiles * 16 * 576 * 1.0 + scale_bytes  # 72 steps of 8
    # 130 columns: 17 steps of 8 (136 columns) for 6 and 8 bits, 9 of 16 (144) for 7
    assert residual_nbytes(48, 130, 6) == tiles * 16 * 136 * 0.75 + 3 * 16 * 2 + 3 * 4
    assert residual_nbytes(48, 130, 7) == tiles * 16 * 144 * 0.875 + 3 * 16 * 2 + 3 * 4
    assert residual_nbytes(48, 130, 8) == tiles * 16 * 136 * 1.0 + 3 * 16 * 2 + 3 * 4


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_dequantize_is_codes_times_group_scale(bits):
    q, scales = random_residual(19, 300, bits)
    w = dequantize_residual(pack_residual(q, scales, bits), bits, 19, d_in=300)
    assert w.dtype == np.float32 and w.shape == (19, 300)
    assert w[5, 200] == np.float32(q[5, 200]) * np.float32(scales[5, 1])
    assert w[18, 299] == np.float32(q[18, 299]) * np.float32(scales[18, 2])


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_tile_slices_are_contiguous_views(bits):
    q, scales = random_residual(100, 200, bits)
    planes = pack_residual(q, scales, bits)
    assert tile_range(32, 70) == (2, 5)
    assert tile_range(0, 100) == (0, 7)
    assert tile_range(17, 17) == (1, 2)
    part = slice_tiles(planes, *tile_range(32, 70))
    for name, plane in part.items():
        assert plane.flags.c_contiguous
        assert np.shares_memory(plane, planes[name])
        base = planes[name].__array_interface__["data"][0]
        assert plane.__array_interface__["data"][0] == base + 2 * planes[name][0].nbytes
    q2, _ = unpack_residual(part, bits, 48, d_in=200)
    np.testing.assert_array_equal(q2, q[32:80])


def test_bad_input():
    q, scales = random_residual(4, 10, 6)
    with pytest.raises(ValueError, match="bits"):
        pack_residual(q, scales, 5)
    with pytest.raises(ValueError, match=r"\[-31, 31\]"):
        pack_residual(np.full((4, 10), 32, np.int8), scales, 6)
    with pytest.raises(ValueError, match="-127"):
        pack_residual(np.full((4, 10), -128, np.int8), scales, 8)
    with pytest.raises(ValueError, match="scales must have shape"):
        pack_residual(q, scales[:, :0], 6)
    with pytest.raises(ValueError, match="int8"):
        pack_residual(q.astype(np.int16), scales, 6)
    with pytest.raises(ValueError, match="float32"):
        pack_residual(q, scales.astype(np.float16), 6)
    with pytest.raises(ValueError, match="2-D"):
        pack_residual(q[0], scales, 6)
    with pytest.raises(ValueError, match=r"bits must be one of \[6, 7, 8\], got 5"):
        num_steps(10, 5)
    planes = pack_residual(q, scales, 6)
    assert check_planes(planes, 6, 4, d_in=10) == (1, 10)
    # d_in is trusted within the last step: 10 and 16 columns take the same 2 steps
    assert check_planes(planes, 6, 4, d_in=16) == (1, 16)
    with pytest.raises(ValueError, match="missing"):
        unpack_residual({"words0": planes["words0"], "scale": planes["scale"]}, 6, 4, d_in=10)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_residual(planes, 6, 17, d_in=10)
    with pytest.raises(ValueError, match=r"needs d_in.*8-column steps"):
        unpack_residual(planes, 6, 4)
    with pytest.raises(
        ValueError, match=r"'words0' of a 6-bit residual of 1 tiles and d_in = 17 must be uint16 \(1, 3, 1, 16\)"
    ):
        check_planes(planes, 6, 4, d_in=17)
    with pytest.raises(ValueError, match=r"'words0' .* must be uint16 \(1, 1, 4, 16\), got uint16 \(1, 2, 1, 16\)"):
        check_planes(planes, 7, 4, d_in=10)  # 6-bit words read as 7-bit
    with pytest.raises(ValueError, match=r"must be uint16.*got int16"):
        check_planes({**planes, "words2": planes["words2"].view(np.int16)}, 6, 4, d_in=10)
    with pytest.raises(ValueError, match=r"\[tiles, steps, words, 16\], got shape \(1, 2, 16\)"):
        check_planes({**planes, "words0": planes["words0"].reshape(1, 2, 16)}, 6, 4, d_in=10)
    with pytest.raises(ValueError, match=r"'scale'.*uint8"):
        check_planes({**planes, "scale": planes["scale"].astype(np.float16)}, 6, 4, d_in=10)
    with pytest.raises(ValueError, match=r"'scale_top'.*float32 \(1,\)"):
        check_planes({**planes, "scale_top": planes["scale_top"][:, None]}, 6, 4, d_in=10)
    with pytest.raises(ValueError, match="positive"):
        check_planes(planes, 6, 4, d_in=0)
    planes8 = pack_residual(q, scales, 8)
    assert check_planes(planes8, 8, 4, d_in=10) == (1, 10)
    with pytest.raises(ValueError, match=r"a 8-bit residual needs d_in.*8-column steps"):
        check_planes(planes8, 8, 4)
    with pytest.raises(ValueError, match=r"needs d_in"):
        unpack_residual(planes8, 8, 4)
    with pytest.raises(ValueError, match=r"needs d_in.*16-column steps"):
        dequantize_residual(pack_residual(q, scales, 7), 7, 4)
    with pytest.raises(
        ValueError, match=r"'words0' of a 8-bit residual of 1 tiles and d_in = 17 must be uint16 \(1, 3, 2, 16\)"
    ):
        check_planes(planes8, 8, 4, d_in=17)
    with pytest.raises(ValueError, match=r"'words0' .* must be uint16 \(1, 2, 2, 16\), got uint16 \(1, 2, 1, 16\)"):
        check_planes(planes, 8, 4, d_in=10)  # 6-bit words read as 8-bit
    with pytest.raises(ValueError, match=r"'words1' .* must be uint16 \(1, 2, 1, 16\), got uint16 \(1, 2, 1, 32\)"):
        check_planes({**planes8, "words1": np.zeros((1, 2, 1, 32), np.uint16)}, 8, 4, d_in=10)
    with pytest.raises(ValueError, match="t0"):
        slice_tiles(planes, 0, 2)
    with pytest.raises(ValueError, match="rows_start"):
        tile_range(5, 3)
