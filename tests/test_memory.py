# SPDX-License-Identifier: MIT
"""Memory: repeated calls do not grow the process, references are not leaked, and sizes that
cannot be allocated (or whose byte counts overflow) give a clear ValueError instead of a
MemoryError or a crash.
"""

import gc
import os
import sys

import numpy as np
import pytest

import pyattn

from conftest import make_qkv, random_mask

sdpa = pyattn.scaled_dot_product_attention
CALLS = 300
# Allowed RSS growth over CALLS calls after warm-up. A leaked output of one call below is >= 256 KiB,
# so a per-call leak would show as >= 75 MiB; allocator noise (arenas, OpenMP stacks) stays far below.
SLACK_BYTES = 16 << 20


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
# AddressSanitizer keeps freed memory in quarantine, so RSS grows by design under tools/sanitize.sh.
not_under_asan = pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""), reason="RSS is meaningless under ASan"
)


def _calls(rng):
    """Closures covering the main paths: plain, masks, causal, GQA, decode, weights, out=, MHA, errors."""
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=4, q_len=128, kv_len=128, head_dim=64, guard=False)
    k2, v2 = k[:, :2], v[:, :2]
    qd = q[:, :, :1]
    mask = random_mask(rng, (128, 128), "bool", np.float32)
    fmask = random_mask(rng, (2, 1, 128, 128), "float", np.float32)
    out = np.empty((2, 4, 128, 64), np.float32)
    q_strided = np.repeat(q, 2, axis=-1)[..., ::2]
    layer = pyattn.MultiHeadAttention(64, 4, num_kv_heads=2, dtype=np.float32, seed=0)
    x = rng.standard_normal((2, 128, 64)).astype(np.float32)

    def bad_call():
        try:
            sdpa(q, k.astype(np.float64), v)
        except TypeError:
            pass
        try:
            sdpa(q, k, v, num_threads=0)
        except ValueError:
            pass

    calls = []
    if hasattr(pyattn, "KVCache"):
        cache = pyattn.KVCache(2, 2, 64, 256, dtype=np.float16)
        step_q = q[:, :, :1]

        def decode():  # prompt, then a few single-token steps; reset keeps the storage
            cache.reset()
            cache.append(k2, v2)
            cache.attend(q)
            for i in range(4):
                cache.append(k2[:, :, i : i + 1], v2[:, :, i : i + 1])
                cache.attend(step_q)

        calls.append(decode)

    return calls + [
        lambda: sdpa(q, k, v),
        lambda: sdpa(q, k, v, mask, is_causal=True),
        lambda: sdpa(q, k, v, fmask, num_threads=1),
        lambda: sdpa(q, k2, v2, enable_gqa=True, is_causal="lower_right"),
        lambda: sdpa(qd, k, v),  # decode: split-key path
        lambda: sdpa(q, k, v, return_weights=True),
        lambda: sdpa(q, k, v, out=out),
        lambda: sdpa(q_strided, k, v),  # last axis not contiguous: the documented copy
        lambda: layer(x, is_causal=True),
        lambda: layer(x, need_weights=True),
        bad_call,
    ]


@needs_proc
@not_under_asan
def test_repeated_calls_do_not_grow_rss(rng):
    calls = _calls(rng)
    for _ in range(20):  # warm-up: allocator arenas, OpenMP thread pool, packed weights
        for call in calls:
            call()
    gc.collect()
    before = _rss_bytes()
    for i in range(CALLS):
        calls[i % len(calls)]()
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < SLACK_BYTES, f"RSS grew by {grown / 2**20:.1f} MiB over {CALLS} calls"


def test_no_reference_leaks(rng):
    q, k, v = make_qkv(rng, np.float64, batch=(2,), q_heads=2, q_len=9, kv_len=11, head_dim=8)
    mask = random_mask(rng, (9, 11), "bool", np.float64)
    out = np.empty((2, 2, 9, 8))
    arrays = (q, k, v, mask, out)
    for _ in range(5):
        sdpa(q, k, v, mask, out=out, return_weights=True)
    before = [sys.getrefcount(a) for a in arrays]
    for _ in range(200):
        sdpa(q, k, v, mask, out=out, return_weights=True, is_causal=True)
        try:
            sdpa(q, k, v, mask, out=out[..., :4])
        except ValueError:
            pass
    assert [sys.getrefcount(a) for a in arrays] == before


def _tiny(shape, dtype=np.float32):
    """A huge read-only view of one row (stride 0 on every axis but the last): no memory behind it."""
    return np.broadcast_to(np.zeros((1,) * (len(shape) - 1) + shape[-1:], dtype=dtype), shape)


@pytest.mark.parametrize(
    "dims, why",
    [
        ((2**16, 2**16, 2**16, 2**16), "element count overflows int64"),
        ((1, 2**10, 2**15, 2**15), "4 TiB"),
    ],
)
def test_return_weights_too_large_is_a_value_error(dims, why):
    batch, heads, q_len, kv_len = dims
    q = _tiny((batch, heads, q_len, 4))
    k = _tiny((batch, heads, kv_len, 4))
    v = _tiny((batch, heads, kv_len, 0))  # empty output: only the weights are large
    with pytest.raises(ValueError, match="return_weights"):
        sdpa(q, k, v, return_weights=True)


def test_output_too_large_is_a_value_error():
    q = _tiny((2**20, 2**10, 2**10, 4))
    k = _tiny((2**20, 2**10, 1, 4))
    v = _tiny((2**20, 2**10, 1, 2**10))  # output 2^50 elements: 4 PiB
    with pytest.raises(ValueError, match="out"):
        sdpa(q, k, v)


def test_mha_need_weights_too_large_is_a_value_error():
    layer = pyattn.MultiHeadAttention(8, 2, dtype=np.float32, seed=0)
    x = _tiny((1, 2**20, 8))  # weights (1, 2, 2^20, 2^20) float32: 8 TiB
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, need_weights=True)


def test_huge_view_needing_a_copy_is_a_value_error():
    # Stride 0 on the last axis too: the kernels need it contiguous, so pyattn must copy 4 PiB (the
    # output, 2^20 elements, is small).
    q = np.broadcast_to(np.zeros((1, 1, 1, 1), np.float32), (2**10, 2**10, 1, 2**30))
    k = _tiny((2**10, 2**10, 1, 2**30))
    v = _tiny((2**10, 2**10, 1, 1))
    with pytest.raises(ValueError, match="query"):
        sdpa(q, k, v)
