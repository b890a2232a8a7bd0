# SPDX-License-Identifier: MIT
"""The tuning module's plans (src/cpp/tuning.cpp) and its one override (_core._set_tuning,
pyattn._tuning.override).

A plan decides how a call runs, never what it computes, so these tests hold results, not rules:

* under every CPU the planner has rules for (Intel, AMD Zen 3, Zen 4, Zen 5), an unknown vendor and
  unknown cache sizes, with the CPU's own cache sizes and with small ones (so that the rules for K/V
  "from memory" run at test sizes), every call matches the float64 reference, on every ISA this host
  runs: each vendor's branch is exercised on any host;
* every plan the override can force gives the reference's values, and plans that keep the order of
  every sum give the same bits: software prefetching (tiles and decode, into L1 or L2), the heads per
  group tile, copied heads, the fused decode step and packed masks change nothing; the decode
  streams, the 16-bit decode block and reading interleaved heads across the heads change the order of
  the keys, so they are compared against the reference (and among themselves only where they agree);
* the override refuses unknown keys and values outside a key's range (ValueError naming the key) and
  changes nothing then; it returns the previous settings, which restore it.
"""

import functools
import itertools

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn._tuning import PROFILES, override

from conftest import f64, np_dtype, random_array, random_mask, tol

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - the bfloat16 cases skip
    ml_dtypes = None

sdpa = pyattn.scaled_dot_product_attention

# Caches small enough that test-sized K/V count as "from memory" and outgrow L2.
SMALL_CACHES = dict(l2_bytes=64 << 10, llc_bytes=256 << 10)


def assert_reference(got, expected, name):
    rtol, atol = tol(name)
    np.testing.assert_allclose(f64(got), expected, rtol=rtol, atol=atol)


def bshd(rng, batch, seq, heads, dim, dtype):
    """A (batch, heads, seq, dim) view of (batch, seq, heads, dim) values: K/V heads that interleave."""
    return np.swapaxes(random_array(rng, (batch, seq, heads, dim), dtype), 1, 2)


def seeded(name):
    """A generator seeded by the dtype's name: the same inputs in every test that builds them."""
    return np.random.default_rng([20240607, *name.encode()])


@functools.cache
def decode_calls(name):
    """Decode-path calls (q_len <= DECODE_MAX_Q_LEN) of dtype `name`, each with its reference: GQA
    groups of 4 rows and single rows, 16-bit K/V read in place and through scratch (head_dim off the
    lanes), interleaved heads, a mask with holes, lower-right causal over 3 new tokens, a long range
    split across threads."""
    dtype, rng = np_dtype(name), seeded(name)
    calls = []
    for q_heads, kv_heads, q_len, kv_len, dim, options in [
        (8, 2, 1, 1100, 64, {}),
        (4, 4, 1, 700, 128, dict(mask=True)),
        (6, 2, 3, 513, 40, dict(causal=True)),
        (8, 8, 1, 900, 32, dict(layout="bshd")),
        (8, 2, 2, 650, 64, dict(layout="bshd", causal=True)),
        (2, 1, 1, 2600, 16, {}),
    ]:
        if options.get("layout") == "bshd":
            q = random_array(rng, (2, q_heads, q_len, dim), dtype)
            k, v = bshd(rng, 2, kv_len, kv_heads, dim, dtype), bshd(rng, 2, kv_len, kv_heads, dim, dtype)
        else:
            q = random_array(rng, (2, q_heads, q_len, dim), dtype)
            k = random_array(rng, (2, kv_heads, kv_len, dim), dtype)
            v = random_array(rng, (2, kv_heads, kv_len, dim), dtype)
        mask = random_mask(rng, (2, 1, q_len, kv_len), "bool", None, p_allowed=0.8) if options.get("mask") else None
        kw = dict(is_causal="lower_right" if options.get("causal") else False, enable_gqa=q_heads != kv_heads)
        expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), mask, **kw)
        calls.append((lambda q=q, k=k, v=v, mask=mask, kw=kw: sdpa(q, k, v, mask, num_threads=2, **kw), expected, name))
    return calls


@functools.cache
def tile_calls(name):
    """Query-tile calls of dtype `name`, each with its reference: GQA groups (group tiles), interleaved
    heads with many query blocks (copied heads, pairs), boolean and float masks (packed or read as they
    are), causal, many small heads (the next-item prefetch), a split key range."""
    dtype, rng = np_dtype(name), seeded(name)
    calls = []
    for batch, q_heads, kv_heads, q_len, kv_len, dim, options in [
        (1, 8, 2, 40, 700, 24, dict(causal="lower_right")),
        (1, 6, 6, 260, 200, 16, dict(layout="bshd")),
        (2, 3, 3, 70, 520, 40, dict(mask="bool")),
        (1, 4, 2, 33, 400, 24, dict(mask="float", causal=True)),
        (16, 4, 4, 20, 64, 32, {}),
        (1, 2, 2, 20, 3000, 24, {}),
    ]:
        if name in ("float16", "bfloat16") and options.get("mask") == "float":
            continue
        q = random_array(rng, (batch, q_heads, q_len, dim), dtype)
        if options.get("layout") == "bshd":
            k, v = bshd(rng, batch, kv_len, kv_heads, dim, dtype), bshd(rng, batch, kv_len, kv_heads, dim, dtype)
        else:
            k = random_array(rng, (batch, kv_heads, kv_len, dim), dtype)
            v = random_array(rng, (batch, kv_heads, kv_len, dim), dtype)
        mask = None
        if "mask" in options:
            mask = random_mask(rng, (batch, 1, q_len, kv_len), options["mask"], dtype, p_allowed=0.8)
        kw = dict(is_causal=options.get("causal", False), enable_gqa=q_heads != kv_heads)
        expected = reference.scaled_dot_product_attention(f64(q), f64(k), f64(v), mask, **kw)
        calls.append((lambda q=q, k=k, v=v, mask=mask, kw=kw: sdpa(q, k, v, mask, num_threads=2, **kw), expected, name))
    return calls


