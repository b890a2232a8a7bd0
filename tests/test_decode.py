# SPDX-License-Identifier: MIT
"""Incremental decoding (issue 5): pyattn.KVCache, MultiHeadAttention(kv_cache=...), the decode path
(few query rows against a long key range, split into chunks and merged) and float16/bfloat16 inputs.

What is held against what:

* decoding token by token, or prefilling in chunks (1, 3, DECODE_MAX, DECODE_MAX + 1, 17 tokens:
  both sides of the decode kernel's q_len <= DECODE_MAX limit, 8), equals one full causal forward of
  the same layer, for every ISA, float32 and float64 layers, multi-head, grouped-query and multi-query attention;
* 16-bit caches (float16, bfloat16) against a float64 computation from the K/V values the cache
  actually stores (already rounded), so the only error left is float32 arithmetic;
* ragged batches (num_new, right or left padding) against each row computed alone, with NaN in the
  padding tokens and NaN garbage in the cache storage past each row's length;
* 16-bit scaled_dot_product_attention and caches, on the decode path (q_len <= DECODE_MAX) and on
  the query tiles (longer queries: every tile width, key blocks converted from 16 bits one at a time)
  against the float64 reference of the rounded inputs;
* a hypothesis property: any cache (dtype, GQA group, head_dim, cached and new tokens) against the
  float64 reference;
* the decode path's key-range split (kv_len 3000) with NaN in forbidden K/V rows, and bitwise
  thread-count determinism (the split depends on the shape only, never on the thread count).

Tolerances: conftest.TOL, the one table (16-bit results and 16-bit storage included).
"""

import copy
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference
from pyattn._tuning import PROFILES, override

from conftest import (
    TOL,
    assert_close,
    f64,
    make_qkv,
    nan_guarded,
    np_dtype,
    random_array,
    random_mask,
    tol,
)

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is optional; bfloat16 cases are then skipped
    ml_dtypes = None

sdpa = pyattn.scaled_dot_product_attention

# Results returned in a 16-bit dtype (scaled_dot_product_attention with float16 or bfloat16 inputs)
# are held to conftest.TOL's entry for that dtype against the float64 reference of the same, already
# rounded, inputs. Results of a 16-bit *cache* (KVCache.attend, mha with kv_cache) are float32
# computed from the stored K/V, so they are held to TOL[np.float32] against a reference built from
# those stored values.

HALF_NAMES = ["float16", "bfloat16"]
# Longest query (rows per head) that the driver gives the decode kernel (kDecodeMaxLen).
DECODE_MAX = pyattn._core.DECODE_MAX_Q_LEN
CACHE_DTYPES = ["float32", "float64", "float16", "bfloat16"]


def compute_dtype(name):
    """The dtype a cache of storage `name` computes in (and its layer must have)."""
    return np.dtype(np.float32) if name in HALF_NAMES else np.dtype(name)


def group_tiles(on):
    """How the query tiles take GQA groups: 1 as the planner decides (a group's heads together,
    KernelSet::attend_group), 0 head by head."""
    return override(group_heads=None if on else 1)


def assert_half_close(actual, expected, name):
    """A 16-bit result against the float64 reference, with the table's tolerance for its dtype."""
    assert actual.dtype == np_dtype(name)
    rtol, atol = tol(name)
    np.testing.assert_allclose(f64(actual), expected, rtol=rtol, atol=atol)


def assert_result_close(actual, expected, name):
    """scaled_dot_product_attention's result for inputs of dtype `name` against the float64
    reference, with conftest's tolerance for the result's dtype."""
    if name in HALF_NAMES:
        assert_half_close(actual, expected, name)
    else:
        assert_close(actual, expected, np_dtype(name).type)


def assert_compute_close(actual, expected, compute):
    """Result of a cache of any storage (computed in `compute`) against a float64 reference."""
    assert actual.dtype == compute
    rtol, atol = TOL[compute.type]
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# --- layers and float64 references ---------------------------------------------------------------


def make_layer(rng, embed_dim, num_heads, num_kv_heads, dtype):
    """A MultiHeadAttention with random weights and non-zero biases."""
    layer = pyattn.MultiHeadAttention(
        embed_dim, num_heads, num_kv_heads=num_kv_heads, dtype=dtype, seed=int(rng.integers(1 << 30))
    )
    state = layer.state_dict()
    state["in_proj_bias"] = (0.5 * rng.standard_normal(state["in_proj_bias"].shape)).astype(dtype)
    state["out_proj.bias"] = (0.5 * rng.standard_normal(state["out_proj.bias"].shape)).astype(dtype)
    layer.load_state_dict(state)
    return layer


def reference_layer(layer, x, **kwargs):
    """pyattn.reference.mha with `layer`'s weights (float64)."""
    state = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    return reference.mha(x, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, **state, **kwargs)


def reference_layer_from_kv(layer, x, keys, values):
    """float64 output of `layer` on x (B, L, E) attending causally to the given K/V (B, Hk, L, D):
    the layer's own Q and output projections around reference attention over those K/V values."""
    state = layer.state_dict()
    e, h = layer.embed_dim, layer.num_heads
    batch, length = x.shape[:2]
    wq, bq = f64(state["in_proj_weight"][:e]), f64(state["in_proj_bias"][:e])
    q = (f64(x) @ wq.T + bq).reshape(batch, length, h, e // h).transpose(0, 2, 1, 3)
    context = reference.scaled_dot_product_attention(q, f64(keys), f64(values), is_causal=True, enable_gqa=True)
    context = context.transpose(0, 2, 1, 3).reshape(batch, length, e)
    return context @ f64(state["out_proj.weight"]).T + f64(state["out_proj.bias"])


def run_chunks(layer, x, cache, sizes, **kwargs):
    """Feed x (B, L, E) through layer with kv_cache in chunks of `sizes` (cycled); concatenated outputs."""
    outs, t, n = [], 0, 0
    while t < x.shape[1]:
        size = sizes[n % len(sizes)]
        outs.append(layer(x[:, t : t + size], kv_cache=cache, **kwargs))
        t, n = t + size, n + 1
    return np.concatenate(outs, axis=1)


# --- decoding through the layer == one causal forward ---------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_token_by_token_equals_causal_forward(isa, dtype, rng, num_kv_heads):
    layer = make_layer(rng, 64, 8, num_kv_heads, dtype)
    x = random_array(rng, (2, 21, 64), dtype)
    cache = pyattn.KVCache(2, num_kv_heads, 8, 32, dtype=dtype)
    got = run_chunks(layer, x, cache, [1])
    assert got.shape == x.shape
    assert cache.lengths.tolist() == [21, 21]
    assert_close(got, layer(x, is_causal=True), dtype)
    assert_close(got, reference_layer(layer, x, is_causal=True), dtype)


@pytest.mark.parametrize(
    "sizes",
    [[1], [3], [DECODE_MAX], [DECODE_MAX + 1], [17], [17, 1, DECODE_MAX + 1, 3, DECODE_MAX, 1]],
    ids=["1", "3", "decode_max", "decode_max+1", "17", "mixed"],
)
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa2", "mqa"])
def test_chunked_prefill_equals_causal_forward(isa, dtype, rng, sizes, num_kv_heads):
    """Chunks of <= DECODE_MAX tokens go through the decode kernel, longer ones through the tiled kernel with
    per-row causal offsets; any mix equals one causal pass (max_len = 40: filled exactly)."""
    layer = make_layer(rng, 96, 8, num_kv_heads, dtype)
    x = random_array(rng, (2, 40, 96), dtype)
    cache = pyattn.KVCache(2, num_kv_heads, 12, 40, dtype=dtype)
    got = run_chunks(layer, x, cache, sizes)
    assert cache.lengths.tolist() == [40, 40]
    assert_close(got, layer(x, is_causal=True), dtype)


def test_unbatched_and_functional_forms(rng, dtype):
    """Unbatched x (chunk, E) with a batch-1 cache, and pyattn.mha(..., kv_cache=) with the same weights."""
    layer = make_layer(rng, 32, 4, 2, dtype)
    x = random_array(rng, (9, 32), dtype)
    cache = pyattn.KVCache(1, 2, 8, 16, dtype=dtype)
    got = np.concatenate([layer(x[:5], kv_cache=cache), layer(x[5:6], kv_cache=cache), layer(x[6:], kv_cache=cache)])
    assert got.shape == x.shape
    assert_close(got, layer(x, is_causal=True), dtype)

    state = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    cache_f = pyattn.KVCache(1, 2, 8, 16, dtype=dtype)
    for t in range(9):
        out = pyattn.mha(x[None, t : t + 1], num_heads=4, num_kv_heads=2, kv_cache=cache_f, **state)
        np.testing.assert_allclose(out[0], got[t : t + 1], rtol=TOL[dtype][0], atol=TOL[dtype][1])
    np.testing.assert_array_equal(cache_f.keys(0), cache.keys(0))


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_cache_layer_matches_reference_of_stored_kv(isa, rng, name, num_kv_heads):
    """float16/bfloat16 caches: prefill (converted path), a 3-token chunk and single tokens (direct
    path) against float64 attention over the cache's own stored (rounded) K/V."""
    storage = np_dtype(name)
    layer = make_layer(rng, 64, 8, num_kv_heads, np.float32)
    x = random_array(rng, (2, 30, 64), np.float32)
    cache = pyattn.KVCache(2, num_kv_heads, 8, 30, dtype=name)
    assert cache.dtype == storage
    got = run_chunks(layer, x, cache, [9, 3, 1])
    assert got.dtype == np.float32
    keys, values = cache.keys(), cache.values()
    assert keys.dtype == storage and keys.shape == (2, num_kv_heads, 30, 8)
    assert_compute_close(got, reference_layer_from_kv(layer, x, keys, values), np.dtype(np.float32))
    # The stored keys are the layer's K projection rounded to the storage dtype.
    state = layer.state_dict()
    e, kv = 64, num_kv_heads * 8
    k_proj = f64(x) @ f64(state["in_proj_weight"][e : e + kv]).T + f64(state["in_proj_bias"][e : e + kv])
    k_proj = k_proj.reshape(2, 30, num_kv_heads, 8).transpose(0, 2, 1, 3)
    rtol, atol = tol(f"stored {name}")
    np.testing.assert_allclose(f64(keys), k_proj, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", HALF_NAMES)
@pytest.mark.parametrize("chunk", [1, 4, DECODE_MAX, DECODE_MAX + 1, 17, 40])
def test_half_cache_attend_equals_float32_cache_of_same_values(isa, rng, name, chunk):
    """A 16-bit cache and a float32 cache holding the same (rounded) values give the same attention."""
    storage = np_dtype(name)
    kv_len, hk, h, d = 70, 2, 6, 20
    k = rng.standard_normal((1, hk, kv_len, d)).astype(storage)
    v = rng.standard_normal((1, hk, kv_len, d)).astype(storage)
    half = pyattn.KVCache(1, hk, d, 80, dtype=name)
    full = pyattn.KVCache(1, hk, d, 80, dtype=np.float32)
    for cache in (half, full):
        cache.append(k[:, :, : kv_len - chunk], v[:, :, : kv_len - chunk])
        cache.append(k[:, :, kv_len - chunk :].astype(np.float32), v[:, :, kv_len - chunk :].astype(np.float32))
    np.testing.assert_array_equal(f64(half.keys()), f64(full.keys()))
    q = random_array(rng, (1, h, chunk, d), np.float32)
    got, expected = half.attend(q), full.attend(q)
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=TOL[np.float32][0], atol=TOL[np.float32][1])
    ref = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), is_causal="lower_right", enable_gqa=True)
    assert_compute_close(got, ref, np.dtype(np.float32))


