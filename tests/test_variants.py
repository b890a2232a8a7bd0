# SPDX-License-Identifier: MIT
"""Parity of the attention variants (sliding window, softcap, sinks, ALiBi) with the float64 reference.

pyattn.scaled_dot_product_attention and KVCache.attend with window=, softcap=, sinks= and
alibi_slopes=, for every compiled ISA (conftest's `isa` fixture) and every input dtype (float32,
float64, float16, bfloat16), held against pyattn.reference.scaled_dot_product_attention with
conftest.TOL, the suite's one tolerance table (no widening anywhere in this file).

Query lengths cover both kernel paths: the decode kernel (q_len <= DECODE_MAX: 1, 3, DECODE_MAX)
and the query tiles (37, 40, 45, 130, 300), against up to 3001 keys (the decode kernel's split key
range, tiles skipping key blocks outside the window). Inputs are NaN-guarded views
(conftest.nan_guarded), so an out-of-bounds read shows up as NaN. What is held:

* each option alone and every combination of them, with and without a causal rule, GQA, masks of
  several broadcast shapes, return_weights, out=, strided views, 2-D to 5-D inputs, odd head and
  value dims;
* the window with every causal alignment, L < S, L == S and L > S, one-sided, (0, 0) and wider
  than the sequence; NaN in the K/V rows no query's window reaches does not leak;
* softcap on scores ~900 times larger than unit-variance inputs give (saturated tanh);
* sinks: rows with no allowed key give zeros, a -inf sink is bitwise no sink;
* ALiBi slopes negative, zero and positive, per head or per (batch, head);
* KVCache.attend on ragged rows (each query's window and ALiBi distance from its own position);
* bitwise equality for num_threads 1 and 2;
* hypothesis properties: a window covering everything is no window, -inf sinks are no sinks, and
  decoding token by token through a float32 or bfloat16 KVCache equals one full causal pass;
* each invalid option raises an error naming its argument.
"""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference

from conftest import f64, make_qkv, np_dtype, random_array, random_mask, tol

sdpa = pyattn.scaled_dot_product_attention

DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16"]
# Longest query the driver gives the decode kernel; longer ones run the query tiles.
DECODE_MAX = pyattn._core.DECODE_MAX_Q_LEN
CAUSAL = [False, True, "upper_left", "lower_right"]
# The distinct alignments (True is "upper_left"), for the grids where the spelling does not matter.
ALIGNMENTS = [False, "upper_left", "lower_right"]
OPTION_NAMES = ["window", "softcap", "sinks", "alibi_slopes"]
# Every subset of the options: none, each alone, every pair, triple, all four.
OPTION_SETS = [c for r in range(len(OPTION_NAMES) + 1) for c in itertools.combinations(OPTION_NAMES, r)]
ALL_OPTIONS = tuple(OPTION_NAMES)
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def option_id(names):
    return "+".join(names) or "none"


@pytest.fixture(params=DTYPE_NAMES)
def name(request):
    """Each input dtype by name; bfloat16 skips without ml_dtypes (conftest.np_dtype)."""
    np_dtype(request.param)
    return request.param


# --- helpers ---------------------------------------------------------------------------------------


def inputs(rng, name, q_len, kv_len, head_dim=16, value_dim=None, q_heads=4, kv_heads=None, batch=(2,), **kwargs):
    """NaN-guarded query (*batch, Hq, L, E), key and value (*batch, Hk, S, E / Ev) of dtype `name`."""
    return make_qkv(
        rng,
        np_dtype(name),
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        value_dim=value_dim,
        **kwargs,
    )


def sinks_for(q_heads):
    """One sink per head: finite of both signs, and -inf (no sink) on the second head."""
    return np.resize(np.array([0.5, -np.inf, 2.0, -1.0, 1.5, 0.0, -np.inf, 3.0]), q_heads)


def slopes_for(q_heads, batch=()):
    """ALiBi slopes -0.1 .. 0.2 over the heads (negative, zero at Hq = 4, positive), (Hq,) or, for a
    non-empty `batch`, (*batch, Hq) with a different offset per batch entry."""
    slopes = np.linspace(-0.1, 0.2, q_heads)
    if not batch:
        return slopes
    offsets = 0.05 * np.arange(int(np.prod(batch))).reshape(tuple(batch) + (1,))
    return slopes + offsets


