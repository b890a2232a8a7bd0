# SPDX-License-Identifier: MIT
"""The float64 reference's attention variants (sliding window, softcap, sinks, ALiBi, packed
sequences) held against independent hand formulas: masks and biases built by loops, softmax written
out, per-sequence calls. These pin the contract the fast path is later tested against."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _load_reference():
    """The reference.py beside these tests in a source tree (it imports no compiled module, so it
    needs no build and the installed package cannot shadow it); the installed one otherwise (wheel
    tests run a copy of tests/)."""
    path = Path(__file__).resolve().parents[1] / "src" / "pyattn" / "reference.py"
    if not path.is_file():
        from pyattn import reference

        return reference
    spec = importlib.util.spec_from_file_location("_pyattn_reference_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()
sdpa = reference.scaled_dot_product_attention

CAUSAL = [False, True, "upper_left", "lower_right"]
# (L, S): square, fewer queries than keys, more queries than keys, single rows and columns.
SIZES = [(5, 5), (4, 9), (9, 4), (1, 6), (6, 1)]
WINDOWS = [(0, 0), (2, 1), (None, 2), (3, None), (0, None), (None, 0), (None, None)]
PROPERTY = settings(max_examples=60, deadline=None)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def qkv(rng, batch, q_len, kv_len, q_heads=3, kv_heads=None, head_dim=4, value_dim=5):
    """Random float64 query (*batch, Hq, L, E), key (*batch, Hk, S, E), value (*batch, Hk, S, Ev)."""
    kv_heads = q_heads if kv_heads is None else kv_heads
    return (
        rng.standard_normal((*batch, q_heads, q_len, head_dim)),
        rng.standard_normal((*batch, kv_heads, kv_len, head_dim)),
        rng.standard_normal((*batch, kv_heads, kv_len, value_dim)),
    )


def diagonal_offset(is_causal, q_len, kv_len):
    """d(i) - i: query i's diagonal key, S - L for lower-right alignment."""
    return kv_len - q_len if is_causal == "lower_right" else 0


def window_mask(q_len, kv_len, is_causal, window):
    """Boolean (L, S) mask of the causal rule and the window, one (i, j) at a time."""
    offset = diagonal_offset(is_causal, q_len, kv_len)
    left, right = window if window is not None else (None, None)
    mask = np.zeros((q_len, kv_len), dtype=bool)
    for i in range(q_len):
        d = i + offset
        for j in range(kv_len):
            allowed = True
            if is_causal is not False and j > d:
                allowed = False
            if left is not None and j < d - left:
                allowed = False
            if right is not None and j > d + right:
                allowed = False
            mask[i, j] = allowed
    return mask


def alibi_bias(slopes, q_len, kv_len, is_causal):
    """Float (..., H, L, S) bias -slope * |d(i) - j|, one entry at a time."""
    slopes = np.asarray(slopes, dtype=np.float64)
    offset = diagonal_offset(is_causal, q_len, kv_len)
    bias = np.empty(slopes.shape + (q_len, kv_len))
    for index in np.ndindex(*slopes.shape):
        for i in range(q_len):
            for j in range(kv_len):
                bias[index + (i, j)] = -slopes[index] * abs(i + offset - j)
    return bias


def hand_attention(logits, value, sinks=None):
    """softmax over the last axis of `logits` (every row has a finite entry) @ value; with sinks (H,),
    an extra logit column sinks[h] whose value row is zero. Returns (out, weights of the real keys)."""
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks)[:, None, None], logits.shape[:-1] + (1,))
        logits = np.concatenate([logits, column], axis=-1)
        zero_row = np.zeros(value.shape[:-2] + (1, value.shape[-1]))
        value = np.concatenate([value, zero_row], axis=-2)
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = exps / exps.sum(axis=-1, keepdims=True)
    out = np.einsum("...ls,...se->...le", weights, value)
    kv_len = logits.shape[-1] - (0 if sinks is None else 1)
    return out, weights[..., :kv_len]


def hand_scores(q, k, scale=None):
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    return np.einsum("...le,...se->...ls", q, k) * scale


