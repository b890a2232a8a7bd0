# SPDX-License-Identifier: MIT
"""Exact partial attention: return_lse and merge_attention_states.

The log-sum-exp of scaled_dot_product_attention, varlen_attention and KVCache.attend against the
float64 reference on every ISA and dtype (both kernel paths, split key ranges, masks, windows,
sinks, fully masked rows), and merge_attention_states against the reference merge and, what it is
for, against the unsplit call: any split of the keys (random cut points, empty shards, shards a
mask or the causal rule forbids entirely), merged, equals the call over all keys to the table's
tolerance; sinks applied once at the merge equal sinks in the call; -inf parts never leak their
outputs; errors name their argument.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference

from conftest import f64, make_qkv, np_dtype, tol

DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16"]


@pytest.fixture(params=DTYPE_NAMES)
def name(request):
    return request.param


def lse_dtype(name):
    """The lse's dtype: the compute dtype (float32 for float32 and 16-bit inputs)."""
    return np.float64 if name == "float64" else np.float32


def assert_lse(got, want, name):
    assert got.dtype == lse_dtype(name)
    rtol, atol = tol(lse_dtype(name))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_array_equal(got[~finite], want[~finite])  # -inf where no key is allowed
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


@pytest.mark.parametrize("q_len, kv_len", [(1, 37), (3, 300), (37, 37), (130, 1030)])
@pytest.mark.parametrize("is_causal", [False, "lower_right"])
def test_lse_matches_reference(isa, rng, name, q_len, kv_len, is_causal):
    q, k, v = make_qkv(rng, np_dtype(name), batch=(2,), q_heads=4, kv_heads=2, q_len=q_len, kv_len=kv_len, head_dim=16)
    out, lse = pyattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True, return_lse=True)
    want_out, want_lse = reference.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, enable_gqa=True, return_lse=True
    )
    assert lse.shape == out.shape[:-1]
    assert_lse(lse, want_lse, name)
    np.testing.assert_allclose(f64(out), want_out, *tol(np_dtype(name)))


@pytest.mark.parametrize("q_len", [1, 40])
def test_lse_with_variants_masks_and_weights(isa, rng, q_len):
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=4, q_len=q_len, kv_len=70, head_dim=16)
    mask = rng.random((2, 1, q_len, 70)) < 0.6
    mask[0, 0, 0] = False  # a row without an allowed key: lse -inf (with a sink: the sink)
    options = {"window": (20, 3), "softcap": 4.0, "alibi_slopes": np.linspace(0, 0.2, 4), "sinks": np.ones(4)}
    for opts in ({}, options, {k: v for k, v in options.items() if k != "sinks"}):
        got = pyattn.scaled_dot_product_attention(q, k, v, mask, return_weights=True, return_lse=True, **opts)
        want = reference.scaled_dot_product_attention(q, k, v, mask, return_weights=True, return_lse=True, **opts)
        assert len(got) == 3
        np.testing.assert_allclose(got[1], want[1], *tol(np.float32))
        assert_lse(got[2], want[2], "float32")


def test_lse_of_split_key_ranges_and_threads(rng):
    # Few heads and a long key range: the drivers split the keys into chunks and merge them, and the
    # lse comes out of that merge; the same bits for any thread count.
    q, k, v = make_qkv(rng, np.float32, batch=(1,), q_heads=1, q_len=2, kv_len=40000, head_dim=32)
    one = pyattn.scaled_dot_product_attention(q, k, v, return_lse=True, num_threads=1)
    two = pyattn.scaled_dot_product_attention(q, k, v, return_lse=True, num_threads=2)
    np.testing.assert_array_equal(one[1], two[1])
    assert_lse(two[1], reference.scaled_dot_product_attention(q, k, v, return_lse=True)[1], "float32")
    q, k, v = make_qkv(rng, np.float32, batch=(1,), q_heads=1, q_len=20, kv_len=20000, head_dim=32)
    got = pyattn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", return_lse=True)
    want = reference.scaled_dot_product_attention(q, k, v, is_causal="lower_right", return_lse=True)
    assert_lse(got[1], want[1], "float32")


