# SPDX-License-Identifier: MIT
"""Parity of pyattn.scaled_dot_product_attention with the float64 reference, for every ISA and dtype.

Inputs are views cut from NaN-filled parents (see conftest.nan_guarded), so an out-of-bounds read or a
stride mistake shows up as NaN in the output.
"""

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn._tuning import override

from conftest import (
    TOL,
    assert_close,
    check_against_reference,
    make_qkv,
    nan_guarded,
    random_array,
    random_mask,
    tol,
)

try:
    import ml_dtypes
except ImportError:  # the 16-bit cases skip
    ml_dtypes = None

sdpa = pyattn.scaled_dot_product_attention


# --- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", list(range(1, 34)) + [64, 128, 256])
@pytest.mark.parametrize("q_len, kv_len", [(1, 17), (17, 113)])
def test_head_dim_sweep(isa, dtype, rng, head_dim, q_len, kv_len):
    q, k, v = make_qkv(rng, dtype, batch=(1,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    check_against_reference(q, k, v)
    check_against_reference(q, k, v, random_mask(rng, (q_len, kv_len), "float", dtype), is_causal=True)


@pytest.mark.parametrize("head_dim, value_dim", [(8, 1), (8, 3), (16, 33), (64, 17), (5, 128), (33, 64), (128, 64)])
def test_value_dim_differs(isa, dtype, rng, head_dim, value_dim):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=75, head_dim=head_dim, value_dim=value_dim)
    out = check_against_reference(q, k, v)
    assert out.shape == (2, 2, 17, value_dim)


@pytest.mark.parametrize("value_dim", range(1, 34))
def test_value_dim_sweep(isa, dtype, rng, value_dim):
    q, k, v = make_qkv(rng, dtype, batch=(1,), q_heads=2, q_len=17, kv_len=113, head_dim=16, value_dim=value_dim)
    check_against_reference(q, k, v, random_mask(rng, (17, 113), "bool", dtype), is_causal="lower_right")


@pytest.mark.parametrize("q_len", [1, 3, 17, 75, 113])
@pytest.mark.parametrize("kv_len", [1, 3, 17, 75, 113])
def test_odd_lengths(isa, dtype, rng, q_len, kv_len):
    q, k, v = make_qkv(rng, dtype, batch=(1,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=64)
    check_against_reference(q, k, v)


# Around SIMD widths, register tiles (4..64 query rows) and key blocks (256 keys) of every ISA.
@pytest.mark.parametrize("q_len", [16, 33, 64, 65])
@pytest.mark.parametrize("kv_len", [63, 64, 65, 128, 255, 256, 257, 513])
def test_block_boundaries(isa, dtype, rng, q_len, kv_len):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=20, value_dim=13)
    mask = random_mask(rng, (q_len, kv_len), "bool", dtype, p_allowed=0.9)
    check_against_reference(q, k, v, mask, is_causal="lower_right", return_weights=True)


# Query tiles run with as few row vectors as hold their rows (1 .. row_vecs: 16..64 rows on AVX-512
# float32, 8..32 float64; AVX2: 8..24 float32, 4..12 float64), a query's row vectors shared out
# evenly over its blocks (attention.cpp): q_len past the decode kernel's limit but short of a block,
# and several blocks of every width with a ragged last row vector, for every ISA and dtype; boolean
# mask with a lower-right causal limit, and the weights (written by the same tile width).
@pytest.mark.parametrize("q_len", [pyattn._core.DECODE_MAX_Q_LEN + 1, 17, 24, 33, 48, 65, 73, 81, 89, 97, 113, 121])
@pytest.mark.parametrize("variant", ["plain", "masked", "weights"])
def test_tile_widths(isa, dtype, rng, q_len, variant):
    kv_len = q_len + 37
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=20, value_dim=13)
    if variant == "plain":
        check_against_reference(q, k, v)
        return
    mask = random_mask(rng, (q_len, kv_len), "bool", dtype, p_allowed=0.8)
    check_against_reference(q, k, v, mask, is_causal="lower_right", return_weights=variant == "weights")


# Tiles of fewer row vectors than the widest (a query of few vectors, blocks that share a query's
# vectors evenly, the causal diagonal's first row vectors) run wider register tiles: more key and
# value columns per tile (AVX2 float32: 2 x 6 and 1 x 12; AVX-512: 3 x 5, 2 x 8, 1 x 16), then
# 4-column tiles, then single columns; P.V tiles of AVX-512 take more value columns still where the
# registers allow (4 x 6, 3 x 8, 2 x 12; kernels.inc, value_cols). Tiles of one row vector (a query
# of at most one vector; up to 8 rows only with the weights, which the decode kernel does not write)
# and of two (q_len 12, 32, 40, 80: blocks of 2 vectors on AVX2 float32; 32, 80 on AVX-512), of
# three and four (80, 112), on every ISA and dtype, value and key counts around those widths,
# forbidden keys whose V rows are NaN (the guarded P.V tiles), the lower-right causal diagonal, and
# the weights.
@pytest.mark.parametrize("q_len", [3, 8, 12, 20, 32, 40, 80, 112])
@pytest.mark.parametrize("value_dim", [1, 3, 5, 6, 7, 8, 11, 12, 13, 17, 18, 24, 25, 33, 36, 49])
def test_narrow_tile_columns(isa, dtype, rng, q_len, value_dim):
    kv_len = q_len + 29
    q, k, v = make_qkv(rng, dtype, q_heads=1, q_len=q_len, kv_len=kv_len, head_dim=7, value_dim=value_dim)
    v = v.copy()
    allowed = rng.random((q_len, kv_len)) < 0.85
    allowed[:, 5] = False
    v[..., 5, :] = np.nan
    weights = value_dim % 4 == 1 or q_len <= pyattn._core.DECODE_MAX_Q_LEN
    check_against_reference(q, k, v, allowed, is_causal="lower_right", return_weights=weights)
    check_against_reference(q, k, v, allowed, return_weights=q_len <= pyattn._core.DECODE_MAX_Q_LEN)


@pytest.mark.parametrize(
    "q_len, kv_len, options",
    [
        (1030, 1030, dict(is_causal=True)),
        (1, 1030, {}),
        (1030, 3, {}),
        (75, 1030, dict(is_causal="lower_right")),
    ],
)
def test_long_sequences(isa, dtype, rng, q_len, kv_len, options):
    q, k, v = make_qkv(rng, dtype, q_heads=1, q_len=q_len, kv_len=kv_len, head_dim=64)
    check_against_reference(q, k, v, **options)


def test_long_sequence_with_mask(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=1, q_len=113, kv_len=1030, head_dim=32)
    check_against_reference(q, k, v, random_mask(rng, (113, 1030), "bool", dtype))


