# SPDX-License-Identifier: MIT
"""Multi-head attention: pyattn.mha and pyattn.MultiHeadAttention against pyattn.reference.mha (every
ISA, both dtypes) and torch.nn.MultiheadAttention (batch_first=True, eval), grouped-query attention,
the error policy, and the packed GEMM behind the projections (pyattn._core.pack_weights/linear).

Inputs and weights are views cut from NaN-filled parents (conftest.nan_guarded) unless a test says
otherwise. Masks follow PyTorch's MultiheadAttention convention here: a bool attn_mask or
key_padding_mask is True where attending is NOT allowed (the opposite of scaled_dot_product_attention).
Torch comparisons keep at least one allowed key per row: torch returns NaN for fully masked rows, pyattn
a zero context (its output is then out_proj_bias).
"""

import copy
import itertools

import numpy as np
import pytest

import pyattn
import pyattn._tuning
from pyattn import reference

from conftest import TOL, assert_close, forced_isa, nan_guarded, random_array, random_mask

WEIGHT_NAMES = (
    "in_proj_weight",
    "in_proj_bias",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "q_proj_bias",
    "k_proj_bias",
    "v_proj_bias",
    "out_proj_weight",
    "out_proj_bias",
)


def mha(*args, **kwargs):
    """pyattn.mha, looked up at call time (so this module imports while mha is being written)."""
    return pyattn.mha(*args, **kwargs)