def variant_options(names, q_heads, batch=()):
    """The options named, with this file's standard values: a window of 6 keys left and 3 right of
    the diagonal, a softcap of 3 (unit-variance scores reach its curved part), sinks_for, slopes_for."""
    every = dict(
        window=(6, 3),
        softcap=3.0,
        sinks=sinks_for(q_heads),
        alibi_slopes=slopes_for(q_heads, batch),
    )
    return {key: every[key] for key in names}


def band(q_len, kv_len, is_causal, window):
    """(L, S) bool: the keys that the causal rule and the window let each query see."""
    d = np.arange(q_len)[:, None] + (kv_len - q_len if is_causal == "lower_right" else 0)
    j = np.arange(kv_len)[None, :]
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if is_causal is not False:
        allowed &= j <= d
    left, right = window
    if left is not None:
        allowed &= j >= d - left
    if right is not None:
        allowed &= j <= d + right
    return allowed


def assert_matches(actual, expected, dtype):
    """pyattn's result (of `dtype`) against the float64 reference, with conftest's tolerance."""
    assert actual.dtype == np.dtype(dtype)
    assert actual.shape == expected.shape
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(f64(actual), expected, rtol=rtol, atol=atol)


def check(q, k, v, attn_mask=None, **kwargs):
    """pyattn and the reference with the same arguments (out= and num_threads= for pyattn only),
    compared with the table's tolerance for the result dtype; returns pyattn's result."""
    got = sdpa(q, k, v, attn_mask, **kwargs)
    ref_kwargs = {key: value for key, value in kwargs.items() if key not in ("out", "num_threads")}
    want = reference.scaled_dot_product_attention(q, k, v, attn_mask, **ref_kwargs)
    if kwargs.get("return_weights"):
        assert_matches(got[0], want[0], q.dtype)
        assert_matches(got[1], want[1], q.dtype)
    else:
        assert_matches(got, want, q.dtype)
    return got


# --- window ----------------------------------------------------------------------------------------