@st.composite
def decode_steps(draw):
    """A random cache and decode step: storage dtype, batch, KV heads, GQA group, head_dim and
    value_dim (whole vectors or not, odd and even vector counts), tokens already cached (none, a
    partial key block, several blocks) and new tokens (one, a few, past the decode kernel's limit)."""
    return dict(
        name=draw(st.sampled_from(CACHE_DTYPES)),
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 5)),
        head_dim=draw(st.sampled_from([1, 5, 8, 16, 24, 40, 48, 64, 100, 128])),
        value_dim=draw(st.sampled_from([None, 3, 8, 24, 48])),
        cached=draw(st.integers(0, 300)),
        new=draw(st.integers(1, DECODE_MAX + 2)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=decode_steps())
def test_decode_step_matches_reference_property(isa, step):
    """Any cache, any step: KVCache.attend against the float64 reference over the stored K/V, with the
    lower-right causal alignment (the new tokens are the cache's last)."""
    name, batch, hk = step["name"], step["batch"], step["kv_heads"]
    d = step["head_dim"]
    dv = d if step["value_dim"] is None else step["value_dim"]
    storage, compute = np_dtype(name), compute_dtype(name)
    rng = np.random.default_rng(step["seed"])
    total = step["cached"] + step["new"]
    cache = pyattn.KVCache(batch, hk, d, total, value_dim=dv, dtype=name)
    k = rng.standard_normal((batch, hk, total, d)).astype(storage)
    v = rng.standard_normal((batch, hk, total, dv)).astype(storage)
    if step["cached"]:
        cache.append(k[:, :, : step["cached"]], v[:, :, : step["cached"]])
    cache.append(k[:, :, step["cached"] :], v[:, :, step["cached"] :])
    q = random_array(rng, (batch, hk * step["group"], step["new"], d), compute)
    got = cache.attend(q)
    expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), is_causal="lower_right", enable_gqa=True)
    assert_compute_close(got, expected, compute)


# --- ragged batches --------------------------------------------------------------------------------


def padded_chunk(rng, counts, chunk, embed_dim, dtype, left):
    """x (B, chunk, E): real tokens where num_new says (first or last counts[b]), NaN in the padding."""
    x = np.full((len(counts), chunk, embed_dim), np.nan, dtype)
    for b, n in enumerate(counts):
        sl = slice(chunk - n, chunk) if left else slice(0, n)
        x[b, sl] = rng.standard_normal((n, embed_dim))
    return x


def real_rows(b, n, chunk, left):
    return slice(chunk - n, chunk) if left else slice(0, n)


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_ragged_batch_equals_rows_alone(isa, rng, name, left_padded):
    """Prompts of different lengths in one padded chunk, then decode steps and another ragged chunk:
    each row's real outputs equal that row decoded alone (its own batch-1 cache)."""
    np_dtype(name)
    compute = compute_dtype(name)
    layer = make_layer(rng, 32, 4, 2, compute)
    steps = [  # (chunk, num_new per row) or (1, None)
        (DECODE_MAX + 2, [DECODE_MAX + 2, 1, 3, 0]),  # tile path (16-bit blocks converted by the tiles)
        (1, None),
        (3, [3, 0, 2, 1]),  # chunk <= DECODE_MAX: decode path (direct 16-bit read)
        (1, None),
        (1, None),
        (5, [0, 5, 4, 2]),
    ]
    batch = 4
    cache = pyattn.KVCache(batch, 2, 8, 24, dtype=name)
    alone = [pyattn.KVCache(1, 2, 8, 24, dtype=name) for _ in range(batch)]
    lengths = np.zeros(batch, np.int64)
    for chunk, counts in steps:
        counts_arr = [chunk] * batch if counts is None else counts
        x = padded_chunk(rng, counts_arr, chunk, 32, compute, left_padded)
        num_new = None if counts is None else np.array(counts)
        out = layer(x, kv_cache=cache, num_new=num_new, left_padded=left_padded)
        lengths += counts_arr
        assert cache.lengths.dtype == np.int64
        assert cache.lengths.tolist() == lengths.tolist()
        for b, n in enumerate(counts_arr):
            if n == 0:
                continue
            rows = real_rows(b, n, chunk, left_padded)
            expected = layer(x[b : b + 1, rows], kv_cache=alone[b])
            assert np.isfinite(out[b, rows]).all()
            rtol, atol = TOL[compute.type]
            np.testing.assert_allclose(out[b : b + 1, rows], expected, rtol=rtol, atol=atol)
    for b in range(batch):
        assert cache.keys(b).shape == (2, lengths[b], 8)
        np.testing.assert_array_equal(f64(cache.keys(b)), f64(alone[b].keys(0)))
        np.testing.assert_array_equal(f64(cache.values(b)), f64(alone[b].values(0)))


def step_through_cache_methods(layer, x, cache, num_new, left_padded):
    """The layer's step over a cache spelled out with the public cache methods: the layer's own
    projections (its packed GEMM), KVCache.append, KVCache.attend, the output projection."""
    w = layer._weights
    batch, chunk = x.shape[:2]
    rows = x.reshape(batch * chunk, x.shape[2])
    heads = lambda y, n: y.reshape(batch, chunk, n, w.head_dim).transpose(0, 2, 1, 3)  # noqa: E731
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
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_layer_step_equals_cache_methods_bitwise(isa, rng, name, left_padded):
    """MultiHeadAttention(kv_cache=) does its step in one call into the core (projections, the new
    K/V into the cache, attention over it, output projection): the same output, stored K/V and cache
    state as the step spelled out with append and attend, bit for bit, through ragged chunks (padding
    tokens NaN), decode steps, a chunk longer than the decode kernel's limit and an empty chunk."""
    np_dtype(name)
    compute = compute_dtype(name)
    layer = make_layer(rng, 48, 6, 2, compute)
    batch = 3
    fused, spelled = (pyattn.KVCache(batch, 2, 8, 64, dtype=name) for _ in range(2))
    steps = [(5, [5, 2, 0]), (1, None), (3, [1, 3, 2]), (1, None), (DECODE_MAX + 3, None), (0, None), (1, None)]
    for chunk, counts in steps:
        counts_arr = [chunk] * batch if counts is None else counts
        x = padded_chunk(rng, counts_arr, chunk, 48, compute, left_padded)
        num_new = None if counts is None else np.array(counts)
        got = layer(x, kv_cache=fused, num_new=num_new, left_padded=left_padded)
        expected = step_through_cache_methods(layer, x, spelled, num_new, left_padded)
        assert got.dtype == compute and got.shape == (batch, chunk, 48)
        np.testing.assert_array_equal(got, expected)  # NaN (padding query rows) where it is NaN
        assert fused.lengths.tolist() == spelled.lengths.tolist()
        assert fused._last_new.tolist() == spelled._last_new.tolist() and fused._last_chunk == spelled._last_chunk
        for a, b in ((fused._k, spelled._k), (fused._v, spelled._v)):  # every stored bit, unused rows too
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_layer_step_binding_checks(rng):
    """_core.mha_cached re-checks what the cache passes before the GIL is released: cache shapes and
    dtypes, the lengths (before <= after <= max_len, after - before <= chunk), the storage code."""
    layer = make_layer(rng, 16, 2, 2, np.float32)
    w = layer._weights
    packed, _ = w.packed()
    weights = (*packed, w.bq, w.bk, w.bv, w.bo)
    cache = pyattn.KVCache(1, 2, 8, 4)
    x = random_array(rng, (1, 16), np.float32)
    out = np.empty((1, 16), np.float32)
    dims = [1, 1, 16, 2, 2, 8]

    def call(k=cache._k_core, v=cache._v_core, storage=0, before=(0,), after=(1,), dims=dims, x=x):
        pyattn._core.mha_cached(
            x, weights, dims, k, v, storage, np.array(before, np.int64), np.array(after, np.int64), False, out, 1
        )

    call()  # valid
    for bad, match in [
        (dict(after=(5,)), "lengths"),
        (dict(before=(2,), after=(1,)), "lengths"),
        (dict(before=(0,), after=(2,)), "lengths"),  # two tokens from a chunk of one
        (dict(before=(-1,), after=(0,)), "lengths"),
        (dict(k=cache._k_core[:, :1]), "k_cache: expected shape"),
        (dict(v=cache._v_core.astype(np.float64)), "v_cache: dtype"),
        (dict(k=np.zeros((1, 2, 5, 8), np.float32)), "same shape"),
        (dict(storage=1), "v_cache|k_cache"),  # float32 arrays passed as 16-bit storage
        (dict(storage=3), "storage"),
        (dict(dims=[1, 1, 16, 2, 2, 7]), "head_dim"),
        (dict(x=x.astype(np.float64), storage=1), "float32"),
        (dict(x=x.astype(np.float64)), "q_proj_weight"),  # float32 weights for a float64 step
    ]:
        with pytest.raises(ValueError, match=match):
            call(**bad)
    readonly = cache._k_core.view()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        call(k=readonly)
    assert not np.isnan(out).any()


