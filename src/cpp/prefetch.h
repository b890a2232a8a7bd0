// SPDX-License-Identifier: MIT
// Software prefetches, for the kernels and the driver: one cache line into L2 or into L1, and the
// rows of a thread's next work item spread over the current item's steps (ItemPrefetch). Whether a
// call prefetches at all is the tuning module's decision (TilePlan, DecodePlan).
#pragma once

#include <cstdint>
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>  // _mm_prefetch
#endif

#include "problem.h"

namespace pyattn {

// Prefetches the cache line at p into L2. An asm statement on x86 with GCC/Clang: GCC deletes
// __builtin_prefetch / _mm_prefetch calls from the optimised tile kernels.
inline void prefetch_l2(const void* p) {
#if defined(_MSC_VER) && !defined(__clang__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#elif defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Prefetches the cache line at p close to the core, marked as data read once (prefetchnta: AMD's
// optimisation guides place it in L1 and keep it out of L2 when it came from memory), for rows the
// caller reads once, soon (the decode kernel's K/V streams).
inline void prefetch_l1_once(const void* p) {
#if defined(_MSC_VER) && !defined(__clang__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
#elif defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetchnta %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 0);
#endif
}

// The rows a thread's next work item reads and writes (its query rows, key rows, value rows and
// output rows), prefetched into L2 a few lines at a time while the thread's current item runs: the
// score tiles call advance() once per step of keys (TilePlan::prefetch_items). Spread evenly over the
// current item's keys, because issuing them all at once fills the core's queue of misses in flight
// and stalls it. Each thread's own object, on cache lines of its own: its progress is written at
// every step.
struct alignas(64) ItemPrefetch {
  struct Rows {
    const char* base = nullptr;
    int64_t rows = 0, stride = 0, lines = 0;  // stride in bytes; lines (64 bytes) per row
  };
  static constexpr int kParts = 4;
  Rows part[kParts];
  int64_t lines_per_key = 0;  // lines issued per key of the current item (set by start)
  int at = kParts;            // the part being prefetched (kParts: all issued)
  int64_t row = 0, line = 0;
  void start(int64_t current_keys) {
    int64_t total = 0;
    for (const Rows& r : part) total += r.rows * r.lines;
    lines_per_key = current_keys > 0 ? (total + current_keys - 1) / current_keys : total;
    if (lines_per_key < 1) lines_per_key = 1;
    at = 0;
    row = line = 0;
  }
  // Issues the lines of `keys` keys' worth.
  void advance(int64_t keys) { issue(keys * lines_per_key); }
  void issue(int64_t n) {
    while (n > 0 && at < kParts) {
      const Rows& r = part[at];
      if (row >= r.rows) {
        ++at;
        row = line = 0;
        continue;
      }
      prefetch_l2(r.base + row * r.stride + line * 64);
      --n;
      if (++line == r.lines) {
        line = 0;
        ++row;
      }
    }
  }
  void finish() { issue(INT64_MAX); }
};

}  // namespace pyattn