# Decode path with L < S and L > S; tiles with L < S (several key blocks), L == S and L > S.
WINDOW_SIZES = [(1, 37), (3, 130), (DECODE_MAX, 5), (40, 300), (37, 37), (130, 40)]
# (0, 0), two-sided, one-sided both ways, half-bounded at 0, wider than a key block, wider than all.
WINDOWS = [(0, 0), (5, 1), (3, None), (None, 2), (0, None), (None, 0), (100, 20), (500, 500)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("q_len, kv_len", WINDOW_SIZES)
@pytest.mark.parametrize("is_causal", ALIGNMENTS, ids=str)
def test_window(isa, name, rng, is_causal, q_len, kv_len, window):
    q, k, v = inputs(rng, name, q_len, kv_len, q_heads=2, batch=(1,))
    check(q, k, v, is_causal=is_causal, window=window)


# --- each option, alone and combined ---------------------------------------------------------------


@pytest.mark.parametrize("options", OPTION_SETS, ids=option_id)
@pytest.mark.parametrize("q_len, kv_len", [(3, 77), (45, 77)], ids=["decode", "tiles"])
@pytest.mark.parametrize("is_causal", [False, "lower_right"], ids=str)
def test_options_alone_and_combined(isa, name, rng, options, q_len, kv_len, is_causal):
    q, k, v = inputs(rng, name, q_len, kv_len)
    check(q, k, v, is_causal=is_causal, **variant_options(options, 4))


# Odd head dims around the SIMD widths (lanes + 1: 5 for AVX2 float64, 9 for AVX2 float32, 17 for
# AVX-512 float32), 1, 64, 80, and value dims that differ from the head dim.
@pytest.mark.parametrize(
    "head_dim, value_dim",
    [(1, 1), (5, 5), (7, 7), (9, 9), (17, 17), (64, 64), (80, 80), (7, 13), (64, 17), (9, 80), (1, 33)],
    ids=str,
)
@pytest.mark.parametrize("q_len", [3, 40], ids=["decode", "tiles"])
def test_head_and_value_dims(isa, name, rng, head_dim, value_dim, q_len):
    q, k, v = inputs(rng, name, q_len, 67, head_dim=head_dim, value_dim=value_dim)
    check(q, k, v, is_causal="lower_right", **variant_options(ALL_OPTIONS, 4))
    check(q, k, v, window=(None, 4), softcap=1.5, alibi_slopes=slopes_for(4, (2,)), scale=-0.7)


@pytest.mark.parametrize("q_len, kv_len", [(1, 130), (3, 37), (40, 130), (130, 40)])
@pytest.mark.parametrize("is_causal", CAUSAL, ids=str)
def test_grouped_query_attention(isa, name, rng, q_len, kv_len, is_causal):
    q, k, v = inputs(rng, name, q_len, kv_len, q_heads=8, kv_heads=2)
    check(q, k, v, is_causal=is_causal, enable_gqa=True, **variant_options(ALL_OPTIONS, 8, batch=(2,)))
    check(q, k, v, is_causal=is_causal, enable_gqa=True, window=(0, 0), sinks=sinks_for(8))


@pytest.mark.parametrize(
    "q_len, kv_len, window",
    [
        (1, 3001, None),  # the decode kernel splits the key range into chunks and merges them
        (3, 3001, (None, 3)),
        (DECODE_MAX, 3001, (700, 0)),
        (130, 1030, (50, 10)),  # tiles skipping whole key blocks before and after the band
    ],
)
@pytest.mark.parametrize("padding", [False, True], ids=["no_mask", "padding_mask"])
def test_long_key_ranges(isa, name, rng, q_len, kv_len, window, padding):
    # Sinks must join each row's softmax once however the key range is split; a padding mask forbids
    # all but 10 keys at each end, so whole chunks have nothing allowed.
    q, k, v = inputs(rng, name, q_len, kv_len, q_heads=2, batch=(1,))
    mask = None
    if padding:
        mask = np.zeros((1, 1, 1, kv_len), dtype=bool)
        mask[..., :10] = mask[..., -10:] = True
    options = dict(variant_options(ALL_OPTIONS, 2), window=window)
    check(q, k, v, mask, is_causal="lower_right", **options)
    check(q, k, v, mask, sinks=np.array([4.0, -1.0]))


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [
        ((3, 8), (40, 8)),  # 2-D: one head, sinks and slopes of shape (1,)
        ((40, 8), (40, 8)),
        ((4, 3, 8), (4, 40, 8)),  # 3-D: (heads, L, E)
        ((2, 1, 4, 45, 8), (3, 4, 40, 8)),  # batch (2, 1) against (3,): output batch (2, 3)
    ],
    ids=str,
)
def test_input_ranks(isa, name, rng, q_shape, kv_shape):
    dtype = np_dtype(name)
    q, k, v = (random_array(rng, shape, dtype) for shape in (q_shape, kv_shape, kv_shape))
    q_heads = q_shape[-3] if len(q_shape) > 2 else 1
    batch = (2, 3) if len(q_shape) == 5 else ()
    check(q, k, v, is_causal="lower_right", **variant_options(ALL_OPTIONS, q_heads, batch))


# --- masks -----------------------------------------------------------------------------------------

# Mask shapes broadcast against (B, Hq, L, S) = (2, 4, L, S), by letter: B, H, L, S or 1.
MASK_SHAPES = ["LS", "1S", "L1", "H1S", "B11S", "B1LS", "BHLS"]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("q_len, kv_len", [(3, 67), (40, 67), (67, 40)])
def test_masks_with_window_and_softcap(isa, name, rng, shape, kind, q_len, kv_len):
    q, k, v = inputs(rng, name, q_len, kv_len)
    sizes = dict(B=2, H=4, L=q_len, S=kv_len, **{"1": 1})
    mask = random_mask(rng, tuple(sizes[c] for c in shape), kind, q.dtype)
    check(q, k, v, mask, window=(6, 3), softcap=3.0)
    check(q, k, v, mask, is_causal="lower_right", **variant_options(ALL_OPTIONS, 4))