@pytest.mark.parametrize("left_padded", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("chunk", [1, 4, 5, DECODE_MAX + 4])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_long_ragged_cache_attend(isa, rng, name, chunk, left_padded):
    """KVCache.attend with rows of very different lengths (the longest split into key chunks), a ragged
    last chunk (NaN in its padding tokens), value_dim != head_dim, GQA, a custom scale, and NaN garbage
    in the storage past each row's length: each row's real queries against the reference."""
    storage, compute = np_dtype(name), compute_dtype(name)
    batch, hk, h, d, dv = 3, 2, 4, 40, 24
    before = np.array([2995, 100, 7])  # lengths before the last chunk
    num_new = np.array([chunk, max(chunk - 1, 1), chunk // 2])
    total = before + num_new
    cache = pyattn.KVCache(batch, hk, d, 3010, value_dim=dv, dtype=name)
    k_all = rng.standard_normal((batch, hk, int(total.max()), d)).astype(storage)
    v_all = rng.standard_normal((batch, hk, int(total.max()), dv)).astype(storage)
    cache.append(k_all[:, :, : int(before.max())], v_all[:, :, : int(before.max())], num_new=before)
    # NaN written past every row's end, then trimmed away: the storage keeps the NaNs.
    cache.append(np.full((batch, hk, 4, d), np.nan), np.full((batch, hk, 4, dv), np.nan))
    cache.trim(4)
    assert cache.lengths.tolist() == before.tolist()
    new_k = np.full((batch, hk, chunk, d), np.nan, storage)
    new_v = np.full((batch, hk, chunk, dv), np.nan, storage)
    for b in range(batch):
        rows = real_rows(b, num_new[b], chunk, left_padded)
        new_k[b, :, rows] = k_all[b, :, before[b] : total[b]]
        new_v[b, :, rows] = v_all[b, :, before[b] : total[b]]
    cache.append(new_k, new_v, num_new=num_new, left_padded=left_padded)
    assert cache.lengths.tolist() == total.tolist()
    q = nan_guarded(np.full((batch, h, chunk, d), np.nan, compute))
    for b in range(batch):
        rows = real_rows(b, num_new[b], chunk, left_padded)
        q[b, :, rows] = rng.standard_normal((h, num_new[b], d))
    got = cache.attend(q, scale=0.3)
    assert got.shape == (batch, h, chunk, dv) and got.dtype == compute
    for b in range(batch):
        if num_new[b] == 0:
            continue
        rows = real_rows(b, num_new[b], chunk, left_padded)
        k_b, v_b = k_all[b, :, : total[b]], v_all[b, :, : total[b]]
        np.testing.assert_array_equal(f64(cache.keys(b)), f64(k_b))
        np.testing.assert_array_equal(f64(cache.values(b)), f64(v_b))
        ref = reference.scaled_dot_product_attention(
            f64(q[b, :, rows]), f64(k_b), f64(v_b), is_causal="lower_right", enable_gqa=True, scale=0.3
        )
        assert_compute_close(got[b, :, rows], ref, compute)


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_many_query_rows_per_kv_head(isa, rng, name):
    """Large GQA groups (multi-query with 17 and 24 heads): a kv head's group * q_len query rows are
    split into several row chunks of the decode kernel, not aligned to heads."""
    dtype = np_dtype(name)
    for heads, q_len in ((24, 1), (24, 3), (17, 4)):
        q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=heads, kv_heads=1, q_len=q_len, kv_len=600, head_dim=24)
        mask = rng.random((2, heads, q_len, 600)) < 0.7
        got = sdpa(q, k, v, mask, is_causal="lower_right", enable_gqa=True)
        expected = reference.scaled_dot_product_attention(
            f64(q), f64(k), f64(v), mask, is_causal="lower_right", enable_gqa=True
        )
        assert_result_close(got, expected, name)


@pytest.mark.parametrize("head_dim", [13, 16, 24, 32, 40, 48, 60, 64, 100, 128])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_group_sizes_and_head_dims(isa, rng, name, head_dim):
    """Every register tiling of the decode kernel: rows of 4 or 8 vectors keep q in registers (as
    many rows at a time as fit), other sizes load it; groups of 1-8 rows per key/value head, odd
    ones leaving a remainder after each tile; 205 keys give whole key blocks and a partial one for
    every storage (blocks of 128 keys in the compute type, 32 in 16 bits). Rows of whole vectors are
    read in place, bfloat16 ones two vectors per load in a paired element order: head_dim 16-48 give
    odd and even vector counts on both vector widths (AVX2 24, 40: 3, 5; AVX-512 16, 48: 1, 3; 48
    on AVX2 takes P.V's step of two vectors)."""
    dtype = np_dtype(name)
    for group, q_len in ((1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (8, 1), (3, 2), (4, 2)):
        q, k, v = make_qkv(
            rng, dtype, batch=(2,), q_heads=2 * group, kv_heads=2, q_len=q_len, kv_len=205, head_dim=head_dim
        )
        got = sdpa(q, k, v, is_causal="lower_right", enable_gqa=True)
        expected = reference.scaled_dot_product_attention(
            f64(q), f64(k), f64(v), is_causal="lower_right", enable_gqa=True
        )
        assert_result_close(got, expected, name)


# --- KVCache API -----------------------------------------------------------------------------------


def kv(rng, batch, heads, chunk, dim, dtype=np.float32):
    return rng.standard_normal((batch, heads, chunk, dim)).astype(dtype)


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_cache_storage_placement(cpu_profile, name):
    # A cache's storage starts where the tuning module says the decode kernel reads it fastest: a
    # float32/float64 cache on a cache line (NumPy puts large arrays 16 bytes past a page, which splits
    # every 64-byte load), a 16-bit one on a line or 16 bytes past one; for every CPU the planner knows.
    dtype = np_dtype(name)
    start = pyattn._core.kv_storage_offset(dtype.itemsize, name == "bfloat16")
    assert start in ((0, 16) if dtype.itemsize == 2 else (0,))
    for max_len in (3, 1000, 70000):
        cache = pyattn.KVCache(2, 3, 40, max_len, value_dim=24, dtype=name)
        assert cache.keys(0).ctypes.data % 64 == start and cache.values(0).ctypes.data % 64 == start
        assert cache.keys(0).base is not None  # still views of the storage, not copies


@pytest.mark.parametrize("profile", ["zen3", "zen5"], ids=["16_bytes_past_a_line", "on_a_line"])
def test_bfloat16_cache_either_placement(isa, rng, profile):
    """A bfloat16 cache's storage starts where the CPU reads it fastest (16 bytes past a line, or on
    one on Zen 5): a decode step over either placement, each forced through the CPU the planner sees
    (GQA and one row per K/V row, ragged lengths, 3 new tokens, head_dim with and without a tail),
    matches the reference, whatever CPU runs the test."""
    with override(**PROFILES[profile]):
        start = pyattn._core.kv_storage_offset(2, True)
        for kv_heads, head_dim in ((2, 128), (8, 40)):
            cache, q, new = ragged_cache_step(rng, "bfloat16", [700, 301, 3], kv_heads, 8, head_dim, q_len=3)
            assert cache.keys(0).ctypes.data % 64 == start
            assert_cache_step_close(cache.attend(q, num_threads=2), cache, q, new, "bfloat16")
    assert start == (16 if profile == "zen3" else 0)  # the two placements, both tested


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_cache_attributes_append_views(rng, name):
    storage = np_dtype(name)
    cache = pyattn.KVCache(2, 3, 8, 10, value_dim=5, dtype=name)
    assert (cache.batch, cache.num_kv_heads, cache.head_dim, cache.value_dim, cache.max_len) == (2, 3, 8, 5, 10)
    assert cache.dtype == storage
    assert cache.lengths.dtype == np.int64 and cache.lengths.tolist() == [0, 0]
    assert cache.keys().shape == (2, 3, 0, 8) and cache.values().shape == (2, 3, 0, 5)
    k1, v1 = kv(rng, 2, 3, 4, 8, np.float64), kv(rng, 2, 3, 4, 5, np.float64)
    cache.append(k1, v1)
    k2, v2 = kv(rng, 2, 3, 2, 8, np.float32), kv(rng, 2, 3, 2, 5, np.float32)
    cache.append(k2, v2)
    assert cache.lengths.tolist() == [6, 6]
    keys, values = cache.keys(), cache.values()
    assert keys.dtype == storage and values.dtype == storage
    np.testing.assert_array_equal(keys, np.concatenate([k1, k2], axis=2).astype(storage))
    np.testing.assert_array_equal(values, np.concatenate([v1, v2], axis=2).astype(storage))
    np.testing.assert_array_equal(cache.keys(1), keys[1])
    np.testing.assert_array_equal(cache.values(0), values[0])
    # Views of the storage, not copies.
    assert not keys.flags.owndata and np.shares_memory(keys, cache.keys(0))
    assert np.shares_memory(cache.values(), cache.values(1))
    assert "KVCache" in repr(cache)


def test_cache_bfloat16_by_name_and_invalid_dtypes():
    if ml_dtypes is not None:
        assert pyattn.KVCache(1, 1, 4, 4, dtype="bfloat16").dtype == np.dtype(ml_dtypes.bfloat16)
        assert pyattn.KVCache(1, 1, 4, 4, dtype=ml_dtypes.bfloat16).dtype == np.dtype(ml_dtypes.bfloat16)
    assert pyattn.KVCache(1, 1, 4, 4, dtype="int8").dtype == np.dtype(np.int8)  # quantised storage
    for bad in (np.int32, np.complex64, np.bool_, "int16", np.uint8):
        with pytest.raises(TypeError, match="dtype"):
            pyattn.KVCache(1, 1, 4, 4, dtype=bad)
    # Big-endian storage names itself "float16"/"float32" too; the kernels would misread it (a
    # '>f2' cache returned wrong attention values before it was refused).
    swapped = [">f2", ">f4", ">f8"] + ([np.dtype(ml_dtypes.bfloat16).newbyteorder(">")] if ml_dtypes else [])
    for bad in swapped:
        with pytest.raises(TypeError, match="dtype: must be .*native byte order"):
            pyattn.KVCache(1, 1, 4, 4, dtype=bad)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(batch=0), "batch"),
        (dict(batch=True), "batch"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(head_dim=-1), "head_dim"),
        (dict(max_len=0), "max_len"),
        (dict(max_len=2.5), "max_len"),
        (dict(value_dim=0), "value_dim"),
    ],
)
def test_cache_constructor_errors(kwargs, name):
    args = dict(dict(batch=1, num_kv_heads=2, head_dim=4, max_len=8, value_dim=None), **kwargs)
    with pytest.raises(ValueError, match=name):
        pyattn.KVCache(
            args["batch"], args["num_kv_heads"], args["head_dim"], args["max_len"], value_dim=args["value_dim"]
        )


def snapshot(cache):
    """Everything observable about a cache, for 'left unchanged' checks."""
    return (
        (cache.lengths.copy(),)
        + tuple(f64(cache.keys(b)).copy() for b in range(cache.batch))
        + tuple(f64(cache.values(b)).copy() for b in range(cache.batch))
    )


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_overflow_raises_and_changes_nothing(rng, name):
    np_dtype(name)
    compute = compute_dtype(name)
    cache = pyattn.KVCache(2, 1, 4, 6, dtype=name)
    cache.append(kv(rng, 2, 1, 3, 4), kv(rng, 2, 1, 3, 4), num_new=np.array([3, 1]))
    q = random_array(rng, (2, 2, 3, 4), compute)
    before_out = cache.attend(q)
    before = snapshot(cache)
    # Row 0 would reach 7 > 6 (row 1 would fit): nothing at all is appended.
    with pytest.raises(ValueError, match="max_len"):
        cache.append(kv(rng, 2, 1, 4, 4), kv(rng, 2, 1, 4, 4))
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="max_len"):
        cache.append(kv(rng, 2, 1, 4, 4), kv(rng, 2, 1, 4, 4), num_new=np.array([4, 0]))
    assert_unchanged(cache, before)
    # The last append is still the one attend() refers to.
    np.testing.assert_array_equal(cache.attend(q), before_out)
    # Filling exactly to max_len works.
    cache.append(kv(rng, 2, 1, 3, 4), kv(rng, 2, 1, 3, 4), num_new=np.array([3, 3]))
    assert cache.lengths.tolist() == [6, 4]


def test_overflow_through_layer_changes_nothing(rng):
    layer = make_layer(rng, 16, 2, 1, np.float32)
    cache = pyattn.KVCache(1, 1, 8, 5, dtype=np.float32)
    layer(random_array(rng, (1, 4, 16), np.float32), kv_cache=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_len"):
        layer(random_array(rng, (1, 2, 16), np.float32), kv_cache=cache)
    assert_unchanged(cache, before)
    layer(random_array(rng, (1, 1, 16), np.float32), kv_cache=cache)
    assert cache.lengths.tolist() == [5]


def test_reset_truncate_trim(rng):
    cache = pyattn.KVCache(3, 2, 4, 16, dtype=np.float32)
    k, v = kv(rng, 3, 2, 8, 4), kv(rng, 3, 2, 8, 4)
    cache.append(k, v, num_new=np.array([8, 5, 2]))
    cache.truncate(4)
    assert cache.lengths.tolist() == [4, 4, 2]
    np.testing.assert_array_equal(cache.keys(0), k[0, :, :4])
    cache.trim(1)
    assert cache.lengths.tolist() == [3, 3, 1]
    cache.trim(np.array([0, 2, 5]))  # more than a row holds -> 0
    assert cache.lengths.tolist() == [3, 1, 0]
    cache.truncate(np.array([2, 5, 0]))  # never grows a row
    assert cache.lengths.tolist() == [2, 1, 0]
    np.testing.assert_array_equal(cache.values(0), v[0, :, :2])
    assert cache.keys(2).shape == (2, 0, 4)
    with pytest.raises(ValueError, match="length"):
        cache.truncate(-1)
    with pytest.raises(ValueError, match="count"):
        cache.trim(np.array([1, -1, 0]))
    assert cache.lengths.tolist() == [2, 1, 0]
    with pytest.raises(ValueError):  # rows of different lengths: keys() needs a row
        cache.keys()
    # Appending after truncation overwrites what was dropped.
    k2, v2 = kv(rng, 3, 2, 1, 4), kv(rng, 3, 2, 1, 4)
    cache.append(k2, v2)
    np.testing.assert_array_equal(cache.keys(1), np.concatenate([k[1, :, :1], k2[1]], axis=1))
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0]
    assert cache.keys().shape == (3, 2, 0, 4)