def scaled_normal(rng, shape, dtype, fan_in, guard=True):
    """Normal values / sqrt(fan_in), so projections of unit-variance inputs stay O(1)."""
    values = (rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(dtype)
    return nan_guarded(values) if guard else values


def random_weights(
    rng,
    dtype,
    embed_dim,
    num_heads,
    *,
    kdim=None,
    vdim=None,
    bias=True,
    num_kv_heads=None,
    packed=None,
    bias_style="separate",
    guard=True,
):
    """mha() weight keywords in PyTorch layouts, with random (non-zero) biases.

    packed=None packs Q/K/V into in_proj_weight when kdim == vdim == embed_dim. With separate
    weights, bias_style="separate" gives q/k/v_proj_bias and "in_proj" one in_proj_bias (as torch does).
    """
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    kv_dim = (num_heads if num_kv_heads is None else num_kv_heads) * (embed_dim // num_heads)
    packed = (kdim == vdim == embed_dim) if packed is None else packed
    w = {}
    if packed:
        w["in_proj_weight"] = scaled_normal(rng, (embed_dim + 2 * kv_dim, embed_dim), dtype, embed_dim, guard)
    else:
        w["q_proj_weight"] = scaled_normal(rng, (embed_dim, embed_dim), dtype, embed_dim, guard)
        w["k_proj_weight"] = scaled_normal(rng, (kv_dim, kdim), dtype, kdim, guard)
        w["v_proj_weight"] = scaled_normal(rng, (kv_dim, vdim), dtype, vdim, guard)
    w["out_proj_weight"] = scaled_normal(rng, (embed_dim, embed_dim), dtype, embed_dim, guard)
    if bias:
        if packed or bias_style == "in_proj":
            w["in_proj_bias"] = random_array(rng, (embed_dim + 2 * kv_dim,), dtype, guard)
        else:
            w["q_proj_bias"] = random_array(rng, (embed_dim,), dtype, guard)
            w["k_proj_bias"] = random_array(rng, (kv_dim,), dtype, guard)
            w["v_proj_bias"] = random_array(rng, (kv_dim,), dtype, guard)
        w["out_proj_bias"] = random_array(rng, (embed_dim,), dtype, guard)
    return w


def make_inputs(rng, dtype, batch, q_len, kv_len, embed_dim, kdim=None, vdim=None):
    """query (B, L, E), key (B, S, kdim), value (B, S, vdim); batch=None drops the batch axis."""
    lead = () if batch is None else (batch,)
    query = random_array(rng, lead + (q_len, embed_dim), dtype)
    key = random_array(rng, lead + (kv_len, embed_dim if kdim is None else kdim), dtype)
    value = random_array(rng, lead + (kv_len, embed_dim if vdim is None else vdim), dtype)
    return query, key, value


def torch_style_mask(rng, shape, kind, dtype, p_forbidden=0.3, keep_first=True):
    """A PyTorch-MultiheadAttention mask: bool True = NOT allowed; float = random offsets, -inf where
    forbidden. keep_first=True always allows key 0, so no row is fully masked."""
    mask = random_mask(rng, shape, kind, dtype, p_allowed=1 - p_forbidden)  # bool: True = attend
    if kind == "bool":
        mask = ~mask
        if keep_first:
            mask[..., 0] = False
    elif keep_first:
        mask[..., 0] = 0.0
    return mask


def causal_forbidden(q_len, kv_len, offset=0):
    """Bool (L, S), True = NOT allowed: query i may attend keys j <= i + offset."""
    return np.arange(kv_len)[None, :] > np.arange(q_len)[:, None] + offset


def assert_same_result(got, expected, dtype):
    """Compare mha results (out or (out, weights)) with the tolerance table."""
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == 2
        assert got[0].shape == expected[0].shape and got[1].shape == expected[1].shape
        assert_close(got[0], expected[0], dtype)
        assert_close(got[1], expected[1], dtype)
    else:
        assert isinstance(got, np.ndarray) and got.shape == expected.shape
        assert_close(got, expected, dtype)


def check_mha(query, key=None, value=None, **kwargs):
    """Run pyattn.mha and reference.mha with the same arguments, compare, return pyattn's result."""
    got = mha(query, key, value, **kwargs)
    assert_same_result(got, reference.mha(query, key, value, **kwargs), query.dtype.type)
    return got


# --- parity with the reference, every ISA -------------------------------------------------------


@pytest.mark.parametrize(
    "embed_dim, num_heads, batch, q_len, kv_len",
    [
        (8, 8, 2, 7, 7),  # head_dim 1
        (8, 1, 1, 1, 1),
        (48, 4, 3, 17, 17),
        (64, 1, 2, 9, 33),
        (96, 4, 1, 65, 65),
        (96, 8, 2, 1, 129),
        (40, 5, 2, 33, 3),
        (256, 4, 1, 20, 20),  # head_dim 64
        (384, 12, 2, 67, 67),  # MiniLM-sized layer
        (768, 12, 1, 130, 130),  # BERT-base-sized layer
    ],
)
def test_shapes_match_reference(isa, dtype, rng, embed_dim, num_heads, batch, q_len, kv_len):
    query, key, value = make_inputs(rng, dtype, batch, q_len, kv_len, embed_dim)
    if q_len == kv_len:
        key = value = query  # self-attention
    out = check_mha(query, key, value, num_heads=num_heads, **random_weights(rng, dtype, embed_dim, num_heads))
    assert out.shape == (batch, q_len, embed_dim)


# Each case: weight options (random_weights keywords), mha keywords, and mask kinds to build.
OPTION_CASES = {
    "self": dict(),
    "cross_kdim_vdim": dict(weights=dict(kdim=12, vdim=20)),
    "cross_same_dim_separate": dict(weights=dict(packed=False)),
    "separate_in_proj_bias": dict(weights=dict(kdim=12, vdim=20, bias_style="in_proj")),
    "no_bias": dict(weights=dict(bias=False)),
    "no_bias_separate": dict(weights=dict(kdim=12, vdim=20, bias=False)),
    "attn_mask_2d_bool": dict(attn_mask=("2d", "bool")),
    "attn_mask_2d_float": dict(attn_mask=("2d", "float")),
    "attn_mask_3d_bool": dict(attn_mask=("3d", "bool")),
    "attn_mask_3d_float": dict(attn_mask=("3d", "float")),
    "key_padding_bool": dict(key_padding_mask="bool"),
    "key_padding_float": dict(key_padding_mask="float"),
    "both_masks_bool": dict(attn_mask=("3d", "bool"), key_padding_mask="bool"),
    "both_masks_float": dict(attn_mask=("2d", "float"), key_padding_mask="float"),
    "masks_mixed_kinds": dict(attn_mask=("2d", "bool"), key_padding_mask="float"),
    "causal": dict(call=dict(is_causal=True)),
    "causal_upper_left": dict(call=dict(is_causal="upper_left")),
    "causal_lower_right": dict(call=dict(is_causal="lower_right")),
    "causal_and_masks": dict(attn_mask=("3d", "float"), key_padding_mask="bool", call=dict(is_causal=True)),
    "weights_averaged": dict(call=dict(need_weights=True)),
    "weights_per_head": dict(call=dict(need_weights=True, average_attn_weights=False)),
    "weights_masked_causal": dict(
        attn_mask=("2d", "bool"), key_padding_mask="bool", call=dict(need_weights=True, is_causal="lower_right")
    ),
    "gqa_2": dict(weights=dict(num_kv_heads=2), call=dict(num_kv_heads=2, need_weights=True)),
    "mqa_cross": dict(
        weights=dict(kdim=12, vdim=20, num_kv_heads=1), key_padding_mask="bool", call=dict(num_kv_heads=1)
    ),
    "threads_1": dict(call=dict(num_threads=1)),
    "threads_3": dict(attn_mask=("2d", "bool"), call=dict(num_threads=3)),
}


def case_options(rng, dtype, case, batch, num_heads, q_len, kv_len):
    """The masks and call keywords (not the weights) of one OPTION_CASES entry; batch None = unbatched."""
    spec = OPTION_CASES[case]
    options = {}
    if "attn_mask" in spec:
        rank, kind = spec["attn_mask"]
        heads = num_heads if batch is None else batch * num_heads
        shape = (q_len, kv_len) if rank == "2d" else (heads, q_len, kv_len)
        options["attn_mask"] = torch_style_mask(rng, shape, kind, dtype)
    if "key_padding_mask" in spec:
        shape = (kv_len,) if batch is None else (batch, kv_len)
        options["key_padding_mask"] = torch_style_mask(rng, shape, spec["key_padding_mask"], dtype)
    options.update(spec.get("call", {}))
    return options


def build_case(rng, dtype, case, batched, embed_dim=32, num_heads=4, q_len=9, kv_len=13):
    """(query, key, value, mha keywords including weights) for one OPTION_CASES entry."""
    weights = OPTION_CASES[case].get("weights", {})
    batch = 3 if batched else None
    query, key, value = make_inputs(
        rng, dtype, batch, q_len, kv_len, embed_dim, weights.get("kdim"), weights.get("vdim")
    )
    kwargs = dict(num_heads=num_heads, **random_weights(rng, dtype, embed_dim, num_heads, **weights))
    kwargs.update(case_options(rng, dtype, case, batch, num_heads, q_len, kv_len))
    return query, key, value, kwargs


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_reference(isa, dtype, rng, case, batched):
    query, key, value, kwargs = build_case(rng, dtype, case, batched)
    result = check_mha(query, key, value, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    assert out.shape == query.shape


def test_key_and_value_default_to_query(dtype, rng):
    query, _, _ = make_inputs(rng, dtype, 2, 11, 11, 24)
    weights = random_weights(rng, dtype, 24, 3)
    got = mha(query, num_heads=3, **weights)
    assert_close(got, reference.mha(query, query, query, num_heads=3, **weights), dtype)
    np.testing.assert_array_equal(got, mha(query, query, query, num_heads=3, **weights))


def test_strided_inputs_and_weights(isa, dtype, rng):
    # (L, B, E) storage viewed as (B, L, E), weights transposed twice: only last axes are contiguous.
    query = np.swapaxes(random_array(rng, (9, 2, 32), dtype), 0, 1)
    key = np.swapaxes(random_array(rng, (13, 2, 12), dtype), 0, 1)
    value = np.swapaxes(random_array(rng, (13, 2, 20), dtype), 0, 1)
    weights = random_weights(rng, dtype, 32, 4, kdim=12, vdim=20)
    weights["k_proj_weight"] = nan_guarded(weights["k_proj_weight"], pad=3)
    mask = np.asfortranarray(torch_style_mask(rng, (9, 13), "float", dtype))
    check_mha(query, key, value, num_heads=4, attn_mask=mask, need_weights=True, **weights)


def test_fortran_order_weights(isa, dtype, rng):
    # Weights whose last axis is not contiguous (e.g. a transposed (in, out) array) are accepted.
    query, key, value = make_inputs(rng, dtype, 2, 9, 13, 32, kdim=12, vdim=20)
    weights = random_weights(rng, dtype, 32, 4, kdim=12, vdim=20)
    weights["k_proj_weight"] = np.asfortranarray(weights["k_proj_weight"])
    weights["out_proj_weight"] = np.asfortranarray(weights["out_proj_weight"])
    check_mha(query, key, value, num_heads=4, **weights)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_fully_masked_rows_give_out_proj_bias(isa, dtype, rng, batched):
    # Batch 0: every key is padding (NaN/Inf in its input rows must not leak). Lower-right causal
    # with L > S also leaves the first L - S query rows of every batch without a key.
    embed_dim, num_heads, q_len, kv_len = 16, 2, 7, 4
    batch = 2 if batched else None
    query, key, value = make_inputs(rng, dtype, batch, q_len, kv_len, embed_dim)
    key, value = np.array(key), np.array(value)
    padding = np.zeros((2, kv_len), dtype=bool)
    padding[0] = True
    padding[1, -1] = True
    key[..., -1, 3], value[..., -1, 5] = np.nan, np.inf
    if batched:
        key[0, 0, 0] = np.inf
    else:
        padding = padding[1]
    weights = random_weights(rng, dtype, embed_dim, num_heads)
    bias = weights["out_proj_bias"]

    options = dict(num_heads=num_heads, need_weights=True, **weights)
    out, attn = check_mha(query, key, value, key_padding_mask=padding, **options)
    assert np.isfinite(out).all()
    if batched:
        np.testing.assert_array_equal(out[0], np.broadcast_to(bias, out[0].shape))
        assert np.all(attn[0] == 0)

    # Lower-right causal with L > S (finite keys this time).
    key, value = query[..., :kv_len, :], query[..., -kv_len:, :]
    out, attn = check_mha(query, key, value, is_causal="lower_right", **options)
    no_key = q_len - kv_len  # query rows 0 .. L-S-1 see no key
    np.testing.assert_array_equal(out[..., :no_key, :], np.broadcast_to(bias, out[..., :no_key, :].shape))
    assert np.all(attn[..., :no_key, :] == 0)


def test_padded_key_values_never_leak(isa, dtype, rng):
    # Garbage (NaN, Inf) in padded key/value rows: the projections make those K/V rows NaN/Inf,
    # and attention must exclude them rather than multiply them by a zero weight.
    query, key, value = make_inputs(rng, dtype, 2, 5, 9, 16, kdim=6, vdim=10)
    key, value = np.array(key), np.array(value)
    padding = np.zeros((2, 9), dtype=bool)
    padding[0, 4:], padding[1, :2] = True, True
    key[0, 5], value[0, 7], key[1, 0], value[1, 1] = np.nan, np.inf, -np.inf, np.nan
    weights = random_weights(rng, dtype, 16, 4, kdim=6, vdim=10)
    out = check_mha(query, key, value, num_heads=4, key_padding_mask=padding, **weights)
    assert np.isfinite(out).all()


def test_inputs_not_modified(isa, dtype, rng):
    query, key, value, kwargs = build_case(rng, dtype, "separate_in_proj_bias", batched=True)
    kwargs["attn_mask"] = torch_style_mask(rng, (9, 13), "float", dtype)
    kwargs["key_padding_mask"] = torch_style_mask(rng, (3, 13), "bool", dtype)
    arrays = dict(query=query, key=key, value=value, **{n: a for n, a in kwargs.items() if isinstance(a, np.ndarray)})
    before = {n: a.copy() for n, a in arrays.items()}
    mha(query, key, value, need_weights=True, **kwargs)
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)


def test_batch_first_false_is_the_transposed_layout(isa, dtype, rng):
    """batch_first=False (torch's default layout, (len, batch, features)) gives the batch-first
    results transposed, bit for bit: inputs, output, weights (which keep their shape), cross-attention
    of another length, unbatched inputs (no batch axis to move) and decode steps over a cache."""
    query, key, value, kwargs = build_case(rng, dtype, "separate_in_proj_bias", batched=True)
    kwargs["attn_mask"] = torch_style_mask(rng, (9, 13), "float", dtype)
    kwargs["key_padding_mask"] = torch_style_mask(rng, (3, 13), "bool", dtype)
    first = mha(query, key, value, need_weights=True, **kwargs)
    t = lambda x: x.swapaxes(0, 1)  # noqa: E731
    second = mha(t(query), t(key), t(value), need_weights=True, batch_first=False, **kwargs)
    assert second[0].shape == t(first[0]).shape and second[1].shape == first[1].shape
    np.testing.assert_array_equal(second[0], t(first[0]))
    np.testing.assert_array_equal(second[1], first[1])
    np.testing.assert_array_equal(
        mha(query[0], key[0], value[0], batch_first=False, **{n: a for n, a in kwargs.items() if "mask" not in n}),
        mha(query[0], key[0], value[0], **{n: a for n, a in kwargs.items() if "mask" not in n}),
    )

    layer = pyattn.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, seed=3, batch_first=False)
    twin = pyattn.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, seed=3)
    assert "batch_first=False" in repr(layer) and "batch_first" not in repr(twin)
    x = random_array(rng, (3, 6, 16), dtype)
    np.testing.assert_array_equal(layer(t(x), is_causal=True), t(twin(x, is_causal=True)))
    caches = [pyattn.KVCache(3, 2, 4, 16, dtype=dtype) for _ in range(2)]
    steps = [x, x[:, :1] * 0.5, x[:, 1:2] * 2]
    for n, chunk in enumerate(steps):
        num_new = np.array([6, 4, 5]) if n == 0 else None
        got = layer(t(chunk), kv_cache=caches[0], num_new=num_new)
        np.testing.assert_array_equal(got, t(twin(chunk, kv_cache=caches[1], num_new=num_new)))
    np.testing.assert_array_equal(caches[0].keys(1), caches[1].keys(1))
    with pytest.raises(TypeError, match="batch_first"):
        pyattn.MultiHeadAttention(16, 4, batch_first=1)
    with pytest.raises(TypeError, match="batch_first"):
        mha(query, key, value, batch_first="no", **kwargs)


