# SPDX-License-Identifier: MIT
"""The one-step C++ path for plain calls (_core.sdpa_simple): bitwise the general path's result, and
None (so the general path runs and raises its own errors) for everything outside its case."""

import numpy as np
import pytest
from conftest import DTYPES, nan_guarded

import pyattn
from pyattn import _core

sdpa = pyattn.scaled_dot_product_attention


def general(q, k, v, **kwargs):
    """The general Python path: a NumPy integer thread count keeps a call off the simple path (which
    takes plain ints only); results do not depend on the thread count."""
    kwargs["num_threads"] = np.int64(kwargs.get("num_threads", 2))
    return sdpa(q, k, v, **kwargs)


def inputs(rng, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim, layout):
    def make(shape):
        x = rng.standard_normal(shape).astype(dtype)
        if layout == "guarded":
            return nan_guarded(x)
        if layout == "heads_major":  # (L, H, D) memory viewed as (H, L, D)
            return np.ascontiguousarray(np.swapaxes(x, -2, -3)).swapaxes(-2, -3)
        return x

    lead = (batch,) if batch else ()
    return (make(lead + (q_heads, q_len, head_dim)), make(lead + (kv_heads, kv_len, head_dim)),
            make(lead + (kv_heads, kv_len, value_dim)))


CAUSAL = [(False, 0), (True, 1), ("upper_left", 1), ("lower_right", 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["contiguous", "guarded", "heads_major"])
@pytest.mark.parametrize("is_causal,code", CAUSAL, ids=[str(c) for c, _ in CAUSAL])
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,q_len,kv_len,head_dim,value_dim",
    [(2, 4, 4, 5, 7, 8, 6), (0, 3, 3, 17, 17, 16, 16), (1, 8, 2, 3, 40, 64, 64), (3, 6, 1, 1, 33, 24, 5),
     (2, 2, 2, 70, 50, 33, 17)],
    ids=["mha", "3d", "gqa-decode", "mqa-1", "ragged"],
)
def test_simple_path_is_bitwise_the_general_path(rng, isa, dtype, layout, is_causal, code, batch, q_heads, kv_heads,
                                                   q_len, kv_len, head_dim, value_dim):
    q, k, v = inputs(rng, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim, layout)
    gqa = q_heads != kv_heads
    direct = _core.sdpa_simple(q, k, v, code, gqa, None, 0)
    assert direct is not None, "the simple path declined a plain call"
    expected = general(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    np.testing.assert_array_equal(direct, expected)
    np.testing.assert_array_equal(sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa), expected)
    # An explicit float scale and a thread count take the simple path too.
    np.testing.assert_array_equal(
        sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=0.3, num_threads=2),
        general(q, k, v, is_causal=is_causal, enable_gqa=gqa, scale=0.3, num_threads=2))
    assert direct.flags.c_contiguous and direct.dtype == dtype


RANKS = {  # q, k, v of shapes (2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6) cut to other ranks or batches
    "2-d": lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0]),
    "k/v batch 1": lambda q, k, v: (q, k[:1], v[:1]),
    "q batch 1": lambda q, k, v: (q[1:], k, v),
    "v batch 1": lambda q, k, v: (q, k, v[1:]),
    "q and k batch 1": lambda q, k, v: (q[:1], k[1:], v),
}


@pytest.mark.parametrize("dtype", DTYPES + ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(RANKS))
@pytest.mark.parametrize("guarded", [False, True], ids=["contiguous", "guarded"])
def test_simple_path_takes_2d_and_broadcast_batches(rng, isa, dtype, case, guarded):
    # 2-D inputs (one head) and 4-D inputs whose batch axes broadcast (each 1 or the common size) go
    # the one-step way too, bitwise the general path's result, with and without a mask and out=.
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v = RANKS[case](*(x.astype(dtype) for x in plain(rng)))
    if guarded:
        q, k, v = nan_guarded(q), nan_guarded(k), nan_guarded(v)
    mask = rng.random((5, 7)) < 0.6
    for is_causal, code in CAUSAL:
        direct = _core.sdpa_simple(q, k, v, code, False, None, 0)
        assert direct is not None, "the simple path declined a call it takes"
        expected = general(q, k, v, is_causal=is_causal)
        assert direct.shape == expected.shape and direct.dtype == expected.dtype
        np.testing.assert_array_equal(direct, expected)
        out = np.full(expected.shape, np.nan, dtype)
        assert _core.sdpa_simple(q, k, v, code, False, 0.3, 1, mask, out) is out
        np.testing.assert_array_equal(out, general(q, k, v, attn_mask=mask, is_causal=is_causal, scale=0.3))


