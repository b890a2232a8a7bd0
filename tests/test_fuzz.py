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

import fuzz_cache
from fuzz_api import cases, check
from hypothesis import HealthCheck, given, settings

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