@pytest.mark.parametrize("copy_kind", ["pickle", "deepcopy"])
def test_layers_pickle_and_deepcopy(isa, dtype, rng, copy_kind):
    """A pickled or deep-copied layer computes what the original does, bit for bit, and is its own:
    the packed weights (a per-ISA cache on cache lines) are not carried over but packed again; before,
    an unpickled layer's packed copies came back off their lines and were refused on the first call."""
    import pickle

    clone = (lambda x: pickle.loads(pickle.dumps(x))) if copy_kind == "pickle" else copy.deepcopy
    layer = pyattn.MultiHeadAttention(16, 4, num_kv_heads=2, kdim=6, vdim=10, dtype=dtype, seed=5, batch_first=False)
    query, key, value = (t.swapaxes(0, 1) for t in make_inputs(rng, dtype, 2, 5, 7, 16, kdim=6, vdim=10))
    twin = clone(layer)
    assert repr(twin) == repr(layer)
    packed, _ = twin._weights.packed()  # packed again, on cache lines as pack_weights allocates them
    assert all(p.ctypes.data % 64 == 0 for p in packed)
    np.testing.assert_array_equal(twin(query, key, value), layer(query, key, value))
    np.testing.assert_array_equal(clone(query), query)  # and the arrays pickle brings back are usable
    np.testing.assert_array_equal(twin(clone(query), clone(key), clone(value)), layer(query, key, value))
    state = layer.state_dict()
    state["out_proj.weight"] = state["out_proj.weight"] * 2
    layer.load_state_dict(state)  # the copy keeps its own weights
    assert not np.array_equal(twin(query, key, value), layer(query, key, value))
    weights = {n.replace(".", "_"): clone(w) for n, w in twin.state_dict().items()}
    np.testing.assert_array_equal(
        mha(clone(query), clone(key), clone(value), num_heads=4, num_kv_heads=2, batch_first=False, **weights),
        twin(query, key, value),
    )


@pytest.mark.parametrize("need_weights", [False, True])
def test_bitwise_identical_for_any_thread_count(isa, dtype, rng, need_weights):
    query, key, value, kwargs = build_case(rng, dtype, "both_masks_bool", batched=True, q_len=67, kv_len=131)
    results = []
    for n in (1, 2, 3):
        result = mha(query, key, value, need_weights=need_weights, num_threads=n, **kwargs)
        results.append(result if need_weights else (result,))
    for result in results[1:]:
        for first, other in zip(results[0], result):
            np.testing.assert_array_equal(first, other)


# --- grouped-query attention ----------------------------------------------------------------------


