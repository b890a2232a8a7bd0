# SPDX-License-Identifier: MIT
"""int8 KV caches: pyattn.KVCache(..., dtype="int8") and MultiHeadAttention / mha with such a cache.

What is held against what:

* the quantisation contract of append (and of the layer's step, which quantises its projected K/V
  in the core): per stored row (one token of one head) scale = max |x| / 127 in float32, int8 values
  round(x / scale) to nearest even within [-127, 127] (exactly, except within TIE of a .5 boundary,
  where the core's x * (127 / max |x|) may round the other way), so every x is within scale / 2 of
  its stored value; zero rows get scale 0, rows holding NaN or Inf a NaN scale and zeros; keys() and
  values() are exactly int8 * scale in float32; float64/float16/bfloat16 and strided inputs are
  taken, and never modified;
* attend() against the float64 reference run on the *dequantized* K/V (keys()/values(), row by row
  for ragged rows) with conftest's float32 tolerance: the kernels' block-wise dequantization must be
  exact, so the only error left is float32 arithmetic. Every ISA, GQA groups 2 and 4, head_dim and
  value_dim in {1, 7, 8, 16, 33, 64, 128} (also value_dim != head_dim), chunks of 1, 2, 8 (decode
  kernel, DECODE_MAX = 8) and 9, 40 (query tiles), ragged rows (num_new, left and right padding, NaN
  in padding tokens and in trimmed-away storage), truncate/trim, long caches split across threads,
  window, softcap, sinks, ALiBi and return_lse;
* NaN/Inf rows: a query that can see one gets NaN, every other query (earlier positions, other
  heads' groups, other batch rows, rows outside a window) is unaffected;
* the error against a float32 cache holding the unquantized N(0, 1) data, within a bound derived
  below (and which a cache that drops its scales, or stores values one step off, exceeds);
* pickling and copies, the dtype and query-dtype rules, and a hypothesis property over random caches.
"""

import copy
import math
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference
from pyattn._tuning import override

from conftest import TOL, f64, nan_guarded, np_dtype, random_array, tol

# Longest query (rows per head) that the driver gives the decode kernel (kDecodeMaxLen).
DECODE_MAX = pyattn._core.DECODE_MAX_Q_LEN
F32 = np.dtype(np.float32)

# The core rounds x * (127 / max|x|) (two float32 roundings, relative error <= 2^-23), not x / scale:
# on the int8 grid (|x / scale| <= 127) the two differ by at most 127 * 2^-23 = 1.5e-5, so only
# values within TIE of a .5 boundary may round to the other neighbour.
TIE = 3e-5

# --- error against the unquantized float32 cache (N(0, 1) K, V and queries, scale 1/sqrt(d)) -----
#
# Rounding moves each stored element by at most half a step, HALF_STEP = max|x| / 254 (max over the
# cache: every row's step is at most that), and on random data the rounding errors are independent,
# uniform in [-s/2, s/2] (standard deviation s / (2 sqrt 3)).
# * V: out = sum_j p_j v_j moves by sum_j p_j dv_j: never more than HALF_STEP (the weights sum to 1),
#   and with n keys of standard deviation HALF_STEP / sqrt(3) * sqrt(sum p_j^2); for unit-variance
#   scores s (q, k ~ N(0, 1), scale 1/sqrt(d)) sum p_j^2 ~ E[e^2s] / (n E[e^s]^2) = e / n.
# * K: each score moves by ds_j = scale * q . dk_j, standard deviation ~ HALF_STEP / sqrt(3) (scale
#   * |q| ~ 1), and the output by sum_j p_j ds_j (v_j - out): the same size as the V part.
# So one output over n keys has sigma(n) = HALF_STEP * sqrt(2 e / (3 n)); the maximum over the ~1e4
# - 1e5 outputs of a test is ~4.5 sigma. LONG_CONTEXT_SIGMAS = 10 leaves a factor >= 1.9 over the
# worst measured (3 seeds, head_dim 64 / 128, chunks of 1, 8 and 40 queries over batch 2 x 16 heads,
# both ISAs of the test machine): 0.23 HALF_STEP at 1000 keys (bound 0.43) and 0.11 at 4096 keys
# (bound 0.21); absolute max |error| 2.0e-3 - 4.3e-3 at 1k tokens, 1.1e-3 - 2.4e-3 at 4k tokens,
# against HALF_STEP ~0.02. Stored values one int8 step too large give >= 2.4 bounds.
LONG_CONTEXT_SIGMAS = 10.0
# Few keys (a prefill from an empty cache: the first query sees one key, then two, ...): the
# averaging is gone. V still moves the output by <= 1 HALF_STEP; K moves a softmax over a few keys
# by ~ds * |v_i - v_j|, a few HALF_STEPs at most for N(0, 1) data: measured <= 2.4 HALF_STEP over 30
# seeds of 48-token prefills (head_dim 8 - 128); bound 4.
SHORT_CONTEXT_HALF_STEPS = 4.0


def long_context_bound(half_step, n):
    """The error bound, in absolute terms, for outputs over at least n keys (see above)."""
    return LONG_CONTEXT_SIGMAS * half_step * math.sqrt(2 * math.e / (3 * n))


# --- helpers ---------------------------------------------------------------------------------------