@pytest.mark.parametrize("kv_heads", [1, 4])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_window_over_a_long_cache(isa, rng, kv_heads, q_len):
    # A long key range split into chunks for the threads, of which only the window's are read (the
    # split starts at the earliest window): the sinks must still count once, in the first chunk.
    q, k, v = inputs(rng, "float32", q_len, 20000, q_heads=4, kv_heads=kv_heads, batch=(1,), guard=False)
    options = {"window": (1500, 0), "sinks": sinks_for(4), "softcap": 3.0}
    check(q, k, v, is_causal="lower_right", enable_gqa=True, **options)
    check(q, k, v, is_causal="lower_right", enable_gqa=True, num_threads=1, **options)


# --- softcap ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("q_len", [1, 3, 40])
def test_softcap_large_scores(isa, name, rng, softcap, q_len):
    # Query and key x30: scores ~900 times larger, far into tanh's flat part; the result stays
    # finite and within the table's tolerance (the cap bounds the softmax's arguments).
    q, k, v = inputs(rng, name, q_len, 67, guard=False)
    q, k = ((30 * f64(x)).astype(x.dtype) for x in (q, k))
    out = check(q, k, v, is_causal="lower_right", softcap=softcap)
    assert np.isfinite(f64(out)).all()
    check(q, k, v, is_causal="lower_right", softcap=softcap, window=(10, 0), alibi_slopes=slopes_for(4))


@pytest.mark.parametrize("softcap", [1e3, 1e6])
@pytest.mark.parametrize("q_len", [1, 40])
def test_softcap_far_above_the_scores(isa, name, rng, softcap, q_len):
    # A cap far above every score is the identity: the kernels' tanh keeps its error relative to
    # the score, not to the cap, so the result stays within the table's tolerance of the reference.
    q, k, v = inputs(rng, name, q_len, 67, guard=False)
    check(q, k, v, is_causal="lower_right", softcap=softcap)


# --- sinks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "empty_rows",
    ["bool_mask", "float_mask", "window_upper_left", "window_lower_right"],
)
@pytest.mark.parametrize("q_len, kv_len", [(3, 2), (40, 31)], ids=["decode", "tiles"])
def test_sinks_with_fully_masked_rows(isa, name, rng, empty_rows, q_len, kv_len):
    # Rows without an allowed key give zero output and zero weights, never NaN, with sinks too: by a
    # mask row of all False / -inf, or by a window (0, 0) whose diagonal key does not exist (L > S:
    # upper-left rows i >= S, lower-right rows i < L - S).
    q, k, v = inputs(rng, name, q_len, kv_len)
    kwargs = dict(sinks=sinks_for(4), softcap=3.0, return_weights=True)
    mask = None
    if empty_rows.endswith("mask"):
        allowed = rng.random((2, 1, q_len, kv_len)) < 0.7
        allowed[0, :, 1] = False
        allowed[1, :, -1] = False
        mask = allowed if empty_rows == "bool_mask" else np.where(allowed, 0.25, -np.inf).astype(q.dtype)
        empty = ~allowed.any(axis=-1)  # (2, 1, L)
    else:
        is_causal = empty_rows.removeprefix("window_")
        kwargs.update(is_causal=is_causal, window=(0, 0))
        empty = ~band(q_len, kv_len, is_causal, (0, 0)).any(axis=-1)  # (L,)
    out, weights = check(q, k, v, mask, **kwargs)
    empty = np.broadcast_to(empty, out.shape[:-1])
    assert empty.any() and not empty.all()
    assert np.isfinite(f64(out)).all() and np.isfinite(f64(weights)).all()
    assert (f64(out)[empty] == 0).all() and (f64(weights)[empty] == 0).all()


@pytest.mark.parametrize(
    "others", [(), ("window",), ("softcap", "alibi_slopes"), ("window", "softcap", "alibi_slopes")]
)
@pytest.mark.parametrize("q_len, kv_len", [(3, 67), (40, 67)], ids=["decode", "tiles"])
def test_neg_inf_sinks_are_no_sinks(isa, name, rng, others, q_len, kv_len):
    q, k, v = inputs(rng, name, q_len, kv_len)
    base = variant_options(others, 4)
    without = sdpa(q, k, v, is_causal="lower_right", **base)
    with_none = sdpa(q, k, v, is_causal="lower_right", sinks=np.full(4, -np.inf), **base)
    assert np.array_equal(with_none, without)
    # Heads whose sink is -inf (head 1 of sinks_for) equal the same heads without sinks.
    mixed = sdpa(q, k, v, is_causal="lower_right", sinks=sinks_for(4), **base)
    assert np.array_equal(mixed[:, 1], without[:, 1])
    assert not np.array_equal(mixed[:, 0], without[:, 0])