def test_cache_and_varlen_lse(isa, rng):
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=4, kv_heads=2, q_len=3, kv_len=50, head_dim=8, guard=False)
    cache = pyattn.KVCache(2, 2, 8, 64)
    cache.append(k[:, :, :47], v[:, :, :47])
    cache.append(k[:, :, 47:], v[:, :, 47:])
    out, lse = cache.attend(q, return_lse=True, window=(10, 0))
    want = reference.scaled_dot_product_attention(
        q, k, v, is_causal="lower_right", enable_gqa=True, window=(10, 0), return_lse=True
    )
    assert_lse(lse, want[1], "float32")
    lengths_q, lengths_k = [3, 0, 5], [7, 4, 0]
    cq, ck = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    qp = rng.standard_normal((8, 4, 8)).astype(np.float32)
    kp = rng.standard_normal((11, 2, 8)).astype(np.float32)
    vp = rng.standard_normal((11, 2, 8)).astype(np.float32)
    got = pyattn.varlen_attention(qp, kp, vp, cq, ck, enable_gqa=True, return_lse=True)
    want = reference.varlen_attention(qp, kp, vp, cq, ck, enable_gqa=True, return_lse=True)
    assert got[1].shape == (4, 8)
    assert_lse(got[1], want[1], "float32")
    assert np.all(got[1][:, 3:] == -np.inf)  # the last sequence has no keys


# -- merging ----------------------------------------------------------------------------------------