# ----------------------------------------------------------------------------------------------
# window


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("q_len, kv_len", SIZES)
@pytest.mark.parametrize("window", WINDOWS)
def test_window_equals_explicit_mask(is_causal, q_len, kv_len, window):
    rng = np.random.default_rng(53)
    q, k, v = qkv(rng, (2,), q_len, kv_len)
    got, got_w = sdpa(q, k, v, is_causal=is_causal, window=window, return_weights=True)
    want, want_w = sdpa(q, k, v, window_mask(q_len, kv_len, is_causal, window), return_weights=True)
    close(got, want)
    close(got_w, want_w)


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("q_len, kv_len", [(4, 9), (9, 4)])
def test_window_combines_with_masks(is_causal, q_len, kv_len):
    # All three rules apply: the allowed set is the intersection, and a bool and a float mask both work.
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), q_len, kv_len)
    user = rng.random((2, 1, q_len, kv_len)) < 0.7
    explicit = user & window_mask(q_len, kv_len, is_causal, (1, 2))
    close(sdpa(q, k, v, user, is_causal=is_causal, window=(1, 2)), sdpa(q, k, v, explicit))
    additive = np.where(user, rng.standard_normal(user.shape), -np.inf)
    explicit_additive = np.where(explicit, additive, -np.inf)
    close(sdpa(q, k, v, additive, is_causal=is_causal, window=(1, 2)), sdpa(q, k, v, explicit_additive))


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("q_len, kv_len", SIZES)
def test_window_covering_everything_is_no_window(is_causal, q_len, kv_len):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (), q_len, kv_len)
    want = sdpa(q, k, v, is_causal=is_causal)
    wide = q_len + kv_len
    for window in [(wide, wide), (None, None), (wide, None), (None, wide)]:
        np.testing.assert_array_equal(sdpa(q, k, v, is_causal=is_causal, window=window), want)


def test_window_rows_without_keys_are_zero():
    # L > S, lower-right: the first queries' windows lie left of every key.
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (), 6, 2)
    out, weights = sdpa(q, k, v, is_causal="lower_right", window=(0, 0), return_weights=True)
    empty = ~window_mask(6, 2, "lower_right", (0, 0)).any(axis=-1)
    assert empty.sum() == 4
    np.testing.assert_array_equal(out[:, empty], 0.0)
    np.testing.assert_array_equal(weights[:, empty], 0.0)


@PROPERTY
@given(
    q_len=st.integers(1, 12),
    kv_len=st.integers(0, 12),
    is_causal=st.sampled_from(CAUSAL),
    left=st.one_of(st.none(), st.integers(0, 14)),
    right=st.one_of(st.none(), st.integers(0, 14)),
    seed=st.integers(0, 2**32 - 1),
)
def test_window_property(q_len, kv_len, is_causal, left, right, seed):
    q, k, v = qkv(np.random.default_rng(seed), (), q_len, kv_len, q_heads=2)
    mask = window_mask(q_len, kv_len, is_causal, (left, right))
    close(sdpa(q, k, v, is_causal=is_causal, window=(left, right)), sdpa(q, k, v, mask))


# ----------------------------------------------------------------------------------------------
# softcap


@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_softcap_equals_formula(softcap):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2,), 6, 7)
    q = 4.0 * q  # scores of several units, so that the cap bites
    scores = hand_scores(q, k)
    want, want_w = hand_attention(softcap * np.tanh(scores / softcap), v)
    got, got_w = sdpa(q, k, v, softcap=softcap, return_weights=True)
    close(got, want)
    close(got_w, want_w)
    assert not np.allclose(got, sdpa(q, k, v))


def test_softcap_comes_before_the_float_mask():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (), 5, 5)
    mask = 10.0 * rng.standard_normal((5, 5))
    scores = hand_scores(q, k, scale=2.0)
    want, _ = hand_attention(1.5 * np.tanh(scores / 1.5) + mask, v)
    close(sdpa(q, k, v, mask, softcap=1.5, scale=2.0), want)