def plain(rng, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6))]


DECLINED = {
    "batch mismatch": lambda q, k, v: (q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]])),
    "5-d": lambda q, k, v: (q[None], k[None], v[None]),
    "mixed ndim": lambda q, k, v: (q, k[0], v[0]),
    "mixed dtypes": lambda q, k, v: (q, k.astype(np.float64), v),
    "float16 with float32": lambda q, k, v: (q.astype(np.float16), k, v),
    "big-endian float16": lambda q, k, v: (q.astype(">f2"), k.astype(">f2"), v.astype(">f2")),
    "float16 query, strided last axis": lambda q, k, v: (np.repeat(q.astype(np.float16), 2, axis=-1)[..., ::2],
                                                         k.astype(np.float16), v.astype(np.float16)),
    "float16 query, reversed rows": lambda q, k, v: (q.astype(np.float16)[:, :, ::-1], k.astype(np.float16),
                                                     v.astype(np.float16)),
    "int": lambda q, k, v: (q.astype(np.int32), k.astype(np.int32), v.astype(np.int32)),
    "big-endian": lambda q, k, v: (q.astype(">f4"), k.astype(">f4"), v.astype(">f4")),
    "strided last axis": lambda q, k, v: (q, np.repeat(k, 2, axis=-1)[..., ::2], v),
    "reversed rows": lambda q, k, v: (q, k[:, :, ::-1], v),
    "misaligned": lambda q, k, v: (q, np.frombuffer(b"\0" + k.tobytes(), np.float32, offset=1).reshape(k.shape), v),
    "empty": lambda q, k, v: (q[:, :, :0], k, v),
    "head_dim mismatch": lambda q, k, v: (q, k[..., :7], v),
    "kv_len mismatch": lambda q, k, v: (q, k, v[:, :, :6]),
    "heads mismatch": lambda q, k, v: (q, k[:, :2], v[:, :2]),
    "list": lambda q, k, v: (q.tolist(), k, v),
    "subclass": lambda q, k, v: (np.ma.asarray(q), k, v),
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_simple_path_declines(rng, case):
    q, k, v = DECLINED[case](*plain(rng))
    assert _core.sdpa_simple(q, k, v, 0, False, None, 0) is None


@pytest.mark.parametrize("scale", [np.nan, np.inf, np.float32(0.5), 1])
def test_simple_path_declines_scales(rng, scale):
    assert _core.sdpa_simple(*plain(rng), 0, False, scale, 0) is None


def test_simple_path_declines_gqa_without_flag_and_bad_threads(rng):
    q, k, v = plain(rng)
    assert _core.sdpa_simple(q, k[:, :2], v[:, :2], 0, True, None, 0) is not None
    assert _core.sdpa_simple(q, k[:, :3], v[:, :3], 0, True, None, 0) is None  # 4 % 3 != 0
    assert _core.sdpa_simple(q, k, v, 0, False, None, -1) is None


def test_inputs_untouched_and_output_fresh(rng):
    q, k, v = plain(rng)
    copies = [x.copy() for x in (q, k, v)]
    out1, out2 = sdpa(q, k, v), sdpa(q, k, v)
    assert not np.shares_memory(out1, out2)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


