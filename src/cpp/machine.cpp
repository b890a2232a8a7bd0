// SPDX-License-Identifier: MIT
// The machine's ceilings, measured for the benchmarks (bench/) with the active ISA's kernels: the
// FMA peak (KernelTable::fma_loop on every thread) and the read bandwidth of memory
// (KernelTable::xor_bytes over a buffer, or over the caller's own arrays, split across threads at
// cache-line boundaries). A benchmark quotes pyattn's speed as a fraction of these, measured in the
// same run.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "attention.h"
#include "parallel.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pyattn {
namespace {

// A large read-only-benchmark buffer, 2 MiB aligned and advised as huge pages on Linux.
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
#if defined(__linux__)
    if (posix_memalign(&data_, kHuge, size) != 0) throw std::bad_alloc();
    madvise(data_, size, MADV_HUGEPAGE);
#else
    raw_.resize(size + kHuge);
    void* p = raw_.data();
    size_t space = raw_.size();
    data_ = std::align(kHuge, size, p, space);
#endif
  }
  ~HugeBuffer() {
#if defined(__linux__)
    std::free(data_);
#endif
  }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  void* data() { return data_; }

 private:
  void* data_ = nullptr;
  std::vector<unsigned char> raw_;
};

}  // namespace

double fma_peak_gflops(int num_threads, double seconds) {
  using clock = std::chrono::steady_clock;
  const KernelTable& kt = active_kernels();
  const int threads = std::max(1, num_threads);
  // Calibrate one call to about a millisecond so the loop dominates the clock reads.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = clock::now();
    kt.fma_loop(iters);
    if (std::chrono::duration<double>(clock::now() - t0).count() > 1e-3 || iters > (int64_t(1) << 40)) break;
    iters *= 2;
  }
  double flops = 0;
  const auto t0 = clock::now();
  parallel_for(threads, threads, [&](int64_t) {
    double mine = 0;
    while (std::chrono::duration<double>(clock::now() - t0).count() < seconds) mine += kt.fma_loop(iters);
#if defined(PYATTN_OPENMP)
#pragma omp atomic
#endif
    flops += mine;
  });
  return flops / std::chrono::duration<double>(clock::now() - t0).count() * 1e-9;
}

namespace {

// Thread c's part [lo, hi) of `bytes` split `threads` ways at 64-byte (cache line) boundaries.
std::pair<int64_t, int64_t> thread_part(int64_t bytes, int threads, int64_t c) {
  const int64_t per = ceil_div(ceil_div(bytes, threads), 64) * 64;
  return {std::min(bytes, c * per), std::min(bytes, (c + 1) * per)};
}

volatile uint64_t g_read_sink = 0;  // keeps the XOR reductions observable

}  // namespace

double read_buffers_gbs(const std::vector<std::pair<const void*, int64_t>>& buffers, int num_threads, int repeats) {
  using clock = std::chrono::steady_clock;
  const int threads = std::max(1, num_threads);
  const KernelTable& kt = active_kernels();
  int64_t total = 0;
  for (const auto& b : buffers) total += b.second;
  double best = 0;
  for (int rep = 0; rep < std::max(1, repeats); ++rep) {
    std::vector<uint64_t> x(size_t(threads), 0);
    const auto t0 = clock::now();
    parallel_for(threads, threads, [&](int64_t c) {
      for (const auto& b : buffers) {  // each thread reads its part of every buffer
        const auto part = thread_part(b.second, threads, c);
        x[size_t(c)] ^= kt.xor_bytes(static_cast<const unsigned char*>(b.first) + part.first, part.second - part.first);
      }
    });
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    for (uint64_t v : x) g_read_sink = g_read_sink ^ v;
    best = std::max(best, double(total) / dt * 1e-9);
  }
  return best;
}

double read_bandwidth_gbs(int num_threads, int64_t nbytes) {
  const int threads = std::max(1, num_threads);
  const int64_t n = std::max<int64_t>(nbytes, 4096);
  // Backed by transparent huge pages where the OS offers them, like NumPy's large arrays (NumPy
  // madvises them): with 4 KiB pages the hardware prefetchers stop at every page boundary and the
  // "ceiling" would be measured well below what attention on NumPy arrays can reach. Whether the
  // OS grants them depends on memory fragmentation; read_buffers_gbs on the arrays themselves
  // measures the ceiling of exactly those pages.
  HugeBuffer buf{size_t(n)};
  unsigned char* data = static_cast<unsigned char*>(buf.data());
  // First touch by the thread that will read each part (NUMA placement), values nonzero.
  parallel_for(threads, threads, [&](int64_t c) {
    const auto part = thread_part(n, threads, c);
    if (part.second > part.first) std::memset(data + part.first, 1, size_t(part.second - part.first));
  });
  return read_buffers_gbs({{data, n}}, threads, 5);
}

}  // namespace pyattn