# ----------------------------------------------------------------------------------------------
# sinks


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_sinks_equal_an_extra_zero_value_column(is_causal):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (2,), 4, 7)
    sinks = np.array([-1.0, 0.0, 2.5])
    logits = np.where(window_mask(4, 7, is_causal, None), hand_scores(q, k), -np.inf)
    want, want_w = hand_attention(logits, v, sinks)
    got, got_w = sdpa(q, k, v, is_causal=is_causal, sinks=sinks, return_weights=True)
    close(got, want)
    close(got_w, want_w)
    assert (got_w.sum(axis=-1) < 1.0).all()


def test_sinks_equal_an_extra_key_through_the_mask():
    # The same extra column another way: a zero key (score 0) whose float mask entry is the sink.
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2,), 5, 6)
    sinks = np.array([0.3, -2.0, 4.0])
    mask = np.where(rng.random((5, 6)) < 0.8, rng.standard_normal((5, 6)), -np.inf)
    k_ext = np.concatenate([k, np.zeros((2, 3, 1, 4))], axis=-2)
    v_ext = np.concatenate([v, np.zeros((2, 3, 1, 5))], axis=-2)
    mask_ext = np.concatenate([np.broadcast_to(mask, (3, 5, 6)), np.broadcast_to(sinks[:, None, None], (3, 5, 1))], -1)
    want, want_w = sdpa(q, k_ext, v_ext, mask_ext, return_weights=True)
    got, got_w = sdpa(q, k, v, mask, sinks=sinks, return_weights=True)
    close(got, want)
    close(got_w, want_w[..., :6])


def test_sinks_minus_inf_is_no_sinks():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, (2,), 5, 6)
    mask = rng.random((5, 6)) < 0.7
    for is_causal in CAUSAL:
        want = sdpa(q, k, v, mask, is_causal=is_causal, return_weights=True)
        got = sdpa(q, k, v, mask, is_causal=is_causal, sinks=np.full(3, -np.inf), return_weights=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("sink", [-np.inf, -3.0, 0.0, 40.0])
def test_sinks_fully_masked_row_is_zero(sink):
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (), 4, 5)
    k[:, 2], v[:, 2] = np.nan, np.inf  # forbidden below for every query: must not leak
    mask = rng.random((4, 5)) < 0.6
    mask[:, 2] = False
    mask[1] = False
    out, weights = sdpa(q, k, v, mask, sinks=np.full(3, sink), return_weights=True)
    np.testing.assert_array_equal(out[:, 1], 0.0)
    np.testing.assert_array_equal(weights[:, 1], 0.0)
    assert np.isfinite(out).all()


def test_sinks_are_stable_for_large_logits():
    # exp of either the scores or the sink alone would overflow; their ratio is ordinary.
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (), 3, 4, q_heads=2)
    scores = hand_scores(q, k)
    sinks = np.array([900.0, -900.0])
    shift = 1000.0
    got = sdpa(q, k, v, np.full((3, 4), shift), sinks=sinks + shift)
    want, _ = hand_attention(scores, v, sinks)
    close(got, want)
    out = sdpa(q, k, v, sinks=np.array([np.inf, np.inf]))
    np.testing.assert_array_equal(out, 0.0)


def test_sinks_with_a_two_dimensional_query():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, (), 4, 6, q_heads=1)
    want, want_w = hand_attention(hand_scores(q, k), v, [0.7])
    got, got_w = sdpa(q[0], k[0], v[0], sinks=[0.7], return_weights=True)
    close(got, want[0])
    close(got_w, want_w[0])