@pytest.mark.parametrize("q_len", [1, 5, 17])
@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_few_queries_long_kv(isa, dtype, rng, q_len, is_causal):
    # Few (batch, head, query-block) tasks and many keys: the driver splits the key range into
    # chunks and merges them; under a causal mask whole chunks have nothing allowed.
    q, k, v = make_qkv(rng, dtype, q_heads=1, q_len=q_len, kv_len=3001, head_dim=24, value_dim=40)
    check_against_reference(q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_few_queries_long_kv_padding_mask(isa, dtype, rng, mask_kind):
    # Padding masks forbid whole key chunks (or all but a few keys); their K/V hold NaN and Inf.
    kv_len = 3001
    q, k, v = make_qkv(rng, dtype, batch=(3,), q_heads=2, q_len=4, kv_len=kv_len, head_dim=16)
    k, v = k.copy(), v.copy()
    allowed = np.ones((3, 1, 1, kv_len), dtype=bool)
    allowed[0, ..., kv_len // 3 :] = False
    allowed[1, ..., : kv_len - 5] = False
    allowed[2] = False
    k[0, :, kv_len // 3 + 7], v[0, :, kv_len // 2] = np.nan, np.inf
    k[1, :, 10], v[1, :, 100] = np.inf, np.nan
    k[2, :, 0], v[2, :, -1] = np.nan, np.nan
    mask = allowed if mask_kind == "bool" else np.where(allowed, 0.0, -np.inf).astype(dtype)
    out = check_against_reference(q, k, v, mask)
    assert np.isfinite(out).all() and np.all(out[2] == 0)


def test_block_sparse_mask(isa, dtype, rng):
    # Whole key blocks forbidden or allowed for runs of query rows: block skipping and per-element
    # fix-up both happen.
    q_len, kv_len = 300, 1030
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=32)
    blocks = rng.random((q_len // 10 + 1, kv_len // 50 + 1)) < 0.4
    mask = np.repeat(np.repeat(blocks, 10, axis=0), 50, axis=1)[:q_len, :kv_len]
    check_against_reference(q, k, v, mask, is_causal="lower_right", return_weights=True)


@pytest.mark.parametrize("q_len, kv_len", [(17, 130), (128, 128), (300, 700)])
@pytest.mark.parametrize("pattern", ["right_padding", "left_padding", "band", "causal_shaped", "padded_holes"])
def test_masked_block_edges(isa, dtype, rng, q_len, kv_len, pattern):
    # Keys that no row of a tile may see at either end of a key block are dropped from the block;
    # their K/V hold NaN and Inf, which must not reach any output. Per batch row a different cut,
    # so the cuts fall inside key blocks, on their edges, and beyond them.
    q, k, v = make_qkv(rng, dtype, batch=(4,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=16)
    k, v = k.copy(), v.copy()
    allowed = np.zeros((4, 1, q_len, kv_len), dtype=bool)
    cuts = [1, kv_len // 3, kv_len // 2 + 5, kv_len - 1]
    for b, cut in enumerate(cuts):
        if pattern == "right_padding":
            allowed[b, :, :, :cut] = True
        elif pattern == "left_padding":
            allowed[b, :, :, kv_len - cut :] = True
        elif pattern == "padded_holes":  # both ends cut, random holes between: the cut words are used bit by bit
            allowed[b, :, :, cut // 2 : kv_len - cut // 3] = rng.random((q_len, kv_len - cut // 3 - cut // 2)) < 0.8
        elif pattern == "band":
            i = np.arange(q_len)[:, None] * kv_len // q_len
            allowed[b, 0] = np.abs(np.arange(kv_len)[None, :] - i) <= cut // 4
        else:  # an explicit lower-right causal mask, shifted by the cut
            allowed[b, 0] = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + cut
    allowed[..., 0] |= ~allowed.any(axis=-1)  # no fully masked row (zeros are tested elsewhere)
    forbidden_everywhere = ~allowed.any(axis=(1, 2))  # (4, kv_len): keys no query may see
    k[np.broadcast_to(forbidden_everywhere[:, None, :], k.shape[:-1])] = np.nan
    v[np.broadcast_to(forbidden_everywhere[:, None, :], v.shape[:-1])] = np.inf
    out = check_against_reference(q, k, v, allowed)
    assert np.isfinite(out).all()


def masks_read_as_bytes():
    """Makes the kernels read masks as they are (boolean bytes, floats): no call packs a bit copy (see
    mask_pack.cpp)."""
    return override(packed_mask_limit=0)


def masks_packed_without_lane_words(mask, batch_heads, q_len, kv_len):
    """Lets the driver pack `mask` (broadcast to batch_heads + (q_len, kv_len)) to bits but leaves no
    room for its lane words (mask_pack.cpp, pack_mask_bits): the tiles then build every partly masked
    block's verdict words from the bits."""
    mask = np.asarray(mask)
    shape = (1,) * (2 + len(batch_heads) - mask.ndim) + mask.shape
    distinct = int(np.prod([n for n in shape[:-2]]))
    rows = shape[-2]
    words = -(-kv_len // 64)
    nbytes = distinct * rows * words * 8 * (1 if mask.dtype == bool else 2)
    return override(packed_mask_limit=nbytes)


@pytest.fixture
def mask_bytes():
    with masks_read_as_bytes():
        yield


def _bool_mask_cases(rng, q_len, kv_len):
    """Boolean masks of every layout the bit packing distinguishes, for (2, 3, q_len, kv_len) inputs."""
    holes = rng.random((2, 3, q_len, kv_len)) < 0.8
    holes[..., 0] = True
    padded = np.ones((2, 1, 1, kv_len), dtype=bool)
    padded[0, ..., kv_len // 3 :] = False
    padded[1, ..., : kv_len // 5] = False
    padded[..., 7 :: kv_len // 5] = False  # holes every row shares: blocks with per-element selects
    return {
        "shared_2d": holes[0, 0],  # one mask for every batch entry and head
        "per_batch": holes[:, :1],  # (B, 1, L, S): heads of a batch entry share one
        "per_head": holes,  # a different mask for every head
        "shared_rows": padded,  # (B, 1, 1, S): row stride 0
        "shared_keys": holes[:1, :, :, 1:2],  # (1, H, L, 1): key stride 0
        "transposed": np.ascontiguousarray(holes[0, 0].T).T,  # key stride q_len
        "reversed": np.ascontiguousarray(holes[0, 0, ::-1, ::-1])[::-1, ::-1],  # negative strides
    }


def _float_mask_cases(rng, dtype, q_len, kv_len):
    """Float masks of every layout the bit packing distinguishes, for (2, 3, q_len, kv_len) inputs:
    mostly 0 and -inf (causal- and padding-shaped, with holes), with finite values to add in some key
    ranges only, so that packed blocks with and without values to add both occur."""
    causal = np.where(np.tril(np.ones((q_len, kv_len), bool), kv_len - q_len), 0.0, -np.inf)
    holes = np.where(rng.random((2, 3, q_len, kv_len)) < 0.8, 0.0, -np.inf)
    holes[..., 0] = 0.0
    holes[..., kv_len // 2 : kv_len // 2 + 40] += rng.standard_normal((2, 3, q_len, min(40, kv_len - kv_len // 2)))
    holes[..., 1, :] = -np.inf  # a row with nothing allowed
    padded = np.zeros((2, 1, 1, kv_len))
    padded[0, ..., kv_len // 3 :] = -np.inf
    padded[1, ..., : kv_len // 5] = -np.inf
    padded[1, ..., -3:] = 1.5
    cases = {
        "causal_2d": causal,
        "per_batch": holes[:, :1],
        "per_head": holes,
        "shared_rows": padded,
        "shared_keys": holes[:1, :, :, 3:4],
        "transposed": np.ascontiguousarray(holes[0, 0].T).T,
        "reversed": np.ascontiguousarray(holes[0, 0, ::-1, ::-1])[::-1, ::-1],
    }
    return {name: m.astype(dtype) for name, m in cases.items()}


MASK_LAYOUTS = [
    ("bool", layout)
    for layout in ("shared_2d", "per_batch", "per_head", "shared_rows", "shared_keys", "transposed", "reversed")
] + [
    ("float", layout)
    for layout in ("causal_2d", "per_batch", "per_head", "shared_rows", "shared_keys", "transposed", "reversed")
]


@pytest.mark.parametrize("q_len, kv_len", [(9, 70), (130, 700)])
@pytest.mark.parametrize("kind, layout", MASK_LAYOUTS)
@pytest.mark.parametrize("options", [{}, {"is_causal": "lower_right"}, {"return_weights": True}], ids=str)
def test_mask_bits_agree_with_mask_as_given(isa, dtype, rng, q_len, kv_len, kind, layout, options):
    # The driver packs masks to bits when the copy fits its budget (boolean: one bit per element;
    # float: two, not -inf and a value to add), with lane words (the bits by 32-key chunk, read in
    # place by the score tiles' select) when those fit too, and the kernels read the bytes or floats
    # otherwise: all three give bit-identical results, and match the reference.
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=3, q_len=q_len, kv_len=kv_len, head_dim=16)
    cases = _bool_mask_cases(rng, q_len, kv_len) if kind == "bool" else _float_mask_cases(rng, dtype, q_len, kv_len)
    mask = cases[layout]
    packed = check_against_reference(q, k, v, mask, **options)
    with masks_read_as_bytes():
        as_given = sdpa(q, k, v, mask, **options)
    with masks_packed_without_lane_words(mask, (2, 3), q_len, kv_len):
        bits_only = sdpa(q, k, v, mask, **options)
    if options.get("return_weights"):
        np.testing.assert_array_equal(packed[1], as_given[1])
        np.testing.assert_array_equal(packed[1], bits_only[1])
        packed, as_given, bits_only = packed[0], as_given[0], bits_only[0]
    np.testing.assert_array_equal(packed, as_given)
    np.testing.assert_array_equal(packed, bits_only)


@pytest.mark.parametrize("column", [130, 297])  # in a whole vector of the row / in its tail
@pytest.mark.parametrize("transposed", [False, True])  # key stride 1 / q_len (element by element)
def test_float_mask_nan_packed_like_floats(isa, rng, column, transposed):
    # A NaN in a float mask is a value to add (the row becomes NaN) in the packed path as in the
    # float path.
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=3, q_len=70, kv_len=300, head_dim=16)
    mask = np.zeros((70, 300), np.float32)
    mask[:, 200:280] = -np.inf
    mask[5, column] = np.nan
    if transposed:
        mask = np.ascontiguousarray(mask.T).T
    packed = sdpa(q, k, v, mask)
    with masks_read_as_bytes():
        from_floats = sdpa(q, k, v, mask)
    np.testing.assert_array_equal(packed, from_floats)
    assert np.isnan(packed[:, :, 5]).all() and np.isfinite(np.delete(packed, 5, axis=2)).all()


@pytest.mark.parametrize("q_len, kv_len", [(17, 130), (300, 700)])
@pytest.mark.parametrize("pattern", ["right_padding", "padded_holes", "causal_shaped"])
def test_masked_block_edges_from_bytes(isa, dtype, rng, mask_bytes, q_len, kv_len, pattern):
    # The block cuts of test_masked_block_edges, with the kernels reading the mask bytes.
    test_masked_block_edges(isa, dtype, rng, q_len, kv_len, pattern)


@pytest.mark.parametrize("head_dim, value_dim", [(256, 256), (512, 64), (64, 512), (300, 7)])
def test_large_head_dims_long_kv(isa, dtype, rng, head_dim, value_dim):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=75, kv_len=600, head_dim=head_dim, value_dim=value_dim)
    check_against_reference(q, k, v, is_causal="lower_right")


def test_two_dim_inputs(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_len=17, kv_len=19, head_dim=8, value_dim=5)
    out = check_against_reference(q, k, v)
    assert out.shape == (17, 5)


def test_three_dim_inputs(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=3, q_len=17, kv_len=19, head_dim=8, value_dim=5)
    out = check_against_reference(q, k, v, is_causal=True)
    assert out.shape == (3, 17, 5)


@pytest.mark.parametrize(
    "q_batch, kv_batch, v_batch, mask_shape, out_batch",
    [
        ((2, 1), (1, 3), (1, 3), None, (2, 3)),
        ((2, 1), (1, 3), (2, 1), None, (2, 3)),
        ((4,), (1,), (1,), None, (4,)),
        ((1,), (4,), (4,), None, (4,)),
        ((2, 3), (3,), (3,), (2, 1, 1, 1, 19), (2, 3)),
        ((5, 2), (2,), (1,), (2, 1, 17, 19), (5, 2)),
    ],
)
def test_batch_broadcasting(isa, dtype, rng, q_batch, kv_batch, v_batch, mask_shape, out_batch):
    q = random_array(rng, q_batch + (2, 17, 8), dtype)
    k = random_array(rng, kv_batch + (2, 19, 8), dtype)
    v = random_array(rng, v_batch + (2, 19, 6), dtype)
    mask = None if mask_shape is None else random_mask(rng, mask_shape, "float", dtype)
    out = check_against_reference(q, k, v, mask)
    assert out.shape == out_batch + (2, 17, 6)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [
        ((0, 2, 5, 8), (0, 2, 7, 8), (0, 2, 7, 4)),  # batch 0
        ((1, 0, 5, 8), (1, 0, 7, 8), (1, 0, 7, 4)),  # heads 0
        ((2, 0, 8), (2, 7, 8), (2, 7, 4)),  # L = 0
        ((2, 5, 8), (2, 0, 8), (2, 0, 4)),  # S = 0: zeros
        ((2, 5, 0), (2, 7, 0), (2, 7, 4)),  # E = 0: uniform weights over allowed keys
        ((2, 5, 8), (2, 7, 8), (2, 7, 0)),  # Ev = 0
        ((0, 0), (0, 0), (0, 0)),
    ],
)
def test_zero_size_dims(isa, dtype, rng, q_shape, k_shape, v_shape):
    q, k, v = (random_array(rng, s, dtype) for s in (q_shape, k_shape, v_shape))
    out, weights = check_against_reference(q, k, v, return_weights=True)
    assert out.shape == q_shape[:-1] + v_shape[-1:]
    assert weights.shape == q_shape[:-1] + k_shape[-2:-1]


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_zero_kv_len_with_mask_is_zeros(isa, dtype, rng, is_causal):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=5, kv_len=0, head_dim=8)
    out = sdpa(q, k, v, np.ones((5, 0), dtype=bool), is_causal=is_causal)
    assert out.shape == (2, 5, 8)
    assert np.all(out == 0)


# --- masks --------------------------------------------------------------------------------------

BATCH, HEADS, Q_LEN, KV_LEN = 2, 3, 17, 19

MASK_SHAPES = [
    (KV_LEN,),
    (Q_LEN, 1),
    (1, KV_LEN),
    (Q_LEN, KV_LEN),
    (HEADS, 1, KV_LEN),
    (HEADS, Q_LEN, KV_LEN),
    (BATCH, 1, 1, KV_LEN),
    (BATCH, 1, Q_LEN, KV_LEN),
    (1, HEADS, Q_LEN, 1),
    (BATCH, HEADS, Q_LEN, KV_LEN),
]


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_mask_broadcast_shapes(isa, dtype, rng, mask_kind, mask_shape):
    q, k, v = make_qkv(rng, dtype, batch=(BATCH,), q_heads=HEADS, q_len=Q_LEN, kv_len=KV_LEN, head_dim=16)
    mask = random_mask(rng, mask_shape, mask_kind, dtype)
    check_against_reference(q, k, v, nan_guarded(mask))


@pytest.mark.parametrize("layout", ["shared_rows", "contiguous", "strided"])
@pytest.mark.parametrize("values", ["zero_and_neg_inf", "finite", "extremes", "nan_and_pos_inf"])
def test_float_mask_values_and_layouts(isa, dtype, rng, layout, values):
    # The vectorised additive-mask paths (one value per key shared by all rows, contiguous rows read
    # through an in-register transpose, and any other stride lane by lane) against the reference,
    # with every kind of value: 0/-inf only (then only the -inf bits matter), ordinary finite values,
    # the dtype's extremes (must stay finite), and NaN/+inf (their rows become NaN).
    q_len, kv_len = 40, 70
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=16)
    shape = (2, 1, 1, kv_len) if layout == "shared_rows" else (2, 2, q_len, kv_len)
    info = np.finfo(dtype)
    pool = {
        "zero_and_neg_inf": [0.0, 0.0, 0.0, -np.inf],
        "finite": [0.0, -3.0, 2.5, -1e3, -np.inf],
        "extremes": [0.0, info.min, info.max / 4, -np.inf, 0.0],
        "nan_and_pos_inf": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, np.nan, np.inf, -np.inf],
    }[values]
    mask = rng.choice(np.array(pool, dtype=np.float64), size=shape).astype(dtype)
    mask[..., 0] = 0.0  # every row keeps one key
    if layout == "strided":
        parent = np.zeros(shape[:-1] + (3 * kv_len,), dtype)
        parent[..., ::3] = mask
        mask = parent[..., ::3]
    for is_causal in (False, "lower_right"):
        check_against_reference(q, k, v, mask, is_causal=is_causal)


def _mask_views(rng, kind, dtype):
    """Masks given as non-contiguous views: stride 0, transposed, reversed, stepped."""
    full = (BATCH, HEADS, Q_LEN, KV_LEN)
    return {
        "broadcast_row": np.broadcast_to(random_mask(rng, (KV_LEN,), kind, dtype), full),
        "broadcast_col": np.broadcast_to(random_mask(rng, (Q_LEN, 1), kind, dtype), (Q_LEN, KV_LEN)),
        "broadcast_heads": np.broadcast_to(random_mask(rng, (BATCH, 1, Q_LEN, KV_LEN), kind, dtype), full),
        "transposed": random_mask(rng, (KV_LEN, Q_LEN), kind, dtype).T,
        "reversed": random_mask(rng, (HEADS, Q_LEN, KV_LEN), kind, dtype)[::-1, ::-1, ::-1],
        "stepped": random_mask(rng, (2 * Q_LEN, 3 * KV_LEN), kind, dtype)[::2, ::3],
        "unaligned": _unaligned_copy(random_mask(rng, (Q_LEN, KV_LEN), kind, dtype)),
    }


def _unaligned_copy(array):
    """A C-contiguous copy of `array` whose data pointer is one byte past an aligned address."""
    raw = np.zeros(array.nbytes + 1, dtype=np.uint8)
    copy = raw[1:].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize(
    "view", ["broadcast_row", "broadcast_col", "broadcast_heads", "transposed", "reversed", "stepped", "unaligned"]
)
def test_mask_views(isa, dtype, rng, mask_kind, view):
    q, k, v = make_qkv(rng, dtype, batch=(BATCH,), q_heads=HEADS, q_len=Q_LEN, kv_len=KV_LEN, head_dim=16)
    mask = _mask_views(rng, mask_kind, dtype)[view]
    mask_copy = mask.copy()
    check_against_reference(q, k, v, mask)
    np.testing.assert_array_equal(mask, mask_copy)


@pytest.mark.parametrize("is_causal", [True, "upper_left", "lower_right"])
@pytest.mark.parametrize("q_len, kv_len", [(5, 17), (17, 17), (17, 5), (1, 75), (75, 1), (113, 113), (3, 113)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_causal(isa, dtype, rng, is_causal, q_len, kv_len, mask_kind):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=16)
    mask = None if mask_kind is None else random_mask(rng, (2, 1, q_len, kv_len), mask_kind, dtype)
    check_against_reference(q, k, v, mask, is_causal=is_causal)


def test_causal_true_is_upper_left(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=7, kv_len=11, head_dim=8)
    a = sdpa(q, k, v, is_causal=True)
    b = sdpa(q, k, v, is_causal="upper_left")
    c = sdpa(q, k, v, np.tril(np.ones((7, 11), dtype=bool)))
    np.testing.assert_array_equal(a, b)
    assert_close(a, c.astype(np.float64), dtype)


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 2), (8, 2), (4, 1), (3, 1)])
@pytest.mark.parametrize("is_causal", [False, "lower_right"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gqa(isa, dtype, rng, q_heads, kv_heads, is_causal, with_mask):
    q, k, v = make_qkv(
        rng, dtype, batch=(2,), q_heads=q_heads, kv_heads=kv_heads, q_len=17, kv_len=19, head_dim=16, value_dim=12
    )
    mask = random_mask(rng, (q_heads, 17, 19), "float", dtype) if with_mask else None
    out = check_against_reference(q, k, v, mask, is_causal=is_causal, enable_gqa=True)
    assert out.shape == (2, q_heads, 17, 12)


def test_gqa_flag_with_equal_heads_is_plain_attention(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=3, q_len=17, kv_len=19, head_dim=16)
    np.testing.assert_array_equal(sdpa(q, k, v, enable_gqa=True), sdpa(q, k, v))


@pytest.mark.parametrize("scale", [-1.0, -0.125, 1e-30, 1e-8, 0.0, 0.5, 3.0])
def test_scale(isa, dtype, rng, scale):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=75, head_dim=16)
    check_against_reference(q, k, v, random_mask(rng, (17, 75), "bool", dtype), scale=scale)


@pytest.mark.parametrize("q_len", [1, 40])  # the decode kernel, the tiles
def test_scores_far_apart(isa, dtype, rng, q_len):
    """Scores hundreds apart (scale 40: each row's spread is several hundred in log2 units), so most
    weights fall below the smallest normal number relative to the row's largest, where exp2 returns
    exactly 0 without clamping its argument (simd.h): the result is still the reference's."""
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=q_len, kv_len=300, head_dim=16)
    check_against_reference(q, k, v, random_mask(rng, (q_len, 300), "bool", dtype), scale=40.0)
    check_against_reference(q, k, v, None, scale=40.0, is_causal=True)


def test_default_scale(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=17, kv_len=19, head_dim=36)
    assert_close(sdpa(q, k, v), sdpa(q, k, v, scale=1 / 6).astype(np.float64), dtype)


# --- layouts ------------------------------------------------------------------------------------


def _layout(rng, dtype, name, shape):
    """A (B, H, N, D) view of random data laid out as `name` says.

    pyattn reads most of these in place; a non-contiguous last axis, a misaligned pointer or a row
    stride that is not a whole number of elements makes it copy first. Either way the result holds.
    """
    b, h, n, d = shape
    if name == "bshd":
        return np.swapaxes(random_array(rng, (b, n, h, d), dtype), 1, 2)
    if name == "stepped":
        return random_array(rng, (b, 2 * h, 3 * n, d), dtype)[:, ::2, ::3]
    if name == "reversed":
        return random_array(rng, shape, dtype)[::-1, ::-1, ::-1]
    if name == "offset":
        return random_array(rng, (b + 1, h, n + 3, d), dtype, guard=False)[1:, :, 3:]
    if name == "head_major":
        return np.transpose(random_array(rng, (h, n, b, d), dtype), (2, 0, 1, 3))
    if name == "noncontiguous_last":
        return random_array(rng, (b, h, n, 2 * d), dtype)[..., ::2]
    if name == "reversed_last":
        return random_array(rng, shape, dtype)[..., ::-1]
    if name == "fortran":
        return np.asfortranarray(random_array(rng, shape, dtype, guard=False))
    if name == "unaligned":
        return _unaligned_copy(random_array(rng, shape, dtype, guard=False))
    if name == "odd_byte_rows":
        # Rows 4*d + 1 (or 8*d + 1) bytes apart: a field of a packed structured array.
        records = np.zeros((b, h, n), dtype=[("x", dtype, (d,)), ("pad", np.uint8)])
        records["x"] = random_array(rng, shape, dtype, guard=False)
        return records["x"]
    raise AssertionError(name)


LAYOUTS = [
    "bshd",
    "stepped",
    "reversed",
    "offset",
    "head_major",
    "noncontiguous_last",
    "reversed_last",
    "fortran",
    "unaligned",
    "odd_byte_rows",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(isa, dtype, rng, layout):
    q = _layout(rng, dtype, layout, (2, 3, 17, 16))
    k = _layout(rng, dtype, layout, (2, 3, 75, 16))
    v = _layout(rng, dtype, layout, (2, 3, 75, 9))
    check_against_reference(q, k, v, random_mask(rng, (17, 75), "float", dtype), is_causal="lower_right")


@pytest.mark.parametrize(
    "q_layout, k_layout, v_layout",
    [
        ("bshd", "reversed", "stepped"),
        ("stepped", "bshd", "noncontiguous_last"),
        ("noncontiguous_last", "head_major", "reversed"),
    ],
)
def test_mixed_layouts(isa, dtype, rng, q_layout, k_layout, v_layout):
    q = _layout(rng, dtype, q_layout, (2, 4, 17, 16))
    k = _layout(rng, dtype, k_layout, (2, 2, 19, 16))
    v = _layout(rng, dtype, v_layout, (2, 2, 19, 5))
    check_against_reference(q, k, v, is_causal=True, enable_gqa=True, return_weights=True)


# --- out=, weights, threads ----------------------------------------------------------------------


@pytest.mark.parametrize("return_weights", [False, True])
def test_out_prefilled_with_nan_is_fully_written(isa, dtype, rng, return_weights):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=3, q_len=17, kv_len=19, head_dim=16, value_dim=7)
    pad = 5
    parent = np.full(2 * 3 * 17 * 7 + 2 * pad, np.nan, dtype=dtype)
    out = parent[pad:-pad].reshape(2, 3, 17, 7)
    result = sdpa(q, k, v, out=out, return_weights=return_weights)
    expected = reference.scaled_dot_product_attention(q, k, v)
    if return_weights:
        assert result[0] is out
    else:
        assert result is out
    assert not np.isnan(out).any()
    assert np.isnan(parent[:pad]).all() and np.isnan(parent[-pad:]).all()
    assert_close(out, expected, dtype)


def test_out_reused_gives_same_result(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=17, kv_len=19, head_dim=8)
    out = np.full((2, 17, 8), np.inf, dtype=dtype)
    sdpa(q, k, v, out=out)
    np.testing.assert_array_equal(out, sdpa(q, k, v))


@pytest.mark.parametrize("is_causal", [False, True, "lower_right"])
def test_return_weights(isa, dtype, rng, is_causal):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=75, head_dim=16, value_dim=9)
    mask = random_mask(rng, (2, 1, 17, 75), "bool", dtype, p_allowed=0.5)
    mask[0, 0, 3] = False  # a fully masked row
    out, weights = check_against_reference(q, k, v, mask, is_causal=is_causal, return_weights=True)
    assert weights.shape == (2, 2, 17, 75) and weights.dtype == dtype
    # Rows sum to 1, or to 0 where every key is forbidden.
    has_keys = reference.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, return_weights=True)[1]
    has_keys = has_keys.sum(axis=-1) > 0.5
    assert not has_keys[0, :, 3].any() and has_keys.sum() > 40
    np.testing.assert_allclose(
        weights.astype(np.float64).sum(axis=-1), has_keys.astype(np.float64), rtol=0, atol=75 * TOL[dtype][1]
    )
    assert np.all(weights[0, :, 3] == 0) and np.all(out[0, :, 3] == 0)
    # The output is exactly what the returned weights say, and the same as without weights.
    assert_close(out, weights.astype(np.float64) @ v.astype(np.float64), dtype)
    np.testing.assert_array_equal(out, sdpa(q, k, v, mask, is_causal=is_causal))


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(is_causal=True),
        dict(is_causal="lower_right", return_weights=True),
        dict(mask="bool"),
        dict(mask="float", enable_gqa=True),
    ],
)
def test_num_threads_bitwise_identical(isa, dtype, rng, options):
    options = dict(options)
    kv_heads = 1 if options.get("enable_gqa") else 4
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=4, kv_heads=kv_heads, q_len=113, kv_len=150, head_dim=32)
    mask_kind = options.pop("mask", None)
    mask = None if mask_kind is None else random_mask(rng, (113, 150), mask_kind, dtype)
    results = [sdpa(q, k, v, mask, num_threads=n, **options) for n in (1, 2, 3)]
    if not options.get("return_weights"):
        results = [(r,) for r in results]
    for result in results[1:]:
        for first, other in zip(results[0], result):
            np.testing.assert_array_equal(first, other)


