# SPDX-License-Identifier: MIT
"""Packed variable-length batches and the layer's variant options.

pyattn.varlen_attention against pyattn.reference.varlen_attention (float64) on every compiled ISA
and dtype: empty sequences (no queries, no keys), length-1 sequences, sequences long enough for the
query tiles, GQA, every causal alignment (each sequence's own L and S), every variant option, strided
packed views (a fused QKV buffer), out=; varlen equals per-sequence scaled_dot_product_attention calls
exactly; errors name cu_seqlens. mha / MultiHeadAttention: the variant options against
reference.mha, cu_seqlens against per-sequence calls, sinks / alibi_slopes in state_dict, a cached
decode with the options equal to the full causal pass.
"""

import numpy as np
import pytest

import pyattn
from pyattn import reference

from conftest import f64, np_dtype, random_array, tol

DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16"]
# (query lengths, key lengths) of the packed sequences: empty ones, single tokens, decode-sized and
# tile-sized ones, L != S.
LENGTHS = {
    "equal": ([5, 0, 1, 40, 130, 3], [5, 0, 1, 40, 130, 3]),
    "ragged": ([7, 0, 1, 33, 3, 2], [7, 4, 1, 60, 0, 200]),
}


@pytest.fixture(params=DTYPE_NAMES)
def dtype(request):
    return np_dtype(request.param)


def cu(lengths, int_dtype=np.int64):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(int_dtype)


def packed(rng, lengths_q, lengths_k, dtype, hq=4, hk=2, e=24, ev=16):
    q = random_array(rng, (sum(lengths_q), hq, e), dtype)
    k = random_array(rng, (sum(lengths_k), hk, e), dtype)
    v = random_array(rng, (sum(lengths_k), hk, ev), dtype)
    return q, k, v


VARIANTS = {
    "none": {},
    "causal": {"is_causal": True},
    "lower_right+window": {"is_causal": "lower_right", "window": (6, 0)},
    "window both sides": {"window": (3, 2)},
    "softcap+sinks+alibi": {
        "softcap": 2.5,
        "sinks": np.array([0.5, -1.0, 2.0, -np.inf]),
        "alibi_slopes": [0.3, 0, -0.1, 0.05],
    },
}


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_varlen_matches_reference(isa, rng, dtype, lengths, variant):
    lq, lk = LENGTHS[lengths]
    q, k, v = packed(rng, lq, lk, dtype)
    options = VARIANTS[variant]
    got = pyattn.varlen_attention(q, k, v, cu(lq, np.int32), cu(lk), enable_gqa=True, **options)
    expected = reference.varlen_attention(q, k, v, cu(lq), cu(lk), enable_gqa=True, **options)
    assert got.dtype == dtype and got.shape == expected.shape
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(f64(got), expected, rtol=rtol, atol=atol)


def test_varlen_equals_per_sequence_calls(rng):
    lq, lk = LENGTHS["ragged"]
    q, k, v = packed(rng, lq, lk, np.float32)
    options = {"is_causal": "lower_right", "window": (9, 1), "softcap": 3.0, "sinks": np.zeros(4)}
    got = pyattn.varlen_attention(q, k, v, cu(lq), cu(lk), enable_gqa=True, **options)
    cq, ck = cu(lq), cu(lk)
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        one = pyattn.scaled_dot_product_attention(
            q[cq[b] : cq[b + 1]].swapaxes(0, 1),
            k[ck[b] : ck[b + 1]].swapaxes(0, 1),
            v[ck[b] : ck[b + 1]].swapaxes(0, 1),
            enable_gqa=True,
            **options,
        )
        np.testing.assert_array_equal(got[cq[b] : cq[b + 1]], one.swapaxes(0, 1))


def test_varlen_sequence_without_keys_is_zero(rng):
    q, k, v = packed(rng, [3, 4], [0, 5], np.float32)
    got = pyattn.varlen_attention(q, k, v, cu([3, 4]), cu([0, 5]), enable_gqa=True, sinks=np.ones(4))
    assert np.all(got[:3] == 0)


def test_varlen_reads_strided_views_and_writes_out(rng):
    lengths = [9, 50, 1]
    qkv = random_array(rng, (sum(lengths), 3, 4, 16), np.float32)  # a fused projection's output
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    before = qkv.copy()
    out = np.empty((sum(lengths), 4, 16), np.float32)
    got = pyattn.varlen_attention(q, k, v, cu(lengths), cu(lengths), is_causal=True, out=out)
    assert got is out
    expected = reference.varlen_attention(q, k, v, cu(lengths), cu(lengths), is_causal=True)
    np.testing.assert_allclose(got, expected, *tol(np.float32))
    np.testing.assert_array_equal(qkv, before)


@pytest.mark.parametrize(
    "cu_q, message",
    [
        ([1, 3, 6], "start at 0"),
        ([0, 4, 3, 6], "non-decreasing"),
        ([0, 3, 5], "end at the total"),
        ([0.0, 3.0, 6.0], "int"),
        ([[0, 3, 6]], "1-D"),
    ],
)
def test_varlen_rejects_bad_cu_seqlens(rng, cu_q, message):
    q, k, v = packed(rng, [3, 3], [3, 3], np.float32, hq=2, hk=2)
    with pytest.raises((ValueError, TypeError), match=f"cu_seqlens_q.*{message}|cu_seqlens_q: expected"):
        pyattn.varlen_attention(q, k, v, np.array(cu_q), cu([3, 3]))