MASK_SHAPES = [(5, 7), (1, 7), (5, 1), (4, 5, 7), (1, 5, 7), (2, 1, 5, 7), (2, 4, 1, 7), (1, 1, 1, 1), (2, 4, 5, 7)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("guarded", [False, True], ids=["contiguous", "guarded"])
def test_simple_path_masks_are_bitwise_the_general_path(rng, isa, dtype, mask_kind, mask_shape, guarded):
    q, k, v = plain(rng, dtype)
    allowed = rng.random(mask_shape) < 0.7
    mask = allowed if mask_kind == "bool" else np.where(allowed, rng.standard_normal(mask_shape), -np.inf).astype(dtype)
    if guarded:
        mask = nan_guarded(mask)
    for is_causal, code in [(False, 0), ("lower_right", 2)]:
        direct = _core.sdpa_simple(q, k, v, code, False, None, 0, mask)
        assert direct is not None, "the simple path declined a broadcastable mask"
        expected = general(q, k, v, attn_mask=mask, is_causal=is_causal)
        np.testing.assert_array_equal(direct, expected)
        np.testing.assert_array_equal(sdpa(q, k, v, mask, is_causal=is_causal), expected)


def test_simple_path_mask_on_three_dim_inputs(rng):
    q, k, v = (x[0] for x in plain(rng))
    mask = rng.random((4, 5, 7)) < 0.5
    direct = _core.sdpa_simple(q, k, v, 0, False, None, 0, mask)
    assert direct is not None
    np.testing.assert_array_equal(direct, general(q, k, v, attn_mask=mask))


MASK_DECLINED = {
    "1-d": lambda m: m[0, 0, 0],
    "too many dims": lambda m: m[None],
    "wrong size": lambda m: m[..., :6],
    "reversed": lambda m: m[..., ::-1],
    "float16": lambda m: m.astype(np.float16),
    "float64 for float32 inputs": lambda m: m.astype(np.float64),
    "int": lambda m: m.astype(np.int8),
    "list": lambda m: m.tolist(),
    "subclass": lambda m: np.ma.asarray(m),
}


@pytest.mark.parametrize("case", list(MASK_DECLINED))
def test_simple_path_declines_masks(rng, case):
    q, k, v = plain(rng)
    mask = MASK_DECLINED[case](rng.random((2, 4, 5, 7)) < 0.5)
    assert _core.sdpa_simple(q, k, v, 0, False, None, 0, mask) is None


def test_simple_path_writes_out(rng, isa):
    q, k, v = plain(rng)
    mask = rng.random((5, 7)) < 0.6
    out = np.full((2, 4, 5, 6), np.nan, np.float32)
    result = _core.sdpa_simple(q, k, v, 1, False, None, 0, mask, out)
    assert result is out
    np.testing.assert_array_equal(out, general(q, k, v, attn_mask=mask, is_causal=True))
    assert sdpa(q, k, v, mask, is_causal=True, out=out) is out


OUT_DECLINED = {
    "float64": lambda q: np.empty((2, 4, 5, 6), np.float64),
    "shape": lambda q: np.empty((2, 4, 5, 7), np.float32),
    "ndim": lambda q: np.empty((8, 5, 6), np.float32),
    "not contiguous": lambda q: np.empty((2, 4, 5, 12), np.float32)[..., ::2],
    "read-only": lambda q: np.broadcast_to(np.empty((1, 4, 5, 6), np.float32), (2, 4, 5, 6)),
    "list": lambda q: np.empty((2, 4, 5, 6), np.float32).tolist(),
    "subclass": lambda q: np.ma.asarray(np.empty((2, 4, 5, 6), np.float32)),
}


@pytest.mark.parametrize("case", list(OUT_DECLINED))
def test_simple_path_declines_out(rng, case):
    q, k, v = plain(rng)
    assert _core.sdpa_simple(q, k, v, 0, False, None, 0, None, OUT_DECLINED[case](q)) is None


def test_simple_path_declines_out_overlapping_an_input(rng):
    q, k, v = plain(rng)
    buf = np.empty(q.size + 240, np.float32)
    q2 = buf[: q.size].reshape(q.shape)
    q2[...] = q
    out = buf[100:340].reshape(2, 4, 5, 6)  # C-contiguous, inside q2's memory
    assert _core.sdpa_simple(q2, k, v, 0, False, None, 0, None, out) is None
    with pytest.raises(ValueError, match="out: must not overlap query"):
        sdpa(q2, k, v, out=out)


def half_dtypes():
    halves = [np.float16]
    try:
        import ml_dtypes
        halves.append(ml_dtypes.bfloat16)
    except ImportError:  # bfloat16 arrays need ml_dtypes (the test extra installs it)
        pass
    return halves


HALVES = half_dtypes()


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("layout", ["contiguous", "guarded", "heads_major"])
@pytest.mark.parametrize("is_causal,code", CAUSAL, ids=[str(c) for c, _ in CAUSAL])
@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,q_len,kv_len,head_dim,value_dim",
    [(2, 4, 4, 5, 7, 8, 6), (0, 3, 3, 17, 17, 16, 16), (1, 8, 2, 1, 300, 64, 64), (3, 6, 1, 1, 33, 24, 5),
     (2, 2, 2, 70, 50, 33, 17)],
    ids=["mha", "3d", "gqa-decode", "mqa-1", "ragged"],
)
def test_simple_path_half_is_bitwise_the_general_path(rng, isa, dtype, layout, is_causal, code, batch, q_heads,
                                                        kv_heads, q_len, kv_len, head_dim, value_dim):
    # float16/bfloat16: the query widened, K/V read as 16-bit storage, the result rounded back, as the
    # general path does, for any layout (the query widened row by row when it is a view).
    q, k, v = inputs(rng, np.float32, batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim, layout)
    q, k, v = (x.astype(dtype) if layout == "contiguous" else _like(x, dtype) for x in (q, k, v))
    assert layout == "contiguous" or q_len == 1 or not q.flags.c_contiguous
    gqa = q_heads != kv_heads
    direct = _core.sdpa_simple(q, k, v, code, gqa, None, 0)
    assert direct is not None, "the simple path declined a plain 16-bit call"
    assert direct.dtype == dtype and direct.flags.c_contiguous
    expected = general(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    np.testing.assert_array_equal(direct.view(np.uint16), expected.view(np.uint16))
    mask = rng.random(q.shape[-2:-1] + k.shape[-2:-1]) < 0.7
    out = np.full(expected.shape, np.nan, dtype)
    result = _core.sdpa_simple(q, k, v, code, gqa, 0.3, 2, mask, out)
    assert result is out
    expected = general(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, scale=0.3, num_threads=2)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def _like(x, dtype):
    """x's values as dtype, in x's own memory layout (strides scaled to the element size)."""
    base = x.base if x.base is not None else x
    while base.base is not None:
        base = base.base
    wide = np.empty(base.shape, dtype)
    wide[...] = base.astype(dtype)
    offset = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize
    strides = tuple(st // x.itemsize * wide.itemsize for st in x.strides)
    flat = wide.reshape(-1)
    return np.lib.stride_tricks.as_strided(flat[offset:], x.shape, strides)


HALF_DECLINED = {
    "float16 mask": lambda q, k, v, m: (q, k, v, np.where(m, 0.0, -np.inf).astype(q.dtype), None),
    "float32 mask": lambda q, k, v, m: (q, k, v, np.where(m, 0.0, -np.inf).astype(np.float32), None),
    "float32 out": lambda q, k, v, m: (q, k, v, None, np.empty((2, 4, 5, 6), np.float32)),
    "out shape": lambda q, k, v, m: (q, k, v, None, np.empty((2, 4, 5, 7), q.dtype)),
    "out not contiguous": lambda q, k, v, m: (q, k, v, None, np.empty((2, 4, 5, 12), q.dtype)[..., ::2]),
    "out overlapping key": lambda q, k, v, m: (q, k, v, None, k.reshape(-1)[:240].reshape(2, 4, 5, 6)),
    "empty": lambda q, k, v, m: (q[:, :, :0], k, v, None, None),
    "batch mismatch": lambda q, k, v, m: (q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]), None, None),
}


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", list(HALF_DECLINED))
def test_simple_path_half_declines(rng, dtype, case):
    q, k, v = (x.astype(dtype) for x in plain(rng))
    q, k, v, mask, out = HALF_DECLINED[case](q, k, v, rng.random((5, 7)) < 0.5)
    assert _core.sdpa_simple(q, k, v, 0, False, None, 0, mask, out) is None