# --- ALiBi -----------------------------------------------------------------------------------------


def make_slopes(kind, q_heads, batch):
    return {
        "negative": -np.linspace(0.05, 0.3, q_heads),
        "zero": np.zeros(q_heads),
        "mixed": slopes_for(q_heads),
        "batched": slopes_for(q_heads, batch),
        "batched_broadcast": slopes_for(q_heads, batch[-1:]),  # (B2, Hq) against batch (B1, B2)
    }[kind]


@pytest.mark.parametrize("kind", ["negative", "zero", "mixed", "batched", "batched_broadcast"])
@pytest.mark.parametrize("q_len, kv_len", [(1, 67), (40, 67), (67, 40)])
@pytest.mark.parametrize("is_causal", ALIGNMENTS, ids=str)
def test_alibi_slopes(isa, name, rng, kind, q_len, kv_len, is_causal):
    q, k, v = inputs(rng, name, q_len, kv_len, batch=(2, 3))
    slopes = make_slopes(kind, 4, (2, 3))
    check(q, k, v, is_causal=is_causal, alibi_slopes=slopes)
    check(q, k, v, is_causal=is_causal, alibi_slopes=slopes, window=(7, 2), sinks=sinks_for(4))


# --- return_weights, out=, strided views, threads --------------------------------------------------


@pytest.mark.parametrize(
    "options", [("window",), ("softcap",), ("sinks",), ("alibi_slopes",), ALL_OPTIONS], ids=option_id
)
@pytest.mark.parametrize("q_len, kv_len", [(3, 67), (40, 67), (67, 40)])
@pytest.mark.parametrize("is_causal", ALIGNMENTS, ids=str)
def test_return_weights(isa, name, rng, options, q_len, kv_len, is_causal):
    q, k, v = inputs(rng, name, q_len, kv_len, value_dim=11)
    _, weights = check(q, k, v, is_causal=is_causal, return_weights=True, **variant_options(options, 4))
    assert weights.shape == (2, 4, q_len, kv_len)


@pytest.mark.parametrize("q_len", [3, 40], ids=["decode", "tiles"])
def test_out(isa, name, rng, q_len):
    q, k, v = inputs(rng, name, q_len, 67, value_dim=9)
    options = variant_options(ALL_OPTIONS, 4)
    out = np.full((2, 4, q_len, 9), np.nan, dtype=q.dtype)
    got = check(q, k, v, is_causal="lower_right", out=out, **options)
    assert got is out
    assert np.array_equal(out, sdpa(q, k, v, is_causal="lower_right", **options))


@pytest.mark.parametrize("layout", ["bshd", "sequence_step", "feature_step", "broadcast_kv_batch"])
@pytest.mark.parametrize("q_len, kv_len", [(3, 67), (40, 67)], ids=["decode", "tiles"])
def test_strided_views(isa, name, rng, layout, q_len, kv_len):
    if layout == "bshd":  # (B, L, H, E) arrays seen as (B, H, L, E)
        q, k, v = inputs(rng, name, q_len, kv_len, layout="bshd")
    elif layout == "sequence_step":  # every other row of longer arrays
        q, k, v = (x[..., ::2, :] for x in inputs(rng, name, 2 * q_len, 2 * kv_len))
    elif layout == "feature_step":  # last axis not contiguous (pyattn copies it)
        q, k, v = (x[..., ::2] for x in inputs(rng, name, q_len, kv_len, head_dim=32))
    else:  # K/V of batch 1 broadcast against the queries' batch 2: stride 0
        q = inputs(rng, name, q_len, kv_len)[0]
        _, k, v = inputs(rng, name, q_len, kv_len, batch=(1,))
    assert not all(x.flags.c_contiguous for x in (q, k, v))
    check(q, k, v, is_causal="lower_right", **variant_options(ALL_OPTIONS, 4, batch=(2,)))


