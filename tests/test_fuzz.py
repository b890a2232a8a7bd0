# SPDX-License-Identifier: MIT
"""Fuzzing the public entry point: random valid and invalid calls never crash, never give a wrong
result, and fail only with the ValueError/TypeError the error policy prescribes.

The strategy and the oracle live in tests/fuzz_api.py, which also runs for longer as a release check
(`python tests/fuzz_api.py --minutes 10`). Here the example count is bounded so the test stays well
under a minute; PYATTN_FUZZ_EXAMPLES overrides it.
"""

import os

from fuzz_api import cases, check
from hypothesis import HealthCheck, given, settings

EXAMPLES = int(os.environ.get("PYATTN_FUZZ_EXAMPLES", "600"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
def test_sdpa_fuzz(case):
    check(case)