@PROPERTY
@given(
    q_len=st.integers(1, 8),
    kv_len=st.integers(1, 8),
    sink=st.floats(-30.0, 30.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sinks_property(q_len, kv_len, sink, seed):
    q, k, v = qkv(np.random.default_rng(seed), (), q_len, kv_len, q_heads=2)
    sinks = np.array([sink, -sink])
    want, want_w = hand_attention(hand_scores(q, k), v, sinks)
    got, got_w = sdpa(q, k, v, sinks=sinks, return_weights=True)
    close(got, want)
    close(got_w, want_w)


# ----------------------------------------------------------------------------------------------
# ALiBi


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("q_len, kv_len", [(5, 5), (3, 8), (8, 3)])
def test_alibi_equals_explicit_bias(is_causal, q_len, kv_len):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, (2,), q_len, kv_len)
    slopes = np.array([0.5, 0.0, -0.25])
    bias = alibi_bias(slopes, q_len, kv_len, is_causal)
    got, got_w = sdpa(q, k, v, is_causal=is_causal, alibi_slopes=slopes, return_weights=True)
    want, want_w = sdpa(q, k, v, bias, is_causal=is_causal, return_weights=True)
    close(got, want)
    close(got_w, want_w)


def test_alibi_batched_slopes():
    # (B, Hq) slopes broadcast against the output's batch dimensions, here adding one to unbatched inputs.
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, (), 4, 6)
    slopes = rng.standard_normal((2, 3))
    got = sdpa(q, k, v, is_causal="lower_right", alibi_slopes=slopes)
    assert got.shape == (2, 3, 4, 5)
    close(got, sdpa(q, k, v, alibi_bias(slopes, 4, 6, "lower_right"), is_causal="lower_right"))


@pytest.mark.parametrize("slopes", [[0.3], [-0.3], [0.0], [[0.3], [-1.0]]])
def test_alibi_with_a_two_dimensional_query(slopes):
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, (), 4, 6, q_heads=1)
    bias = alibi_bias(slopes, 4, 6, False)[..., 0, :, :]
    close(sdpa(q[0], k[0], v[0], alibi_slopes=slopes), sdpa(q[0], k[0], v[0], bias))


def test_variants_together_follow_the_stated_order():
    # scale, softcap, + ALiBi, + float mask (its -inf and the window forbid), softmax with the sink.
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, (2,), 6, 8)
    slopes, sinks = np.array([0.4, -0.1, 0.0]), np.array([1.0, -1.0, 0.0])
    mask = np.where(rng.random((6, 8)) < 0.85, rng.standard_normal((6, 8)), -np.inf)
    allowed = window_mask(6, 8, "lower_right", (3, 1)) & (mask != -np.inf)
    logits = 2.0 * np.tanh(hand_scores(q, k, 0.7) / 2.0) + alibi_bias(slopes, 6, 8, "lower_right") + mask
    logits = np.where(allowed, logits, -np.inf)
    want, want_w = hand_attention(logits, v, sinks)
    got, got_w = sdpa(
        q,
        k,
        v,
        mask,
        is_causal="lower_right",
        scale=0.7,
        window=(3, 1),
        softcap=2.0,
        sinks=sinks,
        alibi_slopes=slopes,
        return_weights=True,
    )
    close(got, want)
    close(got_w, want_w)


# ----------------------------------------------------------------------------------------------
# varlen_attention