@pytest.mark.parametrize(
    "q_len, kv_len, window",
    [
        (1, 3001, (None, 3)),  # decode with its key range split into chunks
        (1, 3001, (700, 0)),
        (3, 1030, (100, 2)),
        (130, 300, (20, 5)),  # query tiles
        (300, 300, (None, None)),
    ],
)
def test_threads_bitwise(isa, name, rng, q_len, kv_len, window):
    q, k, v = inputs(rng, name, q_len, kv_len, q_heads=2, batch=(1,))
    options = dict(variant_options(ALL_OPTIONS, 2), window=window, is_causal="lower_right")
    assert np.array_equal(sdpa(q, k, v, num_threads=1, **options), sdpa(q, k, v, num_threads=2, **options))


@pytest.mark.parametrize("cache_name", DTYPE_NAMES)
def test_cache_threads_bitwise(isa, rng, cache_name):
    storage = np_dtype(cache_name)
    compute = np.dtype(np.float64) if cache_name == "float64" else np.dtype(np.float32)
    cache = pyattn.KVCache(2, 2, 16, 1100, dtype=storage)
    cache.append(random_array(rng, (2, 2, 1030, 16), storage), random_array(rng, (2, 2, 1030, 16), storage))
    options = dict(window=(300, None), softcap=3.0, sinks=sinks_for(4), alibi_slopes=slopes_for(4, (2,)))
    q = random_array(rng, (2, 4, 1030, 16), compute)
    assert np.array_equal(cache.attend(q, num_threads=1, **options), cache.attend(q, num_threads=2, **options))
    cache.append(random_array(rng, (2, 2, 1, 16), storage), random_array(rng, (2, 2, 1, 16), storage))
    q = random_array(rng, (2, 4, 1, 16), compute)
    assert np.array_equal(cache.attend(q, num_threads=1, **options), cache.attend(q, num_threads=2, **options))


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("chunk, counts", [(1, [1, 1, 1]), (3, [3, 1, 0]), (12, [12, 5, 9])])
@pytest.mark.parametrize("cache_name", DTYPE_NAMES)
def test_cache_ragged_rows(isa, rng, cache_name, chunk, counts, left_padded):
    # Rows of different lengths (20, 3, 41 cached, then `counts` new tokens in a padded chunk): each
    # query's window and ALiBi distance count from its own row's position; per-row (batch, Hq) slopes.
    storage = np_dtype(cache_name)
    compute = np.dtype(np.float64) if cache_name == "float64" else np.dtype(np.float32)
    before = np.array([20, 3, 41])
    k = rng.standard_normal((3, 2, 60, 8)).astype(storage)
    v = rng.standard_normal((3, 2, 60, 8)).astype(storage)
    cache = pyattn.KVCache(3, 2, 8, 60, dtype=storage)
    cache.append(k[:, :, :41], v[:, :, :41], num_new=before)
    new_k, new_v = (np.full((3, 2, chunk, 8), np.nan, storage) for _ in range(2))
    rows = [slice(chunk - n, chunk) if left_padded else slice(0, n) for n in counts]
    for b, n in enumerate(counts):
        new_k[b, :, rows[b]] = k[b, :, before[b] : before[b] + n]
        new_v[b, :, rows[b]] = v[b, :, before[b] : before[b] + n]
    cache.append(new_k, new_v, num_new=np.array(counts), left_padded=left_padded)
    q = random_array(rng, (3, 4, chunk, 8), compute)
    options = dict(window=(6, None), softcap=2.5, sinks=sinks_for(4), alibi_slopes=slopes_for(4, (3,)))
    got = cache.attend(q, **options)
    for b, n in enumerate(counts):
        if n:
            length = before[b] + n
            want = reference.scaled_dot_product_attention(
                q[b, :, rows[b]],
                k[b, :, :length],
                v[b, :, :length],
                is_causal="lower_right",
                enable_gqa=True,
                **dict(options, alibi_slopes=options["alibi_slopes"][b]),
            )
            assert_matches(got[b, :, rows[b]], want, compute)