def split_calls(q, k, v, cuts, is_causal=False, window=None, **options):
    """Partial results over the key shards [cuts[i], cuts[i+1]) of one call, each shard's causal rule
    and window given as an explicit mask of the global key positions (lower-right alignment)."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    i = np.arange(q_len)[:, None] + (kv_len - q_len)
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        j = np.arange(a, b)[None, :]
        allowed = np.ones((q_len, b - a), bool)
        if is_causal:
            allowed &= j <= i
        if window is not None:
            allowed &= j >= i - window
        out, lse = pyattn.scaled_dot_product_attention(
            q, k[..., a:b, :], v[..., a:b, :], allowed, return_lse=True, **options
        )
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("q_len", [1, 3, 33])
@pytest.mark.parametrize("cuts", [[0, 100], [0, 10, 10, 55, 100], [0, 1, 2, 99, 100], [0, 0, 0, 100, 100]])
@pytest.mark.parametrize("mode", ["encoder", "causal", "window"])
def test_merged_shards_equal_the_unsplit_call(isa, rng, name, q_len, cuts, mode):
    q, k, v = make_qkv(rng, np_dtype(name), batch=(2,), q_heads=4, kv_heads=2, q_len=q_len, kv_len=100, head_dim=16)
    causal = mode != "encoder"
    window = 30 if mode == "window" else None
    outs, lses = split_calls(q, k, v, cuts, causal, window, enable_gqa=True)
    merged, lse = pyattn.merge_attention_states(outs, lses)
    full, full_lse = pyattn.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal="lower_right" if causal else False,
        window=(window, None) if window else None,
        enable_gqa=True,
        return_lse=True,
    )
    compute = lse_dtype(name)
    assert merged.dtype == compute and lse.dtype == compute
    rtol, atol = tol(name if name in ("float16", "bfloat16") else compute)
    if name in ("float16", "bfloat16"):
        # Each part's output was rounded to 16 bits on its own: the merge carries those roundings,
        # which are relative to the parts' outputs, not to the (smaller, after cancellation) result.
        atol = rtol * float(np.abs(f64(full)).max())
    np.testing.assert_allclose(merged, f64(full), rtol=rtol, atol=atol)
    assert_lse(lse, f64(full_lse), "float64" if compute == np.float64 else "float32")
    want = reference.merge_attention_states(outs, lses)
    np.testing.assert_allclose(merged, want[0], *tol(compute))


def test_merge_applies_sinks_once(isa, rng):
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=4, q_len=5, kv_len=80, head_dim=16, guard=False)
    sinks = np.array([0.5, -1.0, 3.0, -np.inf])
    outs, lses = split_calls(q, k, v, [0, 30, 80], is_causal=True)
    merged, lse = pyattn.merge_attention_states(outs, lses, sinks=sinks)
    full, full_lse = pyattn.scaled_dot_product_attention(q, k, v, is_causal="lower_right", sinks=sinks, return_lse=True)
    np.testing.assert_allclose(merged, full, *tol(np.float32))
    np.testing.assert_allclose(lse, full_lse, *tol(np.float32))


def test_merge_skips_empty_parts_and_keeps_nan(rng):
    outs = rng.standard_normal((3, 2, 4, 5, 8)).astype(np.float32)
    lses = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    lses[1] = -np.inf
    outs[1] = np.nan  # a part that saw no key: whatever its output holds never reaches the merge
    merged, lse = pyattn.merge_attention_states(outs, lses)
    want = reference.merge_attention_states(outs[[0, 2]], lses[[0, 2]])
    np.testing.assert_allclose(merged, want[0], *tol(np.float32))
    lses[:, 0, 0, 0] = -np.inf  # no part saw a key: zeros and -inf, never NaN
    lses[0, 1, 1, 1] = np.nan
    merged, lse = pyattn.merge_attention_states(outs, lses)
    assert np.all(merged[0, 0, 0] == 0) and lse[0, 0, 0] == -np.inf
    assert np.isnan(merged[1, 1, 1]).all() and np.isnan(lse[1, 1, 1])
    merged_sink, lse_sink = pyattn.merge_attention_states(outs, lses, sinks=np.full(4, 2.0))
    assert np.all(merged_sink[0, 0, 0] == 0) and lse_sink[0, 0, 0] == np.float32(2.0)


def test_merge_inputs_and_out(rng):
    outs = [rng.standard_normal((3, 6, 8)).astype(np.float64) for _ in range(3)]
    lses = [rng.standard_normal((3, 6)) for _ in range(3)]
    before = [o.copy() for o in outs]
    listed = pyattn.merge_attention_states(outs, lses)
    stacked = pyattn.merge_attention_states(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(listed[0], stacked[0])
    out = np.empty((3, 6, 8))
    got, _ = pyattn.merge_attention_states(outs, lses, out=out, num_threads=1)
    assert got is out
    np.testing.assert_array_equal(got, listed[0])
    for o, b in zip(outs, before):
        np.testing.assert_array_equal(o, b)
    strided = [np.asfortranarray(o) for o in outs]  # copied into the compute layout, same result
    np.testing.assert_array_equal(pyattn.merge_attention_states(strided, lses)[0], listed[0])


@pytest.mark.parametrize(
    "outputs, lses, kwargs, error, match",
    [
        ("stacked", "stacked_short", {}, ValueError, "lses"),
        ("mismatch", "stacked", {}, ValueError, "outputs"),
        ("stacked", "stacked", {"sinks": np.zeros(3)}, ValueError, "sinks"),
        ("stacked", "stacked", {"out": np.zeros((2, 4, 5, 8), np.float64)}, TypeError, "out"),
        ("stacked", "stacked", {"out": np.zeros((2, 4, 5, 7), np.float32)}, ValueError, "out"),
        ("ints", "stacked", {}, TypeError, "outputs"),
        ("none", "stacked", {}, TypeError, "outputs"),
    ],
)
def test_merge_errors(rng, outputs, lses, kwargs, error, match):
    o = rng.standard_normal((3, 2, 4, 5, 8)).astype(np.float32)
    x = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    arrays = {
        "stacked": o,
        "stacked_short": x[:, :, :, :4],
        "mismatch": [o[0], o[1][..., :7]],
        "ints": o.astype(np.int32),
        "none": None,
    }
    lse_arrays = {"stacked": x, "stacked_short": x[:, :, :, :4]}
    with pytest.raises(error, match=match):
        pyattn.merge_attention_states(arrays[outputs], lse_arrays[lses], **kwargs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(0, 64), min_size=0, max_size=5),
    q_len=st.sampled_from([1, 2, 9, 20]),
    mode=st.sampled_from(["encoder", "causal", "window"]),
    seed=st.integers(0, 2**16),
)
def test_any_split_merges_to_the_unsplit_call_property(cuts, q_len, mode, seed):
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, np.float32, batch=(1,), q_heads=2, q_len=q_len, kv_len=64, head_dim=8, guard=False)
    cuts = [0, *sorted(cuts), 64]
    causal = mode != "encoder"
    window = 10 if mode == "window" else None
    outs, lses = split_calls(q, k, v, cuts, causal, window)
    merged, lse = pyattn.merge_attention_states(outs, lses)
    full, full_lse = pyattn.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal="lower_right" if causal else False,
        window=(window, None) if window else None,
        return_lse=True,
    )
    np.testing.assert_allclose(merged, full, *tol(np.float32))
    np.testing.assert_allclose(lse, full_lse, *tol(np.float32))


@pytest.mark.parametrize("q_len", [1, 20])
def test_lse_without_value_columns(isa, rng, q_len):
    # value_dim 0: the output is empty, the log-sum-exp is not (found by the fuzzer: it was skipped).
    q, k, _ = make_qkv(rng, np.float32, batch=(2,), q_heads=3, q_len=q_len, kv_len=9, head_dim=8)
    v = np.zeros((2, 3, 9, 0), np.float32)
    out, lse = pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == (2, 3, q_len, 0)
    assert_lse(lse, reference.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)[1], "float32")
    qp, kp = q[0].transpose(1, 0, 2).copy(), k[0].transpose(1, 0, 2).copy()
    cu_q, cu_k = np.array([0, q_len]), np.array([0, 9])
    got = pyattn.varlen_attention(qp, kp, np.zeros((9, 3, 0), np.float32), cu_q, cu_k, return_lse=True)[1]
    want = reference.varlen_attention(qp, kp, np.zeros((9, 3, 0)), cu_q, cu_k, return_lse=True)[1]
    assert_lse(got, want, "float32")