def expand_kv_heads(array, num_kv_heads, num_heads):
    """Repeat each kv head's rows (of a K/V weight or bias) so every query head has its own copy."""
    head_dim = array.shape[0] // num_kv_heads
    grouped = np.asarray(array).reshape(num_kv_heads, head_dim, *array.shape[1:])
    return np.repeat(grouped, num_heads // num_kv_heads, axis=0).reshape(num_heads * head_dim, *array.shape[1:])


def expand_gqa_weights(weights, embed_dim, num_kv_heads, num_heads):
    """The same layer written with num_kv_heads = num_heads: K/V rows repeated per query head."""
    kv_dim = num_kv_heads * (embed_dim // num_heads)
    expanded = dict(weights)
    for name in ("in_proj_weight", "in_proj_bias"):
        if name in weights:
            a = weights[name]
            q_part, k_part, v_part = a[:embed_dim], a[embed_dim : embed_dim + kv_dim], a[embed_dim + kv_dim :]
            k_part, v_part = (expand_kv_heads(p, num_kv_heads, num_heads) for p in (k_part, v_part))
            expanded[name] = np.concatenate([q_part, k_part, v_part])
    for name in ("k_proj_weight", "v_proj_weight", "k_proj_bias", "v_proj_bias"):
        if name in weights:
            expanded[name] = expand_kv_heads(weights[name], num_kv_heads, num_heads)
    return expanded


@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("layout", ["in_proj", "separate", "cross"])
def test_gqa_matches_expanded_heads(isa, dtype, rng, num_kv_heads, layout):
    embed_dim, num_heads = 32, 4
    dims = dict(kdim=12, vdim=20) if layout == "cross" else {}
    query, key, value = make_inputs(rng, dtype, 2, 9, 13, embed_dim, **dims)
    weights = random_weights(
        rng, dtype, embed_dim, num_heads, num_kv_heads=num_kv_heads, packed=layout == "in_proj", **dims
    )
    expanded = expand_gqa_weights(weights, embed_dim, num_kv_heads, num_heads)
    options = dict(
        attn_mask=torch_style_mask(rng, (9, 13), "bool", dtype),
        key_padding_mask=torch_style_mask(rng, (2, 13), "float", dtype),
        need_weights=True,
        average_attn_weights=False,
    )
    got = mha(query, key, value, num_heads=num_heads, num_kv_heads=num_kv_heads, **weights, **options)
    full = mha(query, key, value, num_heads=num_heads, **expanded, **options)
    expected = reference.mha(query, key, value, num_heads=num_heads, **expanded, **options)
    assert_same_result(got, expected, dtype)
    assert_same_result(full, expected, dtype)
    # The reference's own GQA path agrees with its expanded form.
    np.testing.assert_allclose(
        reference.mha(query, key, value, num_heads=num_heads, num_kv_heads=num_kv_heads, **weights, **options)[0],
        expected[0],
        rtol=TOL[np.float64][0],
        atol=TOL[np.float64][1],
    )


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_layer_gqa_shapes_and_call(isa, dtype, rng, num_kv_heads):
    layer = pyattn.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=dtype, seed=3)
    kv_dim = num_kv_heads * 8
    assert layer.in_proj_weight.shape == (32 + 2 * kv_dim, 32)
    assert layer.in_proj_bias.shape == (32 + 2 * kv_dim,)
    query, _, _ = make_inputs(rng, dtype, 2, 9, 9, 32)
    got = layer(query, need_weights=True)
    expected = reference.mha(query, num_heads=4, num_kv_heads=num_kv_heads, need_weights=True, **layer_weights(layer))
    assert_same_result(got, expected, dtype)


# --- pyattn.MultiHeadAttention -------------------------------------------------------------------


def layer_weights(layer):
    """mha() weight keywords from a MultiHeadAttention's attributes (those that are not None)."""
    return {n: getattr(layer, n) for n in WEIGHT_NAMES if getattr(layer, n, None) is not None}


@pytest.mark.parametrize(
    "dims, bias",
    [({}, True), ({}, False), (dict(kdim=12, vdim=20), True), (dict(kdim=12, vdim=20), False)],
    ids=["packed", "packed_no_bias", "separate", "separate_no_bias"],
)
def test_layer_attributes(dtype, dims, bias):
    layer = pyattn.MultiHeadAttention(32, 4, bias=bias, dtype=dtype, seed=7, **dims)
    expected = {"out_proj_weight": (32, 32)}
    if dims:
        expected.update(q_proj_weight=(32, 32), k_proj_weight=(32, 12), v_proj_weight=(32, 20))
    else:
        expected["in_proj_weight"] = (96, 32)
    if bias:
        expected.update(in_proj_bias=(96,), out_proj_bias=(32,))
    for name, shape in expected.items():
        array = getattr(layer, name)
        assert isinstance(array, np.ndarray) and array.shape == shape and array.dtype == np.dtype(dtype), name
    for name in set(WEIGHT_NAMES) - set(expected):
        assert getattr(layer, name, None) is None, name
    again = pyattn.MultiHeadAttention(32, 4, bias=bias, dtype=dtype, seed=7, **dims)
    for name in expected:
        np.testing.assert_array_equal(getattr(layer, name), getattr(again, name))


def test_layer_follows_isa_changes(dtype, rng):
    # Weights are packed for the ISA active at construction; a later ISA switch must still work.
    layer = pyattn.MultiHeadAttention(48, 4, dtype=dtype, seed=5)
    query, _, _ = make_inputs(rng, dtype, 2, 17, 17, 48)
    expected = reference.mha(query, num_heads=4, **layer_weights(layer))
    for name in pyattn.available_isas()[::-1] + [pyattn.get_isa()]:
        with forced_isa(name):
            assert_close(layer(query), expected, dtype)


def test_layer_call_matches_mha(isa, dtype, rng):
    layer = pyattn.MultiHeadAttention(32, 4, kdim=12, vdim=20, dtype=dtype, seed=1)
    query, key, value = make_inputs(rng, dtype, 2, 9, 13, 32, kdim=12, vdim=20)
    options = dict(
        attn_mask=torch_style_mask(rng, (8, 9, 13), "float", dtype),
        key_padding_mask=torch_style_mask(rng, (2, 13), "float", dtype),
        is_causal="lower_right",
        need_weights=True,
        num_threads=2,
    )
    got = layer(query, key, value, **options)
    assert_same_result(got, mha(query, key, value, num_heads=4, **layer_weights(layer), **options), dtype)
    assert_same_result(got, reference.mha(query, key, value, num_heads=4, **layer_weights(layer), **options), dtype)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_from_linear_weights(isa, dtype, rng, with_bias, num_kv_heads):
    # BERT/GPT-style separate q/k/v/o linear layers, weights (out_features, in_features).
    embed_dim, num_heads = 48, 4
    kv_dim = (num_kv_heads or num_heads) * 12
    q_w, o_w = (scaled_normal(rng, (embed_dim, embed_dim), dtype, embed_dim) for _ in range(2))
    k_w, v_w = (scaled_normal(rng, (kv_dim, embed_dim), dtype, embed_dim) for _ in range(2))
    biases = {}
    if with_bias:
        biases = dict(
            q_bias=random_array(rng, (embed_dim,), dtype),
            k_bias=random_array(rng, (kv_dim,), dtype),
            v_bias=random_array(rng, (kv_dim,), dtype),
            o_bias=random_array(rng, (embed_dim,), dtype),
        )
    layer = pyattn.MultiHeadAttention.from_linear_weights(
        q_w, k_w, v_w, o_w, num_heads=num_heads, num_kv_heads=num_kv_heads, **biases
    )
    weights = dict(q_proj_weight=q_w, k_proj_weight=k_w, v_proj_weight=v_w, out_proj_weight=o_w)
    if with_bias:
        weights.update(
            q_proj_bias=biases["q_bias"],
            k_proj_bias=biases["k_bias"],
            v_proj_bias=biases["v_bias"],
            out_proj_bias=biases["o_bias"],
        )
    query, _, _ = make_inputs(rng, dtype, 2, 11, 11, embed_dim)
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=True)
    got = layer(query, is_causal=True)
    assert got.dtype == np.dtype(dtype)
    assert_close(got, mha(query, **weights, **options), dtype)
    assert_close(got, reference.mha(query, **weights, **options), dtype)


# --- torch.nn.MultiheadAttention ------------------------------------------------------------------


def import_torch():
    return pytest.importorskip("torch")


def torch_module(rng, embed_dim, num_heads, *, kdim=None, vdim=None, bias=True, dtype=np.float64, values=None):
    """An eval-mode batch_first torch.nn.MultiheadAttention of torch dtype `dtype` whose parameters
    are random values representable in `values` (default `dtype`), biases included (torch zeros them)."""
    torch = import_torch()
    module = torch.nn.MultiheadAttention(
        embed_dim,
        num_heads,
        bias=bias,
        kdim=kdim,
        vdim=vdim,
        batch_first=True,
        dtype=torch.float64 if dtype == np.float64 else torch.float32,
    ).eval()
    values = dtype if values is None else values
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-1] if param.ndim == 2 else 1
            data = scaled_normal(rng, tuple(param.shape), values, fan_in, guard=False)
            param.copy_(torch.from_numpy(data.astype(dtype)))
    return module