# --- NaN outside the window ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_len, kv_len, is_causal, window",
    [
        (1, 130, "lower_right", (4, 0)),  # decode: only the last 5 keys
        (3, 130, "lower_right", (4, None)),
        (3, 130, False, (None, 2)),  # decode: only the first 5 keys
        (40, 300, "lower_right", (5, 0)),  # tiles: the last 45 keys
        (40, 300, False, (3, 7)),  # tiles: the first 47 keys
        (130, 300, "upper_left", (2, 0)),
        (40, 300, False, (0, 0)),
    ],
)
@pytest.mark.parametrize("options", [("window",), ALL_OPTIONS], ids=option_id)
def test_nan_outside_window_does_not_leak(isa, name, rng, q_len, kv_len, is_causal, window, options):
    q, k, v = inputs(rng, name, q_len, kv_len, value_dim=12)
    kwargs = dict(variant_options(options, 4), is_causal=is_causal, window=window)
    want = reference.scaled_dot_product_attention(q, k, v, **kwargs)
    never = ~band(q_len, kv_len, is_causal, window).any(axis=0)  # keys no query's window reaches
    assert never.sum() > kv_len // 2
    k, v = k.copy(), v.copy()
    k[..., never, :] = np.nan
    v[..., never, :] = np.nan
    v[..., never, 0] = np.inf
    got = sdpa(q, k, v, **kwargs)
    assert np.isfinite(f64(got)).all()
    assert_matches(got, want, q.dtype)


# --- properties --------------------------------------------------------------------------------------

sides = st.one_of(st.none(), st.integers(0, 12))


