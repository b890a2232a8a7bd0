# SPDX-License-Identifier: MIT
"""The core's float16 <-> float32 conversion (pyattn._core._convert_half), which scaled_dot_product_attention
uses for float16 queries, masks and outputs: bit-identical to NumPy's astype (IEEE 754, round to nearest
even) on every compiled ISA, for every float16 pattern, float32 values of every magnitude, exact
rounding ties, overflow and specials; sizes around the vector width and the per-thread chunk; errors.
NaN payloads may differ (the vector instructions quiet a signalling NaN; NumPy keeps it), so NaN is
only required to stay NaN."""

import numpy as np
import pytest

import pyattn
from pyattn import _core

ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def float32_cases():
    rng = np.random.default_rng(7)
    scaled = [rng.standard_normal(20000).astype(np.float32) * np.float32(s) for s in (1e-9, 3e-8, 1e-6, 1e-4, 1, 300, 6e4)]
    random_bits = rng.integers(0, 1 << 32, 100000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Exact midpoints between neighbouring float16 values (ties: round to even) and one float32 ulp
    # either side of them.
    finite = ALL_HALVES.view(np.float16)
    finite = finite[np.isfinite(finite)].astype(np.float32)
    mid = (finite.view(np.uint32) + np.uint32(1 << 12)).view(np.float32)
    below, above = np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, 65536, 1e30,
                          2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 1e-45])
    return np.concatenate(scaled + [random_bits, mid, below, above, special, -special])


def assert_same(got, expected):
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint8), expected[~nan].view(np.uint8))


def test_half_to_float_every_pattern(isa):
    wide = np.full(ALL_HALVES.size, np.nan, np.float32)
    _core._convert_half(ALL_HALVES, wide, 2)
    assert_same(wide, ALL_HALVES.view(np.float16).astype(np.float32))


def test_float_to_half_rounds_like_numpy(isa):
    values = float32_cases()
    narrow = np.zeros(values.size, np.uint16)
    _core._convert_half(values, narrow, 2)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    assert_same(narrow.view(np.float16), expected)


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 33, (1 << 16) - 1, (1 << 17) + 5, 3 * (1 << 16) + 11])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sizes_and_thread_chunks(isa, rng, n, threads):
    """Vector bodies and scalar tails, and the split into per-thread chunks (64 Ki elements and up)."""
    values = (rng.standard_normal(n) * 100).astype(np.float32)
    narrow = np.zeros(n, np.uint16)
    _core._convert_half(values, narrow, threads)
    assert_same(narrow.view(np.float16), values.astype(np.float16))
    wide = np.full(n, np.nan, np.float32)
    _core._convert_half(narrow, wide, threads)
    assert_same(wide, narrow.view(np.float16).astype(np.float32))


def test_errors():
    a16, a32 = np.zeros(8, np.uint16), np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="uint16"):
        _core._convert_half(a32, np.zeros(8, np.float64))
    with pytest.raises(TypeError, match="uint16"):
        _core._convert_half(a16, np.zeros(8, np.uint16))
    with pytest.raises(ValueError, match="same size"):
        _core._convert_half(a16, np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        _core._convert_half(np.zeros(16, np.uint16)[::2], a32)
    read_only = np.zeros(8, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _core._convert_half(a16, read_only)
    with pytest.raises(ValueError, match="aligned"):
        _core._convert_half(misaligned(8, np.uint16), a32)
    with pytest.raises(ValueError, match="aligned"):
        _core._convert_half(a32, misaligned(8, np.uint16))
    _core._convert_half(misaligned(0, np.uint16), np.zeros(0, np.float32))  # nothing to read: accepted


def misaligned(shape, dtype):
    """A C-contiguous array of zeros whose data starts one byte past an element boundary."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.zeros(count * dtype.itemsize + 1, np.uint8)[1:]
    x = raw.view(dtype).reshape(shape)
    assert x.flags.c_contiguous and (count == 0 or not x.flags.aligned)  # NumPy calls empty arrays aligned
    return x


def test_sdpa_float16_misaligned(rng):
    """float16 queries, keys, values, masks and out= at odd addresses (which the core's conversion
    refuses) give the bits of aligned ones: UBSan found the query's conversion reading them in place."""
    arrays = [rng.standard_normal((2, 3, 37, 16)).astype(np.float16) for _ in range(3)]
    mask = (rng.standard_normal((37, 37)) * 3).astype(np.float16)
    expected = pyattn.scaled_dot_product_attention(*arrays, mask)
    moved = []
    for x in arrays + [mask]:
        m = misaligned(x.shape, np.float16)
        m[...] = x
        moved.append(m)
    out = misaligned(expected.shape, np.float16)
    got = pyattn.scaled_dot_product_attention(*moved[:3], moved[3], out=out)
    assert got is out
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
    for x, m in zip(arrays + [mask], moved):
        np.testing.assert_array_equal(m.view(np.uint16), x.view(np.uint16))  # inputs untouched


def test_sdpa_float16_paths_agree(rng):
    """float16 SDPA converts contiguous queries, masks and outputs with the core and strided ones with
    NumPy: both give the same bits (a strided view of the same values)."""
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float16) for _ in range(3))
    mask = (rng.standard_normal((40, 40)) * 3).astype(np.float16)
    got = pyattn.scaled_dot_product_attention(q, k, v, mask)
    wide_q = np.zeros((2, 3, 40, 32), np.float16)
    wide_q[..., ::2] = q  # the same values through a non-contiguous view
    strided_q = wide_q[..., ::2]
    assert not strided_q.flags.c_contiguous
    wide_mask = np.zeros((40, 80), np.float16)
    wide_mask[:, ::2] = mask
    strided = pyattn.scaled_dot_product_attention(strided_q, k, v, wide_mask[:, ::2])
    np.testing.assert_array_equal(got.view(np.uint16), strided.view(np.uint16))
    out = np.empty_like(got)
    assert pyattn.scaled_dot_product_attention(q, k, v, mask, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16), got.view(np.uint16))
