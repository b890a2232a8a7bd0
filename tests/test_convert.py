# SPDX-License-Identifier: MIT
"""The core's float16/bfloat16 <-> float32 conversions (pyattn._core._convert_half), which
scaled_dot_product_attention uses for 16-bit queries, masks and outputs: bit-identical to NumPy's
float16 astype (IEEE 754, round to nearest even) and to ml_dtypes' bfloat16 astype on every compiled
ISA, for every 16-bit pattern, float32 values of every magnitude, exact rounding ties, overflow and
specials; sizes around the vector width and the per-thread chunk; errors. float16 NaN payloads may
differ (the vector instructions quiet a signalling NaN; NumPy keeps it), so NaN is only required to
stay NaN there; bfloat16 matches ml_dtypes bit for bit, NaN included (the quiet NaN of its sign)."""

import numpy as np
import pytest

import pyattn
from pyattn import _core

try:
    import ml_dtypes
except ImportError:  # e.g. the sanitizer build's environment (NumPy, pytest, hypothesis only)
    ml_dtypes = None
needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="bfloat16 needs ml_dtypes")

ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def float32_cases():
    rng = np.random.default_rng(7)
    scaled = [
        rng.standard_normal(20000).astype(np.float32) * np.float32(s) for s in (1e-9, 3e-8, 1e-6, 1e-4, 1, 300, 6e4)
    ]
    random_bits = rng.integers(0, 1 << 32, 100000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # Exact midpoints between neighbouring float16 values (ties: round to even) and one float32 ulp
    # either side of them.
    finite = ALL_HALVES.view(np.float16)
    finite = finite[np.isfinite(finite)].astype(np.float32)
    mid = (finite.view(np.uint32) + np.uint32(1 << 12)).view(np.float32)
    below, above = np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))
    special = np.float32(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504,
            65519.996,
            65520,
            65536,
            1e30,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-26,
            2.0**-26,
            1e-45,
        ]
    )
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


@needs_ml_dtypes
def test_bfloat16_to_float_every_pattern(isa):
    wide = np.full(ALL_HALVES.size, np.nan, np.float32)
    _core._convert_half(ALL_HALVES, wide, 2, bfloat16=True)
    expected = ALL_HALVES.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(wide.view(np.uint32), expected.view(np.uint32))  # a shift: NaN payloads too


@needs_ml_dtypes
def test_float_to_bfloat16_rounds_like_ml_dtypes(isa):
    # float16's cases, plus exact midpoints between neighbouring bfloat16 values (ties to even: the
    # low 16 bits 0x8000) and one float32 ulp either side, subnormal and NaN patterns of both signs.
    tops = ALL_HALVES.astype(np.uint32) << np.uint32(16)
    mid = tops | np.uint32(0x8000)
    bits = np.concatenate(
        [
            mid,
            mid - np.uint32(1),
            mid + np.uint32(1),
            tops | np.uint32(0x7FFF),
            np.uint32(
                [
                    0x7F800001,
                    0xFF800001,
                    0x7FBFFFFF,
                    0x7FC00001,
                    0xFFFFFFFF,
                    0x00000001,
                    0x007FFFFF,
                    0x80008000,
                    0x7F7FFFFF,
                    0xFF7F8000,
                ]
            ),
        ]
    )
    values = np.concatenate([float32_cases(), bits.view(np.float32)])
    narrow = np.zeros(values.size, np.uint16)
    _core._convert_half(values, narrow, 2, bfloat16=True)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(narrow, expected)


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
    if ml_dtypes is None:
        return
    _core._convert_half(values, narrow, threads, bfloat16=True)
    np.testing.assert_array_equal(narrow, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    wide = np.full(n, np.nan, np.float32)
    _core._convert_half(narrow, wide, threads, bfloat16=True)
    np.testing.assert_array_equal(wide, narrow.view(ml_dtypes.bfloat16).astype(np.float32))


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


HALF_DTYPES = [np.float16] + ([ml_dtypes.bfloat16] if ml_dtypes is not None else [])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_sdpa_half_misaligned(rng, dtype):
    """16-bit queries, keys, values, masks and out= at odd addresses (which the core's conversion
    refuses) give the bits of aligned ones: UBSan found the query's conversion reading them in place."""
    arrays = [rng.standard_normal((2, 3, 37, 16)).astype(dtype) for _ in range(3)]
    mask = (rng.standard_normal((37, 37)) * 3).astype(dtype)
    expected = pyattn.scaled_dot_product_attention(*arrays, mask)
    moved = []
    for x in arrays + [mask]:
        m = misaligned(x.shape, dtype)
        m[...] = x
        moved.append(m)
    out = misaligned(expected.shape, dtype)
    got = pyattn.scaled_dot_product_attention(*moved[:3], moved[3], out=out)
    assert got is out
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
    for x, m in zip(arrays + [mask], moved):
        np.testing.assert_array_equal(m.view(np.uint16), x.view(np.uint16))  # inputs untouched


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_sdpa_half_paths_agree(rng, dtype):
    """16-bit SDPA converts contiguous queries, masks and outputs with the core and strided ones with
    NumPy / ml_dtypes: both give the same bits (a strided view of the same values)."""
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(dtype) for _ in range(3))
    mask = (rng.standard_normal((40, 40)) * 3).astype(dtype)
    got = pyattn.scaled_dot_product_attention(q, k, v, mask)
    wide_q = np.zeros((2, 3, 40, 32), dtype)
    wide_q[..., ::2] = q  # the same values through a non-contiguous view
    strided_q = wide_q[..., ::2]
    assert not strided_q.flags.c_contiguous
    wide_mask = np.zeros((40, 80), dtype)
    wide_mask[:, ::2] = mask
    strided = pyattn.scaled_dot_product_attention(strided_q, k, v, wide_mask[:, ::2])
    np.testing.assert_array_equal(got.view(np.uint16), strided.view(np.uint16))
    out = np.empty_like(got)
    assert pyattn.scaled_dot_product_attention(q, k, v, mask, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16), got.view(np.uint16))