@st.composite
def small_problems(draw):
    """Small sizes on both kernel paths, any causal alignment, and a subset of the other options."""
    return dict(
        q_len=draw(st.sampled_from([1, 2, 3, DECODE_MAX, DECODE_MAX + 1, 17, 40])),
        kv_len=draw(st.integers(1, 60)),
        q_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 4, 9, 16])),
        is_causal=draw(st.sampled_from(CAUSAL)),
        others=draw(st.lists(st.sampled_from(["softcap", "sinks", "alibi_slopes"]), unique=True)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def problem_inputs(name, p):
    rng = np.random.default_rng(p["seed"])
    q, k, v = inputs(rng, name, p["q_len"], p["kv_len"], head_dim=p["head_dim"], q_heads=p["q_heads"])
    return q, k, v, dict(variant_options(p["others"], p["q_heads"]), is_causal=p["is_causal"])


@PROPERTY
@given(p=small_problems(), extra=st.integers(0, 5), which=st.sampled_from(["both", "left", "right"]))
def test_window_covering_everything_is_no_window_property(isa, name, p, extra, which):
    q, k, v, kwargs = problem_inputs(name, p)
    wide = p["q_len"] + p["kv_len"] + extra
    window = {"both": (wide, wide), "left": (wide, None), "right": (None, wide)}[which]
    assert np.array_equal(sdpa(q, k, v, window=window, **kwargs), sdpa(q, k, v, **kwargs))


@PROPERTY
@given(p=small_problems(), window=st.one_of(st.none(), st.tuples(sides, sides)))
def test_neg_inf_sinks_are_no_sinks_property(isa, name, p, window):
    q, k, v, kwargs = problem_inputs(name, p)
    kwargs.pop("sinks", None)
    without = sdpa(q, k, v, window=window, **kwargs)
    assert np.array_equal(sdpa(q, k, v, window=window, sinks=np.full(p["q_heads"], -np.inf), **kwargs), without)


@st.composite
def decode_runs(draw):
    """A cache filled by one prefill chunk (possibly empty or past DECODE_MAX), then token by token,
    attending with a subset of the options after every append."""
    total = draw(st.integers(1, 24))
    return dict(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([1, 7, 16, 33])),
        total=total,
        prefill=draw(st.integers(0, total - 1)),
        window=draw(st.one_of(st.none(), st.tuples(sides, sides))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 10.0))),
        sinks=draw(st.booleans()),
        alibi=draw(st.sampled_from([None, "per_head", "per_row"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.fixture(params=["float32", "bfloat16"])
def cache_dtype(request):
    return np_dtype(request.param)


@PROPERTY
@given(run=decode_runs())
def test_decode_token_by_token_equals_causal_pass_property(isa, cache_dtype, run):
    rng = np.random.default_rng(run["seed"])
    batch, hk, e, total = run["batch"], run["kv_heads"], run["head_dim"], run["total"]
    hq = hk * run["group"]
    options = dict(window=run["window"], softcap=run["softcap"])
    if run["sinks"]:
        options["sinks"] = sinks_for(hq)
    if run["alibi"]:
        options["alibi_slopes"] = slopes_for(hq, (batch,) if run["alibi"] == "per_row" else ())
    q = rng.standard_normal((batch, hq, total, e), dtype=np.float32)
    k = rng.standard_normal((batch, hk, total, e), dtype=np.float32)
    v = rng.standard_normal((batch, hk, total, e), dtype=np.float32)

    cache = pyattn.KVCache(batch, hk, e, total, dtype=cache_dtype)
    chunks = ([slice(0, run["prefill"])] if run["prefill"] else []) + [
        slice(t, t + 1) for t in range(run["prefill"], total)
    ]
    outs = []
    for rows in chunks:
        cache.append(k[:, :, rows], v[:, :, rows])
        outs.append(cache.attend(q[:, :, rows], **options))
    got = np.concatenate(outs, axis=2)

    # The full pass over the K/V the cache stores (rounded to its dtype), in float32.
    k_stored, v_stored = (x.astype(cache_dtype).astype(np.float32) for x in (k, v))
    full = sdpa(q, k_stored, v_stored, is_causal=True, enable_gqa=True, **options)
    want = reference.scaled_dot_product_attention(q, k_stored, v_stored, is_causal=True, enable_gqa=True, **options)
    assert_matches(got, want, np.float32)
    rtol, atol = tol(np.float32)
    np.testing.assert_allclose(got, full, rtol=rtol, atol=atol)


# --- validation --------------------------------------------------------------------------------------

INVALID = [
    (dict(window=(-1, 2)), ValueError, "window"),
    (dict(window=(1, -1)), ValueError, "window"),
    (dict(window=(1.5, 2)), TypeError, "window"),
    (dict(window=(1, "2")), TypeError, "window"),
    (dict(window=(True, 2)), TypeError, "window"),
    (dict(window=3), TypeError, "window"),
    (dict(window=(1, 2, 3)), TypeError, "window"),
    (dict(window=(1,)), TypeError, "window"),
    (dict(window="ab"), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=np.nan), ValueError, "softcap"),
    (dict(softcap=np.inf), ValueError, "softcap"),
    (dict(softcap="3"), TypeError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(sinks=np.zeros((2, 4))), ValueError, "sinks"),
    # The documented shapes are (Hq,) and (..., Hq): a scalar or a one-element list for 4 heads is
    # refused like a 0-d array (as the reference refuses them).
    (dict(sinks=np.array(0.5)), ValueError, "sinks"),
    (dict(sinks=[0.5]), ValueError, "sinks"),
    (dict(sinks=0.5), ValueError, "sinks"),
    (dict(sinks=[0.0, np.nan, 0.0, 0.0]), ValueError, "sinks"),
    (dict(sinks=[0.0, np.inf, 0.0, 0.0]), ValueError, "sinks"),
    (dict(alibi_slopes=np.zeros(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.zeros((3, 4))), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.1]), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=0.1), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.0, np.nan, 0.0, 0.0]), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.0, np.inf, 0.0, 0.0]), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=[0.0, -np.inf, 0.0, 0.0]), ValueError, "alibi_slopes"),
]


def invalid_id(case):
    ((key, value),) = case[0].items()
    return f"{key}={value!r}"


@pytest.mark.parametrize("kwargs, error, match", INVALID, ids=[invalid_id(c) for c in INVALID])
def test_invalid_options(rng, kwargs, error, match):
    q, k, v = inputs(rng, "float32", 3, 9)  # batch (2,), 4 heads
    with pytest.raises(error, match=match):
        sdpa(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", INVALID, ids=[invalid_id(c) for c in INVALID])
def test_invalid_cache_options(rng, kwargs, error, match):
    cache = pyattn.KVCache(2, 2, 8, 16)
    cache.append(random_array(rng, (2, 2, 5, 8), np.float32), random_array(rng, (2, 2, 5, 8), np.float32))
    q = random_array(rng, (2, 4, 5, 8), np.float32)
    with pytest.raises(error, match=match):
        cache.attend(q, **kwargs)
