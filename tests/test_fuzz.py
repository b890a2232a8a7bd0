# SPDX-License-Identifier: MIT
"""Fuzzing the public entry points: random valid and invalid calls never crash, never give a wrong
result, and fail only with the ValueError/TypeError the error policy prescribes.

test_sdpa_fuzz: scaled_dot_product_attention; strategy and oracle in tests/fuzz_api.py.
test_cache_fuzz: incremental decoding (KVCache, mha/MultiHeadAttention with kv_cache=), random
sequences of operations against a NumPy model of the cache; strategy and runner in tests/fuzz_cache.py,
model and oracle in tests/fuzz_cache_model.py, mistakes in tests/fuzz_cache_mistakes.py.

Both also run for longer as release checks (`python tests/fuzz_api.py --minutes 10`,
`python tests/fuzz_cache.py --minutes 10`). Here the example counts are bounded so each test stays
well under a minute; PYATTN_FUZZ_EXAMPLES and PYATTN_FUZZ_CACHE_EXAMPLES override them.
"""

import os

import numpy as np
from hypothesis import HealthCheck, given, settings

import fuzz_cache
from fuzz_api import _score_factor, cases, check, largest_finite_norm

EXAMPLES = int(os.environ.get("PYATTN_FUZZ_EXAMPLES", "600"))
# Programs (a cache and 1-13 operations on it, ~6 on average): ~16 s on the 2-core dev machine.
CACHE_EXAMPLES = int(os.environ.get("PYATTN_FUZZ_CACHE_EXAMPLES", "600"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
def test_sdpa_fuzz(case):
    check(case)


@settings(
    max_examples=CACHE_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fuzz_cache.programs())
def test_cache_fuzz(program):
    fuzz_cache.check(program)


def test_score_factor_ignores_non_finite_rows():
    # The fuzzer's tolerance widens with the largest |score| the finite rows can give; a NaN or Inf
    # row (compared by position) must not reset it to 1 for the rest of the call.
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 4, 64)), rng.standard_normal((2, 6, 64))
    clean = _score_factor(q, k, 2.2)
    assert clean > 5.0  # |score| bound 2.2 * |q| * |k|, about 2.2 * 8 * 8 / 16 here
    for bad in (np.nan, np.inf, -np.inf):
        q_bad, k_bad = q.copy(), k.copy()
        q_bad[1, 2, 5] = bad
        k_bad[0, 3, 0] = bad
        assert 1.0 < _score_factor(q_bad, k, 2.2) <= clean
        assert 1.0 < _score_factor(q, k_bad, 2.2) <= clean
    assert largest_finite_norm(np.full((3, 4), np.nan)) == 0.0
    assert _score_factor(np.full((1, 2, 4), np.nan), k[..., :4], 2.2) == 1.0