@pytest.mark.parametrize("left", [False, True])
def test_truncate_keeps_the_chunk_queries_positions(isa, rng, left):
    """attend() after truncate/trim: the last chunk's queries keep their positions. trim(0) changes
    nothing (it used to forget the chunk, making its queries see every key, their own future
    included); a cut into the chunk leaves its remaining queries attending as before, over the keys
    that remain."""
    cache = pyattn.KVCache(2, 2, 8, 16)
    cache.append(kv(rng, 2, 2, 6, 8), kv(rng, 2, 2, 6, 8))
    k, v = kv(rng, 2, 2, 4, 8), kv(rng, 2, 2, 4, 8)
    cache.append(k, v, num_new=np.array([4, 3]), left_padded=left)  # row 1: one padding token
    q = random_array(rng, (2, 4, 4, 8), np.float32)
    before = cache.attend(q)
    cache.trim(0)
    np.testing.assert_array_equal(cache.attend(q), before)
    cache.trim(np.array([2, 1]))  # row 0 keeps 2 of its 4 new tokens, row 1 2 of 3
    out = cache.attend(q)
    for b, (n_old, n_new) in enumerate([(4, 2), (3, 2)]):
        first = 4 - n_old if left else 0  # the chunk index of the row's first real token
        rows = slice(first, first + n_new)
        expected = sdpa(q[b][:, rows], cache.keys(b), cache.values(b), is_causal="lower_right", enable_gqa=True)
        np.testing.assert_array_equal(out[b][:, rows], expected)
    # The keys cut were in those queries' future: they attend as before the cut.
    for b, n_old in enumerate([4, 3]):
        first = 4 - n_old if left else 0
        rows = slice(first, first + 2)
        np.testing.assert_allclose(
            out[b][:, rows], before[b][:, rows], rtol=TOL[np.float32][0], atol=TOL[np.float32][1]
        )


@pytest.mark.parametrize(
    "call, name, exc",
    [
        (lambda c: c.trim(np.zeros(3, np.int64)), "count", ValueError),
        (lambda c: c.trim(1.5), "count", TypeError),
        (lambda c: c.truncate(None), "length", TypeError),
        (lambda c: c.truncate("abc"), "length", TypeError),
        (lambda c: c.truncate(2.7), "length", TypeError),
        (lambda c: c.truncate(True), "length", TypeError),
        (lambda c: c.keys(2), "row", ValueError),
        (lambda c: c.values(-3), "row", ValueError),
        (lambda c: c.keys(1.0), "row", TypeError),
        (lambda c: c.attend(np.zeros((2, 2, 1, 4), np.float32), scale="0.5"), "scale", TypeError),
        (lambda c: c.attend(np.zeros((2, 2, 1, 4), np.float32), scale=True), "scale", TypeError),
        (lambda c: c.attend(np.zeros((2, 2, 1, 4), np.float32), scale=1j), "scale", TypeError),
        (
            lambda c: c.append(np.ma.zeros((2, 1, 1, 4), np.float32), np.zeros((2, 1, 1, 4), np.float32)),
            "key",
            TypeError,
        ),
        (
            lambda c: c.append(np.zeros((2, 1, 1, 4), np.float32), np.ma.zeros((2, 1, 1, 4), np.float32)),
            "value",
            TypeError,
        ),
        (
            lambda c: c.append(
                np.zeros((2, 1, 2, 4), np.float32),
                np.zeros((2, 1, 2, 4), np.float32),
                num_new=np.ma.masked_array([2, 1], mask=[False, True]),
            ),
            "num_new",
            TypeError,
        ),
        (lambda c: c.attend(np.ma.zeros((2, 2, 1, 4), np.float32)), "query", TypeError),
        (lambda c: c.truncate(np.ma.masked_array([0, 1], mask=[True, False])), "length", TypeError),
        (lambda c: c.trim(np.ma.masked_array([1, 0], mask=[True, False])), "count", TypeError),
        (lambda c: pyattn.KVCache(1, 1, 4, 8, dtype="float8"), "dtype", TypeError),
        (lambda c: pyattn.KVCache(1, 1, 4, 8, dtype=None), "dtype", TypeError),
    ],
)
def test_cache_arguments_named_in_errors(rng, call, name, exc):
    """Bad arguments to the cache's methods raise the error policy's ValueError/TypeError naming the
    argument, and change nothing (found by tests/fuzz_cache.py)."""
    cache = pyattn.KVCache(2, 1, 4, 8)
    cache.append(kv(rng, 2, 1, 1, 4), kv(rng, 2, 1, 1, 4))
    with pytest.raises(exc, match=name):
        call(cache)
    assert cache.lengths.tolist() == [1, 1] and cache._last_new.tolist() == [1, 1]


@pytest.mark.parametrize("bad", [[-1, 1], [1, 9]])
def test_attend_and_views_name_lengths_edited_out_of_range(rng, bad):
    cache = pyattn.KVCache(2, 1, 4, 8)
    cache.append(kv(rng, 2, 1, 1, 4), kv(rng, 2, 1, 1, 4))
    cache.lengths[:] = bad
    with pytest.raises(ValueError, match="lengths"):
        cache.attend(np.zeros((2, 2, 1, 4), np.float32))
    with pytest.raises(ValueError, match="lengths"):
        cache.keys(0)
    with pytest.raises(ValueError, match="lengths"):
        cache.trim(1)


@pytest.mark.parametrize("batch", [1, 3, 64, 65])  # the bounds are checked on a list up to 64 rows, by NumPy above
@pytest.mark.parametrize("row", [0, -1])
@pytest.mark.parametrize("bad", [-1, 7, 8, 9])  # max_len 8: 7 and 8 are fine until a token is appended
def test_lengths_edited_in_place_are_checked_by_every_method(rng, batch, row, bad):
    """An in-place edit of the public lengths is seen by every method: out of [0, max_len] (or with no
    room for the new token) gives a ValueError and changes nothing, in range it is where the next
    token goes."""
    layer = make_layer(rng, 8, 2, 1, np.float32)
    cache = pyattn.KVCache(batch, 1, 4, 8)
    layer(random_array(rng, (batch, 2, 8), np.float32), kv_cache=cache)
    cache.lengths[row] = bad
    fits = 0 <= bad <= 7
    calls = [
        ("layer", lambda: layer(random_array(rng, (batch, 1, 8), np.float32), kv_cache=cache), fits),
        ("append", lambda: cache.append(kv(rng, batch, 1, 1, 4), kv(rng, batch, 1, 1, 4)), fits),
        ("truncate", lambda: cache.truncate(5), 0 <= bad <= 8),
        ("trim", lambda: cache.trim(0), 0 <= bad <= 8),
        ("keys", lambda: cache.keys(row), 0 <= bad <= 8),
    ]
    for name, call, ok in calls:
        before = cache.lengths.copy()
        if ok:
            call()
            if name in ("layer", "append"):
                expected = before + 1
            elif name == "truncate":
                expected = np.minimum(before, 5)
            else:
                expected = before
            assert cache.lengths.tolist() == expected.tolist(), name
            cache.lengths = before.copy()
            continue
        with pytest.raises(ValueError, match="lengths|max_len"):
            call()
        assert cache.lengths.tolist() == before.tolist(), name


@pytest.mark.parametrize("batch", [2, 65])
def test_lengths_replaced_by_other_arrays(rng, batch):
    """lengths replaced by a list or another integer dtype still works (the same lengths); by floats,
    another shape or a non-array it is a ValueError naming lengths, never a silently rounded length."""
    layer = make_layer(rng, 8, 2, 1, np.float32)
    x = random_array(rng, (batch, 1, 8), np.float32)
    reference = pyattn.KVCache(batch, 1, 4, 8)
    layer(random_array(rng, (batch, 3, 8), np.float32), kv_cache=reference)
    for replacement in ([3] * batch, np.full(batch, 3, np.int32), np.full(batch, 3, np.uint8)):
        cache = _copy_cache(reference)
        cache.lengths = replacement
        np.testing.assert_array_equal(layer(x, kv_cache=cache), layer(x, kv_cache=_copy_cache(reference)))
        assert cache.lengths.dtype == np.int64 and cache.lengths.tolist() == [4] * batch
    for replacement in (np.full(batch, 3.0), np.full(batch, 3.7), np.full((batch, 1), 3), np.full(batch + 1, 3), "3"):
        cache = _copy_cache(reference)
        cache.lengths = replacement
        for call in (
            lambda cache=cache: layer(x, kv_cache=cache),
            lambda cache=cache: cache.truncate(2),
            lambda cache=cache: cache.keys(0),
        ):
            with pytest.raises(ValueError, match="lengths"):
                call()
    # A masked array's data would be used as the lengths, its mask dropped: refused by every method.
    cache = _copy_cache(reference)
    cache.lengths = np.ma.masked_array(np.full(batch, 3), mask=np.arange(batch) == 0)
    for call in (lambda: layer(x, kv_cache=cache), lambda: cache.truncate(2), lambda: cache.keys(0)):
        with pytest.raises(TypeError, match="^lengths: masked arrays"):
            call()


@pytest.mark.parametrize("copy_kind", ["pickle", "deepcopy", "copy"])
@pytest.mark.parametrize("storage", CACHE_DTYPES)
def test_caches_pickle_and_deepcopy(rng, storage, copy_kind):
    """A pickled or copied cache decodes as the original does and is its own (copy.copy too: a cache
    sharing its lengths but not its storage would be neither a copy nor the same). The core writes a
    16-bit cache through a uint16 view of its storage; pickled, that view came back as a separate
    array, so the copy's steps went where keys()/values() did not look (and a float32 copy was
    refused: the core compared dtypes by identity)."""
    import pickle

    dtype = np_dtype(storage)
    clone = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "deepcopy": copy.deepcopy, "copy": copy.copy}[copy_kind]
    compute = np.float64 if storage == "float64" else np.float32
    layer = make_layer(rng, 16, 4, 2, compute)
    cache = pyattn.KVCache(2, 2, 4, 12, dtype=dtype)
    layer(random_array(rng, (2, 5, 16), compute), kv_cache=cache, num_new=np.array([5, 3]))
    twin = clone(cache)
    assert repr(twin) == repr(cache)
    # Nothing shared: reset() and edits of lengths work in place.
    for name in ("lengths", "_last_new", "_last_first", "_k", "_v"):
        assert not np.shares_memory(getattr(twin, name), getattr(cache, name)), name
    for _ in range(3):  # the same steps on both: a layer step, and append + attend
        x = random_array(rng, (2, 1, 16), compute)
        np.testing.assert_array_equal(layer(x, kv_cache=twin), layer(x, kv_cache=cache))
        k, q = random_array(rng, (2, 2, 1, 4), compute), random_array(rng, (2, 4, 1, 4), compute)
        cache.append(k, k)
        twin.append(k, k)
        np.testing.assert_array_equal(twin.attend(q), cache.attend(q))
    for row in range(2):
        np.testing.assert_array_equal(twin.keys(row).view(np.uint8), cache.keys(row).view(np.uint8))
        np.testing.assert_array_equal(twin.values(row).view(np.uint8), cache.values(row).view(np.uint8))
    cache.reset()  # the copy keeps its own storage and lengths
    assert twin.lengths.tolist() == [11, 9] and twin.keys(0).shape == (2, 11, 4)


def _copy_cache(cache):
    copy = pyattn.KVCache(
        cache.batch, cache.num_kv_heads, cache.head_dim, cache.max_len, value_dim=cache.value_dim, dtype=cache.dtype
    )
    copy._k[...], copy._v[...] = cache._k, cache._v
    copy.lengths = cache.lengths.copy()
    return copy


