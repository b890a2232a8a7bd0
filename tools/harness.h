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
#include "machine_kernels.inc"  // fma_loop: the FMA peak the harnesses quote rates against
#include "parallel.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdint>
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

// Attention of one query row over the key rows [0, n) (row-major, dim and value_dim floats), in
// double: what the harnesses hold the kernels' output to before timing them, so that a harness run
// is also a check (.ci/run builds and runs each briefly).
inline std::vector<double> reference_row(const float* q, const float* k, const float* v, int64_t n, int64_t dim,
                                         int64_t value_dim, double scale) {
  std::vector<double> s(static_cast<size_t>(n)), out(static_cast<size_t>(value_dim), 0.0);
  double m = -1e300, l = 0;
  for (int64_t j = 0; j < n; ++j) {
    double d = 0;
    for (int64_t x = 0; x < dim; ++x) d += double(q[x]) * double(k[j * dim + x]);
    s[size_t(j)] = d * scale;
    m = std::max(m, s[size_t(j)]);
  }
  for (int64_t j = 0; j < n; ++j) {
    const double p = std::exp(s[size_t(j)] - m);
    l += p;
    for (int64_t e = 0; e < value_dim; ++e) out[size_t(e)] += p * double(v[j * value_dim + e]);
  }
  for (double& x : out) x /= l;
  return out;
}

// The first element of x on a cache line (x allocated 16 floats longer), as the driver's buffers
// start (parallel.h, grow_only_scratch): std::vector promises 16 bytes only.
inline float* on_line(std::vector<float>& x) { return x.data() + pyattn::elements_to_line(x.data()); }

// Rows 0, step, 2 * step, ... and the last of n rows, step chosen so that checking them against
// float64 takes about 2e7 multiply-adds when each row costs work_per_row.
inline std::vector<int64_t> sampled_rows(int64_t n, int64_t work_per_row) {
  const int64_t step = std::max<int64_t>(1, n * work_per_row / 20000000);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < n; i += step) rows.push_back(i);
  if (n > 0 && rows.back() != n - 1) rows.push_back(n - 1);
  return rows;
}

// Largest |got - want| beyond which a harness reports its kernel wrong and exits 1: the float32
// kernels measure ~1e-6 on these O(1) random inputs; a lost key block or row is off by 1e-2 or more.
constexpr double kMaxError = 1e-4;

// Whether err is within bound; says on stderr what was wrong when it is not (or is NaN).
inline bool agrees(double err, double bound, const char* what) {
  if (err <= bound) return true;
  std::fprintf(stderr, "wrong result: max %s = %g\n", what, err);
  return false;
}

}  // namespace harness