def test_varlen_rejects_mismatched_batches(rng):
    q, k, v = packed(rng, [3, 3], [3, 3], np.float32, hq=2, hk=2)
    with pytest.raises(ValueError, match="same length"):
        pyattn.varlen_attention(q, k, v, cu([3, 3]), cu([6]))
    with pytest.raises(ValueError, match="packed"):
        pyattn.varlen_attention(q[None], k, v, cu([3, 3]), cu([3, 3]))


# -- the layer --------------------------------------------------------------------------------------

LAYER_OPTIONS = {"window": (5, 0), "softcap": 4.0}


def make_layer(rng, dtype=np.float32, **options):
    return pyattn.MultiHeadAttention(
        32,
        4,
        num_kv_heads=2,
        dtype=dtype,
        seed=int(rng.integers(1 << 30)),
        sinks=rng.standard_normal(4),
        alibi_slopes=rng.uniform(-0.1, 0.3, 4),
        **options,
    )


def reference_layer_kwargs(layer, **extra):
    sd = layer.state_dict()
    return dict(
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        in_proj_weight=sd["in_proj_weight"],
        in_proj_bias=sd["in_proj_bias"],
        out_proj_weight=sd["out_proj.weight"],
        out_proj_bias=sd["out_proj.bias"],
        window=layer.window,
        softcap=layer.softcap,
        sinks=sd["sinks"],
        alibi_slopes=sd["alibi_slopes"],
        **extra,
    )


@pytest.mark.parametrize("layer_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_layer_variants_match_reference(isa, rng, layer_dtype, is_causal):
    layer = make_layer(rng, layer_dtype, **LAYER_OPTIONS)
    x = random_array(rng, (2, 37, 32), layer_dtype)
    got = layer(x, is_causal=is_causal)
    expected = reference.mha(x, **reference_layer_kwargs(layer, is_causal=is_causal))
    np.testing.assert_allclose(got, expected, *tol(layer_dtype))


def test_layer_packed_batch_equals_per_sequence_calls(isa, rng):
    layer = make_layer(rng, **LAYER_OPTIONS)
    lengths = [5, 0, 17, 1, 40]
    x = random_array(rng, (sum(lengths), 32), np.float32)
    got = layer(x, cu_seqlens=cu(lengths), is_causal=True)
    expected = reference.mha(x, **reference_layer_kwargs(layer, cu_seqlens=cu(lengths), is_causal=True))
    np.testing.assert_allclose(got, expected, *tol(np.float32))
    c = cu(lengths)
    for b, n in enumerate(lengths):
        if n:
            np.testing.assert_array_equal(got[c[b] : c[b + 1]], layer(x[c[b] : c[b + 1]], is_causal=True))


def test_layer_packed_batch_equals_padded_batch(rng):
    """A BERT-style batch: packed without padding equals the padded batch with key_padding_mask."""
    layer = pyattn.MultiHeadAttention(32, 4, seed=3)
    lengths = [12, 3, 30]
    x = random_array(rng, (sum(lengths), 32), np.float32)
    padded = np.zeros((3, 30, 32), np.float32)
    padding = np.ones((3, 30), bool)
    c = cu(lengths)
    for b, n in enumerate(lengths):
        padded[b, :n] = x[c[b] : c[b + 1]]
        padding[b, :n] = False
    got = layer(x, cu_seqlens=c)
    full = layer(padded, key_padding_mask=padding)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(got[c[b] : c[b + 1]], full[b, :n], *tol(np.float32))


def test_layer_state_dict_round_trips_sinks_and_slopes(rng):
    layer = make_layer(rng)
    sd = layer.state_dict()
    assert sd["sinks"].shape == (4,) and sd["alibi_slopes"].shape == (4,)
    other = pyattn.MultiHeadAttention(32, 4, num_kv_heads=2, seed=99)
    assert "sinks" not in other.state_dict()
    other.load_state_dict(sd)
    x = random_array(rng, (1, 9, 32), np.float32)
    np.testing.assert_array_equal(other(x), layer(x))
    sd["sinks"] = np.zeros(3)
    with pytest.raises(ValueError, match="sinks"):
        other.load_state_dict(sd)


def test_layer_cached_decode_with_variants_equals_full_pass(rng):
    layer = make_layer(rng, **LAYER_OPTIONS)
    x = random_array(rng, (2, 24, 32), np.float32)
    full = layer(x, is_causal=True)
    cache = pyattn.KVCache(2, 2, 8, 32)
    steps = [layer(x[:, t : t + 1], kv_cache=cache) for t in range(24)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, *tol(np.float32))


def test_layer_packed_batch_refuses_masks_and_weights(rng):
    layer = make_layer(rng)
    x = random_array(rng, (10, 32), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu([4, 6]), key_padding_mask=np.zeros((2, 6), bool))
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, cu_seqlens=cu([4, 6]), need_weights=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu([4, 5]))
    with pytest.raises(ValueError, match="query"):
        layer(x[None], cu_seqlens=cu([4, 6]))