def pack(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


VARIANTS = [
    {},
    {"is_causal": True},
    {"is_causal": "lower_right", "window": (2, 0), "sinks": np.array([0.5, -1.0, 0.0, 2.0])},
    {"softcap": 1.5, "alibi_slopes": np.array([0.25, 0.0, -0.5, 1.0]), "scale": 0.3},
]
# mha takes no scale: the last variant without it.
MHA_VARIANTS = VARIANTS[:3] + [{"softcap": 1.5, "alibi_slopes": np.array([0.25, 0.0, -0.5, 1.0])}]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_varlen_equals_per_sequence_calls(variant, kv_heads):
    rng = np.random.default_rng(19)
    q_lens, kv_lens = [3, 0, 1, 5, 2, 4], [4, 2, 1, 5, 0, 1]
    q = rng.standard_normal((sum(q_lens), 4, 3))
    k = rng.standard_normal((sum(kv_lens), kv_heads, 3))
    v = rng.standard_normal((sum(kv_lens), kv_heads, 6))
    cu_q, cu_k = pack(q_lens), pack(kv_lens)
    got = reference.varlen_attention(q, k, v, cu_q, cu_k, enable_gqa=kv_heads != 4, **variant)
    assert got.shape == (sum(q_lens), 4, 6) and got.dtype == np.float64
    group = 4 // kv_heads
    for b in range(len(q_lens)):
        qb = q[cu_q[b] : cu_q[b + 1]].transpose(1, 0, 2)
        # Grouped K/V expanded by hand: query head h reads kv head h // group.
        kb = np.repeat(k[cu_k[b] : cu_k[b + 1]], group, axis=1).transpose(1, 0, 2)
        vb = np.repeat(v[cu_k[b] : cu_k[b + 1]], group, axis=1).transpose(1, 0, 2)
        want = sdpa(qb, kb, vb, **variant).transpose(1, 0, 2)
        close(got[cu_q[b] : cu_q[b + 1]], want)
    np.testing.assert_array_equal(got[cu_q[4] : cu_q[5]], 0.0)  # sequence 4 has no keys


def test_varlen_without_sequences_or_tokens():
    q, k, v = np.zeros((0, 2, 3)), np.zeros((0, 2, 3)), np.zeros((0, 2, 4))
    assert reference.varlen_attention(q, k, v, [0], [0]).shape == (0, 2, 4)
    assert reference.varlen_attention(q, k, v, [0, 0, 0], [0, 0, 0]).shape == (0, 2, 4)


# ----------------------------------------------------------------------------------------------
# mha with cu_seqlens


@pytest.mark.parametrize("num_kv_heads", [None, 1])
@pytest.mark.parametrize("variant", MHA_VARIANTS)
def test_mha_packed_equals_per_sequence_calls(num_kv_heads, variant):
    rng = np.random.default_rng(20)
    embed_dim, num_heads, kdim = 8, 4, 5
    kv_dim = embed_dim if num_kv_heads is None else 2
    layer = {
        "q_proj_weight": rng.standard_normal((embed_dim, embed_dim)),
        "k_proj_weight": rng.standard_normal((kv_dim, kdim)),
        "v_proj_weight": rng.standard_normal((kv_dim, kdim)),
        "in_proj_bias": rng.standard_normal(embed_dim + 2 * kv_dim),
        "out_proj_weight": rng.standard_normal((embed_dim, embed_dim)),
        "out_proj_bias": rng.standard_normal(embed_dim),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
    }
    lengths = [3, 1, 0, 6]
    cu = pack(lengths)
    x = rng.standard_normal((sum(lengths), embed_dim))
    memory = rng.standard_normal((sum(lengths), kdim))
    got = reference.mha(x, memory, cu_seqlens=cu, **layer, **variant)
    assert got.shape == x.shape
    for b in range(len(lengths)):
        rows = slice(cu[b], cu[b + 1])
        close(got[rows], reference.mha(x[rows], memory[rows], **layer, **variant))


@pytest.mark.parametrize("variant", MHA_VARIANTS[1:])
def test_mha_passes_variants_to_attention(variant):
    # The layer by hand: project, split heads, the reference attention with the variant, merge, project.
    rng = np.random.default_rng(21)
    batch, q_len, embed_dim, num_heads = 2, 5, 8, 4
    w_in, w_out = rng.standard_normal((3 * embed_dim, embed_dim)), rng.standard_normal((embed_dim, embed_dim))
    x = rng.standard_normal((batch, q_len, embed_dim))
    q, k, v = (
        (x @ w.T).reshape(batch, q_len, num_heads, embed_dim // num_heads).transpose(0, 2, 1, 3)
        for w in np.split(w_in, 3)
    )
    context = sdpa(q, k, v, **variant).transpose(0, 2, 1, 3).reshape(batch, q_len, embed_dim)
    got = reference.mha(x, num_heads=num_heads, in_proj_weight=w_in, out_proj_weight=w_out, **variant)
    close(got, context @ w_out.T)


# ----------------------------------------------------------------------------------------------
# validation


def _small():
    return qkv(np.random.default_rng(0), (), 3, 4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"window": 3}, TypeError, "window"),
        ({"window": "ab"}, TypeError, "window"),
        ({"window": (1,)}, TypeError, "window"),
        ({"window": (1, 2, 3)}, TypeError, "window"),
        ({"window": (-1, 0)}, ValueError, "window"),
        ({"window": (0, -2)}, ValueError, "window"),
        ({"window": (1.5, 0)}, TypeError, "window"),
        ({"window": (True, 0)}, TypeError, "window"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": np.inf}, ValueError, "softcap"),
        ({"softcap": np.nan}, ValueError, "softcap"),
        ({"softcap": "1"}, TypeError, "softcap"),
        ({"softcap": True}, TypeError, "softcap"),
        ({"sinks": np.zeros(2)}, ValueError, "sinks"),
        ({"sinks": np.zeros((1, 3))}, ValueError, "sinks"),
        ({"sinks": 0.0}, ValueError, "sinks"),
        ({"sinks": [0.0, np.nan, 0.0]}, ValueError, "sinks"),
        ({"alibi_slopes": np.zeros(4)}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.zeros((2, 2))}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": 0.5}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": [0.5, np.nan, 0.0]}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": [0.5, np.inf, 0.0]}, ValueError, "alibi_slopes"),
    ],
)
def test_sdpa_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        sdpa(*_small(), **kwargs)


