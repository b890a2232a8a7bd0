# SPDX-License-Identifier: MIT
"""The NumPy model and oracle of the KV-cache fuzzer (tests/fuzz_cache.py): what a KVCache must hold
after each operation (every row's length, the whole K/V storage, what the last append added), what
"unchanged" means (the bits of inputs and of the cache), the float64 attention its outputs are held
to, and the tolerances and size caps of those checks.
"""

from __future__ import annotations

import numpy as np

from pyattn import reference

from conftest import f64 as _f64  # noqa: E402  (after fuzz_api, which puts tests/ on sys.path)
from fuzz_api import largest_finite_norm, tol  # tol: conftest's table, the one of the suite

# K/V that a layer step projects and stores are held to conftest.TOL's "stored <dtype>" entries (16-bit
# storage) or their dtype's entry; attention outputs to the compute dtype's (float32 for 16-bit
# caches), against the reference on the stored values.

# Size caps that keep the checks cheap (they run after every operation of every program).
MAX_ELEMENTS = 400_000  # K+V storage elements per cache: a bitwise check after every operation stays cheap
MAX_EMBED = 384  # layers: embed_dim = num_heads * head_dim at most this


def _bits(x):
    """The bytes of an array's values in C order (NaN-exact, works for bfloat16)."""
    x = np.ascontiguousarray(x)
    return x.dtype.str, x.shape, x.tobytes()


class Snapshot:
    """Copies of the arrays a call receives (and of the NaN-guarded parents they are cut from), to
    check afterwards that the call modified none of them."""

    def __init__(self, *arrays):
        self.items = []
        for x in arrays:
            if isinstance(x, np.ndarray):
                base = x
                while isinstance(base.base, np.ndarray):
                    base = base.base
                self.items += [(x, _bits(x)), (base, _bits(base))]
            elif isinstance(x, dict):
                self.items += [(v, _bits(v)) for v in x.values() if isinstance(v, np.ndarray)]

    def assert_unchanged(self):
        for x, bits in self.items:
            assert _bits(x) == bits, "an input was modified"


def _cache_state(cache):
    """Everything a call may change: lengths, every stored bit, and what the last append added
    (attend() reads it). Private attributes on purpose: 'changes nothing' includes the storage past
    each row's length and the causal state."""
    return (
        _bits(cache.lengths),
        _bits(cache._k),
        _bits(cache._v),
        _bits(cache._last_new),
        _bits(cache._last_first),
        int(cache._last_chunk),
    )


class Model:
    """What the cache must hold: lengths, the whole storage (storage dtype), the last append."""

    def __init__(self, batch, num_kv_heads, head_dim, value_dim, max_len, storage):
        self.k = np.zeros((batch, num_kv_heads, max_len, head_dim), storage)
        self.v = np.zeros((batch, num_kv_heads, max_len, value_dim), storage)
        self.lengths = np.zeros(batch, np.int64)
        self.last_new = np.zeros(batch, np.int64)
        self.last_chunk = 0
        self.last_left = False
        self.last_first = np.zeros(batch, np.int64)  # chunk index of each row's first real token

    def real_rows(self, b):
        """The query rows of the last chunk that belong to row b's real tokens (still stored: a
        truncate takes the tokens it cuts off last_new, the rows keep their positions)."""
        first = int(self.last_first[b])
        return slice(first, first + int(self.last_new[b]))

    def cut(self, new_lengths):
        """truncate/trim to new_lengths: the chunk's tokens cut off no longer count as new."""
        self.last_new = np.maximum(self.last_new - (self.lengths - new_lengths), 0)
        self.lengths = new_lengths

    def rooms(self):
        return self.k.shape[2] - self.lengths

    def expected_attention(self, q64, scale):
        """float64 reference attention of every row's real query rows (lower-right causal over the
        row's own keys: the stored, rounded values): {b: (rows, (H, n, Dv))}, and the query and key
        rows it used (for the score factor)."""
        result, q_rows, k_rows = {}, [], []
        for b in range(len(self.lengths)):
            rows = self.real_rows(b)
            if rows.stop - rows.start == 0:
                continue
            n_keys = int(self.lengths[b])
            k = _f64(self.k[b, :, :n_keys])
            v = _f64(self.v[b, :, :n_keys])
            q = q64[b, :, rows]
            result[b] = (
                rows,
                reference.scaled_dot_product_attention(q, k, v, is_causal="lower_right", scale=scale, enable_gqa=True),
            )
            q_rows.append(q)
            k_rows.append(k)
        return result, q_rows, k_rows


def _score_factor(q_rows, k_rows, scale):
    """How much larger than TOL assumes the scores can be (|score| <= |scale| |q| |k|; TOL holds
    for |score| below ~16), as in fuzz_api._score_factor."""
    if not q_rows or not k_rows:
        return 1.0
    qn = max(largest_finite_norm(q) for q in q_rows)
    kn = max(largest_finite_norm(k) for k in k_rows)
    bound = abs(scale) * qn * kn
    return max(1.0, bound / 16.0) if np.isfinite(bound) else 1.0


def _compare(got, want, dtype, factor, what):
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(_f64(got), want, rtol=rtol * factor, atol=atol * factor, err_msg=what)