# --- masked rows, non-finite values ---------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_rows_are_zero(isa, dtype, rng, mask_kind):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=19, head_dim=8)
    mask = random_mask(rng, (2, 2, 17, 19), mask_kind, dtype)
    forbidden = False if mask_kind == "bool" else -np.inf
    mask[:, :, [0, 5, 16]] = forbidden
    mask[1, 0, :] = forbidden  # a whole head
    out, weights = check_against_reference(q, k, v, mask, return_weights=True)
    assert np.all(out[:, :, [0, 5, 16]] == 0) and np.all(out[1, 0] == 0)
    assert np.all(weights[:, :, [0, 5, 16]] == 0) and np.all(weights[1, 0] == 0)


def test_float_mask_at_dtype_lowest_is_finite(isa, dtype, rng):
    # Masks built with np.finfo(dtype).min (PyTorch / Hugging Face style) hold a finite value: it is
    # added, not treated as forbidden. In a row made only of it the scores are absorbed (the ulp of
    # finfo.min dwarfs them), so the softmax is uniform, as in PyTorch; it is not a fully masked row.
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=5, kv_len=7, head_dim=8)
    mask = np.full((5, 7), np.finfo(dtype).min, dtype=dtype)
    mask[0] = 0
    mask[2, 4] = 0
    out = sdpa(q, k, v, mask)
    expected = np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True), out.shape).copy()
    expected[:, 0] = reference.scaled_dot_product_attention(q, k, v)[:, 0]
    expected[:, 2] = v[:, 4]
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("q_len, kv_len", [(17, 5), (75, 3)])
def test_lower_right_rows_without_keys_are_zero(isa, dtype, rng, q_len, kv_len):
    q, k, v = make_qkv(rng, dtype, q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=8)
    out = check_against_reference(q, k, v, is_causal="lower_right")
    assert np.all(out[:, : q_len - kv_len] == 0)
    assert not np.any(out[:, q_len - kv_len :] == 0)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("masking", ["bool", "float", "upper_left", "lower_right", "mask_and_causal"])
