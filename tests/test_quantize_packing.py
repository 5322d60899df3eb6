"""The residual's tile/plane layout: exact byte formulas, round trips, tile slices, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.quantize.packing import (
    PLANES,
    bytes_per_weight,
    check_planes,
    dequantize_residual,
    num_groups,
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
    scales = (rng.random((rows, num_groups(d_in))) * 0.01).astype(np.float16)
    return q, scales


@pytest.mark.parametrize("bits", [6, 7, 8])
@pytest.mark.parametrize(("rows", "d_in"), [(37, 576), (1, 130), (32, 128), (16, 5)])
def test_round_trip(bits, rows, d_in):
    q, scales = random_residual(rows, d_in, bits)
    planes = pack_residual(q, scales, bits)
    assert set(planes) == {*PLANES[bits], "scale"}
    q2, scales2 = unpack_residual(planes, bits, rows)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(scales2, scales)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([6, 7, 8]), rows=st.integers(1, 40), d_in=st.integers(1, 300), seed=st.integers(0, 99))
def test_round_trip_any_shape(bits, rows, d_in, seed):
    q, scales = random_residual(rows, d_in, bits, seed)
    q2, scales2 = unpack_residual(pack_residual(q, scales, bits), bits, rows)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(scales2, scales)


@pytest.mark.parametrize("bits", [6, 7, 8])
def test_layout_matches_the_byte_formulas(bits):
    """Spell out the decided layout byte by byte for one input column of a 2-tile residual."""
    q, scales = random_residual(20, 130, bits, seed=3)  # 20 rows: tile 1 has 4 real rows + 12 pad
    planes = pack_residual(q, scales, bits)
    t, col = 1, 129
    rows = [16 * t + r for r in range(16)]
    u = [int(q[r, col]) + 2 ** (bits - 1) if r < 20 else 2 ** (bits - 1) for r in rows]
    if bits == 8:
        assert planes["q"].shape == (2, 130, 16)
        assert list(planes["q"][t, col]) == [v - 128 for v in u]
    else:
        nib = [(u[j] & 15) | ((u[j + 8] & 15) << 4) for j in range(8)]
        crumb = [sum(((u[j + 4 * k] >> 4) & 3) << (2 * k) for k in range(4)) for j in range(4)]
        assert list(planes["nib"][t, col]) == nib
        assert list(planes["crumb"][t, col]) == crumb
    if bits == 7:
        bit = [sum(((u[j + 2 * k] >> 6) & 1) << k for k in range(8)) for j in range(2)]
        assert list(planes["bit"][t, col]) == bit
    assert planes["scale"].shape == (2, 2, 16)
    np.testing.assert_array_equal(planes["scale"][t, 1, :4], scales[16:20, 1])
    assert not planes["scale"][t, :, 4:].any()  # padded rows: scale 0


def test_bytes_per_weight_and_sizes():
    assert [bytes_per_weight(b) for b in (6, 7, 8)] == [0.75, 0.875, 1.0]
    q, scales = random_residual(37, 576, 7)
    planes = pack_residual(q, scales, 7)
    assert residual_nbytes(37, 576, 7) == sum(p.nbytes for p in planes.values())


@pytest.mark.parametrize("bits", [6, 8])
def test_dequantize_is_codes_times_group_scale(bits):
    q, scales = random_residual(19, 300, bits)
    w = dequantize_residual(pack_residual(q, scales, bits), bits, 19)
    assert w.dtype == np.float32 and w.shape == (19, 300)
    assert w[5, 200] == np.float32(q[5, 200]) * np.float32(scales[5, 1])
    assert w[18, 299] == np.float32(q[18, 299]) * np.float32(scales[18, 2])


def test_tile_slices_are_contiguous_views():
    q, scales = random_residual(100, 200, 7)
    planes = pack_residual(q, scales, 7)
    assert tile_range(32, 70) == (2, 5)
    assert tile_range(0, 100) == (0, 7)
    assert tile_range(17, 17) == (1, 2)
    part = slice_tiles(planes, *tile_range(32, 70))
    for name, plane in part.items():
        assert plane.flags.c_contiguous
        assert np.shares_memory(plane, planes[name])
        base = planes[name].__array_interface__["data"][0]
        assert plane.__array_interface__["data"][0] == base + 2 * planes[name][0].nbytes
    q2, _ = unpack_residual(part, 7, 48)
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
    with pytest.raises(ValueError, match="float16"):
        pack_residual(q, scales.astype(np.float32), 6)
    with pytest.raises(ValueError, match="2-D"):
        pack_residual(q[0], scales, 6)
    planes = pack_residual(q, scales, 6)
    with pytest.raises(ValueError, match="missing"):
        unpack_residual(planes, 7, 4)
    with pytest.raises(ValueError, match="do not fit"):
        unpack_residual(planes, 6, 17)
    with pytest.raises(ValueError, match="crumb"):
        check_planes({**planes, "crumb": planes["crumb"][:, :5]}, 6, 4)
    with pytest.raises(ValueError, match="t0"):
        slice_tiles(planes, 0, 2)
    with pytest.raises(ValueError, match="rows_start"):
        tile_range(5, 3)
