# SPDX-License-Identifier: MIT
"""Type stub of pyattn._machine: the machine's ceilings for the benchmarks (private, src/cpp/machine.cpp)."""

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

def fma_peak_gflops(num_threads: int, seconds: float = 0.5, isa: str | None = None) -> float:
    """float32 FMA throughput of an ISA's register-only loop on num_threads threads, GFLOP/s (isa None:
    the ISA pyattn runs, pyattn.get_isa(); one this CPU does not run raises ValueError)."""

def dot16_peak_gflops(num_threads: int, seconds: float = 0.5, isa: str | None = None) -> float:
    """bfloat16 dot-product (vdpbf16ps) throughput of a register-only loop, GFLOP/s; ValueError for an
    ISA without it (only avx512bf16 has one)."""

def read_bandwidth_gbs(num_threads: int, nbytes: int = 1073741824, isa: str | None = None) -> float:
    """Streaming read bandwidth of a fresh buffer, GB/s (best of 5)."""

def read_buffers_gbs(
    arrays: Sequence[npt.NDArray[Any]], num_threads: int, repeats: int = 5, isa: str | None = None
) -> float:
    """GB/s of reading these C-contiguous arrays once, each split across num_threads threads (best of
    `repeats` passes; bench_decode --cold uses one pass over a large buffer to evict the caches)."""