def test_forbidden_keys_do_not_leak(isa, dtype, rng, bad_value, masking):
    q_len, kv_len = 17, 40
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=q_len, kv_len=kv_len, head_dim=16)
    k, v = k.copy(), v.copy()
    options = {}
    mask = None
    forbidden_cols = [2, 9, 33]
    if masking in ("bool", "float", "mask_and_causal"):
        allowed = np.ones((q_len, kv_len), dtype=bool)
        allowed[:, forbidden_cols] = False
        allowed[4, :] = False  # a fully masked row must stay zero too
        mask = allowed if masking != "float" else np.where(allowed, 0.0, -np.inf).astype(dtype)
        if masking == "mask_and_causal":
            options["is_causal"] = "lower_right"
        bad_cols = forbidden_cols
    elif masking == "upper_left":
        options["is_causal"] = "upper_left"
        bad_cols = list(range(q_len, kv_len))  # never visible to any query row
    else:
        options["is_causal"] = "lower_right"
        bad_cols = None  # per-row: key j is forbidden for rows i < j - (kv_len - q_len)
    if bad_cols is None:
        k[..., -1, :] = bad_value
        v[..., -3:, :] = bad_value
    else:
        k[..., bad_cols, :] = bad_value
        v[..., bad_cols, :] = bad_value
    out = check_against_reference(q, k, v, mask, **options)
    if bad_cols is None:
        # The last key is visible only to the last query row; V rows -3.. to the last three rows.
        assert np.isfinite(out[..., : q_len - 3, :]).all()
    else:
        assert np.isfinite(out).all()


