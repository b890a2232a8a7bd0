# SPDX-License-Identifier: MIT
"""Private: force the C++ core's tuning decisions, or the CPU its planner sees, for tests and
benchmarks.

The core plans every call from the CPU (vendor, family, cache sizes) and the call's sizes (see
src/cpp/tuning.h). ``override`` forces any of those decisions, or replaces any field of the CPU, for
the duration of a ``with`` block, whatever CPU the process runs on; ``PROFILES`` are the CPUs whose
rules the core knows. A plan changes how a call runs, never what it computes: results agree with the
reference under every plan, and bit for bit wherever the plan keeps the order of the sums.

    with override(decode_streams=4, decode_prefetch="off"):
        ...
    with override(**PROFILES["zen5"]):
        ...
"""

from __future__ import annotations

import contextlib

from . import _core

# The CPUs the planner has rules for (and two without): vendor, CPUID family and model, L2 and
# last-level cache bytes per core.
PROFILES = {
    "intel": dict(cpu_vendor="intel", cpu_family=6, cpu_model=143, l2_bytes=2 << 20, llc_bytes=105 << 20),
    "zen3": dict(cpu_vendor="amd", cpu_family=0x19, cpu_model=1, l2_bytes=512 << 10, llc_bytes=32 << 20),
    "zen4": dict(cpu_vendor="amd", cpu_family=0x19, cpu_model=0x11, l2_bytes=1 << 20, llc_bytes=32 << 20),
    "zen5": dict(cpu_vendor="amd", cpu_family=0x1A, cpu_model=2, l2_bytes=1 << 20, llc_bytes=32 << 20),
    "unknown_vendor": dict(cpu_vendor="unknown", cpu_family=0, cpu_model=0, l2_bytes=1 << 20, llc_bytes=16 << 20),
    "unknown_caches": dict(l2_bytes=0, llc_bytes=0),
}


@contextlib.contextmanager
def override(**settings):
    """Runs the body with the given tuning settings (keys and values as _core._set_tuning takes them;
    None leaves a key to the rules) and restores every setting afterwards."""
    previous = _core._set_tuning(settings)
    try:
        yield
    finally:
        _core._set_tuning(previous)
