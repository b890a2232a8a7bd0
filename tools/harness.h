// SPDX-License-Identifier: MIT
// What the developers' kernel harnesses (tools/decode_harness.cpp, tools/tile_harness.cpp) share:
// the kernels of one ISA compiled into the harness itself, as kernels_<isa>.cpp compiles them
// (AVX-512 by default, -DHARNESS_AVX2 for AVX2, with the matching -m flags), and the clock they read.
#pragma once

#if defined(HARNESS_AVX2)
#define PYATTN_ISA_NS avx2
#define PYATTN_ISA_NAME "avx2"
#define PYATTN_SIMD_AVX2 1
#else
#define PYATTN_ISA_NS avx512
#define PYATTN_ISA_NAME "avx512"
#define PYATTN_SIMD_AVX512 1
#endif
#include "kernels.inc"

#include <algorithm>
#include <ctime>
#include <vector>

namespace harness {

// CPU time of the calling thread: what a shared VM's other tenants disturb least.
inline double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// The sample at fraction q (0 to 1) of the sorted samples: index q * n, the last one for q = 1.
inline double quantile(std::vector<double> samples, double q) {
  std::sort(samples.begin(), samples.end());
  return samples[std::min(samples.size() - 1, size_t(q * double(samples.size())))];
}

}  // namespace harness