def test_reset_and_trim_then_decode_like_fresh(isa, rng):
    """Decoding after reset() equals a fresh cache; after trimming rejected (speculative) tokens it
    equals a cache that never saw them."""
    layer = make_layer(rng, 32, 4, 2, np.float32)
    x = random_array(rng, (2, 10, 32), np.float32)
    junk = random_array(rng, (2, 3, 32), np.float32)
    fresh = pyattn.KVCache(2, 2, 8, 16)
    expected = run_chunks(layer, x, fresh, [5, 1])

    reused = pyattn.KVCache(2, 2, 8, 16)
    run_chunks(layer, junk, reused, [3])
    reused.reset()
    np.testing.assert_array_equal(run_chunks(layer, x, reused, [5, 1]), expected)

    speculative = pyattn.KVCache(2, 2, 8, 16)
    first = layer(x[:, :5], kv_cache=speculative)
    layer(junk, kv_cache=speculative)  # three draft tokens, all rejected
    speculative.trim(3)
    rest = run_chunks(layer, x[:, 5:], speculative, [1])
    np.testing.assert_array_equal(np.concatenate([first, rest], axis=1), expected)


def test_append_shape_and_dtype_errors(rng):
    cache = pyattn.KVCache(2, 2, 4, 8, value_dim=3)
    good_k, good_v = kv(rng, 2, 2, 1, 4), kv(rng, 2, 2, 1, 3)
    cases = [
        (ValueError, "key", kv(rng, 2, 2, 1, 5), good_v),
        (ValueError, "key", kv(rng, 1, 2, 1, 4), good_v),
        (ValueError, "key", kv(rng, 2, 1, 1, 4), good_v),
        (ValueError, "key", good_k[0], good_v),
        (ValueError, "value", good_k, kv(rng, 2, 2, 1, 4)),
        (ValueError, "value", good_k, kv(rng, 2, 2, 2, 3)),
        (TypeError, "key", good_k.astype(np.int32), good_v),
        (TypeError, "value", good_k, good_v.astype(np.complex64)),
        (TypeError, "key", good_k.astype(object), good_v),
    ]
    for error, name, k, v in cases:
        with pytest.raises(error, match=name):
            cache.append(k, v)
    for bad in (np.array([1]), np.array([1, 2, 0]), np.array([2, 0]), np.array([-1, 0]), 1):
        with pytest.raises(ValueError, match="num_new"):
            cache.append(good_k, good_v, num_new=bad)
    for bad in (np.array([0.5, 1.0]), np.array([1.0, 1.0]), np.array([True, False]), ["1", "1"]):
        with pytest.raises(TypeError, match="num_new"):
            cache.append(good_k, good_v, num_new=bad)
    assert cache.lengths.tolist() == [0, 0]


def test_attend_errors(rng):
    cache = pyattn.KVCache(2, 2, 4, 8)
    with pytest.raises(ValueError, match="^query: a chunk of 3 queries, but no token was appended since the cache"):
        cache.attend(kv(rng, 2, 4, 3, 4))
    cache.append(kv(rng, 2, 2, 3, 4), kv(rng, 2, 2, 3, 4))
    q = kv(rng, 2, 4, 3, 4)
    cases = [
        (ValueError, "query", kv(rng, 2, 4, 3, 5)),
        (ValueError, "query", kv(rng, 1, 4, 3, 4)),
        (ValueError, "query", kv(rng, 2, 3, 3, 4)),  # 3 heads, not a multiple of 2
        (ValueError, r"query: chunk length 2 does not match the last append's \(3 tokens", kv(rng, 2, 4, 2, 4)),
        (ValueError, "query", q[0]),
        (TypeError, "query", q.astype(np.int64)),
    ]
    for error, name, query in cases:
        with pytest.raises(error, match=name):
            cache.attend(query)
    with pytest.raises(ValueError, match="scale"):
        cache.attend(q, scale=float("inf"))
    ref = reference.scaled_dot_product_attention(
        f64(q), f64(cache.keys()), f64(cache.values()), is_causal="lower_right", enable_gqa=True
    )
    assert_close(cache.attend(q.astype(np.float64)), ref, np.float32)  # query converted to the compute dtype


@pytest.mark.parametrize(
    "layer_dtype, cache_dtype",
    [(np.float64, "float32"), (np.float32, "float64"), (np.float64, "float16"), (np.float64, "bfloat16")],
)
def test_layer_cache_dtype_mismatch(rng, layer_dtype, cache_dtype):
    np_dtype(cache_dtype)
    layer = make_layer(rng, 16, 2, 2, layer_dtype)
    cache = pyattn.KVCache(1, 2, 8, 4, dtype=cache_dtype)
    with pytest.raises(TypeError, match="kv_cache"):
        layer(random_array(rng, (1, 1, 16), layer_dtype), kv_cache=cache)
    assert cache.lengths.tolist() == [0]


def test_layer_cache_argument_errors(rng):
    layer = make_layer(rng, 16, 2, 2, np.float32)
    x = random_array(rng, (1, 2, 16), np.float32)
    cache = pyattn.KVCache(1, 2, 8, 8)
    for bad_cache in (pyattn.KVCache(1, 1, 8, 8), pyattn.KVCache(1, 2, 4, 8), pyattn.KVCache(1, 2, 8, 8, value_dim=4)):
        with pytest.raises(ValueError, match="kv_cache"):
            layer(x, kv_cache=bad_cache)
    with pytest.raises(TypeError, match="kv_cache"):
        layer(x, kv_cache={"k": None})
    with pytest.raises(ValueError, match="query"):
        layer(random_array(rng, (2, 2, 16), np.float32), kv_cache=cache)  # batch 2, cache batch 1
    with pytest.raises(ValueError, match="query"):
        layer(random_array(rng, (1, 2, 8), np.float32), kv_cache=cache)  # wrong embed_dim
    with pytest.raises(TypeError, match="query"):
        layer(x.astype(np.float64), kv_cache=cache)
    with pytest.raises(ValueError):
        layer(x, kv_cache=cache, attn_mask=np.ones((2, 2), bool))
    with pytest.raises(ValueError):
        layer(x, kv_cache=cache, key_padding_mask=np.zeros((1, 2), bool))
    with pytest.raises(ValueError):
        layer(x, x, x, kv_cache=cache)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, kv_cache=cache, need_weights=True)
    with pytest.raises(ValueError, match="num_new"):
        layer(x, kv_cache=cache, num_new=np.array([3]))
    cross = pyattn.MultiHeadAttention(16, 2, kdim=8, vdim=8)  # K/V projected from 8 features: no self-attention
    with pytest.raises(ValueError, match="kdim = vdim = embed_dim"):
        cross(x, kv_cache=cache)
    assert cache.lengths.tolist() == [0]


# --- scaled_dot_product_attention with float16 / bfloat16 inputs --------------------------------------

HALF_CASES = {
    "plain": dict(),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "lower_right_gqa": dict(is_causal="lower_right", gqa=True),
    "upper_left_mask_gqa": dict(is_causal=True, mask="bool", gqa=True),
}


@pytest.mark.parametrize("case", list(HALF_CASES))
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 5, DECODE_MAX, DECODE_MAX + 1, 17, 33, 65])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_sdpa_matches_reference(isa, rng, name, q_len, case):
    """q_len <= DECODE_MAX runs the decode kernel, longer ones the query tiles (of every width), both reading
    16-bit K/V directly;
    both against the float64 reference of the (already rounded) inputs. Inputs are strided views cut
    from NaN-filled parents; head_dim 24 leaves a conversion tail on every ISA."""
    dtype = np_dtype(name)
    opts = HALF_CASES[case]
    kv_heads = 2 if opts.get("gqa") else 4
    q, k, v = make_qkv(
        rng, dtype, batch=(2,), q_heads=4, kv_heads=kv_heads, q_len=q_len, kv_len=37, head_dim=24, value_dim=19
    )
    mask = None
    if opts.get("mask"):
        mask = random_mask(rng, (2, 1, q_len, 37), opts["mask"], dtype)
        mask[..., 0] = True if mask.dtype == np.bool_ else 0.0  # key 0 allowed: no fully masked row
        mask = nan_guarded(mask)
    kwargs = dict(is_causal=opts.get("is_causal", False), enable_gqa=bool(opts.get("gqa")))
    got = sdpa(q, k, v, mask, **kwargs)
    ref_mask = None if mask is None else (mask if mask.dtype == np.bool_ else f64(mask))
    expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), ref_mask, **kwargs)
    assert got.shape == expected.shape
    assert_half_close(got, expected, name)


@pytest.mark.parametrize("name", HALF_NAMES)
def test_reference_takes_half_float_masks(rng, name):
    """The reference reads a float16/bfloat16 float mask as the values it holds (-inf forbids, the rest
    is added), as pyattn does: the same as its float64 widening, for pyattn and the reference alike.
    (ml_dtypes' bfloat16 has NumPy kind 'V', which the reference once refused.)"""
    dtype = np_dtype(name)
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=5, kv_len=9, head_dim=8, guard=False)
    mask = random_mask(rng, (2, 5, 9), "float", dtype)
    mask[..., 0] = 0.0  # key 0 allowed: no fully masked row
    assert np.isneginf(f64(mask)).any() and (np.isfinite(f64(mask)) & (f64(mask) != 0)).any()
    expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), f64(mask))
    np.testing.assert_array_equal(reference.scaled_dot_product_attention(q, k, v, mask), expected)
    assert_half_close(sdpa(q, k, v, mask), expected, name)


@pytest.mark.parametrize("head_dim", [1, 7, 8, 16, 17, 33, 64, 128])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_sdpa_head_dims(isa, rng, name, head_dim):
    dtype = np_dtype(name)
    for q_len in (1, 6, 20):
        q, k, v = make_qkv(rng, dtype, batch=(1,), q_heads=2, kv_len=45, q_len=q_len, head_dim=head_dim)
        got = sdpa(q, k, v, is_causal="lower_right")
        expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), is_causal="lower_right")
        assert_half_close(got, expected, name)


@pytest.mark.parametrize("q_len", [2, 7])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_sdpa_out_weights_and_dtype_errors(rng, name, q_len):
    dtype = np_dtype(name)
    q, k, v = make_qkv(rng, dtype, q_heads=3, q_len=q_len, kv_len=11, head_dim=8, guard=False)
    expected = reference.scaled_dot_product_attention(
        f64(q), f64(k), f64(v), is_causal="lower_right", return_weights=True
    )
    plain = sdpa(q, k, v, is_causal="lower_right")
    out = np.full((3, q_len, 8), np.nan, dtype)
    got = sdpa(q, k, v, is_causal="lower_right", out=out)
    assert got is out
    np.testing.assert_array_equal(f64(out), f64(plain))
    assert_half_close(out, expected[0], name)
    got, weights = sdpa(q, k, v, is_causal="lower_right", return_weights=True)
    assert weights.dtype == dtype and weights.shape == (3, q_len, 11)
    assert_half_close(got, expected[0], name)
    assert_half_close(weights, expected[1], name)
    # 2-D inputs: one head.
    assert_half_close(
        sdpa(q[0], k[0], v[0]), reference.scaled_dot_product_attention(f64(q[0]), f64(k[0]), f64(v[0])), name
    )

    with pytest.raises(TypeError, match="out"):
        sdpa(q, k, v, out=np.empty((3, q_len, 8), np.float32))
    with pytest.raises(ValueError, match="out"):
        sdpa(q, k, v, out=np.empty((3, q_len, 9), dtype))
    with pytest.raises(TypeError):
        sdpa(q, k.astype(np.float32), v)
    other = np.float16 if name == "bfloat16" else (ml_dtypes.bfloat16 if ml_dtypes is not None else np.float32)
    with pytest.raises(TypeError):
        sdpa(q, k, v.astype(other))
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, k, v, np.zeros((q_len, 11), np.float32))
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, k, v, np.zeros((q_len, 11), np.int8))