def quantise(x):
    """The documented rule in NumPy on rows x (..., dim): (q, scale, ratio) with scale = max|x| / 127
    in float32 (NaN for rows holding NaN/Inf, 0 for zero rows), ratio = x / scale in float64 (0 for
    those rows) and q = ratio rounded to nearest even, clamped to [-127, 127]."""
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x).all(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.abs(x).max(axis=-1)
        scale = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
        ratio = f64(x) / f64(scale)[..., None]
    ratio = np.where((finite & (amax > 0))[..., None], ratio, 0.0)
    return np.clip(np.rint(ratio), -127, 127), scale, ratio


def assert_quantised(x, stored, scales):
    """Stored int8 rows and their scales follow the documented rule for the rows x (..., dim)."""
    q, scale, ratio = quantise(x)
    assert stored.dtype == np.int8 and scales.dtype == F32
    assert stored.shape == x.shape and scales.shape == x.shape[:-1]
    np.testing.assert_array_equal(scales, scale)  # bit for bit, NaN where NaN
    assert (np.abs(stored.astype(np.int64)) <= 127).all()  # -128 is never used
    np.testing.assert_array_less(np.abs(stored - ratio), 0.5 + TIE)  # a nearest neighbour on the grid
    away_from_ties = np.abs(np.abs(ratio) % 1.0 - 0.5) > TIE
    np.testing.assert_array_equal(np.where(away_from_ties, stored, 0), np.where(away_from_ties, q, 0))


def assert_dequantized(cache, row=None):
    """keys()/values() are exactly stored int8 * row scale in float32, for one row or all rows."""
    for view, stored, scales in ((cache.keys, cache._k, cache._k_scales), (cache.values, cache._v, cache._v_scales)):
        got = view(row)
        n = got.shape[-2]
        if row is None:
            expected = stored[:, :, :n].astype(np.float32) * scales[:, :, :n, None]
        else:
            expected = stored[row, :, :n].astype(np.float32) * scales[row, :, :n, None]
        assert got.dtype == F32
        np.testing.assert_array_equal(got, expected)


# A subnormal float32 scale (rows with max |x| < 127 * 2**-126) is itself rounded to a multiple of
# 2**-149: q * scale may then move by up to 127 half-spacings more.
SUBNORMAL_SLACK = 127 * 2.0**-150


def assert_within_half_step(x, dequantized, scales):
    """Every finite row of x is within scale / 2 of its stored value (+ float32 rounding of q * scale,
    and of a subnormal scale)."""
    x = f64(np.asarray(x, np.float32))
    finite = np.isfinite(x).all(axis=-1)
    err = np.abs(x - f64(dequantized))[finite]
    sc = f64(scales)[finite][..., None]
    allowed = sc * (0.5 + TIE) + np.abs(f64(dequantized))[finite] * 2.0**-24
    allowed = allowed + np.where(sc < 2.0**-126, SUBNORMAL_SLACK, 0.0)
    assert (err <= allowed).all(), float(np.max(err - allowed))


def assert_f32_close(actual, expected):
    """float32 result of an int8 cache against the float64 reference of its dequantized K/V."""
    assert actual.dtype == F32
    rtol, atol = tol(np.float32)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def ref_attend(q, keys, values, **kwargs):
    """float64 reference attention of the chunk's queries q (H, L, E) over one row's (Hk, S, D) K/V."""
    return reference.scaled_dot_product_attention(
        f64(q), f64(keys), f64(values), is_causal="lower_right", enable_gqa=True, **kwargs
    )


def real_rows(n, chunk, left):
    """The chunk indices of a row's n real tokens."""
    return slice(chunk - n, chunk) if left else slice(0, n)


def rows_of(rng, shape, spread=True):
    """float32 N(0, 1) rows, each scaled by 10^U(-3, 3) when `spread` (the scale is per row)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if spread:
        x *= (10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))).astype(np.float32)
    return x


def ragged_int8_cache(rng, lengths, chunk, kv_heads, head_dim, value_dim, left_padded):
    """An int8 cache whose row b ends at lengths[b]; its last append is a chunk of `chunk` tokens
    holding min(chunk, lengths[b]) real ones (padding tokens NaN, left or right), after NaN rows
    written past every row's end and trimmed away (the storage keeps them). K/V are N(0, 1) (scores
    of unit variance: conftest's float32 tolerance applies). Returns (cache, new)."""
    batch = len(lengths)
    lengths = np.asarray(lengths)
    new = np.minimum(lengths, chunk)
    before = lengths - new
    max_len = int(lengths.max()) + 4
    cache = pyattn.KVCache(batch, kv_heads, head_dim, max_len, value_dim=value_dim, dtype="int8")
    width = int(before.max())
    cache.append(
        rows_of(rng, (batch, kv_heads, width, head_dim), spread=False),
        rows_of(rng, (batch, kv_heads, width, value_dim), spread=False),
        num_new=before,
    )
    nan_k = np.full((batch, kv_heads, 4, head_dim), np.nan, np.float32)
    nan_v = np.full((batch, kv_heads, 4, value_dim), np.nan, np.float32)
    cache.append(nan_k, nan_v)
    cache.trim(4)
    assert cache.lengths.tolist() == before.tolist()
    k = np.full((batch, kv_heads, chunk, head_dim), np.nan, np.float32)
    v = np.full((batch, kv_heads, chunk, value_dim), np.nan, np.float32)
    for b in range(batch):
        rows = real_rows(int(new[b]), chunk, left_padded)
        k[b, :, rows] = rows_of(rng, (kv_heads, int(new[b]), head_dim), spread=False)
        v[b, :, rows] = rows_of(rng, (kv_heads, int(new[b]), value_dim), spread=False)
    cache.append(k, v, num_new=new, left_padded=left_padded)
    assert cache.lengths.tolist() == lengths.tolist()
    return cache, new


def assert_attend_matches_reference(cache, q, new, left_padded, got=None, **kwargs):
    """cache.attend(q, **kwargs) (or `got`) against the reference over each row's dequantized K/V, for
    each row's real queries; alibi_slopes (batch, H) is given to the reference row by row."""
    if got is None:
        got = cache.attend(q, **kwargs)
    chunk = q.shape[2]
    lse = kwargs.get("return_lse", False)
    out = got[0] if lse else got
    assert out.dtype == F32 and out.shape == q.shape[:3] + (cache.value_dim,)
    for b in range(cache.batch):
        if new[b] == 0:
            continue
        rows = real_rows(int(new[b]), chunk, left_padded)
        row_kwargs = {name: value for name, value in kwargs.items() if name != "num_threads"}
        alibi = kwargs.get("alibi_slopes")
        if alibi is not None and np.ndim(alibi) == 2:
            row_kwargs["alibi_slopes"] = alibi[b]
        expected = ref_attend(q[b, :, rows], cache.keys(b), cache.values(b), **row_kwargs)
        if lse:
            assert_f32_close(out[b, :, rows], expected[0])
            assert_f32_close(got[1][b, :, rows], expected[1])
        else:
            assert_f32_close(out[b, :, rows], expected)
    return got


# --- 1. the quantisation contract ------------------------------------------------------------------


def test_round_to_nearest_even_and_special_rows():
    """Exact .5 ties round to even (scale 1: max|x| = 127); a zero row (and a -0.0 row) gets scale 0
    and zeros; a row holding NaN, +Inf or -Inf gets a NaN scale and zeros, and reads back as NaN; the
    largest element of a row is stored as +/-127."""
    rows = np.zeros((1, 1, 6, 8), np.float32)
    rows[0, 0, 0] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]
    rows[0, 0, 1] = -0.0
    rows[0, 0, 2] = [1, 2, np.nan, 3, 4, 5, 6, 7]
    rows[0, 0, 3] = [np.inf, 0, 0, 0, 0, 0, 0, 1]
    rows[0, 0, 4] = [-1, 0, 0, 0, 0, 0, 0, -np.inf]
    rows[0, 0, 5] = [0, 0, 0, -3e-3, 0, 0, 1e-3, 0]
    cache = pyattn.KVCache(1, 1, 8, 8, dtype="int8")
    cache.append(rows, rows[..., ::-1])
    assert cache._k[0, 0, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert cache._k_scales[0, 0, 0] == 1.0
    assert cache._k[0, 0, 1].tolist() == [0] * 8 and cache._k_scales[0, 0, 1] == 0.0
    for r in (2, 3, 4):
        assert np.isnan(cache._k_scales[0, 0, r]) and np.isnan(cache._v_scales[0, 0, r])
        assert cache._k[0, 0, r].tolist() == [0] * 8 and cache._v[0, 0, r].tolist() == [0] * 8
        assert np.isnan(cache.keys()[0, 0, r]).all() and np.isnan(cache.values()[0, 0, r]).all()
    assert cache._k[0, 0, 5].tolist() == [0, 0, 0, -127, 0, 0, 42, 0]  # 1e-3 / (3e-3 / 127) = 42.33
    np.testing.assert_array_equal(cache.keys()[0, 0, :2], [[127, 0, 2, 2, 0, -2, -2, 126], [0] * 8])
    assert_quantised(rows, cache._k[:, :, :6], cache._k_scales[:, :, :6])
    assert_quantised(rows[..., ::-1], cache._v[:, :, :6], cache._v_scales[:, :, :6])
    # Untouched past the filled length.
    assert not cache._k[:, :, 6:].any() and not cache._k_scales[:, :, 6:].any()


@pytest.mark.parametrize("layout", ["contiguous", "strided", "bshd"])
@pytest.mark.parametrize("name", ["float32", "float64", "float16", "bfloat16"])
def test_append_quantises_each_row(rng, name, layout):
    """append quantises every (token, head) row of K and V by the documented rule, from any float
    input dtype (converted to float32 first) and from strided views; keys()/values() are int8 *
    scale; the inputs are not modified; the storage past each row's length is untouched."""
    dtype = np_dtype(name)
    batch, hk, d, dv = 2, 3, 33, 16
    cache = pyattn.KVCache(batch, hk, d, 40, value_dim=dv, dtype="int8")
    assert cache.dtype == np.int8 and cache._k_scales.shape == (batch, hk, 40)
    chunks = []
    for chunk in (7, 1, 12):
        k = rows_of(rng, (batch, hk, chunk, d)).astype(dtype)
        v = rows_of(rng, (batch, hk, chunk, dv)).astype(dtype)
        k[0, 1, 0] = 0  # a zero row
        if layout == "strided":
            k, v = nan_guarded(k), nan_guarded(v)
        elif layout == "bshd":  # (B, S, H, D) storage seen as (B, H, S, D)
            k = np.swapaxes(np.ascontiguousarray(np.swapaxes(k, 1, 2)), 1, 2)
            v = np.swapaxes(np.ascontiguousarray(np.swapaxes(v, 1, 2)), 1, 2)
        before = (k.copy(), v.copy())
        cache.append(k, v)
        np.testing.assert_array_equal(f64(k), f64(before[0]))  # the inputs are not modified
        np.testing.assert_array_equal(f64(v), f64(before[1]))
        chunks.append((k, v))
    n = cache.lengths[0]
    assert n == 20 and cache.lengths.tolist() == [20, 20]
    k_all = np.concatenate([np.asarray(k, np.float32) for k, _ in chunks], axis=2)
    v_all = np.concatenate([np.asarray(v, np.float32) for _, v in chunks], axis=2)
    assert_quantised(k_all, cache._k[:, :, :n], cache._k_scales[:, :, :n])
    assert_quantised(v_all, cache._v[:, :, :n], cache._v_scales[:, :, :n])
    assert cache._k_scales[0, 1, 0] == 0 and not cache._k[0, 1, 0].any()
    assert_dequantized(cache)
    assert_dequantized(cache, 1)
    assert_within_half_step(k_all, cache.keys(), cache._k_scales[:, :, :n])
    assert_within_half_step(v_all, cache.values(), cache._v_scales[:, :, :n])
    assert not cache._k[:, :, n:].any() and not cache._v_scales[:, :, n:].any()


def test_append_ragged_quantises_real_tokens_only(rng):
    """num_new with left and right padding: only the real tokens are quantised, each to its row's
    next positions (NaN padding never reaches the storage or the scales)."""
    cache = pyattn.KVCache(3, 2, 16, 12, dtype="int8")
    expected = [[] for _ in range(3)]
    for counts, left in (([5, 2, 0], False), ([1, 4, 3], True), ([2, 2, 2], False)):
        chunk = max(counts) + 1
        k = np.full((3, 2, chunk, 16), np.nan, np.float32)
        for b, n in enumerate(counts):
            k[b, :, real_rows(n, chunk, left)] = rows_of(rng, (2, n, 16))
            expected[b].append(k[b, :, real_rows(n, chunk, left)])
        cache.append(k, k * 2, num_new=np.array(counts), left_padded=left)
    assert cache.lengths.tolist() == [8, 8, 5]
    for b in range(3):
        x = np.concatenate(expected[b], axis=1)
        n = x.shape[1]
        assert_quantised(x, cache._k[b, :, :n], cache._k_scales[b, :, :n])
        assert_quantised(x * 2, cache._v[b, :, :n], cache._v_scales[b, :, :n])
        assert np.isfinite(cache.keys(b)).all() and np.isfinite(cache.values(b)).all()
        assert_dequantized(cache, b)
    assert not cache._k_scales[2, :, 5:].any()


def test_tiny_rows_keep_the_half_step_contract():
    """Rows whose max |x| is tiny but normal (1e-37) or subnormal are still within scale / 2."""
    rows = np.array([[[[1e-37, 0, 5e-38, -2e-38], [1e-40, 0, -5e-41, 3e-41]]]], np.float32)
    cache = pyattn.KVCache(1, 1, 4, 2, dtype="int8")
    cache.append(rows, rows)
    # Documented: [127, 0, 64, -25] for the first row (5e-38 / (1e-37 / 127) = 63.5: ties to even).
    assert_within_half_step(rows, cache.keys(), cache._k_scales[:, :, :2])


def test_nonfinite_rows_poison_only_the_queries_that_see_them(isa, rng):
    """A NaN in a K row or an Inf in a V row is stored as a NaN-scaled row: the queries that can see
    that row (causally, in its KV head's group, inside the window) get NaN, every other query is
    unaffected; on the decode kernel and on the query tiles; the whole result matches the reference
    over the dequantized K/V (NaN where NaN)."""
    batch, hk, h, d, cached = 3, 2, 4, 16, 20
    for chunk in (3, DECODE_MAX + 4):
        cache = pyattn.KVCache(batch, hk, d, cached + chunk, dtype="int8")
        k = rows_of(rng, (batch, hk, cached + chunk, d), spread=False)
        v = rows_of(rng, (batch, hk, cached + chunk, d), spread=False)
        t0 = chunk // 2  # row 0: a NaN in K of KV head 0 at the chunk's token t0
        k[0, 0, cached + t0, 5] = np.nan
        v[1, 1, 5, 0] = np.inf  # row 1: an Inf in V of KV head 1 at cached position 5
        v[2, 0, cached + chunk - 1] = 0  # row 2: a zero V row and a zero K row, nothing else
        k[2, 1, 3] = 0
        cache.append(k[:, :, :cached], v[:, :, :cached])
        cache.append(k[:, :, cached:], v[:, :, cached:])
        assert np.isnan(cache._k_scales[0, 0, cached + t0]) and np.isnan(cache._v_scales[1, 1, 5])
        assert cache._v_scales[2, 0, cached + chunk - 1] == 0 and cache._k_scales[2, 1, 3] == 0
        assert np.isfinite(cache._k_scales[[1, 2]]).all() and np.isfinite(cache._v_scales[[0, 2]]).all()
        q = random_array(rng, (batch, h, chunk, d), F32)
        for window in (None, (2, 0)):
            out = cache.attend(q, window=window)
            nan = np.isnan(out).any(axis=-1)  # (batch, h, chunk)
            expected = np.zeros_like(nan)
            seen = np.arange(chunk) >= t0 if window is None else (np.arange(chunk) >= t0) & (np.arange(chunk) <= t0 + 2)
            expected[0, :2] = seen  # query heads 0 and 1 read KV head 0
            if window is None:
                expected[1, 2:] = True  # every query of heads 2, 3 sees position 5; the window (2, 0) hides it
            np.testing.assert_array_equal(nan, expected)
            assert_attend_matches_reference(cache, q, [chunk] * batch, False, got=out, window=window)


# --- 2. attention over the stored values is exact -------------------------------------------------

# value_dim != head_dim partners for each head_dim.
OTHER_VALUE_DIM = {1: 3, 7: 8, 8: 7, 16: 33, 33: 16, 64: 128, 128: 64}


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("chunk", [1, 2, DECODE_MAX, DECODE_MAX + 1, 40])
@pytest.mark.parametrize("head_dim", [1, 7, 8, 16, 33, 64, 128])
def test_attend_matches_reference_of_dequantized(isa, rng, head_dim, chunk, left_padded):
    """Ragged rows (one shorter than the chunk), GQA groups 2 and 4, value_dim = head_dim and not:
    attend() equals float64 attention over keys()/values() up to float32 arithmetic, on the decode
    kernel (chunk <= DECODE_MAX) and the query tiles."""
    lengths = [chunk + 37, chunk + 3, max(chunk - 1, 1)]
    for value_dim, group in ((head_dim, 2), (OTHER_VALUE_DIM[head_dim], 4)):
        cache, new = ragged_int8_cache(rng, lengths, chunk, 2, head_dim, value_dim, left_padded)
        q = nan_guarded(np.full((3, 2 * group, chunk, head_dim), np.nan, np.float32))
        for b in range(3):
            q[b, :, real_rows(int(new[b]), chunk, left_padded)] = rng.standard_normal(
                (2 * group, int(new[b]), head_dim)
            )
        assert_attend_matches_reference(cache, q, new, left_padded)
        assert_attend_matches_reference(cache, q, new, left_padded, scale=0.7)


@pytest.mark.parametrize("group_heads", [None, 1], ids=["group_tiles", "head_by_head"])
def test_tiles_group_heads_bitwise(isa, rng, group_heads):
    """The query tiles dequantize a key block once for a GQA group's heads or head by head: the same
    bits either way, and the reference's values."""
    cache, new = ragged_int8_cache(rng, [300, 57, 12], 12, 2, 24, 24, False)
    q = random_array(rng, (3, 8, 12, 24), F32)
    with override(group_heads=group_heads):
        got = cache.attend(q)
    with override(group_heads=1):
        alone = cache.attend(q)
    np.testing.assert_array_equal(got, alone)
    assert_attend_matches_reference(cache, q, new, False, got=got)


def variant_options(rng, h, batch):
    """Each option alone, then all of them together with return_lse."""
    sinks = rng.standard_normal(h)
    slopes = np.abs(rng.standard_normal(h)) * 0.1
    per_row = np.abs(rng.standard_normal((batch, h))) * 0.1
    return {
        "window": dict(window=(6, 0)),
        "window_both_sides": dict(window=(3, 2)),
        "window_left_none": dict(window=(None, 1)),
        "softcap": dict(softcap=1.5),
        "sinks": dict(sinks=sinks),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_per_row": dict(alibi_slopes=per_row),
        "return_lse": dict(return_lse=True),
        "all": dict(window=(9, 1), softcap=3.0, sinks=sinks, alibi_slopes=per_row, return_lse=True, scale=0.4),
    }


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("chunk", [1, 3, DECODE_MAX, DECODE_MAX + 1, 40])
def test_attend_options_match_reference(isa, rng, chunk, left_padded):
    """window, softcap, sinks, ALiBi (per head and per batch row), return_lse (the lse against the
    reference's), alone and together, over ragged int8 rows."""
    batch, hk, h = 3, 2, 4
    cache, new = ragged_int8_cache(rng, [chunk + 60, chunk + 9, chunk], chunk, hk, 24, 40, left_padded)
    q = random_array(rng, (batch, h, chunk, 24), F32)
    for name, options in variant_options(rng, h, batch).items():
        try:
            assert_attend_matches_reference(cache, q, new, left_padded, **options)
        except AssertionError as e:
            raise AssertionError(f"options {name}") from e


@pytest.mark.parametrize(
    "head_dim, lengths, chunk",
    [(128, [3000, 1100], 1), (64, [2500, 1200], 3), (40, [1500, 1024], DECODE_MAX + 4)],
    ids=["d128_decode1", "d64_decode3", "d40_tiles"],
)
def test_long_cache_split_across_threads(isa, rng, head_dim, lengths, chunk):
    """Caches of 1000+ tokens, attended with 2 threads (the decode kernel splits the key range into
    chunks and merges them), with and without variants: the reference's values, and the same bits
    for 1, 2 and 3 threads."""
    cache, new = ragged_int8_cache(rng, lengths, chunk, 2, head_dim, head_dim, False)
    q = random_array(rng, (2, 8, chunk, head_dim), F32)
    got = assert_attend_matches_reference(cache, q, new, False, num_threads=2)
    for threads in (1, 3):
        np.testing.assert_array_equal(cache.attend(q, num_threads=threads), got)
    options = dict(window=(700, 0), sinks=rng.standard_normal(8), return_lse=True)
    out, lse = assert_attend_matches_reference(cache, q, new, False, num_threads=2, **options)
    out1, lse1 = cache.attend(q, num_threads=1, **options)
    np.testing.assert_array_equal(out1, out)
    np.testing.assert_array_equal(lse1, lse)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_truncate_trim_then_append(isa, rng, left):
    """truncate/trim of an int8 cache: the last chunk's remaining queries keep their positions, and
    appending after a cut overwrites the dropped rows' values and scales (a NaN row trimmed away and
    replaced leaves nothing behind)."""
    cache = pyattn.KVCache(2, 2, 16, 32, dtype="int8")
    cache.append(rows_of(rng, (2, 2, 10, 16)), rows_of(rng, (2, 2, 10, 16)))
    k, v = rows_of(rng, (2, 2, 5, 16)), rows_of(rng, (2, 2, 5, 16))
    cache.append(k, v, num_new=np.array([5, 3]), left_padded=left)
    q = random_array(rng, (2, 4, 5, 16), F32)
    before = cache.attend(q)
    cache.trim(0)
    np.testing.assert_array_equal(cache.attend(q), before)
    cache.truncate(np.array([12, 11]))  # row 0 keeps 2 of its 5 new tokens, row 1 1 of 3
    assert cache.lengths.tolist() == [12, 11]
    out = cache.attend(q)
    for b, (n_old, n_new) in enumerate([(5, 2), (3, 1)]):
        first = 5 - n_old if left else 0
        rows = slice(first, first + n_new)
        assert_f32_close(out[b, :, rows], ref_attend(q[b, :, rows], cache.keys(b), cache.values(b)))
        np.testing.assert_allclose(
            out[b, :, rows], before[b, :, rows], rtol=TOL[np.float32][0], atol=TOL[np.float32][1]
        )
    # A NaN row appended and trimmed away, then replaced by a finite one: its scale is overwritten.
    nan = np.full((2, 2, 1, 16), np.nan, np.float32)
    cache.append(nan, nan)
    assert np.isnan(cache._k_scales[0, :, 12]).all()
    cache.trim(1)
    k1, v1 = rows_of(rng, (2, 2, 1, 16)), rows_of(rng, (2, 2, 1, 16))
    cache.append(k1, v1)
    assert np.isfinite(cache._k_scales[0, :, 12]).all() and np.isfinite(cache._v_scales[0, :, 12]).all()
    assert_quantised(k1[0], cache._k[0, :, 12:13], cache._k_scales[0, :, 12:13])
    q1 = random_array(rng, (2, 4, 1, 16), F32)
    out = assert_attend_matches_reference(cache, q1, [1, 1], False)
    assert np.isfinite(out).all()
    cache.reset()
    cache.append(k1, v1)
    assert_attend_matches_reference(cache, q1, [1, 1], False)


# --- 3. error against the unquantized float32 cache ------------------------------------------------


def int8_and_float32_caches(rng, batch, hk, head_dim, kv_len, chunk, room=0):
    """The same N(0, 1) K/V in an int8 and a float32 cache (room for `room` more tokens), the last
    `chunk` tokens appended last; and the int8 half step of the data, max|x| / 254."""
    k = rng.standard_normal((batch, hk, kv_len, head_dim), dtype=np.float32)
    v = rng.standard_normal((batch, hk, kv_len, head_dim), dtype=np.float32)
    max_len = kv_len + room
    caches = pyattn.KVCache(batch, hk, head_dim, max_len, dtype="int8"), pyattn.KVCache(batch, hk, head_dim, max_len)
    for cache in caches:
        if kv_len > chunk:
            cache.append(k[:, :, : kv_len - chunk], v[:, :, : kv_len - chunk])
        cache.append(k[:, :, kv_len - chunk :], v[:, :, kv_len - chunk :])
    half_step = max(np.abs(k).max(), np.abs(v).max()) / 254.0
    return caches, (k, v), half_step


def corrupted(cache, how):
    """A copy of an int8 cache with its scales dropped (all 1) or its values one step up."""
    bad = copy.deepcopy(cache)
    if how == "scales_dropped":
        bad._k_scales[...] = 1.0
        bad._v_scales[...] = 1.0
    else:  # every stored value one int8 step too large (a wrong rounding rule, say)
        bad._k[...] = np.minimum(bad._k.astype(np.int16) + 1, 127).astype(np.int8)
        bad._v[...] = np.minimum(bad._v.astype(np.int16) + 1, 127).astype(np.int8)
    return bad


@pytest.mark.parametrize("chunk", [1, DECODE_MAX, 40])
@pytest.mark.parametrize("head_dim, kv_len", [(64, 1000), (128, 1000), (64, 4096), (128, 4096)])
def test_error_against_float32_cache_long_context(rng, head_dim, kv_len, chunk):
    """N(0, 1) data: keys()/values() within half a step of the float32 values, and attend's output
    within long_context_bound of the float32 cache's; a cache without its scales, or with its values
    one step off, is far outside it."""
    (int8, full), (k, v), half_step = int8_and_float32_caches(rng, 2, 4, head_dim, kv_len, chunk)
    assert_within_half_step(k, int8.keys(), int8._k_scales)
    assert_within_half_step(v, int8.values(), int8._v_scales)
    assert np.abs(int8.keys() - k).max() <= half_step * (1 + TIE)
    q = rng.standard_normal((2, 16, chunk, head_dim), dtype=np.float32)
    expected = full.attend(q)
    err = np.abs(int8.attend(q) - expected).max()
    bound = long_context_bound(half_step, kv_len - chunk + 1)  # the first query sees the fewest keys
    assert 0 < err <= bound, (err, bound, half_step)
    for how in ("scales_dropped", "one_step_up"):
        bad_err = np.abs(corrupted(int8, how).attend(q) - expected).max()
        assert bad_err > 2 * bound, (how, bad_err, bound)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_error_against_float32_cache_short_context(isa, rng, head_dim):
    """A 48-token prefill into empty caches (query i sees i + 1 keys), then 4 decode steps: every
    output within SHORT_CONTEXT_HALF_STEPS half steps of the float32 cache's (the first query's output
    is its one V row: within one half step)."""
    (int8, full), _, half_step = int8_and_float32_caches(rng, 2, 4, head_dim, 48, 48, room=4)
    q = rng.standard_normal((2, 16, 48, head_dim), dtype=np.float32)
    expected = full.attend(q)
    err = np.abs(int8.attend(q) - expected)
    assert err[:, :, 0].max() <= half_step * (1 + TIE)
    assert 0 < err.max() <= SHORT_CONTEXT_HALF_STEPS * half_step, err.max() / half_step
    assert (
        np.abs(corrupted(int8, "scales_dropped").attend(q) - expected).max() > 10 * SHORT_CONTEXT_HALF_STEPS * half_step
    )
    for _ in range(4):
        k1 = rng.standard_normal((2, 4, 1, head_dim), dtype=np.float32)
        v1 = rng.standard_normal((2, 4, 1, head_dim), dtype=np.float32)
        half_step = max(half_step, np.abs(k1).max() / 254, np.abs(v1).max() / 254)
        for cache in (int8, full):
            cache.append(k1, v1)
        q1 = rng.standard_normal((2, 16, 1, head_dim), dtype=np.float32)
        assert np.abs(int8.attend(q1) - full.attend(q1)).max() <= SHORT_CONTEXT_HALF_STEPS * half_step


def test_requantising_dequantized_values_is_exact(rng):
    """keys() of an int8 cache appended to another int8 cache are stored again as the same int8
    values (max |q| = 127 on every row, so the scale is recovered, to float32 rounding): no drift."""
    a = pyattn.KVCache(2, 3, 40, 20, dtype="int8")
    a.append(rows_of(rng, (2, 3, 20, 40)), rows_of(rng, (2, 3, 20, 40)))
    b = pyattn.KVCache(2, 3, 40, 20, dtype="int8")
    b.append(a.keys(), a.values())
    np.testing.assert_array_equal(b._k, a._k)
    np.testing.assert_array_equal(b._v, a._v)
    np.testing.assert_allclose(b._k_scales, a._k_scales, rtol=2.0**-23, atol=0)
    np.testing.assert_allclose(b.values(), a.values(), rtol=2.0**-22, atol=0)


# --- 4. the layer ------------------------------------------------------------------------------------


def make_layer(rng, embed_dim, num_heads, num_kv_heads):
    """A float32 MultiHeadAttention (seed 0 weights) with non-zero biases."""
    layer = pyattn.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, seed=0)
    state = layer.state_dict()
    state["in_proj_bias"] = (0.5 * rng.standard_normal(state["in_proj_bias"].shape)).astype(np.float32)
    state["out_proj.bias"] = (0.5 * rng.standard_normal(state["out_proj.bias"].shape)).astype(np.float32)
    layer.load_state_dict(state)
    return layer