def _packed():
    rng = np.random.default_rng(1)
    return rng.standard_normal((5, 2, 3)), rng.standard_normal((6, 2, 3)), rng.standard_normal((6, 2, 4))


@pytest.mark.parametrize(
    "cu_q, cu_k, kwargs, match",
    [
        ([[0, 5]], [0, 6], {}, "cu_seqlens_q"),
        ([0.0, 5.0], [0, 6], {}, "cu_seqlens_q"),
        ([], [0, 6], {}, "cu_seqlens_q"),
        ([1, 5], [0, 6], {}, "cu_seqlens_q"),
        ([0, 4], [0, 6], {}, "cu_seqlens_q"),
        ([0, 3, 2, 5], [0, 1, 2, 6], {}, "cu_seqlens_q"),
        ([0, 5], [0, 7], {}, "cu_seqlens_k"),
        ([0, 5], [0, 6, 3, 6], {}, "cu_seqlens_k"),
        ([0, 2, 5], [0, 6], {}, "cu_seqlens_q and cu_seqlens_k"),
        ([0, 5], [0, 6], {"alibi_slopes": np.zeros((1, 2))}, "alibi_slopes"),
        ([0, 5], [0, 6], {"sinks": np.zeros(3)}, "sinks"),
    ],
)
def test_varlen_validation(cu_q, cu_k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        reference.varlen_attention(*_packed(), cu_q, cu_k, **kwargs)


def test_varlen_needs_packed_inputs():
    q, k, v = _packed()
    with pytest.raises(ValueError, match="query"):
        reference.varlen_attention(q[None], k, v, [0, 5], [0, 6])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attn_mask": np.zeros((5, 5), dtype=bool)}, "attn_mask"),
        ({"key_padding_mask": np.zeros(5, dtype=bool)}, "key_padding_mask"),
        ({"need_weights": True}, "need_weights"),
        ({"query": np.zeros((1, 5, 4))}, "query"),
        ({"key": np.zeros((4, 4))}, "key"),
        ({"sinks": np.zeros(3)}, "sinks"),
        ({"alibi_slopes": np.zeros((1, 2))}, "alibi_slopes"),
        ({"cu_seqlens": [0, 2, 4]}, "cu_seqlens"),
    ],
)
def test_mha_packed_validation(kwargs, match):
    rng = np.random.default_rng(2)
    args = {
        "query": rng.standard_normal((5, 4)),
        "num_heads": 2,
        "in_proj_weight": rng.standard_normal((12, 4)),
        "out_proj_weight": rng.standard_normal((4, 4)),
        "cu_seqlens": [0, 2, 5],
    }
    with pytest.raises(ValueError, match=match):
        reference.mha(**{**args, **kwargs})