# --- the decode path's key-range split, forbidden NaN keys, threads --------------------------------


def long_kv_inputs(
    rng, dtype, q_len, kv_len=3000, heads=4, kv_heads=2, head_dim=32, batch=1, hole=(300, 1400), per_head=True
):
    """Inputs for the split decode path (by default 2 (batch, kv head) tasks and 3000 keys, i.e. 12
    key chunks merged per task). The bool mask (True = attend) forbids some keys for every query
    (their K and V rows are NaN), a run of keys (hole; by default whole key chunks), and random other
    (query, key) pairs; per_head: a mask per head, forbidding every key of head 1 (whose rows must be
    zeros), else one broadcast over the heads. Returns q, k, v, mask and NaN-free float64 K/V for
    the reference (zeros at the NaN rows, which no query may see)."""
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(batch,),
        q_heads=heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        guard=False,
    )
    key_ok = rng.random(kv_len) < 0.8
    key_ok[hole[0] : hole[1]] = False
    mask = key_ok & (rng.random((batch, heads if per_head else 1, q_len, kv_len)) < 0.9)
    if per_head:
        mask[:, 1] = False
    clean_k, clean_v = f64(k), f64(v)
    for x, clean in ((k, clean_k), (v, clean_v)):
        x[..., ~key_ok, :] = np.nan
        clean[..., ~key_ok, :] = 0.0
    return q, k, v, mask, clean_k, clean_v


@pytest.mark.parametrize("group", [1, 0], ids=["group_tiles", "head_tiles"])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, DECODE_MAX + 1, 40])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_long_kv_split_and_nan_forbidden_keys(isa, rng, name, q_len, group):
    """The decode kernel (q_len <= DECODE_MAX) and the query tiles (longer; a GQA group's heads
    together or head by head), over 3000 keys split into chunks and merged per head."""
    dtype = np_dtype(name)
    q, k, v, mask, clean_k, clean_v = long_kv_inputs(rng, dtype, q_len)
    with group_tiles(group):
        got = sdpa(q, k, v, mask, is_causal="lower_right", enable_gqa=True)
    assert got.dtype == dtype
    assert np.isfinite(f64(got)).all()
    np.testing.assert_array_equal(f64(got[:, 1]), 0.0)
    expected = reference.scaled_dot_product_attention(
        f64(q), clean_k, clean_v, mask, is_causal="lower_right", enable_gqa=True
    )
    assert_result_close(got, expected, name)


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_long_kv_float_mask(isa, rng, name):
    """A float mask (-inf forbids) on the split path, with a 16-bit mask for 16-bit inputs."""
    dtype = np_dtype(name)
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, kv_heads=1, q_len=1, kv_len=3000, head_dim=16)
    mask = random_mask(rng, (2, 1, 1, 3000), "float", dtype, p_allowed=0.5)
    got = sdpa(q, k, v, mask, enable_gqa=True)
    expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), f64(mask), enable_gqa=True)
    assert_result_close(got, expected, name)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_path_bitwise_across_thread_counts(isa, rng, name, q_len):
    dtype = np_dtype(name)
    q, k, v, mask, _, _ = long_kv_inputs(rng, dtype, q_len)
    results = [sdpa(q, k, v, mask, is_causal="lower_right", enable_gqa=True, num_threads=n) for n in (1, 2, 3)]
    for r in results[1:]:
        np.testing.assert_array_equal(f64(r), f64(results[0]))
    q2, k2, v2 = make_qkv(rng, dtype, batch=(2,), q_heads=8, kv_heads=8, q_len=q_len, kv_len=700, head_dim=24)
    results = [sdpa(q2, k2, v2, num_threads=n) for n in (1, 2, 3)]
    for r in results[1:]:
        np.testing.assert_array_equal(f64(r), f64(results[0]))


def ragged_cache_step(rng, name, lengths, kv_heads, q_heads, head_dim, q_len):
    """A KVCache whose batch row b holds lengths[b] tokens, the last min(q_len, lengths[b]) of them
    appended as one right-padded chunk, and that chunk's queries. Returns (cache, q, new): new[b] =
    row b's real queries (the first new[b] of the chunk)."""
    batch, max_len = len(lengths), max(lengths)
    cache = pyattn.KVCache(batch, kv_heads, head_dim, max_len, dtype=name)
    k = random_array(rng, (batch, kv_heads, max_len, head_dim), compute_dtype(name))
    v = random_array(rng, (batch, kv_heads, max_len, head_dim), compute_dtype(name))
    first = [n - q_len if n >= q_len else 0 for n in lengths]
    cache.append(k[:, :, : max(first)], v[:, :, : max(first)], num_new=np.array(first))
    new = [n - f for n, f in zip(lengths, first)]
    chunk = max(new)
    take = [np.minimum(np.arange(chunk) + first[b], max_len - 1) for b in range(batch)]  # row b's next keys
    kn = np.stack([k[b][:, take[b]] for b in range(batch)])
    vn = np.stack([v[b][:, take[b]] for b in range(batch)])
    cache.append(kn, vn, num_new=np.array(new))
    assert cache.lengths.tolist() == list(lengths)
    q = random_array(rng, (batch, q_heads, chunk, head_dim), compute_dtype(name))
    return cache, q, new


def assert_cache_step_close(got, cache, q, new, name):
    """got (an attend of the chunk) against the reference, row by row over each row's real queries."""
    for b in range(len(new)):
        rows = slice(0, new[b])  # right padding: row b's real queries come first
        expected = reference.scaled_dot_product_attention(
            f64(q[b : b + 1, :, rows]),
            f64(cache.keys(b))[None],
            f64(cache.values(b))[None],
            is_causal="lower_right",
            enable_gqa=True,
        )
        assert_close(got[b : b + 1, :, rows], expected, compute_dtype(name).type)  # the stored values, exactly


def decode_prefetch(level):
    """The decode kernel's software prefetch of K/V rows: "l1" (8 KiB ahead), "l2" (16 KiB ahead),
    "off", or None: as the planner decides."""
    return override(decode_prefetch=level)


@pytest.mark.parametrize(
    "head_dim, q_heads, kv_heads, q_len, lengths",
    [
        (128, 8, 2, 1, [3000, 2999]),  # GQA 4 rows, rows of whole vectors (read in place): prefetched
        (64, 4, 4, 1, [1500, 40]),  # one row per K/V row; the second row's range ends before the distance
        (128, 2, 1, 3, [700, 1]),  # 6 rows per K/V row; a one-key row
        (24, 4, 2, 2, [900, 600]),  # AVX-512: rows converted into scratch (hint unused); AVX2, generic: in place
    ],
)
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_prefetch_changes_nothing(isa, rng, name, head_dim, q_heads, kv_heads, q_len, lengths):
    """The decode kernel's prefetch of K and V rows ahead in their streams is a hint only: forced on,
    into L1 or into L2 (each its own distance), it gives the bits it gives off, through a ragged
    KVCache (each row's range ends at its own length, some shorter than the prefetch distance) and
    through a split long call whose forbidden keys' rows hold NaN (the prefetches touch them too);
    both against the reference."""
    dtype = np_dtype(name)
    cache, q, new = ragged_cache_step(rng, name, lengths, kv_heads, q_heads, head_dim, q_len)
    # The number of parts the range is read in changes the order of the keys, and the planner's rule
    # ties it to prefetching on some CPUs: each count is pinned.
    for streams, level in itertools.product((1, 4), ("l1", "l2")):
        with decode_streams(streams), decode_prefetch(level):
            on = cache.attend(q, num_threads=2)
        with decode_streams(streams), decode_prefetch("off"):
            off = cache.attend(q, num_threads=2)
        np.testing.assert_array_equal(f64(on), f64(off))
    assert_cache_step_close(on, cache, q, new, name)

    # The split path (12 key chunks per task) with NaN rows at forbidden keys.
    q2, k2, v2, mask, clean_k, clean_v = long_kv_inputs(rng, dtype, min(q_len, DECODE_MAX), head_dim=head_dim)
    for streams, level in itertools.product((1, 4), ("l1", "l2")):
        with decode_streams(streams), decode_prefetch(level):
            on = sdpa(q2, k2, v2, mask, is_causal="lower_right", enable_gqa=True)
        with decode_streams(streams), decode_prefetch("off"):
            off = sdpa(q2, k2, v2, mask, is_causal="lower_right", enable_gqa=True)
        np.testing.assert_array_equal(f64(on), f64(off))
    assert np.isfinite(f64(on)).all()
    expected = reference.scaled_dot_product_attention(
        f64(q2), clean_k, clean_v, mask, is_causal="lower_right", enable_gqa=True
    )
    assert_result_close(on, expected, name)


def decode_fuse(mode):
    """Whether the decode kernel reads a block's K rows together with the previous block's V rows, key
    by key (one query row per K/V row, rows of 4 or 8 vectors in the compute type, read in place): 1
    wherever it can, 0 never."""
    return override(decode_fuse=bool(mode))


@pytest.mark.parametrize("head_dim", [128, 64, 32, 96, 8])  # 8, 4 vectors (AVX-512 float32); 4 on AVX2; others: never
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_fused_blocks_change_nothing(isa, rng, name, head_dim):
    """Reading one block's K rows together with the previous block's V rows changes the order of the
    reads only, not of any sum: fused or not, the bits are the same, through a ragged KVCache with
    one query row per K/V row (lengths on, around and between the 128-key blocks, a one-key row, and
    a range read as 1, 2 or 4 parts side by side), and through a split long call whose forbidden
    keys' rows hold NaN (blocks skipped whole, blocks whose P.V skips them one by one); both against
    the reference."""
    dtype = np_dtype(name)
    lengths = [1000, 640, 385, 384, 256, 129, 128, 1]
    for streams in (1, 2, 4):
        cache, q, new = ragged_cache_step(rng, name, lengths, 2, 2, head_dim, q_len=1)
        with decode_streams(streams), decode_fuse(1):
            fused = cache.attend(q, num_threads=2)
        with decode_streams(streams), decode_fuse(0):
            apart = cache.attend(q, num_threads=2)
        np.testing.assert_array_equal(f64(fused), f64(apart))
        assert_cache_step_close(fused, cache, q, new, name)

    q2, k2, v2, mask, clean_k, clean_v = long_kv_inputs(rng, dtype, 1, heads=4, kv_heads=4, head_dim=head_dim)
    with decode_fuse(1):
        fused = sdpa(q2, k2, v2, mask)
    with decode_fuse(0):
        apart = sdpa(q2, k2, v2, mask)
    np.testing.assert_array_equal(f64(fused), f64(apart))
    assert np.isfinite(f64(fused)).all()
    np.testing.assert_array_equal(f64(fused[:, 1]), 0.0)
    expected = reference.scaled_dot_product_attention(f64(q2), clean_k, clean_v, mask)
    assert_result_close(fused, expected, name)