def torch_state(module, dtype):
    """module.state_dict() as NumPy arrays of `dtype`."""
    return {k: t.detach().numpy().astype(dtype) for k, t in module.state_dict().items()}


def weights_of_torch(module, dtype):
    """mha() weight keywords holding a torch module's parameters (cast to `dtype`)."""
    state = torch_state(module, dtype)
    names = {"out_proj.weight": "out_proj_weight", "out_proj.bias": "out_proj_bias"}
    return {names.get(k, k): v for k, v in state.items()}


def run_torch(module, query, key=None, value=None, *, attn_mask=None, key_padding_mask=None, **kwargs):
    """module(...) on NumPy inputs cast to the module's dtype; returns float64 out or (out, weights).

    Gradients stay enabled so torch takes its plain (not the fused "fast path") implementation, which
    supports every option here; outputs are detached.
    """
    torch = import_torch()
    np_dtype = np.float64 if module.out_proj.weight.dtype == torch.float64 else np.float32
    key = query if key is None else key
    value = key if value is None else value

    def tensor(a, cast=True):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.astype(np_dtype) if cast and a.dtype != np.bool_ else a)

    need_weights = kwargs.get("need_weights", False)
    out, weights = module(
        tensor(query),
        tensor(key),
        tensor(value),
        attn_mask=tensor(attn_mask),
        key_padding_mask=tensor(key_padding_mask),
        **kwargs,
    )
    out = out.detach().numpy().astype(np.float64)
    return (out, weights.detach().numpy().astype(np.float64)) if need_weights else out


def dims_grid():
    return [(e, h) for e in (8, 48, 64, 96) for h in (1, 2, 4, 8) if e % h == 0]


@pytest.mark.parametrize("embed_dim, num_heads", dims_grid())
def test_dims_match_torch(dtype, rng, embed_dim, num_heads):
    # Torch runs in float64 with parameters representable in `dtype`: the exact answer to pyattn's problem.
    module = torch_module(rng, embed_dim, num_heads, values=dtype)
    weights = weights_of_torch(module, dtype)
    query, _, _ = make_inputs(rng, dtype, 2, 7, 7, embed_dim)
    for average in (True, False):
        options = dict(need_weights=True, average_attn_weights=average)
        got = mha(query, num_heads=num_heads, **weights, **options)
        assert_same_result(got, run_torch(module, query, **options), dtype)


# Cases for torch (same keys as OPTION_CASES where they overlap); pyattn's is_causal is given to torch
# as an explicit attn_mask (torch's own is_causal is only a hint that needs one).
TORCH_CASES = [
    "self",
    "cross_kdim_vdim",
    "no_bias",
    "no_bias_separate",
    "attn_mask_2d_bool",
    "attn_mask_2d_float",
    "attn_mask_3d_bool",
    "attn_mask_3d_float",
    "key_padding_bool",
    "key_padding_float",
    "both_masks_bool",
    "both_masks_float",
    "causal",
    "weights_averaged",
    "weights_per_head",
]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("case", TORCH_CASES)
@pytest.mark.parametrize("embed_dim, num_heads", [(48, 4), (64, 8)])
def test_options_match_torch(dtype, rng, case, batched, embed_dim, num_heads):
    spec = OPTION_CASES[case]
    q_len, kv_len = 9, 13
    dims = {k: v for k, v in spec.get("weights", {}).items() if k in ("kdim", "vdim")}
    bias = spec.get("weights", {}).get("bias", True)
    module = torch_module(rng, embed_dim, num_heads, bias=bias, values=dtype, **dims)
    batch = 3 if batched else None
    query, key, value = make_inputs(rng, dtype, batch, q_len, kv_len, embed_dim, **dims)
    options = case_options(rng, dtype, case, batch, num_heads, q_len, kv_len)
    got = mha(query, key, value, num_heads=num_heads, **weights_of_torch(module, dtype), **options)
    if options.pop("is_causal", False):
        options["attn_mask"] = causal_forbidden(q_len, kv_len)
    assert_same_result(got, run_torch(module, query, key, value, **options), dtype)


@pytest.mark.parametrize("case", ["self", "cross_kdim_vdim", "both_masks_float", "weights_per_head"])
def test_float32_matches_torch_float32(rng, case):
    # Both libraries in float32 on the same float32 problem: within the float32 tolerance of each other.
    dtype, embed_dim, num_heads, q_len, kv_len = np.float32, 64, 4, 9, 13
    spec = OPTION_CASES[case]
    dims = {k: v for k, v in spec.get("weights", {}).items() if k in ("kdim", "vdim")}
    module = torch_module(rng, embed_dim, num_heads, dtype=np.float32, **dims)
    query, key, value = make_inputs(rng, dtype, 3, q_len, kv_len, embed_dim, **dims)
    options = case_options(rng, dtype, case, 3, num_heads, q_len, kv_len)
    got = mha(query, key, value, num_heads=num_heads, **weights_of_torch(module, dtype), **options)
    assert_same_result(got, run_torch(module, query, key, value, **options), dtype)


@pytest.mark.parametrize(
    "dims, bias",
    [({}, True), ({}, False), (dict(kdim=12, vdim=20), True), (dict(kdim=12, vdim=20), False)],
    ids=["packed", "packed_no_bias", "separate", "separate_no_bias"],
)
def test_from_torch_round_trip(isa, rng, dims, bias):
    dtype = np.float32
    module = torch_module(rng, 32, 4, bias=bias, dtype=dtype, **dims)
    layer = pyattn.MultiHeadAttention.from_torch(module)
    state = layer.state_dict()
    torch_sd = torch_state(module, dtype)
    assert set(state) == set(torch_sd)
    for name, array in state.items():
        assert isinstance(array, np.ndarray) and array.dtype == np.dtype(dtype), name
        np.testing.assert_array_equal(array, torch_sd[name], err_msg=name)

    query, key, value = make_inputs(rng, dtype, 2, 9, 13, 32, **dims)
    masks = dict(key_padding_mask=torch_style_mask(rng, (2, 13), "bool", dtype), need_weights=True)
    got = layer(query, key, value, **masks)
    assert_same_result(got, run_torch(copy.deepcopy(module).double(), query, key, value, **masks), dtype)

    # A fresh layer (other seed) loaded with the torch state computes exactly the same thing.
    fresh = pyattn.MultiHeadAttention(32, 4, bias=bias, dtype=dtype, seed=99, **dims)
    fresh.load_state_dict(torch_sd)
    for a, b in zip(fresh(query, key, value, **masks), got):
        np.testing.assert_array_equal(a, b)

    # And the other way: a pyattn state loads into torch (strict: same keys and shapes).
    torch = import_torch()
    other = torch_module(rng, 32, 4, bias=bias, dtype=np.float64, **dims)
    other.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in fresh.state_dict().items()})
    assert_same_result(got, run_torch(other, query, key, value, **masks), dtype)


def test_from_torch_keeps_float64(rng):
    module = torch_module(rng, 16, 2, dtype=np.float64)
    layer = pyattn.MultiHeadAttention.from_torch(module)
    assert all(a.dtype == np.float64 for a in layer.state_dict().values())
    query, _, _ = make_inputs(rng, np.float64, 2, 5, 5, 16)
    assert_close(layer(query), run_torch(module, query), np.float64)


# --- errors ----------------------------------------------------------------------------------------


