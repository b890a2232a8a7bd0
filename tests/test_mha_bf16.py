# SPDX-License-Identifier: MIT
"""bfloat16 layers: pyattn.mha with bfloat16 weights and MultiHeadAttention(dtype=ml_dtypes.bfloat16).

Every ISA (the isa fixture; avx512bf16, whose projections are vdpbf16ps pair GEMMs, through the SIMDe
emulation in CI: tools/emulate_avx512.sh) against pyattn.reference.mha in float64 on the bfloat16
values, with the tolerance table's bound (conftest.tol("bfloat16 layer"): "fast bfloat16 layer"
where the ISA has bfloat16 dot products, else bfloat16's, the output's single rounding). On ISAs
without them the bfloat16 layer is the float32 layer over the same values, rounded once: checked
bit for bit. Odd sizes (embed_dim, kdim and vdim odd, so the pair GEMM's k tail has half a pair),
every option of the float32 layer (test_mha.OPTION_CASES), the variants, packed batches,
bit-identity across thread counts and between mha and the layer, pickling, decoding over every kind
of KV cache, torch's bfloat16 module (from_torch; pyattn's error no worse than 1.5x torch's own
bfloat16 error), precision="highest" (the float32 layer rounded once, bit for bit, on every ISA), a
hypothesis property over random small layers, and the error policy.

Inputs and weights are NaN-guarded views (conftest.nan_guarded) unless a test says otherwise.
"""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference

from conftest import f64, forced_isa, np_dtype, random_array, tol
from test_mha import OPTION_CASES, WEIGHT_NAMES, case_options, make_inputs, random_weights, torch_style_mask


@pytest.fixture
def bf16():
    return np_dtype("bfloat16")


def as_f64(value):
    """An mha keyword's value for the float64 reference (arrays of bfloat16 widen exactly)."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "biu":
        return f64(value)
    return value


def reference_mha(query, key=None, value=None, **kwargs):
    """pyattn.reference.mha in float64 over the bfloat16 values."""
    kwargs = {name: as_f64(v) for name, v in kwargs.items()}
    return reference.mha(*(None if x is None else f64(x) for x in (query, key, value)), **kwargs)


def assert_bf16_close(got, expected, bf16):
    """A bfloat16 result against the float64 reference with the table's bfloat16 bound."""
    assert got.dtype == bf16 and got.shape == expected.shape
    rtol, atol = tol("bfloat16 layer")
    np.testing.assert_allclose(f64(got), expected, rtol=rtol, atol=atol)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def check_bf16_mha(query, key=None, value=None, **kwargs):
    """pyattn.mha on bfloat16 arrays against the reference; where it takes no bfloat16 dot products
    (an ISA without them, or precision="highest") also against the float32 computation rounded once,
    bit for bit. Returns pyattn's result."""
    bf16 = query.dtype
    got = pyattn.mha(query, key, value, **kwargs)
    precision = kwargs.pop("precision", "fast")
    expected = reference_mha(query, key, value, **kwargs)
    results = got if isinstance(got, tuple) else (got,)
    for g, e in zip(results, expected if isinstance(expected, tuple) else (expected,)):
        assert_bf16_close(g, e, bf16)
    if not pyattn._core.bf16_dots(precision):
        as32 = {n: v.astype(np.float32) if getattr(v, "dtype", None) == bf16 else v for n, v in kwargs.items()}
        f32 = pyattn.mha(*(None if x is None else x.astype(np.float32) for x in (query, key, value)), **as32)
        for g, r in zip(results, f32 if isinstance(f32, tuple) else (f32,)):
            assert_same_bits(g, r.astype(bf16))
    return got


def weights_of(layer):
    return {n: getattr(layer, n) for n in WEIGHT_NAMES if getattr(layer, n, None) is not None}


# --- parity with the reference, every ISA -------------------------------------------------------