@pytest.mark.parametrize("fuse", [1, 0])
@pytest.mark.parametrize("q_len, heads, kv_heads, head_dim", [(1, 4, 4, 128), (1, 4, 2, 24), (3, 4, 2, 64)])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_poisoned_forbidden_rows_change_no_bits(isa, rng, name, q_len, heads, kv_heads, head_dim, fuse):
    """The decode kernel's P.V goes unguarded through blocks with forbidden keys and reruns a tile
    with its V rows checked only when its accumulators end up non-finite. Forbidden keys (15% of 700,
    the same for every query row, none among the first and last five) whose K and V rows hold NaN,
    +Inf or -Inf give the same bits as the same rows holding zeros, with and without an allowed V
    row holding +Inf (which sends the zero rows' tiles through the checks too); and the zero rows'
    result is the reference's (the +Inf column exactly)."""
    dtype = np_dtype(name)
    kv_len = 700
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(1,),
        q_heads=heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        guard=False,
    )
    allowed = rng.random(kv_len) >= 0.15
    allowed[:5] = allowed[-5:] = True
    mask = allowed.reshape(1, 1, 1, kv_len)  # the same keys forbidden for every row: a column mask
    holes = np.flatnonzero(~allowed)
    for inf_row in (None, int(np.flatnonzero(allowed)[200])):
        clean_k, clean_v = k.copy(), v.copy()
        clean_k[..., holes, :] = 0
        clean_v[..., holes, :] = 0
        if inf_row is not None:
            clean_v[0, 1, inf_row, 3] = np.inf
        bad_k, bad_v = clean_k.copy(), clean_v.copy()
        for i, bad in enumerate((np.nan, np.inf, -np.inf)):
            bad_k[..., holes[i::3], :] = bad
            bad_v[..., holes[i::3], :] = bad
        with decode_fuse(fuse):
            clean = sdpa(q, clean_k, clean_v, mask, is_causal="lower_right", enable_gqa=True, num_threads=2)
            poisoned = sdpa(q, bad_k, bad_v, mask, is_causal="lower_right", enable_gqa=True, num_threads=2)
        np.testing.assert_array_equal(f64(poisoned), f64(clean))
        expected = reference.scaled_dot_product_attention(
            f64(q), f64(clean_k), f64(clean_v), mask, is_causal="lower_right", enable_gqa=True
        )
        finite = np.isfinite(expected)
        if inf_row is None:
            assert finite.all()
        else:  # +Inf in V row inf_row, column 3 of K/V head 1: query heads of that group, column 3
            group = heads // kv_heads
            assert not finite[0, group : 2 * group, :, 3].any() and finite.sum() == finite.size - group * q_len
            np.testing.assert_array_equal(f64(clean)[~finite], expected[~finite])
        assert_result_close(np.where(finite, clean, 0).astype(dtype), np.where(finite, expected, 0), name)


def decode_streams(n):
    """How many parts of a work item's keys the decode kernel reads side by side, rows in turn: 1, 2,
    4 forced (a part needs a key block of its own: 128 keys in the compute type, 32 or 64 in 16 bits;
    fewer parts where an item is shorter), or None: as the planner decides."""
    return override(decode_streams=n)


@pytest.mark.parametrize("head_dim", [32, 24])  # 24 on AVX-512: rows through scratch, one stream
@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_decode_streams_same_keys_in_another_order(isa, rng, name, streams, head_dim):
    """Reading a work item's keys as 2 or 4 parts side by side takes the keys in another order, so the
    sums differ in rounding only: against the reference, through a ragged KVCache (lengths around
    the thresholds of 2 and 4 parts per item, and remainders that are not a multiple of the parts:
    every key must be seen once, at its own position for the causal limits of 3 new tokens), and
    through an explicit mask with holes whose forbidden keys' K/V rows hold NaN. 8 x 8 K/V heads
    are enough tasks that no key range is split: each item is a row's whole range."""
    dtype = np_dtype(name)
    lengths = [1031, 1000, 515, 512, 511, 259, 129, 2]
    batch, kv_heads, q_heads = len(lengths), 8, 16
    cache, q, new = ragged_cache_step(rng, name, lengths, kv_heads, q_heads, head_dim, q_len=3)
    with decode_streams(streams):
        got = cache.attend(q, num_threads=2)
    assert_cache_step_close(got, cache, q, new, name)

    q2, k2, v2, mask, clean_k, clean_v = long_kv_inputs(
        rng,
        dtype,
        2,
        kv_len=1100,
        heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        batch=batch,
        hole=(600, 700),
        per_head=False,
    )
    with decode_streams(streams):
        got = sdpa(q2, k2, v2, mask, is_causal="lower_right", enable_gqa=True)
    assert np.isfinite(f64(got)).all()
    expected = reference.scaled_dot_product_attention(
        f64(q2), clean_k, clean_v, mask, is_causal="lower_right", enable_gqa=True
    )
    assert_result_close(got, expected, name)


def decode_block16(keys):
    """Keys per block of the decode kernel for 16-bit K/V read in place: 32 / 64 forced, or None: as
    the planner decides."""
    return override(decode_block16=keys)


@pytest.mark.parametrize("q_heads, q_len", [(8, 1), (16, 3), (32, 1)])  # 1, 6 and 4 rows per K/V row
@pytest.mark.parametrize("head_dim", [16, 32, 128])  # rows of whole vectors: read in place
@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("keys", [32, 64])
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_decode_16_bit_blocks_of_32_or_64_keys(isa, rng, name, keys, streams, head_dim, q_heads, q_len):
    """16-bit K/V read in blocks of 32 or 64 keys: the same keys, summed block by block, against the
    reference through a ragged KVCache whose lengths fall on either side of both block sizes (and of
    a block per part with four parts), and through the split path's mask with holes whose forbidden
    keys' K/V rows hold NaN (long_kv_inputs: a block of 64 with some keys forbidden takes the NaN
    guard as one of 32 does); the two sizes must differ in the bits of a long range, or the setting did nothing."""
    kv_heads = 8
    lengths = [1031, 257, 256, 255, 129, 65, 64, 63, 33, 2]
    cache, q, new = ragged_cache_step(rng, name, lengths, kv_heads, q_heads, head_dim, q_len)
    with decode_block16(keys), decode_streams(streams):
        got = cache.attend(q, num_threads=2)
    assert_cache_step_close(got, cache, q, new, name)
    if keys == 64:
        with decode_block16(32), decode_streams(streams):
            other = cache.attend(q, num_threads=2)
        assert not np.array_equal(f64(got)[0], f64(other)[0]), "blocks of 32 and 64 keys agree bit for bit"

    q2, k2, v2, mask, clean_k, clean_v = long_kv_inputs(
        rng, np_dtype(name), q_len, kv_len=1600, heads=q_heads, kv_heads=kv_heads, head_dim=head_dim
    )
    with decode_block16(keys), decode_streams(streams):
        got = sdpa(q2, k2, v2, mask, is_causal="lower_right", enable_gqa=True)
    assert np.isfinite(f64(got)).all()
    expected = reference.scaled_dot_product_attention(
        f64(q2), clean_k, clean_v, mask, is_causal="lower_right", enable_gqa=True
    )
    assert_result_close(got, expected, name)


# The child process of test_mask_padding_k_v_rows_are_never_read (argv[1]: the ISA). K and V of each
# head are laid out as [left padding | keys | right padding] in anonymous memory, the pages wholly
# inside the padding are made unreadable (PROT_NONE), and a mask forbids the padding to every query
# row: a decode call that reads a padded key row dies with SIGSEGV. Hardware and software
# prefetches of such pages do not fault; only real loads do. The reference is computed from copies
# taken before the pages are closed.
PADDING_CHILD = r"""
import ctypes, mmap, sys
import numpy as np
import pyattn
from pyattn import reference
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
pyattn._core._set_isa(sys.argv[1])
DECODE_MAX = pyattn._core.DECODE_MAX_Q_LEN
rng = np.random.default_rng(7)
names = ["float32", "float16"] + (["bfloat16"] if ml_dtypes is not None else [])
tol = {"float32": (2e-5, 2e-6), "float16": (1e-3, 2e-5), "bfloat16": (8e-3, 2e-5)}
if pyattn._core.bf16_dots():  # precision="fast" on the bfloat16 pair kernels: tests/conftest.py's bound
    tol["bfloat16"] = (1.6e-2, 6e-3)
closed = []


def padded_kv(dtype, kv_heads, left, keys, right, dim):
    rows = left + keys + right
    item = np.dtype(dtype).itemsize
    mm = mmap.mmap(-1, kv_heads * rows * dim * item + PAGE)
    x = np.frombuffer(mm, dtype=dtype, count=kv_heads * rows * dim).reshape(1, kv_heads, rows, dim)
    x[...] = rng.standard_normal(x.shape).astype(dtype)
    base = x.ctypes.data
    spans = []  # byte ranges of each head's padding
    for h in range(kv_heads):
        head = h * rows * dim * item
        spans += [(head, head + left * dim * item), (head + (left + keys) * dim * item, head + rows * dim * item)]
    return mm, x, base, spans


def close(base, spans):  # returns the bytes this call closed
    shut = 0
    for lo, hi in spans:
        lo_page = -(-(base + lo) // PAGE) * PAGE
        hi_page = (base + hi) // PAGE * PAGE
        if hi_page > lo_page:
            assert libc.mprotect(lo_page, hi_page - lo_page, 0) == 0, ctypes.get_errno()
            closed.append((lo_page, hi_page - lo_page))
            shut += hi_page - lo_page
    return shut


for name in names:
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    for dim in (64, 24):
        for left, right in ((0, 700), (700, 0), (650, 900)):
            keys, kv_heads, q_heads = 1500, 2, 4
            mk, k, kb, kspans = padded_kv(dtype, kv_heads, left, keys, right, dim)
            mv, v, vb, vspans = padded_kv(dtype, kv_heads, left, keys, right, dim)
            rows = left + keys + right
            for q_len in (1, 3, 17, 64):  # the decode kernel, then the query tiles
                q = rng.standard_normal((1, q_heads, q_len, dim)).astype(dtype)
                # Every query row its own mask: holes inside, and rows that cut more than the padding,
                # so the span read is the union over a GQA group's rows.
                mask = rng.random((1, q_heads, q_len, rows)) < 0.9
                mask[..., :left] = False
                mask[..., left + keys:] = False
                mask[:, 1, :, left:left + 37] = False
                mask[:, 2, :, left + keys - 50:] = False
                expected = reference.scaled_dot_product_attention(
                    q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask, enable_gqa=True)
                assert close(kb, kspans) >= PAGE and close(vb, vspans) >= PAGE, "no page inside the padding to close"
                # Decode: the key range as 1, 2 and 4 parts; query tiles: GQA group tiles (16-bit K/V
                # converted a block at a time for the group's heads) and head by head.
                settings = [{"decode_streams": n} for n in (1, 2, 4)] if q_len <= DECODE_MAX else [
                    {"group_heads": n} for n in (None, 1)]
                for setting in settings:
                    previous = pyattn._core._set_tuning(setting)
                    got = pyattn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, num_threads=2)
                    pyattn._core._set_tuning(previous)
                    np.testing.assert_allclose(got.astype(np.float64), expected, *tol[name],
                                               err_msg=f"{name} dim {dim} pads {left}/{right} q_len {q_len}")
                for lo, n in closed:
                    assert libc.mprotect(lo, n, 3) == 0
                closed.clear()
print("ok")
"""