def run_chunks(layer, x, cache, sizes, **kwargs):
    """x (B, L, E) through the layer with kv_cache in chunks of `sizes` (cycled); outputs joined."""
    outs, t, n = [], 0, 0
    while t < x.shape[1]:
        size = sizes[n % len(sizes)]
        outs.append(layer(x[:, t : t + size], kv_cache=cache, **kwargs))
        t, n = t + size, n + 1
    return np.concatenate(outs, axis=1)


def reference_layer_from_kv(layer, x, keys, values, **kwargs):
    """float64 output of `layer` on x (B, L, E) attending causally to the given K/V (B, Hk, L, D): the
    layer's Q and output projections around reference attention over those K/V (kwargs: variants)."""
    state = layer.state_dict()
    e, h = layer.embed_dim, layer.num_heads
    batch, length = x.shape[:2]
    wq, bq = f64(state["in_proj_weight"][:e]), f64(state["in_proj_bias"][:e])
    q = (f64(x) @ wq.T + bq).reshape(batch, length, h, e // h).transpose(0, 2, 1, 3)
    context = reference.scaled_dot_product_attention(
        q, f64(keys), f64(values), is_causal=True, enable_gqa=True, **kwargs
    )
    context = context.transpose(0, 2, 1, 3).reshape(batch, length, e)
    return context @ f64(state["out_proj.weight"]).T + f64(state["out_proj.bias"])


@pytest.mark.parametrize("sizes", [[1], [DECODE_MAX + 1, 1, 3]], ids=["token_by_token", "mixed_chunks"])
@pytest.mark.parametrize("num_kv_heads", [8, 2], ids=["mha", "gqa4"])
def test_layer_quantises_its_projections_and_attends_over_them(isa, rng, num_kv_heads, sizes):
    """MultiHeadAttention(kv_cache=int8 cache): the cache holds the layer's own K/V projections (a
    float32 cache's values after the same steps) quantised by the documented rule, and the layer's
    output is the float64 reference attention over the int8 cache's dequantized K/V, between the
    layer's Q and output projections."""
    layer = make_layer(rng, 64, 8, num_kv_heads)
    x = random_array(rng, (2, 17, 64), F32)
    int8 = pyattn.KVCache(2, num_kv_heads, 8, 17, dtype="int8")
    full = pyattn.KVCache(2, num_kv_heads, 8, 17)
    got = run_chunks(layer, x, int8, sizes)
    unquantized = run_chunks(layer, x, full, sizes)
    assert got.dtype == F32 and int8.lengths.tolist() == [17, 17]
    assert_quantised(full.keys(), int8._k[:, :, :17], int8._k_scales[:, :, :17])
    assert_quantised(full.values(), int8._v[:, :, :17], int8._v_scales[:, :, :17])
    assert_within_half_step(full.keys(), int8.keys(), int8._k_scales[:, :, :17])
    assert_dequantized(int8)
    expected = reference_layer_from_kv(layer, x, int8.keys(), int8.values())
    assert_f32_close(got, expected)
    # And it differs from the float32 cache's output (the values are quantised), though not by much.
    assert 0 < np.abs(got - unquantized).max() < 0.05 * np.abs(unquantized).max()


@pytest.mark.parametrize("sizes", [[1], [DECODE_MAX + 1, 1]], ids=["token_by_token", "mixed_chunks"])
def test_mha_variants_with_int8_cache(isa, rng, sizes):
    """pyattn.mha(kv_cache=int8 cache) with window, softcap, sinks and ALiBi: the reference over the
    cache's dequantized K/V with the same variants."""
    layer = make_layer(rng, 64, 8, 2)
    state = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    x = random_array(rng, (2, 14, 64), F32)
    variants = dict(
        window=(4, 0), softcap=2.5, sinks=rng.standard_normal(8), alibi_slopes=np.abs(rng.standard_normal(8))
    )
    cache = pyattn.KVCache(2, 2, 8, 14, dtype="int8")
    outs, t, n = [], 0, 0
    while t < 14:
        size = sizes[n % len(sizes)]
        outs.append(pyattn.mha(x[:, t : t + size], num_heads=8, num_kv_heads=2, kv_cache=cache, **variants, **state))
        t, n = t + size, n + 1
    got = np.concatenate(outs, axis=1)
    assert_f32_close(got, reference_layer_from_kv(layer, x, cache.keys(), cache.values(), **variants))


def step_through_cache_methods(layer, x, cache, num_new, left_padded):
    """The layer's step spelled out with the public cache methods: the layer's own projections (its
    packed GEMM), KVCache.append, KVCache.attend, the output projection."""
    w = layer._weights
    batch, chunk = x.shape[:2]
    rows = x.reshape(batch * chunk, x.shape[2])

    def heads(y, n):
        return y.reshape(batch, chunk, n, w.head_dim).transpose(0, 2, 1, 3)

    cache.append(
        heads(w.linear(rows, "k", 0), w.num_kv_heads),
        heads(w.linear(rows, "v", 0), w.num_kv_heads),
        num_new=num_new,
        left_padded=left_padded,
    )
    context = cache.attend(heads(w.linear(rows, "q", 0), w.num_heads))
    context = np.ascontiguousarray(context.transpose(0, 2, 1, 3)).reshape(batch * chunk, w.embed_dim)
    return w.linear(context, "o", 0).reshape(batch, chunk, w.embed_dim)


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
def test_layer_step_equals_cache_methods_bitwise(isa, rng, left_padded):
    """The layer's one-call step (quantising in the core's store_token) and the step spelled out with
    append (quantising through _core.quantize_int8) and attend: the same output, int8 values, scales
    and lengths, bit for bit, through ragged chunks (NaN padding tokens), decode steps, a chunk past
    the decode kernel's limit and an empty chunk; pyattn.mha(kv_cache=) likewise."""
    layer = make_layer(rng, 48, 6, 2)
    batch = 3
    fused, spelled, functional = (pyattn.KVCache(batch, 2, 8, 64, dtype="int8") for _ in range(3))
    state = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    steps = [(5, [5, 2, 0]), (1, None), (3, [1, 3, 2]), (1, None), (DECODE_MAX + 3, None), (0, None), (1, None)]
    for chunk, counts in steps:
        counts_arr = [chunk] * batch if counts is None else counts
        x = np.full((batch, chunk, 48), np.nan, np.float32)
        for b, n in enumerate(counts_arr):
            x[b, real_rows(n, chunk, left_padded)] = rng.standard_normal((n, 48))
        num_new = None if counts is None else np.array(counts)
        got = layer(x, kv_cache=fused, num_new=num_new, left_padded=left_padded)
        expected = step_through_cache_methods(layer, x, spelled, num_new, left_padded)
        func = pyattn.mha(
            x, num_heads=6, num_kv_heads=2, kv_cache=functional, num_new=num_new, left_padded=left_padded, **state
        )
        assert got.dtype == F32 and got.shape == (batch, chunk, 48)
        np.testing.assert_array_equal(got, expected)  # NaN (padding query rows) where NaN
        np.testing.assert_array_equal(func, got)
        for other in (spelled, functional):
            assert fused.lengths.tolist() == other.lengths.tolist()
            for name in ("_k", "_v", "_k_scales", "_v_scales"):  # every stored bit, unused rows too
                np.testing.assert_array_equal(getattr(fused, name).view(np.uint8), getattr(other, name).view(np.uint8))
    for b in range(batch):
        assert np.isfinite(fused.keys(b)).all()  # no padding token was stored


def test_layer_dtype_rules(rng):
    """An int8 cache computes in float32: a float64 layer is refused (TypeError naming kv_cache),
    changing nothing."""
    layer = pyattn.MultiHeadAttention(16, 2, num_kv_heads=2, dtype=np.float64, seed=0)
    cache = pyattn.KVCache(1, 2, 8, 4, dtype="int8")
    with pytest.raises(TypeError, match="kv_cache"):
        layer(random_array(rng, (1, 1, 16), np.float64), kv_cache=cache)
    assert cache.lengths.tolist() == [0] and not cache._k_scales.any()


# --- 5. pickling and copies --------------------------------------------------------------------------


@pytest.mark.parametrize("copy_kind", ["pickle", "deepcopy", "copy"])
def test_pickle_and_copies(rng, copy_kind):
    """A pickled or copied int8 cache keeps its int8 values, scales (NaN included) and lengths bit for
    bit, shares none of them, attends bit for bit like the original, and goes on like it."""
    clone = {"pickle": lambda c: pickle.loads(pickle.dumps(c)), "deepcopy": copy.deepcopy, "copy": copy.copy}[copy_kind]
    layer = make_layer(rng, 16, 4, 2)
    cache = pyattn.KVCache(2, 2, 4, 16, dtype="int8")
    layer(random_array(rng, (2, 5, 16), F32), kv_cache=cache, num_new=np.array([5, 3]))
    k = rows_of(rng, (2, 2, 1, 4))
    k[0, 1, 0, 2] = np.nan  # a NaN scale: row 0's query heads 2 and 3 give NaN from here on
    cache.append(k, rows_of(rng, (2, 2, 1, 4)))
    assert np.isnan(cache._k_scales[0, 1, 5])
    twin = clone(cache)
    assert repr(twin) == repr(cache) and "dtype=int8" in repr(twin)
    assert twin.dtype == np.int8
    for name in ("_k", "_v", "_k_scales", "_v_scales", "lengths"):
        a, b = getattr(cache, name), getattr(twin, name)
        assert not np.shares_memory(a, b), name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    q = random_array(rng, (2, 4, 1, 4), F32)
    np.testing.assert_array_equal(twin.attend(q).view(np.uint32), cache.attend(q).view(np.uint32))
    for _ in range(3):  # the same steps on both: a layer step, and append + attend
        x = random_array(rng, (2, 1, 16), F32)
        np.testing.assert_array_equal(layer(x, kv_cache=twin), layer(x, kv_cache=cache))
        k = rows_of(rng, (2, 2, 1, 4))
        cache.append(k, k)
        twin.append(k, k)
        np.testing.assert_array_equal(twin.attend(q), cache.attend(q))
    for name in ("_k", "_v", "_k_scales", "_v_scales"):
        np.testing.assert_array_equal(getattr(cache, name).view(np.uint8), getattr(twin, name).view(np.uint8))
    cache.reset()
    assert twin.lengths.tolist() == [12, 10] and np.isnan(twin._k_scales[0, 1, 5])


# --- 6. dtype rules and errors -------------------------------------------------------------------------


def test_dtype_names_and_refused_integer_dtypes():
    """ "int8", np.int8 and np.dtype("int8") make an int8 cache; other integer dtypes are a TypeError
    naming dtype."""
    for spelling in ("int8", np.int8, np.dtype(np.int8)):
        cache = pyattn.KVCache(1, 1, 4, 4, dtype=spelling)
        assert cache.dtype == np.int8 and cache._k_scales is not None
    assert pyattn.KVCache(1, 1, 4, 4)._k_scales is None
    for bad in ("uint8", "int16", np.uint8, np.int16, "int4", "i1x"):
        with pytest.raises(TypeError, match="dtype"):
            pyattn.KVCache(1, 1, 4, 4, dtype=bad)


@pytest.mark.parametrize("name", ["float64", "float16", "bfloat16"])
def test_query_of_other_float_dtypes_is_converted(isa, rng, name):
    """A float64 / float16 / bfloat16 query on an int8 cache is converted to float32: the result is
    float32 and the same bits as the float32 query's."""
    cache, new = ragged_int8_cache(rng, [30, 12], 3, 2, 16, 16, False)
    q = rng.standard_normal((2, 4, 3, 16)).astype(np_dtype(name))
    got = cache.attend(q)
    assert got.dtype == F32
    np.testing.assert_array_equal(got, cache.attend(q.astype(np.float32)))
    assert_attend_matches_reference(cache, q.astype(np.float32), new, False, got=got)


def test_append_and_attend_errors_change_nothing(rng):
    """Integer K/V (already quantised values, say) are a TypeError naming key/value; an integer query
    a TypeError naming query; an append past max_len a ValueError; none changes values, scales or
    lengths."""
    cache = pyattn.KVCache(2, 1, 4, 6, dtype="int8")
    cache.append(rows_of(rng, (2, 1, 3, 4)), rows_of(rng, (2, 1, 3, 4)), num_new=np.array([3, 1]))
    q = random_array(rng, (2, 2, 3, 4), F32)
    before_out = cache.attend(q)
    state = [getattr(cache, n).copy() for n in ("_k", "_v", "_k_scales", "_v_scales", "lengths")]
    good = rows_of(rng, (2, 1, 1, 4))
    cases = [
        (TypeError, "key", lambda: cache.append(good.astype(np.int8), good)),
        (TypeError, "value", lambda: cache.append(good, good.astype(np.int32))),
        (ValueError, "max_len", lambda: cache.append(rows_of(rng, (2, 1, 4, 4)), rows_of(rng, (2, 1, 4, 4)))),
        (ValueError, "value", lambda: cache.append(good, rows_of(rng, (2, 1, 1, 5)))),
        (TypeError, "query", lambda: cache.attend(q.astype(np.int8))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    for name, saved in zip(("_k", "_v", "_k_scales", "_v_scales", "lengths"), state):
        np.testing.assert_array_equal(getattr(cache, name), saved)
    np.testing.assert_array_equal(cache.attend(q), before_out)


# --- 7. property -----------------------------------------------------------------------------------------


@st.composite
def int8_steps(draw):
    """A random int8 cache and chunk: batch, KV heads, GQA group, head_dim and value_dim, ragged rows
    (cached tokens, real tokens of the chunk, padding side), options."""
    batch = draw(st.integers(1, 3))
    chunk = draw(st.sampled_from([1, 2, 3, DECODE_MAX, DECODE_MAX + 1, 13]))
    return dict(
        batch=batch,
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16, 24, 33, 64, 100, 128])),
        value_dim=draw(st.sampled_from([None, 2, 8, 17, 64])),
        chunk=chunk,
        lengths=draw(st.lists(st.integers(1, chunk + 300), min_size=batch, max_size=batch)),
        left_padded=draw(st.booleans()),
        options=draw(st.sampled_from(["none", "window", "softcap", "sinks", "alibi", "lse"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=int8_steps())
def test_int8_cache_matches_reference_property(isa, step):
    """Any int8 cache, any chunk: attend() equals the float64 reference over the dequantized K/V."""
    rng = np.random.default_rng(step["seed"])
    d = step["head_dim"]
    dv = d if step["value_dim"] is None else step["value_dim"]
    h = step["kv_heads"] * step["group"]
    chunk = step["chunk"]
    lengths = step["lengths"]
    cache, new = ragged_int8_cache(rng, lengths, chunk, step["kv_heads"], d, dv, step["left_padded"])
    q = random_array(rng, (step["batch"], h, chunk, d), F32)
    options = {
        "none": {},
        "window": dict(window=(int(rng.integers(0, 20)), int(rng.integers(0, 3)))),
        "softcap": dict(softcap=2.0),
        "sinks": dict(sinks=rng.standard_normal(h)),
        "alibi": dict(alibi_slopes=np.abs(rng.standard_normal(h)) * 0.1),
        "lse": dict(return_lse=True),
    }[step["options"]]
    assert_attend_matches_reference(cache, q, new, step["left_padded"], **options)