@pytest.mark.parametrize("source", ["query", "key", "value", "mask"])
def test_nan_in_allowed_position_propagates(isa, dtype, rng, source):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=19, head_dim=8)
    q, k, v = q.copy(), k.copy(), v.copy()
    mask = np.zeros((17, 19), dtype=dtype)
    if source == "query":
        q[1, 0, 6, 3] = np.nan
    elif source == "key":
        k[1, 0, 4, 0] = np.nan  # every row sees key 4 -> head (1, 0) all NaN
    elif source == "value":
        v[1, 0, 4, 2] = np.nan  # column 2 of head (1, 0) NaN
    else:
        mask[6, 11] = np.nan  # row 6 of every head NaN
    out = check_against_reference(q, k, v, mask)
    nan_rows = np.isnan(out).any(axis=-1)
    expected_rows = np.zeros((2, 2, 17), dtype=bool)
    if source == "query":
        expected_rows[1, 0, 6] = True
    elif source in ("key", "value"):
        expected_rows[1, 0, :] = True
    else:
        expected_rows[:, :, 6] = True
    np.testing.assert_array_equal(nan_rows, expected_rows)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_inputs_unchanged(isa, dtype, rng, mask_kind):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=17, kv_len=19, head_dim=8, value_dim=5)
    mask = None if mask_kind is None else nan_guarded(random_mask(rng, (17, 19), mask_kind, dtype))
    arrays = [a for a in (q, k, v, mask) if a is not None]
    parents = [a.base for a in arrays]
    copies = [p.copy() for p in parents]
    sdpa(q, k, v, mask, is_causal=True, return_weights=True, num_threads=2)
    for parent, copy in zip(parents, copies):
        np.testing.assert_array_equal(parent, copy)