def test_mask_padding_k_v_rows_are_never_read(isa):
    """Keys that a mask forbids to every query row at either end of the range (left or right
    padding) are not read at all: by the decode kernel, whether it reads the range as one part or as
    several side by side, and by the query tiles, head by head or as GQA group tiles (which convert
    16-bit K/V for the group's heads at once). K and V rows there lie on unreadable pages, so a read
    kills the child process (SIGSEGV). The results are held to the reference. float32 / float16 /
    bfloat16, head_dim 64 (rows read in place) and 24 (through scratch blocks), 1, 3, 17 and 64
    query rows, a mask per query row."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("needs mprotect through ctypes (Linux)")
    done = subprocess.run([sys.executable, "-c", PADDING_CHILD, isa], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        f"return code {done.returncode} (-11: a padded K/V row was read)\n{done.stdout}\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_cache_attend_and_layer_bitwise_across_thread_counts(isa, rng, name):
    np_dtype(name)
    compute = compute_dtype(name)
    cache = pyattn.KVCache(2, 2, 16, 2100, dtype=name)
    cache.append(kv(rng, 2, 2, 2000, 16), kv(rng, 2, 2, 2000, 16), num_new=np.array([2000, 900]))
    q = random_array(rng, (2, 4, 1, 16), compute)
    cache.append(kv(rng, 2, 2, 1, 16), kv(rng, 2, 2, 1, 16))
    results = [cache.attend(q, num_threads=n) for n in (1, 2, 3)]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])

    layer = make_layer(rng, 32, 4, 2, compute)
    x = random_array(rng, (2, 12, 32), compute)
    outs = []
    for n in (1, 2, 3):
        c = pyattn.KVCache(2, 2, 8, 12, dtype=name)
        outs.append(run_chunks(layer, x, c, [5, 1, 3], num_threads=n))
    for r in outs[1:]:
        np.testing.assert_array_equal(r, outs[0])


@pytest.mark.parametrize("name", ["float32", "float64"])
def test_cache_attend_independent_of_max_len(isa, rng, name):
    # The core sees the filled part only: a roomy cache (max_len far beyond the content) attends
    # bit for bit like a tight one and like scaled_dot_product_attention on the filled views (the
    # key-range split depends on kv_len, so passing max_len as kv_len changed the merge order).
    keys, values = kv(rng, 1, 2, 600, 16).astype(name), kv(rng, 1, 2, 600, 16).astype(name)
    q = random_array(rng, (1, 8, 1, 16), np.dtype(name))
    outs = []
    for max_len in (600, 4096, 65536):
        cache = pyattn.KVCache(1, 2, 16, max_len, dtype=name)
        cache.append(keys[:, :, :599], values[:, :, :599])
        cache.append(keys[:, :, 599:], values[:, :, 599:])
        outs.append(cache.attend(q))
    expected = sdpa(q, keys, values, is_causal="lower_right", enable_gqa=True)
    for out in outs:
        np.testing.assert_array_equal(out, expected)


def test_cache_attend_follows_every_change_of_lengths(rng):
    # attend() keeps its per-row causal state between calls (a decode loop attends many times per
    # append); any change of the lengths must still reach the core: append, truncate, reset, and the
    # public lengths array changed in place. Single-token queries see keys [0, lengths[b]) of row b.
    keys, values = kv(rng, 2, 2, 40, 16), kv(rng, 2, 2, 40, 16)
    q = random_array(rng, (2, 4, 1, 16), np.dtype(np.float32))
    cache = pyattn.KVCache(2, 2, 16, 64)

    def check(lengths):
        out = cache.attend(q)
        for b, n in enumerate(lengths):
            assert cache.keys(b).shape[1] == n
            expected = sdpa(q[b], cache.keys(b), cache.values(b), enable_gqa=True)
            np.testing.assert_array_equal(out[b], expected)

    cache.append(keys[:, :, :29], values[:, :, :29])
    cache.append(keys[:, :, 29:30], values[:, :, 29:30])
    check([30, 30])
    cache.lengths[1] = 17  # in place: the query now sits at position 16 of row 1
    check([30, 17])
    cache.lengths[1] = 35  # in place, beyond the last append (zeros there): the query sits at 34
    check([30, 35])
    cache.lengths[1] = 17
    cache.truncate(20)
    cache.append(keys[:, :, 20:21], values[:, :, 20:21])  # row 1 goes on from 17: keys 0..16 and key 20
    out = cache.attend(q)
    expected = sdpa(
        q[1],
        np.concatenate([keys[1, :, :17], keys[1, :, 20:21]], axis=1),
        np.concatenate([values[1, :, :17], values[1, :, 20:21]], axis=1),
        enable_gqa=True,
    )
    np.testing.assert_array_equal(out[1], expected)
    cache.reset()
    cache.append(keys[:, :, :1], values[:, :, :1])
    check([1, 1])


def test_lengths_out_of_range_raise_before_any_write(rng):
    """The public lengths array set out of [0, max_len] (by hand): append and the layer's step raise
    a ValueError naming the lengths and write nothing (a negative position would index the storage
    from its end)."""
    layer = make_layer(rng, 16, 2, 2, np.float32)
    cache = pyattn.KVCache(2, 2, 8, 6)
    x = random_array(rng, (2, 1, 16), np.float32)
    layer(x, kv_cache=cache)
    k = random_array(rng, (2, 2, 1, 8), np.float32)
    for bad in ([-1, 1], [1, 7]):
        cache.lengths = np.array(bad, np.int64)
        stored = cache._k.copy(), cache._v.copy()
        with pytest.raises(ValueError, match="lengths|max_len"):
            cache.append(k, k)
        with pytest.raises(ValueError, match="lengths|max_len"):
            layer(x, kv_cache=cache)
        with pytest.raises(ValueError, match="lengths|max_len"):
            cache.append(k, k, num_new=np.array([1, 1]))
        np.testing.assert_array_equal(cache._k, stored[0])
        np.testing.assert_array_equal(cache._v, stored[1])
        assert cache.lengths.tolist() == bad


@pytest.mark.parametrize("q_len", [1, 4, 6, 20])
@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_sdpa_layouts_and_broadcast(isa, rng, name, q_len):
    """16-bit K/V read through strides: (B, S, H, E) views, and K/V broadcast over the batch (stride 0)."""
    dtype = np_dtype(name)
    q, k, v = make_qkv(
        rng, dtype, batch=(3,), q_heads=4, kv_heads=2, q_len=q_len, kv_len=50, head_dim=16, layout="bshd"
    )
    expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), enable_gqa=True)
    assert_half_close(sdpa(q, k, v, enable_gqa=True), expected, name)
    k1, v1 = k[:1], v[:1]
    expected = reference.scaled_dot_product_attention(f64(q), f64(k1), f64(v1), enable_gqa=True)
    assert_half_close(sdpa(q, k1, v1, enable_gqa=True), expected, name)
    assert_half_close(
        sdpa(q, np.broadcast_to(k1, k.shape), np.broadcast_to(v1, v.shape), enable_gqa=True), expected, name
    )


@pytest.mark.parametrize("name", HALF_NAMES)
def test_half_sdpa_edges(rng, name):
    """More queries than keys with lower-right alignment (early rows see nothing: zeros), and
    zero-size dimensions, with 16-bit inputs on both paths."""
    dtype = np_dtype(name)
    for q_len in (4, 7, 20):
        q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=q_len, kv_len=2, head_dim=8)
        got = sdpa(q, k, v, is_causal="lower_right")
        expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), is_causal="lower_right")
        assert_half_close(got, expected, name)
        np.testing.assert_array_equal(f64(got[:, : q_len - 2]), 0.0)
    for q_len, kv_len, head_dim, value_dim in ((0, 5, 8, 8), (3, 0, 8, 8), (3, 5, 8, 0), (2, 5, 0, 4)):
        q, k, v = make_qkv(
            rng, dtype, q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=head_dim, value_dim=value_dim, guard=False
        )
        got = sdpa(q, k, v)
        assert got.dtype == dtype and got.shape == (2, q_len, value_dim)
        expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v))
        assert_half_close(got, expected, name)


# --- GQA group tiles: a group's heads through the key blocks together ----------------------------


# (q_heads, kv_heads, q_len, kv_len, options). kv_len <= 256 keeps every call in one key chunk (the
# shortest key block of any tile is 256 keys), so both ways go through the same blocks in the same
# order and must agree bit for bit.
GROUP_CASES = {
    "group4": (8, 2, 17, 200, dict()),
    "two_query_blocks_causal": (4, 1, 70, 256, dict(is_causal=True)),
    "mqa12_subgroups_lower_right": (12, 1, 9, 100, dict(is_causal="lower_right")),  # 2 sub-groups of 6
    "mqa32_subgroups": (32, 1, 10, 60, dict()),  # 4 sub-groups of 8
    "bool_mask_per_head_nan_kv": (6, 2, 20, 150, dict(mask="bool")),
    "float_mask_value_dim": (6, 3, 33, 90, dict(mask="float", value_dim=19)),
    # Keys 0-39 forbidden to every query (left padding) with finite K/V: the tiles drop them from the
    # block, and read the converted rows from key 40 on.
    "left_padding_finite_kv": (8, 2, 12, 230, dict(mask="bool", pad=40)),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_group_tiles_bitwise_equal_to_head_by_head(isa, rng, name, case, threads):
    """Group tiles against head-by-head tiles, every dtype (16-bit K/V converted once per group and
    block), and against the reference. Masks differ per head; forbidden keys (no query of the batch
    entry may see them) hold NaN in K and Inf in V, so a head whose unguarded pass fails reruns alone
    (head by head, which would hide a wrong row offset: hence also finite padded keys)."""
    dtype = np_dtype(name)
    q_heads, kv_heads, q_len, kv_len, opts = GROUP_CASES[case]
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(2,),
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=24,
        value_dim=opts.get("value_dim"),
    )
    mask, clean_k, clean_v = None, f64(k), f64(v)
    if "mask" in opts:
        mask = random_mask(rng, (2, q_heads, q_len, kv_len), opts["mask"], dtype)
        pad = opts.get("pad", 0)
        mask[..., pad] = True if mask.dtype == np.bool_ else 0.0
        mask[..., :pad] = False
        if not pad:
            forbidden = rng.random(kv_len) < 0.3
            forbidden[0] = False
            mask[..., forbidden] = False if mask.dtype == np.bool_ else -np.inf
            k[..., forbidden, :] = np.nan
            v[..., forbidden, :] = np.inf
            clean_k[..., forbidden, :] = 0.0
            clean_v[..., forbidden, :] = 0.0
        mask = nan_guarded(mask)
    kwargs = dict(is_causal=opts.get("is_causal", False), enable_gqa=True, num_threads=threads)
    with group_tiles(1):
        together = sdpa(q, k, v, mask, **kwargs)
    with group_tiles(0):
        alone = sdpa(q, k, v, mask, **kwargs)
    np.testing.assert_array_equal(f64(together), f64(alone))
    kwargs.pop("num_threads")
    ref_mask = None if mask is None else (mask if mask.dtype == np.bool_ else f64(mask))
    expected = reference.scaled_dot_product_attention(f64(q), clean_k, clean_v, ref_mask, **kwargs)
    assert_result_close(together, expected, name)


@pytest.mark.parametrize("name", HALF_NAMES)
def test_group_tiles_ragged_cache(isa, rng, name):
    """A 16-bit cache whose rows have different lengths, a 12-token chunk (query tiles): group tiles
    give the same bits as head by head."""
    storage = np_dtype(name)  # first: skips bfloat16 without ml_dtypes
    cache = pyattn.KVCache(3, 2, 16, 300, dtype=name)
    lengths = np.array([200, 37, 5])
    cache.append(
        rng.standard_normal((3, 2, 200, 16)).astype(storage),
        rng.standard_normal((3, 2, 200, 16)).astype(storage),
        num_new=lengths,
    )
    cache.append(
        rng.standard_normal((3, 2, 12, 16)).astype(storage), rng.standard_normal((3, 2, 12, 16)).astype(storage)
    )
    q = rng.standard_normal((3, 8, 12, 16)).astype(np.float32)
    with group_tiles(1):
        together = cache.attend(q)
    with group_tiles(0):
        alone = cache.attend(q)
    np.testing.assert_array_equal(together, alone)
    for b in range(3):
        ref = reference.scaled_dot_product_attention(
            f64(q[b]), f64(cache.keys(b)), f64(cache.values(b)), is_causal="lower_right", enable_gqa=True
        )
        assert_compute_close(together[b], ref, np.dtype(np.float32))