@functools.cache
def cache_steps(name):
    """KVCache decode steps of storage `name` (GQA and one row per K/V row, ragged lengths), with their
    references from the stored K/V (the results are float32 or float64, held to that dtype's
    tolerance: the K/V values are the stored ones)."""
    np_dtype(name)
    compute, rng = (np.float64 if name == "float64" else np.float32), seeded(name)
    steps = []
    for kv_heads, q_heads, dim, q_len in ((2, 8, 128, 1), (4, 4, 64, 1), (2, 8, 40, 3)):
        lengths = [900, 257]
        cache = pyattn.KVCache(2, kv_heads, dim, 1000, dtype=name)
        k = rng.standard_normal((2, kv_heads, 900, dim)).astype(compute)
        v = rng.standard_normal((2, kv_heads, 900, dim)).astype(compute)
        cache.append(k[:, :, :-q_len], v[:, :, :-q_len], num_new=np.array(lengths) - q_len)
        cache.append(k[:, :, -q_len:], v[:, :, -q_len:])
        q = rng.standard_normal((2, q_heads, q_len, dim)).astype(compute)
        expected = []
        for b in range(2):
            expected.append(
                reference.scaled_dot_product_attention(
                    f64(q[b : b + 1]),
                    f64(cache.keys(b))[None],
                    f64(cache.values(b))[None],
                    is_causal="lower_right",
                    enable_gqa=True,
                )
            )
        steps.append(
            (lambda cache=cache, q=q: cache.attend(q, num_threads=2), np.concatenate(expected), np.dtype(compute).name)
        )
    return steps


# ---- every CPU the planner knows ------------------------------------------------------------------


@pytest.mark.parametrize("caches", ["own", "small"])
@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64", "int8"])
def test_every_cpu_profile_matches_the_reference(isa, cpu_profile, caches, name):
    """Each CPU profile's plans (with its own cache sizes, and with small ones: K/V "from memory",
    where the int8 and 16-bit prefetch rules apply) give the reference's values on the decode path,
    the query tiles and KVCache steps."""
    with override(**(SMALL_CACHES if caches == "small" else {})):
        for call, expected, tol in sdpa_and_cache_calls(name):
            assert_reference(call(), expected, tol)


def test_cpu_profiles_reach_the_planner(cpu_profile):
    """The CPU a profile describes is the one the planner sees (runtime_info reports it), and the
    probed one comes back afterwards."""
    cpu = pyattn.runtime_info()["cpu"]
    for key, value in PROFILES[cpu_profile].items():
        field = {"cpu_vendor": "vendor", "cpu_family": "family", "cpu_model": "model"}.get(key, key)
        assert cpu[field] == value


def test_probed_cpu_comes_back():
    probed = pyattn._core.cpu_info()
    with override(**PROFILES["intel"]):
        assert pyattn._core.cpu_info()["vendor"] == "intel"
        with override(l2_bytes=0):
            assert pyattn._core.cpu_info()["l2_bytes"] == 0
            assert pyattn._core.cpu_info()["vendor"] == "intel"
        assert pyattn._core.cpu_info()["l2_bytes"] == PROFILES["intel"]["l2_bytes"]
    assert pyattn._core.cpu_info() == probed


# ---- every plan the override can force ------------------------------------------------------------

NEUTRAL_DECODE = [
    dict(decode_prefetch=p, decode_fuse=f) for p, f in itertools.product(("off", "l1", "l2"), (False, True))
]
# Every prefetch mode with every group size; heads copied or not, masks packed or not, in turn.
NEUTRAL_TILES = [
    dict(tile_prefetch=p, group_heads=g, pack_heads=n % 2 == 0, packed_mask_limit=None if n % 3 else 0)
    for n, (p, g) in enumerate(itertools.product(("off", "kv_rows", "next_items"), (1, 2, 3, 8)))
]


def sdpa_and_cache_calls(name, tiles=True):
    """decode_calls (and tile_calls) + cache_steps of dtype `name`; int8 is a cache storage only."""
    if name == "int8":
        return cache_steps(name)
    return decode_calls(name) + (tile_calls(name) if tiles else []) + cache_steps(name)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int8"])