def reference_ignoring_poison(q, k, v, mask, **kwargs):
    """The float64 reference, with the NaN / +Inf a test put into forbidden K and V rows set to 0
    (forbidden rows must not matter, so the result is what pyattn owes)."""
    clean_k, clean_v = (np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=0.0) for x in (k, v))
    ref_mask = None if mask is None else (mask if mask.dtype == np.bool_ else np.asarray(mask, np.float64))
    return reference.scaled_dot_product_attention(np.asarray(q, np.float64), clean_k, clean_v, ref_mask, **kwargs)


def assert_close_to_reference(out, expected, dtype):
    """The table's tolerance for the result's dtype (16-bit ones included)."""
    if dtype in (np.float32, np.float64):
        assert_close(out, expected, dtype)
    else:
        rtol, atol = tol(dtype)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=rtol, atol=atol)


def bshd_with_nan_neighbours(rng, batch, kv_len, kv_heads, dim, dtype):
    """K or V as a (batch, kv_len, kv_heads, dim) view, heads first, of a (batch, kv_len, 2, kv_heads,
    dim + 3) NaN-filled parent (a fused K/V array padded per row): every element next to the view's
    rows is NaN, so a read past a row or into the other half shows up."""
    parent = np.full((batch, kv_len, 2, kv_heads, dim + 3), np.nan, dtype)
    view = parent[:, :, 1, :, 1 : dim + 1]
    view[...] = rng.standard_normal(view.shape).astype(dtype)
    return np.swapaxes(view, 1, 2)


def across_heads():
    """Decode over interleaved K/V heads read across the heads (attend_decode_heads) wherever it can be,
    whatever the planner would pick for this CPU."""
    return override(decode_across_heads=True)