@pytest.fixture
def layer_args(rng):
    """query (2, 5, 16), key (2, 7, 6), value (2, 7, 10) and separate float32 weights, 4 heads."""
    query, key, value = make_inputs(rng, np.float32, 2, 5, 7, 16, kdim=6, vdim=10)
    weights = random_weights(rng, np.float32, 16, 4, kdim=6, vdim=10)
    return dict(query=query, key=key, value=value, num_heads=4, **weights)


def test_num_heads_must_divide_embed_dim(layer_args):
    with pytest.raises(ValueError, match="num_heads"):
        mha(**{**layer_args, "num_heads": 3})
    with pytest.raises(ValueError, match="num_heads"):
        pyattn.MultiHeadAttention(10, 3)


@pytest.mark.parametrize("num_kv_heads", [3, 0])
def test_num_kv_heads_must_divide_num_heads(rng, num_kv_heads):
    query, _, _ = make_inputs(rng, np.float32, 2, 5, 5, 24)
    weights = random_weights(rng, np.float32, 24, 4, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        mha(query, num_heads=4, num_kv_heads=num_kv_heads, **weights)
    with pytest.raises(ValueError, match="num_kv_heads"):
        pyattn.MultiHeadAttention(24, 4, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("q_proj_weight", (16, 15)),
        ("q_proj_weight", (12, 16)),
        ("k_proj_weight", (16, 7)),  # kdim is 6
        ("k_proj_weight", (8, 6)),
        ("v_proj_weight", (16, 6)),  # vdim is 10
        ("v_proj_weight", (16,)),
        ("out_proj_weight", (16, 12)),
        ("out_proj_weight", (12, 16)),
        ("q_proj_bias", (15,)),
        ("k_proj_bias", (17,)),
        ("v_proj_bias", (16, 1)),
        ("out_proj_bias", (8,)),
        ("in_proj_bias", (47,)),
    ],
)
def test_wrong_weight_shapes(layer_args, name, shape):
    layer_args[name] = np.zeros(shape, dtype=np.float32)
    if name == "in_proj_bias":  # instead of the separate biases
        for other in ("q_proj_bias", "k_proj_bias", "v_proj_bias"):
            del layer_args[other]
    with pytest.raises(ValueError, match=name):
        mha(**layer_args)


@pytest.mark.parametrize("shape", [(47, 16), (48, 15), (48,), (16, 16)])
def test_wrong_in_proj_weight_shape(rng, shape):
    query, _, _ = make_inputs(rng, np.float32, 2, 5, 5, 16)
    weights = random_weights(rng, np.float32, 16, 4)
    weights["in_proj_weight"] = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match="in_proj_weight"):
        mha(query, num_heads=4, **weights)


def test_in_proj_weight_needs_embed_dim_key_and_value(layer_args):
    weights = random_weights(np.random.default_rng(0), np.float32, 16, 4)
    args = {k: v for k, v in layer_args.items() if k in ("query", "key", "value", "num_heads")}
    with pytest.raises(ValueError, match="in_proj_weight|key"):
        mha(**args, **weights)


@pytest.mark.parametrize("missing", ["q_proj_weight", "k_proj_weight", "v_proj_weight"])
def test_missing_projection_weight(layer_args, missing):
    del layer_args[missing]
    with pytest.raises(ValueError, match=missing):
        mha(**layer_args)


def test_missing_all_projection_weights(layer_args):
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        del layer_args[name]
    with pytest.raises(ValueError, match="in_proj_weight|q_proj_weight"):
        mha(**layer_args)


def test_missing_out_proj_weight(layer_args):
    del layer_args["out_proj_weight"]
    with pytest.raises((TypeError, ValueError), match="out_proj_weight"):
        mha(**layer_args)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("attn_mask", (5, 8)),
        ("attn_mask", (6, 7)),
        ("attn_mask", (7,)),
        ("attn_mask", (4, 5, 7)),  # needs B*num_heads = 8
        ("attn_mask", (9, 5, 7)),
        ("attn_mask", (2, 4, 5, 7)),
        ("key_padding_mask", (2, 8)),
        ("key_padding_mask", (7,)),
        ("key_padding_mask", (1, 7)),
        ("key_padding_mask", (2, 5, 7)),
    ],
)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_wrong_mask_shapes(layer_args, name, shape, kind):
    layer_args[name] = np.zeros(shape, dtype=bool if kind == "bool" else np.float32)
    with pytest.raises(ValueError, match=name):
        mha(**layer_args)


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("bad_dtype", [np.int32, np.float64, np.float16])
def test_wrong_mask_dtypes(layer_args, name, bad_dtype):
    shape = (5, 7) if name == "attn_mask" else (2, 7)
    layer_args[name] = np.zeros(shape, dtype=bad_dtype)
    with pytest.raises(TypeError, match=name):
        mha(**layer_args)


@pytest.mark.parametrize(
    "name",
    [
        "key",
        "value",
        "q_proj_weight",
        "k_proj_weight",
        "v_proj_weight",
        "out_proj_weight",
        "q_proj_bias",
        "out_proj_bias",
    ],
)
def test_mixed_dtypes(layer_args, name):
    layer_args[name] = layer_args[name].astype(np.float64)
    with pytest.raises(TypeError, match=name):
        mha(**layer_args)


@pytest.mark.parametrize(
    "name",
    [
        "query",
        "key",
        "value",
        "q_proj_weight",
        "k_proj_bias",
        "out_proj_weight",
        "out_proj_bias",
        "attn_mask",
        "key_padding_mask",
    ],
)
def test_masked_arrays_are_refused(layer_args, name):
    # A numpy.ma array's mask would be dropped (np.asarray keeps the data): a masked padding flag
    # or weight would count as unmasked. TypeError naming the argument, in mha and in the layer.
    layer_args["attn_mask"] = np.zeros((5, 7), bool)
    layer_args["key_padding_mask"] = np.zeros((2, 7), bool)
    mask = np.zeros(layer_args[name].shape, bool)
    mask.flat[-1] = True
    layer_args[name] = np.ma.masked_array(layer_args[name], mask=mask)
    with pytest.raises(TypeError, match=rf"^{name}: masked arrays \(numpy.ma\) are not supported"):
        mha(**layer_args)


def test_masked_arrays_are_refused_by_the_layer(layer_args):
    layer = pyattn.MultiHeadAttention(16, 4, kdim=6, vdim=10)
    state = layer.state_dict()
    with pytest.raises(TypeError, match=r"^out_proj.weight: masked arrays"):
        layer.load_state_dict({**state, "out_proj.weight": np.ma.masked_array(state["out_proj.weight"])})
    with pytest.raises(TypeError, match=r"^query: masked arrays"):
        layer(np.ma.masked_array(layer_args["query"]), layer_args["key"], layer_args["value"])
    with pytest.raises(TypeError, match=r"^key_padding_mask: masked arrays"):
        layer(
            layer_args["query"],
            layer_args["key"],
            layer_args["value"],
            key_padding_mask=np.ma.masked_array(np.zeros((2, 7), bool), mask=True),
        )


@pytest.mark.parametrize("bad_dtype", [np.int64, np.complex64, object])
def test_non_float_query(layer_args, bad_dtype):
    layer_args["query"] = layer_args["query"].astype(bad_dtype)
    with pytest.raises(TypeError, match="query"):
        mha(**layer_args)


@pytest.mark.parametrize("shape", [(16,), (1, 2, 5, 16)])
def test_query_ndim(layer_args, shape):
    layer_args["query"] = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match="query"):
        mha(**layer_args)