def test_forced_decode_plans(isa, name):
    """Every decode plan: streams 1, 2, 4 x 16-bit blocks of 32 and 64 keys x interleaved heads across
    the heads or chunk by chunk, each against the reference; within each, software prefetching (off,
    into L1, into L2) and the fused step change no bit."""
    calls = sdpa_and_cache_calls(name, tiles=False)
    for streams, block16, across in itertools.product((1, 2, 4), (32, 64), (False, True)):
        fixed = dict(decode_streams=streams, decode_block16=block16, decode_across_heads=across)
        for call, expected, result_dtype in calls:
            results = []
            for neutral in NEUTRAL_DECODE:
                with override(**fixed, **neutral):
                    results.append(call())
            for other in results[1:]:
                np.testing.assert_array_equal(f64(other), f64(results[0]))
            assert_reference(results[0], expected, result_dtype)


@pytest.mark.parametrize("name", ["float32", "float64", "bfloat16"])
def test_forced_tile_plans(isa, name):
    """Every query-tile plan (prefetching nothing, K/V rows or the next items; 1, 2, 3 or 8 heads per
    group tile; interleaved heads copied or not; masks packed to bits or read as they are) gives the
    same bits, and the reference's values."""
    for call, expected, result_dtype in tile_calls(name):
        with override(**NEUTRAL_TILES[0]):
            first = call()
        assert_reference(first, expected, result_dtype)
        for neutral in NEUTRAL_TILES[1:]:
            with override(**neutral):
                np.testing.assert_array_equal(f64(call()), f64(first))


# ---- the override itself --------------------------------------------------------------------------

BAD_VALUES = {
    "tile_prefetch": [1, "on", True, -1],
    "group_heads": [0, 9, -1, True, 2.0, "2"],
    "pack_heads": [1, 0, "yes"],
    "decode_prefetch": ["L1", 1, "on"],
    "decode_streams": [0, 3, 8, -1, True],
    "decode_block16": [0, 16, 48, 128],
    "decode_across_heads": [1, "no"],
    "decode_fuse": [2, 0],
    "packed_mask_limit": [-1, -(2**40), 2**70, 1.5],
    "cpu_vendor": ["GenuineIntel", "AMD", 1],
    "cpu_family": [-1, 0x1000, "25"],
    "cpu_model": [-2, 4096],
    "l2_bytes": [-1, 2**60],
    "llc_bytes": [-3, "big"],
}
GOOD_VALUES = {
    "tile_prefetch": "next_items",
    "group_heads": 3,
    "pack_heads": True,
    "decode_prefetch": "l1",
    "decode_streams": 2,
    "decode_block16": 64,
    "decode_across_heads": False,
    "decode_fuse": True,
    "packed_mask_limit": 4096,
    "cpu_vendor": "amd",
    "cpu_family": 0x1A,
    "cpu_model": 17,
    "l2_bytes": 1 << 20,
    "llc_bytes": 0,
}


def test_override_keys_are_documented():
    assert set(pyattn._core._set_tuning({})) == set(BAD_VALUES) == set(GOOD_VALUES)


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_override_refuses_values_a_key_does_not_take(key):
    """A value outside a key's range raises a ValueError naming the key, and nothing changes (the key
    keeps its previous value; other keys in the same call are not set either)."""
    with override(**{key: GOOD_VALUES[key]}):
        for bad in BAD_VALUES[key]:
            with pytest.raises(ValueError, match=f"_set_tuning: {key}: expected"):
                pyattn._core._set_tuning({"decode_streams": 4, key: bad})
            settings = pyattn._core._set_tuning({})
            assert settings[key] == GOOD_VALUES[key]
            assert settings["decode_streams"] == (GOOD_VALUES[key] if key == "decode_streams" else None)


def test_override_refuses_unknown_keys():
    before = pyattn._core._set_tuning({})
    for bad in ("prefetch", "decode_heads", "", "L2_bytes"):
        with pytest.raises(ValueError, match="unknown key"):
            pyattn._core._set_tuning({"decode_fuse": True, bad: 1})
    assert pyattn._core._set_tuning({}) == before
    with pytest.raises(TypeError):
        pyattn._core._set_tuning([("decode_fuse", True)])


def test_override_returns_what_restores_it():
    """_set_tuning returns every key's previous value; keys not given keep theirs; passing the
    returned settings back restores them; None hands a key back to the rules."""
    assert all(v is None for v in pyattn._core._set_tuning({}).values())
    previous = pyattn._core._set_tuning(GOOD_VALUES)
    try:
        assert all(v is None for v in previous.values())
        again = pyattn._core._set_tuning({"decode_streams": None})
        assert again == GOOD_VALUES
        current = pyattn._core._set_tuning({})
        assert current == {**GOOD_VALUES, "decode_streams": None}
    finally:
        pyattn._core._set_tuning(previous)
    assert pyattn._core._set_tuning({}) == previous
    with override(decode_fuse=True):
        with override(decode_streams=4):
            assert pyattn._core._set_tuning({})["decode_fuse"] is True
        assert pyattn._core._set_tuning({})["decode_streams"] is None
    assert pyattn._core._set_tuning({})["decode_fuse"] is None