@pytest.mark.parametrize(
    "q_heads, kv_heads, q_len, kv_len, head_dim, options",
    [
        (32, 32, 1, 4099, 128, dict()),  # 32 heads of one row; chunks of whole blocks and a remainder
        (32, 8, 1, 1500, 128, dict(mask="head")),  # GQA: 4 rows a head; masks that differ by head
        (12, 4, 2, 333, 64, dict(is_causal="lower_right")),  # 6 rows a head, causal per row
        (8, 8, 1, 600, 32, dict(mask="padding")),  # heads narrowed to different spans
        (4, 4, 1, 5, 16, dict()),  # fewer keys than a block
        (16, 2, 1, 2000, 128, dict(mask="poison")),  # forbidden rows NaN / Inf
        (6, 3, 1, 700, 64, dict(mask="float")),
    ],
)
def test_decode_across_heads(isa, dtype, rng, q_heads, kv_heads, q_len, kv_len, head_dim, options):
    """attend_decode_heads (decode over heads that interleave in memory, read key by key across every
    head) against the reference, NaN-filled neighbours of every K/V row, masks that differ by head
    (and so narrow each head's keys differently), a head whose row sees nothing; bit for bit the same
    for 1, 2 and 3 threads."""
    batch = 2
    q = random_array(rng, (batch, q_heads, q_len, head_dim), dtype)
    k = bshd_with_nan_neighbours(rng, batch, kv_len, kv_heads, head_dim, dtype)
    v = bshd_with_nan_neighbours(rng, batch, kv_len, kv_heads, head_dim, dtype)
    mask = None
    kind = options.get("mask")
    if kind == "head":
        mask = random_mask(rng, (batch, q_heads, q_len, kv_len), "bool", dtype, p_allowed=0.5)
        mask[0, 3] = False  # a head that sees nothing: zeros
    elif kind == "padding":
        mask = np.zeros((batch, q_heads, 1, kv_len), bool)
        for h in range(q_heads):
            mask[:, h, :, 7 * h : kv_len - 11 * h] = True
    elif kind == "poison":
        mask = np.ones((batch, 1, 1, kv_len), bool)
        forbidden = np.zeros(kv_len, bool)
        forbidden[kv_len // 3 :: 7] = True
        mask[..., forbidden] = False
        k[..., forbidden, :] = np.nan
        v[..., forbidden, :] = np.inf
    elif kind == "float":
        mask = random_mask(rng, (batch, 1, q_len, kv_len), "float", dtype)
    kwargs = dict(is_causal=options.get("is_causal", False), enable_gqa=q_heads != kv_heads)
    with across_heads():
        outs = [sdpa(q, k, v, mask, num_threads=threads, **kwargs) for threads in (1, 2, 3)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    expected = reference_ignoring_poison(q, k, v, mask, **kwargs)
    if kind == "head":
        assert (expected[0, 3] == 0).all() and (outs[0][0, 3] == 0).all()
    assert_close_to_reference(outs[0], expected, dtype)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_decode_across_heads_16_bit(isa, rng, storage):
    """attend_decode_heads over 16-bit K/V (bfloat16 rows read in the paired element order; GQA
    groups through P.V's register tiles): the float64 reference of the same 16-bit values; head_dim
    from one vector to several; forbidden keys whose K rows are NaN and V rows +Inf."""
    if ml_dtypes is None and storage == "bfloat16":
        pytest.skip("bfloat16 needs ml_dtypes")
    dtype = np.float16 if storage == "float16" else ml_dtypes.bfloat16
    kv_len = 777
    for q_heads, kv_heads, head_dim in ((8, 8, 8), (8, 8, 24), (8, 2, 16), (32, 8, 128), (6, 6, 48)):
        for poisoned in (False, True):
            q = random_array(rng, (1, q_heads, 1, head_dim), dtype)
            k = bshd_with_nan_neighbours(rng, 1, kv_len, kv_heads, head_dim, dtype)
            v = bshd_with_nan_neighbours(rng, 1, kv_len, kv_heads, head_dim, dtype)
            mask = None
            if poisoned:
                mask = np.ones((1, 1, 1, kv_len), bool)
                mask[..., 5::9] = False
                k[..., 5::9, :] = np.nan
                v[..., 5::9, :] = np.inf
            with across_heads():
                got = sdpa(q, k, v, mask, enable_gqa=q_heads != kv_heads)
            assert got.dtype == dtype
            expected = reference_ignoring_poison(q, k, v, mask, enable_gqa=q_heads != kv_heads)
            assert_close_to_reference(got, expected, dtype)


def test_decode_across_heads_head_dims(isa, dtype, rng):
    """Every head_dim from 1 to 2 * lanes + 1 (AVX-512 float32: 33): rows of whole vectors take
    attend_decode_heads, the others the chunks; both the reference's values."""
    for head_dim in range(1, 34):
        for value_dim in (head_dim, 2 * head_dim + 1):
            q = random_array(rng, (1, 4, 1, head_dim), dtype)
            k = bshd_with_nan_neighbours(rng, 1, 100, 2, head_dim, dtype)
            v = bshd_with_nan_neighbours(rng, 1, 100, 2, value_dim, dtype)
            with across_heads():
                got = sdpa(q, k, v, enable_gqa=True)
            assert_close(got, reference_ignoring_poison(q, k, v, None, enable_gqa=True), dtype)


def prefetch(mode):
    """Forces the tiles' prefetching: 0 none, 1 the next key block's K/V rows, 2 the next work item's
    rows; -1 as the planner decides (from the cache sizes)."""
    return override(tile_prefetch={-1: None, 0: "off", 1: "kv_rows", 2: "next_items"}[mode])


@pytest.mark.parametrize(
    "q_len, kv_len, options",
    [
        (40, 700, dict(is_causal="lower_right")),  # 3 key blocks, the last one short
        (70, 520, dict(mask="bool")),  # a full 64-row tile and a 16-row one; holes and a padded end
        (17, 300, dict(mask="float", gqa=True)),
        (130, 130, dict(is_causal=True, layout="bshd")),
        (9, 1030, dict(half=True)),
        (20, 600, dict(half=True, mask="bool", is_causal="lower_right")),
        (200, 90, dict(is_causal=True, threads=3)),
        (64, 64, dict(threads=1, layout="bshd")),
        (300, 40, dict(threads=5, mask="bool")),  # 40 items claimed ahead by 5 threads
    ],
)
@pytest.mark.parametrize("mode", [1, 2])
def test_prefetch_changes_nothing(isa, rng, q_len, kv_len, options, mode):
    """Prefetching (on when the arrays outgrow the caches: mode 1 K/V rows of a long head's next key
    block, mode 2 the rows of a thread's next work item) is a hint only: every tile path, forced on,
    gives the bits of the path without it, and the reference's values; forbidden keys' rows hold NaN
    and Inf (the prefetches read them too)."""
    dtype = np.float32
    if options.get("half"):
        if ml_dtypes is None:
            pytest.skip("ml_dtypes is not installed")
        dtype = ml_dtypes.bfloat16
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(2,),
        q_heads=4,
        kv_heads=2 if options.get("gqa") else 4,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=24,
        value_dim=40,
        layout=options.get("layout", "bhsd"),
    )
    mask = None
    if "mask" in options:
        mask = random_mask(rng, (2, 1, q_len, kv_len), options["mask"], np.float32 if dtype == np.float32 else dtype)
        mask[..., 0] = True if mask.dtype == np.bool_ else 0.0
        forbidden = np.ones(kv_len, bool)
        forbidden[kv_len // 2 :] = False
        mask[..., ~forbidden] = False if mask.dtype == np.bool_ else -np.inf
        k[..., ~forbidden, :] = np.nan
        v[..., ~forbidden, :] = np.inf
    kwargs = dict(is_causal=options.get("is_causal", False), enable_gqa=bool(options.get("gqa")))
    threads = options.get("threads", 2)
    with prefetch(mode):
        on = pyattn.scaled_dot_product_attention(q, k, v, mask, num_threads=threads, **kwargs)
    with prefetch(0):
        off = pyattn.scaled_dot_product_attention(q, k, v, mask, num_threads=threads, **kwargs)
    np.testing.assert_array_equal(np.asarray(on, np.float64), np.asarray(off, np.float64))
    assert np.isfinite(np.asarray(on, np.float64)).all()
    expected = reference_ignoring_poison(q, k, v, mask, **kwargs)
    assert_close_to_reference(on, expected, dtype)


@pytest.mark.parametrize(
    "heads, kv_heads, q_len, kv_len, options",
    [
        (2, 2, 17, 113, dict()),
        (3, 3, 70, 600, dict(is_causal=True)),  # an odd head count: pairs and a last head alone
        (5, 5, 40, 700, dict(is_causal="lower_right", threads=1)),
        (4, 4, 75, 300, dict(mask="bool", poison=True)),  # forbidden rows NaN / Inf: the checked pass
        (3, 3, 9, 520, dict(mask="float", is_causal=True, prefetch=1)),
        (4, 4, 130, 90, dict(half=True, threads=3)),
        (3, 3, 33, 400, dict(half=True, mask="bool", prefetch=1)),
        (2, 2, 20, 300, dict(half=True, mask="float", poison=True)),
        (1, 1, 30, 2000, dict()),  # one head: key chunks split across threads, each copied apart
        (3, 3, 9, 2000, dict()),  # an odd head count with split key ranges: the split as head by head
        (6, 2, 50, 333, dict(is_causal=True)),  # GQA groups whose K/V heads interleave
        (8, 2, 20, 250, dict(half=True, mask="bool")),
        (4, 4, 40, 200, dict(shared_k=True)),  # one K row for every head, V rows of their own
    ],
)
def test_interleaved_heads_change_nothing(isa, dtype, rng, heads, kv_heads, q_len, kv_len, options):
    """K/V whose heads interleave in memory ((batch, seq, heads, dim) arrays viewed heads first) go
    through the key blocks two heads at a time, each reading its own rows, or are copied head by
    head into a per-thread buffer that the tiles read (attention.cpp: pairs, pack_heads): both give
    the bits of head by head (group tiles off, no copies), and the reference's values."""
    if options.get("half"):
        if ml_dtypes is None or dtype != np.float32:
            pytest.skip("16-bit inputs: once, with ml_dtypes")
        dtype = ml_dtypes.bfloat16
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(2,),
        q_heads=heads,
        kv_heads=kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=24,
        value_dim=40,
        layout="bshd",
    )
    assert kv_heads == 1 or k.strides[-2] > k.strides[-3] > 0  # rows of the heads interleave
    mask = None
    if "mask" in options:
        mask = random_mask(rng, (2, 1, q_len, kv_len), options["mask"], dtype)
        mask[..., 0] = True if mask.dtype == np.bool_ else 0.0
        forbidden = np.zeros(kv_len, bool)
        forbidden[kv_len // 3 :: 7] = True
        mask[..., forbidden] = False if mask.dtype == np.bool_ else -np.inf
        if options.get("poison"):
            k[..., forbidden, :] = np.nan
            v[..., forbidden, :] = np.inf
    if options.get("shared_k"):
        k = np.broadcast_to(k[:, :1], k.shape)
    kwargs = dict(
        is_causal=options.get("is_causal", False), enable_gqa=heads != kv_heads, num_threads=options.get("threads", 2)
    )
    with prefetch(options.get("prefetch", -1)):
        with override(pack_heads=False):
            paired = sdpa(q, k, v, mask, **kwargs)
            with override(group_heads=1):
                alone = sdpa(q, k, v, mask, **kwargs)
        with override(pack_heads=True):
            copied = sdpa(q, k, v, mask, **kwargs)
        by_rule = sdpa(q, k, v, mask, **kwargs)
    for out in (paired, copied, by_rule):
        np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(alone, np.float64))
    kwargs.pop("num_threads")
    expected = reference_ignoring_poison(q, k, v, mask, **kwargs)
    assert np.isfinite(expected).all()
    assert_close_to_reference(paired, expected, dtype)


@pytest.mark.parametrize(
    "q_heads, kv_heads, q_len, kv_len, options",
    [
        (4, 4, 1, 700, dict()),  # six chunks of 128 keys, the last one short
        (6, 3, 1, 1000, dict(mask="bool", poison=True)),  # GQA; forbidden rows NaN / Inf
        (2, 2, 3, 300, dict(is_causal="lower_right", threads=1)),
        (4, 2, 8, 513, dict(mask="float", threads=3)),
        (2, 2, 1, 33000, dict(head_dim=8)),  # more than 256 chunks of 128: longer chunks
        (4, 4, 1, 128, dict()),  # one chunk: not split
        (4, 2, 2, 900, dict(half=True)),
    ],
)
@pytest.mark.parametrize("route", ["across heads", "chunks"])
def test_interleaved_heads_decode(isa, dtype, rng, q_heads, kv_heads, q_len, kv_len, options, route):
    """Decoding (q_len <= 8) against K/V whose heads interleave in memory reads the keys key by key
    across all heads where a head's query rows fit one tile and the rows are whole vectors
    (attend_decode_heads), else in short chunks, chunk by chunk across the heads (kInterleavedChunk;
    decode_across_heads forces each): the reference's values, and those of the same values stored
    heads first, for every chunk count and remainder."""
    with override(decode_across_heads=route == "across heads"):
        interleaved_heads_decode(dtype, rng, q_heads, kv_heads, q_len, kv_len, options)


def interleaved_heads_decode(dtype, rng, q_heads, kv_heads, q_len, kv_len, options):
    if options.get("half"):
        if ml_dtypes is None or dtype != np.float32:
            pytest.skip("16-bit inputs: once, with ml_dtypes")
        dtype = ml_dtypes.bfloat16
    head_dim = options.get("head_dim", 24)
    q = random_array(rng, (2, q_heads, q_len, head_dim), dtype)
    k, v = (np.swapaxes(random_array(rng, (2, kv_len, kv_heads, dim), dtype), 1, 2) for dim in (head_dim, 40))
    assert k.strides[-2] > k.strides[-3] > 0  # rows of the heads interleave
    mask = None
    if "mask" in options:
        mask = random_mask(rng, (2, 1, q_len, kv_len), options["mask"], dtype)
        mask[..., 0] = True if mask.dtype == np.bool_ else 0.0
        if options.get("poison"):
            forbidden = np.zeros(kv_len, bool)
            forbidden[kv_len // 3 :: 7] = True
            mask[..., forbidden] = False if mask.dtype == np.bool_ else -np.inf
            k[..., forbidden, :] = np.nan
            v[..., forbidden, :] = np.inf
    kwargs = dict(is_causal=options.get("is_causal", False), enable_gqa=q_heads != kv_heads)
    threads = options.get("threads", 2)
    got = sdpa(q, k, v, mask, num_threads=threads, **kwargs)
    stored_heads_first = sdpa(q, np.ascontiguousarray(k), np.ascontiguousarray(v), mask, num_threads=threads, **kwargs)
    expected = reference_ignoring_poison(q, k, v, mask, **kwargs)
    assert np.isfinite(expected).all()
    for out in (got, stored_heads_first):
        assert_close_to_reference(out, expected, dtype)