def test_query_embed_dim_must_match_weights(layer_args):
    layer_args["query"] = np.zeros((2, 5, 12), dtype=np.float32)
    with pytest.raises(ValueError, match="query|q_proj_weight"):
        mha(**layer_args)


@pytest.mark.parametrize(
    "name, shape", [("key", (3, 7, 6)), ("value", (2, 8, 10)), ("key", (7, 6)), ("value", (2, 7, 11))]
)
def test_key_value_shapes(layer_args, name, shape):
    # A feature size that disagrees with its projection may be blamed on either side.
    layer_args[name] = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match=f"{name}|{name[0]}_proj_weight"):
        mha(**layer_args)


@pytest.mark.parametrize("is_causal", ["lower-right", 2])
def test_bad_is_causal(layer_args, is_causal):
    with pytest.raises((ValueError, TypeError), match="is_causal"):
        mha(**layer_args, is_causal=is_causal)


@pytest.mark.parametrize("num_threads", [0, -1])
def test_bad_num_threads(layer_args, num_threads):
    with pytest.raises(ValueError, match="num_threads"):
        mha(**layer_args, num_threads=num_threads)


def test_from_linear_weights_wrong_shapes(rng):
    w = scaled_normal(rng, (16, 16), np.float32, 16)
    with pytest.raises(ValueError, match="k_weight|k_proj_weight"):
        pyattn.MultiHeadAttention.from_linear_weights(w, w[:12], w, w, num_heads=4)
    with pytest.raises(ValueError, match="o_weight|out_proj_weight"):
        pyattn.MultiHeadAttention.from_linear_weights(w, w, w, w[:8], num_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        pyattn.MultiHeadAttention.from_linear_weights(w, w, w, w, num_heads=3)


# --- the packed GEMM behind the projections --------------------------------------------------------

GEMM_SIZES = (1, 7, 17, 33, 65, 129)
# Rows: every remainder after whole register tiles of 4 and of 6 rows (the tiles' heights across ISAs).
GEMM_ROWS = (1, 2, 3, 4, 5, 7, 10, 17, 33, 65, 129)


@pytest.mark.parametrize("l2", [1 << 20, 256 << 10, 0], ids=["l2_1MiB", "l2_256KiB", "l2_unknown"])
def test_linear_with_a_weight_larger_than_twice_l2(isa, rng, l2):
    """A packed weight over twice the L2 size gets tasks of more rows (tuning.cpp, gemm_task_tiles: as
    many as half of L2 holds, here 32 register tiles): row blocks of that height plus a ragged one,
    threaded, packed and unpacked, against the float64 product; the L2 the planner sees is forced, so
    the rule runs on any host (and with an unknown L2, none does)."""
    with pyattn._tuning.override(l2_bytes=l2):
        linear_with_a_large_weight(isa, rng, l2 or 1 << 20)


def linear_with_a_large_weight(isa, rng, l2):
    """test_linear_with_a_weight_larger_than_twice_l2's call, sized for an L2 of l2 bytes."""
    tile_rows = 6 if isa != "generic" else 4  # simd.h gemm_rows (float32)
    k = max(64, l2 // (2 * 4 * tile_rows * 32))  # half of L2 holds 32 tiles' rows of A
    n = 2 * l2 // (4 * k) + 70  # over twice L2 packed, and a partial last panel
    m = 2 * 32 * tile_rows + 7
    x = random_array(rng, (m, k), np.float32) / np.float32(np.sqrt(k))  # O(1) results for the table's atol
    w = random_array(rng, (n, k), np.float32)
    bias = random_array(rng, (n,), np.float32)
    packed, panel = pyattn._core.pack_weights(w)
    assert packed.size * 4 > 2 * l2
    out = np.full((m, n), np.nan, np.float32)
    pyattn._core.linear(x, packed, panel, n, bias, out, 2)
    expected = x.astype(np.float64) @ w.astype(np.float64).T + bias
    rtol, atol = TOL[np.float32]
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol)
    unpacked = np.full((m, n), np.nan, np.float32)
    pyattn._core.linear(x, w, panel, n, bias, unpacked, 2)
    np.testing.assert_array_equal(unpacked, out)


def test_pack_weights_layout(isa, dtype, rng):
    """pack_weights writes panels of `panel` output columns, k-major, zeros past n: whole lanes x lanes
    blocks through the in-register transpose, the ragged edges element by element, for every size
    around the blocks (and weight rows cut from a NaN-filled parent, so a read past a row shows)."""
    for n, k in itertools.product((1, 3, 8, 15, 16, 17, 40, 70), (1, 5, 8, 16, 23, 64, 67)):
        w = random_array(rng, (n, k), dtype)
        packed, panel = pyattn._core.pack_weights(w)
        panels = -(-n // panel)
        expected = np.zeros((panels, k, panel), dtype)
        for col in range(n):
            expected[col // panel, :, col % panel] = w[col]
        np.testing.assert_array_equal(packed.reshape(panels, k, panel), expected, err_msg=f"n={n} k={k}")
        # On a cache line, whatever NumPy's allocator gave: the GEMM loads whole 64-byte vectors of it.
        assert packed.ctypes.data % 64 == 0, (
            f"n={n} k={k}: packed weights start {packed.ctypes.data % 64} bytes past a line"
        )
        assert packed.flags.c_contiguous and packed.flags.writeable and packed.size == panels * k * panel


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_linear_rows_do_not_depend_on_the_batch(isa, dtype, rng, with_bias):
    """A row of x @ W.T + b has the same bits whether it is computed alone (the one-row tiles over
    several panels at once), with one other row, or inside a batch of full register tiles: every
    output sums over k in the same order from its bias."""
    for n, k in ((16, 9), (40, 33), (136, 65), (300, 130)):
        w = random_array(rng, (n, k), dtype)
        bias = random_array(rng, (n,), dtype) if with_bias else None
        packed, panel = pyattn._core.pack_weights(w)
        x = random_array(rng, (13, k), dtype)
        full = np.empty((13, n), dtype)
        pyattn._core.linear(x, packed, panel, n, bias, full, 2)
        for rows in (slice(0, 1), slice(5, 6), slice(12, 13), slice(3, 5), slice(11, 13), slice(0, 3)):
            part = np.empty((rows.stop - rows.start, n), dtype)
            pyattn._core.linear(x[rows], packed, panel, n, bias, part, 1)
            np.testing.assert_array_equal(part, full[rows], err_msg=f"n={n} k={k} rows={rows}")


def test_linear_unpacked_weight_views(isa, dtype, rng):
    # The weight read through its row stride (a row slice of a wider array, rows reversed, rows
    # skipped) and packed by the GEMM's tasks: the bits of the packed-beforehand GEMM, for a few row
    # blocks and for many (over 8 blocks of 16 register tiles of up to 8 rows).
    n, k = 70, 45
    parent = random_array(rng, (2 * n + 3, k + 9), dtype)
    for m in (200, 1100):
        x = random_array(rng, (m, k), dtype)
        for w in (parent[3 : n + 3, 2 : k + 2], parent[n - 1 :: -1, :k], parent[::2, 5 : k + 5][:n]):
            saved = w.copy()
            packed, panel = pyattn._core.pack_weights(np.ascontiguousarray(w))
            expected = np.empty((m, n), dtype)
            pyattn._core.linear(x, packed, panel, n, None, expected, 2)
            got = np.full((m, n), np.nan, dtype)
            pyattn._core.linear(x, w, panel, n, None, got, 2)
            np.testing.assert_array_equal(got, expected, err_msg=f"m={m}")
            np.testing.assert_array_equal(w, saved)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_linear_unpacked_one_or_two_rows(isa, dtype, rng, rows):
    # One or two rows read the weight as it is, a lanes x lanes block at a time through the
    # in-register transpose (gemm.inc, gemm_short_unpacked), two blocks at a time unless the rows
    # share L1 sets (row lengths of a multiple of 1-4 KiB); three rows pack first. Every size around
    # the blocks, weight rows cut from a NaN-filled parent, reversed and skipped rows, with and
    # without bias, 1 and 2 threads: the bits of the packed-beforehand GEMM.
    sizes = list(itertools.product((1, 3, 8, 15, 16, 17, 33, 40, 70, 300), (1, 5, 8, 16, 23, 64, 67, 130)))
    sizes += [(40, 512), (70, 1024), (33, 768), (64, 2048)]
    for n, k in sizes:
        parent = random_array(rng, (2 * n + 3, k + 9), dtype)
        parent[:3] = np.nan
        parent[:, :2] = np.nan
        x = random_array(rng, (rows, k), dtype)
        bias = random_array(rng, (n,), dtype)
        for w in (
            parent[3 : n + 3, 2 : k + 2],
            parent[n + 2 : 2 : -1, 2 : k + 2],
            parent[3::2, 2 : k + 2][:n],
            np.ascontiguousarray(parent[3 : n + 3, 2 : k + 2]),
        ):
            packed, panel = pyattn._core.pack_weights(np.ascontiguousarray(w))
            for b in (bias, None):
                expected = np.empty((rows, n), dtype)
                pyattn._core.linear(x, packed, panel, n, b, expected, 2)
                assert np.isfinite(expected).all()
                for threads in (1, 2):
                    got = np.full((rows, n), np.nan, dtype)
                    pyattn._core.linear(x, w, panel, n, b, got, threads)
                    np.testing.assert_array_equal(got, expected, err_msg=f"n={n} k={k} threads={threads}")


def test_linear_empty_inner_dimension(isa, dtype, rng):
    # k = 0: every output is its bias, whether the weight comes packed or as it is.
    bias = random_array(rng, (5,), dtype)
    w = np.ones((5, 0), dtype)
    packed, panel = pyattn._core.pack_weights(w)
    for weight in (packed, w):
        out = np.full((3, 5), np.nan, dtype)
        pyattn._core.linear(np.ones((3, 0), dtype), weight, panel, 5, bias, out, 2)
        np.testing.assert_array_equal(out, np.broadcast_to(bias, (3, 5)))


@pytest.mark.parametrize("kv_cache", [False, True], ids=["no_cache", "cache"])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_mha_function_equals_layer_bitwise(isa, dtype, rng, num_kv_heads, kv_cache):
    # pyattn.mha hands the core the weights as they are (packed by the GEMM's tasks), the layer its
    # packed copies: the same bits, for one-row steps (several panels per task) and long inputs
    # (several row blocks), embed_dim not a multiple of the GEMM panel.
    embed_dim, num_heads = 36, 4
    layer = pyattn.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, dtype=dtype, seed=3)
    state = layer.state_dict()
    for name in ("in_proj_bias", "out_proj.bias"):  # nonzero, so a bias read at the wrong columns shows
        state[name] = random_array(rng, state[name].shape, dtype)
    layer.load_state_dict(state)
    weights = layer_weights(layer)
    kv = num_kv_heads or num_heads
    for batch, length in ((1, 1), (2, 2), (3, 131)):
        x = random_array(rng, (batch, length, embed_dim), dtype)
        if kv_cache:
            cached = [random_array(rng, (batch, kv, 5, embed_dim // num_heads), dtype) for _ in range(2)]
            caches = [pyattn.KVCache(batch, kv, embed_dim // num_heads, 300, dtype=dtype) for _ in range(2)]
            for c in caches:
                c.append(*cached)
            expected = layer(x, kv_cache=caches[0])
            got = mha(x, num_heads=num_heads, num_kv_heads=num_kv_heads, kv_cache=caches[1], **weights)
        else:
            expected = layer(x, is_causal=True)
            got = mha(x, num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=True, **weights)
        np.testing.assert_array_equal(got, expected, err_msg=f"batch={batch} length={length}")


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_linear_matches_matmul(isa, dtype, rng, with_bias):
    # Every (m, n, k) combination: register-tile edges in all three dimensions.
    for m, n, k in itertools.product(GEMM_ROWS, GEMM_SIZES, GEMM_SIZES):
        x = random_array(rng, (m, k), dtype)  # rows not adjacent (NaN gaps between them)
        w = random_array(rng, (n, k), dtype)
        bias = random_array(rng, (n,), dtype) if with_bias else None
        saved = [a.copy() for a in (x, w) + ((bias,) if with_bias else ())]
        packed, panel = pyattn._core.pack_weights(w)
        out = np.full((m, n), np.nan, dtype=dtype)
        pyattn._core.linear(x, packed, panel, n, bias, out, 1 + (m + n + k) % 3)
        expected = x.astype(np.float64) @ w.astype(np.float64).T
        if with_bias:
            expected += bias
        rtol, atol = TOL[dtype]
        np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol, err_msg=f"m={m} n={n} k={k}")
        # W not packed beforehand (pyattn.mha): the tasks pack their panels; the same bits.
        unpacked = np.full((m, n), np.nan, dtype=dtype)
        pyattn._core.linear(x, w, panel, n, bias, unpacked, 1 + (m + n) % 3)
        np.testing.assert_array_equal(unpacked, out, err_msg=f"unpacked weight, m={m} n={n} k={k}")
        for before, after in zip(saved, (x, w) + ((bias,) if with_bias else ())):
            np.testing.assert_array_equal(after, before, err_msg=f"input modified, m={m} n={n} k={k}")


@pytest.mark.parametrize("entry", ["mha", "mha_cached"])
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"batch": -1}, "dims must be non-negative"),
        ({"num_kv_heads": 3}, "positive multiple of num_kv_heads"),
        ({"num_kv_heads": 0}, "positive multiple of num_kv_heads"),
        ({"head_dim": 5}, "must equal embed_dim"),
        # num_heads * head_dim = 2**64: wraps to 0 in int64, which must not pass for embed_dim 0.
        ({"num_heads": 2**33, "num_kv_heads": 2**33, "head_dim": 2**31, "embed_dim": 0}, "must equal embed_dim"),
    ],
)
def test_low_level_layer_entries_check_their_sizes(entry, bad, message):
    # pyattn._mha checks these before it calls the core, but the entries are reachable on their own:
    # a size they are handed that does not add up is a ValueError, never a read out of bounds.
    sizes = {"batch": 1, "q_len": 2, "kv_len": 2, "embed_dim": 8, "num_heads": 2, "num_kv_heads": 2, "head_dim": 4}
    sizes.update(bad)
    x = np.zeros((2, 8), np.float32)
    weights = (None,) * 8
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=message):
        if entry == "mha":
            dims = (
                [sizes[n] for n in ("batch", "q_len", "kv_len", "embed_dim")]
                + [8, 8]
                + [sizes[n] for n in ("num_heads", "num_kv_heads", "head_dim")]
            )
            pyattn._core.mha(x, x, x, weights, dims, [], False, out, None, 1)
        else:
            dims = [sizes[n] for n in ("batch", "q_len", "embed_dim", "num_heads", "num_kv_heads", "head_dim")]
            cache = np.zeros((1, 2, 4, 4), np.float32)
            lengths = np.zeros(1, np.int64)
            pyattn._core.mha_cached(x, weights, dims, cache, cache, 0, lengths, lengths, False, out, 1)
