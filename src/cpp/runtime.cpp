// SPDX-License-Identifier: MIT
// The runtime around the kernels: threads, the fork guard, OpenMP's identity, array conversions.

#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "dispatch.h"
#include "parallel.h"

#if defined(PYATTN_FORK_GUARD)
#include <pthread.h>
#endif

namespace pyattn {
namespace {

std::atomic<int> g_default_threads{0};  // set_num_threads(); read by every call, from any thread

// Elements per thread at least when converting arrays: below that, starting a thread costs more
// than it saves.
constexpr int64_t kConvertChunk = 1 << 16;

// Runs convert(from, to, count) over [0, n) in chunks of at least kConvertChunk elements, one chunk
// per thread.
template <class From, class To, class F>
void convert_parallel(const From* src, To* dst, int64_t n, int num_threads, F convert) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(std::max(1, num_threads), n / kConvertChunk));
  parallel_for(parts, int(parts), [&](int64_t c) {
    const int64_t begin = n * c / parts, end = n * (c + 1) / parts;
    convert(src + begin, dst + begin, end - begin);
  });
}

}  // namespace

void install_fork_guard() {
#if defined(PYATTN_FORK_GUARD)
  static const int installed = pthread_atfork(nullptr, nullptr, &ForkGuard::on_fork_child);
  (void)installed;  // 0, or ENOMEM: then a forked child is as unguarded as without pyattn's help
#endif
}

int default_num_threads() {
  if (!ForkGuard::teams_allowed()) return 1;  // a child forked after a team ran: see parallel.h
  const int n = g_default_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
#if defined(PYATTN_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_default_num_threads(int n) { g_default_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

bool openmp_enabled() {
#if defined(PYATTN_OPENMP)
  return true;
#else
  return false;
#endif
}

const char* openmp_runtime() {
  if (!ForkGuard::teams_allowed())
    return "libgomp (GNU); single-threaded: this process was forked after a parallel region";
#if !defined(PYATTN_OPENMP)
  return "none (built without OpenMP: single-threaded)";
#elif defined(__clang__)
  return "libomp (LLVM)";
#elif defined(__GNUC__)
  return "libgomp (GNU)";
#elif defined(_MSC_VER)
  return "vcomp (MSVC)";
#else
  return "unknown";
#endif
}

void convert_half(const uint16_t* src, float* dst, int64_t n, int num_threads, bool bfloat16) {
  const KernelTable& kt = active_kernels();
  convert_parallel(src, dst, n, num_threads > 0 ? num_threads : default_num_threads(),
                   bfloat16 ? kt.bf16_to_float : kt.half_to_float);
}

void convert_half(const float* src, uint16_t* dst, int64_t n, int num_threads, bool bfloat16) {
  const KernelTable& kt = active_kernels();
  convert_parallel(src, dst, n, num_threads > 0 ? num_threads : default_num_threads(),
                   bfloat16 ? kt.float_to_bf16 : kt.float_to_half);
}

void quantize_int8(const float* src, int64_t rows, int64_t dim, int8_t* dst, int64_t dst_stride, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * dim;
    int8_t* q = dst + r * dst_stride;
    float amax = 0.0f;
    bool finite = true;
    for (int64_t e = 0; e < dim; ++e) {
      finite = finite && std::isfinite(x[e]);
      amax = std::max(amax, std::fabs(x[e]));
    }
    if (!finite || amax == 0.0f) {
      scales[r] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      for (int64_t e = 0; e < dim; ++e) q[e] = 0;
      continue;
    }
    scales[r] = amax / 127.0f;
    // In double: 127 / amax overflows float for rows below 127 / FLT_MAX (subnormal ones included).
    const double inv = 127.0 / double(amax);
    for (int64_t e = 0; e < dim; ++e) {
      const double v = std::nearbyint(double(x[e]) * inv);  // |x * inv| <= 127 up to rounding: clamp
      q[e] = int8_t(std::min(127.0, std::max(-127.0, v)));
    }
  }
}

}  // namespace pyattn