@pytest.mark.parametrize(
    "embed_dim, num_heads, batch, q_len, kv_len, kdim, vdim",
    [
        (8, 8, 2, 7, 7, None, None),  # head_dim 1
        (9, 3, 2, 5, 5, None, None),  # odd embed_dim: half a pair at the end of every k
        (15, 5, 1, 4, 9, 7, 13),  # odd kdim and vdim
        (48, 4, 3, 17, 17, None, None),
        (64, 1, 2, 9, 33, None, None),
        (96, 8, 2, 1, 129, None, None),
        (40, 5, 2, 33, 3, None, None),
        (256, 4, 1, 20, 20, None, None),  # head_dim 64
        (384, 12, 2, 67, 67, None, None),
        (768, 12, 1, 130, 130, None, None),  # BERT-base-sized
    ],
)
def test_shapes_match_reference(isa, bf16, rng, embed_dim, num_heads, batch, q_len, kv_len, kdim, vdim):
    query, key, value = make_inputs(rng, bf16, batch, q_len, kv_len, embed_dim, kdim, vdim)
    if q_len == kv_len and kdim is None:
        key = value = query
    weights = random_weights(rng, bf16, embed_dim, num_heads, kdim=kdim, vdim=vdim)
    out = check_bf16_mha(query, key, value, num_heads=num_heads, **weights)
    assert out.shape == (batch, q_len, embed_dim)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_match_reference(isa, bf16, rng, case, batched):
    spec = OPTION_CASES[case].get("weights", {})
    batch = 3 if batched else None
    query, key, value = make_inputs(rng, bf16, batch, 9, 13, 32, spec.get("kdim"), spec.get("vdim"))
    kwargs = dict(num_heads=4, **random_weights(rng, bf16, 32, 4, **spec))
    kwargs.update(case_options(rng, bf16, case, batch, 4, 9, 13))  # float masks in bfloat16, the layer's dtype
    result = check_bf16_mha(query, key, value, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    assert out.shape == query.shape


VARIANTS = {
    "window": dict(window=(4, 2), is_causal=False),
    "softcap": dict(softcap=3.0),
    "sinks": dict(sinks="heads"),
    "alibi": dict(alibi_slopes="heads", is_causal=True),
    "window_causal_softcap": dict(window=(5, 0), is_causal=True, softcap=2.0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_reference(isa, bf16, rng, variant):
    options = dict(VARIANTS[variant])
    for name in ("sinks", "alibi_slopes"):
        if options.get(name) == "heads":  # per-head values in the layer's dtype
            options[name] = (rng.standard_normal(4) * 0.5).astype(bf16)
    query, _, _ = make_inputs(rng, bf16, 2, 19, 19, 32)
    check_bf16_mha(query, num_heads=4, **random_weights(rng, bf16, 32, 4), **options)


def test_packed_batch_matches_each_sequence(isa, bf16, rng):
    """cu_seqlens: each sequence of a packed batch is the layer on that sequence alone."""
    lengths = [5, 1, 12, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    tokens = random_array(rng, (cu[-1], 24), bf16)
    weights = random_weights(rng, bf16, 24, 3)
    packed = check_bf16_mha(tokens, num_heads=3, cu_seqlens=cu, is_causal=True, **weights)
    for s in range(len(lengths)):
        alone = pyattn.mha(tokens[cu[s] : cu[s + 1]], num_heads=3, is_causal=True, **weights)
        assert_same_bits(packed[cu[s] : cu[s + 1]], alone)


@pytest.mark.parametrize("need_weights", [False, True])
def test_bitwise_identical_for_any_thread_count(isa, bf16, rng, need_weights):
    query, key, value = make_inputs(rng, bf16, 2, 67, 131, 48, kdim=20, vdim=36)
    kwargs = dict(
        num_heads=4,
        key_padding_mask=torch_style_mask(rng, (2, 131), "bool", bf16),
        need_weights=need_weights,
        **random_weights(rng, bf16, 48, 4, kdim=20, vdim=36),
    )
    results = [pyattn.mha(query, key, value, num_threads=n, **kwargs) for n in (1, 2, 3)]
    for result in results[1:]:
        for first, other in zip(*(r if need_weights else (r,) for r in (results[0], result))):
            assert_same_bits(first, other)


def test_inputs_not_modified(isa, bf16, rng):
    query, key, value = make_inputs(rng, bf16, 2, 9, 13, 32, kdim=12, vdim=20)
    kwargs = dict(num_heads=4, attn_mask=torch_style_mask(rng, (9, 13), "float", bf16))
    kwargs.update(random_weights(rng, bf16, 32, 4, kdim=12, vdim=20))
    arrays = [query, key, value] + [v for v in kwargs.values() if isinstance(v, np.ndarray)]
    before = [a.copy() for a in arrays]
    pyattn.mha(query, key, value, **kwargs)
    for a, b in zip(arrays, before):
        assert_same_bits(a, b)


@st.composite
def layer_problems(draw):
    """A random small bfloat16 layer problem: dims (GQA, kdim/vdim of any parity), lengths, options."""
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.integers(1, 3))
    embed_dim = num_heads * draw(st.integers(1, 12))
    cross = draw(st.booleans())
    dims = dict(kdim=draw(st.integers(1, 40)), vdim=draw(st.integers(1, 40))) if cross else {}
    return dict(
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        embed_dim=embed_dim,
        dims=dims,
        batch=draw(st.sampled_from([None, 1, 2])),
        q_len=draw(st.integers(1, 24)),
        kv_len=draw(st.integers(1, 24)),
        causal=draw(st.sampled_from([False, "lower_right", "upper_left"])),
        bias=draw(st.booleans()),
        precision=draw(st.sampled_from(["fast", "highest"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=layer_problems())
def test_random_layers_match_reference_property(isa, bf16, problem):
    """Any small bfloat16 layer under either precision against the reference (and, without bfloat16 dot
    products, bit for bit against the float32 layer rounded once: check_bf16_mha)."""
    rng = np.random.default_rng(problem["seed"])
    p = problem
    query, key, value = make_inputs(
        rng, bf16, p["batch"], p["q_len"], p["kv_len"], p["embed_dim"], p["dims"].get("kdim"), p["dims"].get("vdim")
    )
    weights = random_weights(
        rng, bf16, p["embed_dim"], p["num_heads"], num_kv_heads=p["num_kv_heads"], bias=p["bias"], **p["dims"]
    )
    options = dict(num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], is_causal=p["causal"])
    check_bf16_mha(query, key, value, precision=p["precision"], **options, **weights)


# --- the layer ----------------------------------------------------------------------------------


def test_layer_holds_bf16_and_matches_mha(isa, bf16, rng):
    layer = pyattn.MultiHeadAttention(32, 4, num_kv_heads=2, kdim=12, vdim=20, dtype=bf16, seed=3)
    for name, array in weights_of(layer).items():
        assert array.dtype == bf16, name
    assert all(v.dtype == bf16 for v in layer.state_dict().values())
    query, key, value = make_inputs(rng, bf16, 2, 9, 13, 32, kdim=12, vdim=20)
    options = dict(
        attn_mask=torch_style_mask(rng, (8, 9, 13), "float", bf16),
        key_padding_mask=torch_style_mask(rng, (2, 13), "bool", bf16),
        is_causal="lower_right",
        need_weights=True,
    )
    got = layer(query, key, value, **options)
    expected = pyattn.mha(query, key, value, num_heads=4, num_kv_heads=2, **weights_of(layer), **options)
    for g, e in zip(got, expected):
        assert_same_bits(g, e)
    reference_out = reference_mha(query, key, value, num_heads=4, num_kv_heads=2, **weights_of(layer), **options)
    for g, e in zip(got, reference_out):
        assert_bf16_close(g, e, bf16)


def test_layer_follows_isa_changes(bf16, rng):
    """A bfloat16 layer packs per ISA (pairs where the ISA has bfloat16 dot products, float32 values
    elsewhere): switching ISAs after construction computes with the new ISA's packing."""
    layer = pyattn.MultiHeadAttention(48, 4, dtype=bf16, seed=5)
    query, _, _ = make_inputs(rng, bf16, 2, 17, 17, 48)
    expected = reference_mha(query, num_heads=4, **weights_of(layer))
    for name in pyattn.available_isas()[::-1] + [pyattn.get_isa()]:
        with forced_isa(name):
            assert_bf16_close(layer(query), expected, bf16)


@pytest.mark.parametrize("copy_kind", ["pickle", "deepcopy"])
def test_layer_pickles(isa, bf16, rng, copy_kind):
    clone = (lambda x: pickle.loads(pickle.dumps(x))) if copy_kind == "pickle" else copy.deepcopy
    layer = pyattn.MultiHeadAttention(16, 4, kdim=6, vdim=10, dtype=bf16, seed=5)
    query, key, value = make_inputs(rng, bf16, 2, 5, 7, 16, kdim=6, vdim=10)
    twin = clone(layer)
    assert twin.out_proj_weight.dtype == bf16
    assert_same_bits(twin(query, key, value), layer(query, key, value))


def test_load_state_dict_round_trip(isa, bf16, rng):
    layer = pyattn.MultiHeadAttention(24, 3, dtype=bf16, seed=1)
    other = pyattn.MultiHeadAttention(24, 3, dtype=bf16, seed=2)
    other.load_state_dict(layer.state_dict())
    query, _, _ = make_inputs(rng, bf16, 2, 6, 6, 24)
    assert_same_bits(other(query), layer(query))


def test_bf16_weights_round_the_float32_layer(bf16, rng):
    """The bfloat16 layer seeded like a float32 one holds that layer's weights rounded to bfloat16."""
    layer32 = pyattn.MultiHeadAttention(24, 3, seed=9)
    layer16 = pyattn.MultiHeadAttention(24, 3, dtype=bf16, seed=9)
    for name, array in weights_of(layer32).items():
        assert_same_bits(getattr(layer16, name), array.astype(bf16))


# --- decoding over a KV cache ------------------------------------------------------------------

CACHE_STORAGES = ["float32", "float16", "bfloat16", "int8"]
CHUNKS = [9, 3, 1, 1, 5, 1]  # a prefill, a chunk, decode steps


def run_chunks(layer, x, cache, chunks=CHUNKS, **options):
    """layer(x's tokens chunk by chunk, kv_cache=cache): the outputs, concatenated over the tokens."""
    outs, start = [], 0
    for n in chunks:
        outs.append(layer(x[:, start : start + n], kv_cache=cache, **options))
        start += n
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_cached_steps_match_reference(isa, bf16, rng, num_kv_heads):
    """A float32 cache: every chunk's output against the float64 layer over the whole sequence with
    lower-right causal masking; the stored K/V against the float64 projections of the bfloat16
    values at float32's tolerance (pair GEMMs multiply exactly and sum in float32)."""
    layer = pyattn.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, dtype=bf16, seed=11)
    x = random_array(rng, (2, sum(CHUNKS), 32), bf16)
    cache = pyattn.KVCache(2, num_kv_heads, 8, 24, dtype=np.float32)
    got = run_chunks(layer, x, cache)
    expected = reference_mha(x, num_heads=4, num_kv_heads=num_kv_heads, is_causal=True, **weights_of(layer))
    assert_bf16_close(got, expected, bf16)
    state = layer.state_dict()
    kv = num_kv_heads * 8
    k_proj = f64(x) @ f64(state["in_proj_weight"][32 : 32 + kv]).T + f64(state["in_proj_bias"][32 : 32 + kv])
    rtol, atol = tol(np.float32)
    k_proj = k_proj.reshape(2, sum(CHUNKS), num_kv_heads, 8).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(cache.keys(), k_proj, rtol=rtol, atol=atol)


@pytest.mark.parametrize("storage", CACHE_STORAGES)
def test_cached_steps_match_float32_layer(isa, bf16, rng, storage):
    """Every cache a float32 layer decodes with, a bfloat16 layer does too: its outputs are the float32
    layer's (same values, same kind of cache) rounded once, bit for bit, where the ISA has no bfloat16
    dot products, and within the bfloat16 layer bound where it has; ragged chunks (num_new) too."""
    np_dtype(storage)
    layer = pyattn.MultiHeadAttention(48, 6, num_kv_heads=2, dtype=bf16, seed=4)
    layer32 = pyattn.MultiHeadAttention(48, 6, num_kv_heads=2, seed=4)
    layer32.load_state_dict({k: v.astype(np.float32) for k, v in layer.state_dict().items()})
    caches = [pyattn.KVCache(2, 2, 8, 32, dtype=storage) for _ in range(2)]
    x = random_array(rng, (2, sum(CHUNKS), 48), bf16)
    got = run_chunks(layer, x, caches[0])
    expected = run_chunks(layer32, x.astype(np.float32), caches[1])
    ragged = dict(num_new=np.array([3, 1]))
    got = np.concatenate([got, layer(x[:, :3], kv_cache=caches[0], **ragged)[:, :1]], axis=1)
    expected = np.concatenate([expected, layer32(x[:, :3].astype(np.float32), kv_cache=caches[1], **ragged)[:, :1]], 1)
    assert got.dtype == bf16 and caches[0].lengths.tolist() == [sum(CHUNKS) + 3, sum(CHUNKS) + 1]
    if not pyattn._core.bf16_dots():
        assert_same_bits(got, expected.astype(bf16))
        np.testing.assert_array_equal(f64(caches[0].keys(0)), f64(caches[1].keys(0)))
    else:
        rtol, atol = tol("bfloat16 layer")
        np.testing.assert_allclose(f64(got), f64(expected), rtol=rtol, atol=atol)


def test_cached_prefill_equals_uncached_causal(isa, bf16, rng):
    """One chunk into an empty float32 cache is the causal layer over that chunk (within the bound:
    the cache's attention kernel is not the uncached one)."""
    layer = pyattn.MultiHeadAttention(64, 4, dtype=bf16, seed=2)
    x = random_array(rng, (2, 21, 64), bf16)
    got = layer(x, kv_cache=pyattn.KVCache(2, 4, 16, 21))
    rtol, atol = tol("bfloat16 layer")
    np.testing.assert_allclose(f64(got), f64(layer(x, is_causal=True)), rtol=rtol, atol=atol)


def test_cached_steps_bitwise_for_any_thread_count(isa, bf16, rng):
    layer = pyattn.MultiHeadAttention(48, 6, num_kv_heads=3, dtype=bf16, seed=8)
    x = random_array(rng, (2, sum(CHUNKS), 48), bf16)
    outs = [run_chunks(layer, x, pyattn.KVCache(2, 3, 8, 32, dtype="bfloat16"), num_threads=n) for n in (1, 2, 3)]
    for out in outs[1:]:
        assert_same_bits(out, outs[0])


# --- precision= -----------------------------------------------------------------------------------


def float32_twin(layer):
    """The float32 layer holding a bfloat16 layer's weights (widened exactly)."""
    twin = pyattn.MultiHeadAttention(layer.embed_dim, layer.num_heads, num_kv_heads=layer.num_kv_heads)
    twin.load_state_dict({k: v.astype(np.float32) for k, v in layer.state_dict().items()})
    return twin


def test_highest_is_the_float32_layer_rounded_once(isa, bf16, rng):
    """precision="highest": on every ISA (avx512bf16's pair GEMMs included) a bfloat16 layer is the
    float32 layer over the same values, rounded once, bit for bit: plain, masked with weights,
    packed batch and cached steps; "fast" is the default and within the bfloat16 layer bound."""
    layer = pyattn.MultiHeadAttention(40, 5, num_kv_heads=5, dtype=bf16, seed=8)
    twin = float32_twin(layer)
    x = random_array(rng, (2, 11, 40), bf16)
    x32 = x.astype(np.float32)
    mask = torch_style_mask(rng, (2, 11), "bool", bf16)
    for options in ({}, dict(is_causal=True), dict(key_padding_mask=mask, need_weights=True)):
        got = layer(x, precision="highest", **options)
        want = twin(x32, **options)
        for g, w in zip(*(r if isinstance(r, tuple) else (r,) for r in (got, want))):
            assert_same_bits(g, w.astype(bf16))
        default, fast = (layer(x, **options, **p) for p in ({}, dict(precision="fast")))
        assert_same_bits(*(r[0] if isinstance(r, tuple) else r for r in (default, fast)))
    expected = reference_mha(x, num_heads=5, **weights_of(layer))
    fast = layer(x, precision="fast")
    assert_bf16_close(fast, expected, bf16)
    if pyattn._core.bf16_dots():  # "fast" does take the pair GEMMs where the ISA has them
        assert not np.array_equal(fast.view(np.uint16), layer(x, precision="highest").view(np.uint16))
    cu = np.array([0, 4, 4, 11])
    assert_same_bits(
        pyattn.mha(x[0], num_heads=5, cu_seqlens=cu, precision="highest", **weights_of(layer)),
        pyattn.mha(x32[0], num_heads=5, cu_seqlens=cu, **weights_of(twin)).astype(bf16),
    )
    caches = [pyattn.KVCache(2, 5, 8, 16, dtype=np.float32) for _ in range(2)]
    got = run_chunks(layer, x, caches[0], chunks=[6, 1, 4], precision="highest")
    want = run_chunks(twin, x32, caches[1], chunks=[6, 1, 4])
    assert_same_bits(got, want.astype(bf16))
    np.testing.assert_array_equal(caches[0].keys(), caches[1].keys())


def test_precision_per_call_keeps_both_packings(bf16, rng):
    """A layer called with either precision in turn gives each one's result every time (the weights
    are packed once per ISA and form, not repacked or mixed up)."""
    layer = pyattn.MultiHeadAttention(24, 3, dtype=bf16, seed=2)
    x = random_array(rng, (1, 7, 24), bf16)
    for isa in pyattn.available_isas():
        with forced_isa(isa):
            first = {p: layer(x, precision=p) for p in ("fast", "highest", "fast")}
            for p in ("highest", "fast", "highest"):
                assert_same_bits(layer(x, precision=p), first[p])


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize(
    "precision, error", [("low", ValueError), ("Fast", ValueError), (None, TypeError), (1, TypeError)]
)
def test_bad_precision_is_named(rng, dtype, precision, error):
    """Every layer dtype checks precision (float32 and float64 layers ignore a valid one), in mha, the
    layer and the cached step."""
    dt = np_dtype(dtype)
    layer = pyattn.MultiHeadAttention(16, 2, dtype=dt, seed=1)
    x = random_array(rng, (1, 3, 16), dt)
    cache = pyattn.KVCache(1, 2, 8, 8, dtype=np.float64 if dtype == "float64" else np.float32)
    calls = [
        lambda: layer(x, precision=precision),
        lambda: pyattn.mha(x, num_heads=2, precision=precision, **weights_of(layer)),
        lambda: layer(x, kv_cache=cache, precision=precision),
    ]
    for call in calls:
        with pytest.raises(error, match="precision: expected 'fast' or 'highest'"):
            call()
    assert cache.lengths.tolist() == [0]  # refused before anything was appended
    if dtype != "bfloat16":
        np.testing.assert_array_equal(layer(x, precision="highest"), layer(x))


# --- torch's bfloat16 module --------------------------------------------------------------------


@pytest.mark.parametrize("embed_dim, num_heads, q_len", [(64, 4, 33), (192, 3, 70)])
def test_from_torch_bf16_no_worse_than_torch(bf16, rng, embed_dim, num_heads, q_len):
    """from_torch(a bfloat16 module) holds its values; its output's error against float64 is no more
    than 1.5x that of torch's own bfloat16 forward pass on the same inputs (the accuracy target)."""
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True).eval()
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-1] if param.ndim == 2 else 1
            param.copy_(torch.from_numpy(rng.standard_normal(tuple(param.shape)).astype(np.float32) / np.sqrt(fan_in)))
    module = module.to(torch.bfloat16)
    layer = pyattn.MultiHeadAttention.from_torch(module)
    assert layer.out_proj_weight.dtype == bf16
    np.testing.assert_array_equal(f64(layer.in_proj_weight), module.in_proj_weight.float().detach().numpy())
    query = rng.standard_normal((2, q_len, embed_dim)).astype(bf16)
    got = layer(query)
    with torch.inference_mode():
        torch_out = module(*(torch.from_numpy(query.astype(np.float32)).bfloat16(),) * 3, need_weights=False)[0]
    expected = reference_mha(query, num_heads=num_heads, **weights_of(layer))
    assert_bf16_close(got, expected, bf16)
    err = np.max(np.abs(f64(got) - expected))
    torch_err = np.max(np.abs(torch_out.float().numpy().astype(np.float64) - expected))
    assert err <= 1.5 * torch_err, (err, torch_err)


def test_explain_walks_a_bf16_layer_in_float64(bf16, rng):
    """explain() of a bfloat16 layer is the float64 layer on its bfloat16 values (the reference), and
    the layer's own output is within the bfloat16 layer bound of it."""
    layer = pyattn.MultiHeadAttention(16, 2, dtype=bf16, seed=6)
    x = random_array(rng, (5, 16), bf16)
    ex = pyattn.explain(x, layer, is_causal=True)
    expected = reference_mha(x, num_heads=2, is_causal=True, **weights_of(layer))
    rtol, atol = tol(np.float64)
    np.testing.assert_allclose(ex.output, expected, rtol=rtol, atol=atol)
    assert_bf16_close(layer(x, is_causal=True), expected, bf16)


# --- the error policy ---------------------------------------------------------------------------


def test_float64_cache_is_refused(bf16, rng):
    """A bfloat16 layer computes in float32: a float64 cache is a TypeError naming kv_cache, changing
    nothing."""
    layer = pyattn.MultiHeadAttention(16, 2, dtype=bf16, seed=0)
    cache = pyattn.KVCache(1, 2, 8, 8, dtype=np.float64)
    with pytest.raises(TypeError, match="^kv_cache: storage float64 computes in float64, but the layer"):
        layer(random_array(rng, (1, 1, 16), bf16), kv_cache=cache)
    assert cache.lengths.tolist() == [0]


def test_mixed_dtypes_are_refused(bf16, rng):
    layer = pyattn.MultiHeadAttention(16, 2, dtype=bf16, seed=0)
    with pytest.raises(TypeError, match="query"):
        layer(random_array(rng, (1, 3, 16), np.float32))
    weights = random_weights(rng, bf16, 16, 2)
    with pytest.raises(TypeError, match="out_proj_weight: dtype must be bfloat16"):
        weights["out_proj_weight"] = np.ones((16, 16), np.float32)
        pyattn.mha(random_array(rng, (1, 3, 16), bf16), num_heads=2, **weights)
    with pytest.raises(TypeError, match="attn_mask: dtype must be bool or the inputs' dtype"):
        layer(random_array(rng, (1, 3, 16), bf16), attn_mask=np.zeros((3, 3), np.float32))


@pytest.mark.parametrize("num_threads, error, message", [(0, ValueError, ">= 1"), ("2", TypeError, "an int or None")])
def test_bad_num_threads(isa, bf16, rng, num_threads, error, message):
    """A bfloat16 layer's call names num_threads for a bad value, whichever path converts its inputs."""
    layer = pyattn.MultiHeadAttention(16, 2, dtype=bf16, seed=0)
    with pytest.raises(error, match=f"^num_threads: .*{message}"):
        layer(random_array(rng, (1, 3, 16), bf16), num_threads=num_threads)


def test_float16_layers_are_refused():
    with pytest.raises(TypeError, match="^dtype: must be float32, float64 or bfloat16"):
        pyattn.MultiHeadAttention(16, 2, dtype=np.float16)
