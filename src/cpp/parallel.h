// SPDX-License-Identifier: MIT
// The thread pool of the C++ core: OpenMP's, entered only through these helpers, so every parallel
// region of pyattn (the attention driver, the projections' GEMM, mask packing, the machine ceilings)
// is one of the two loops below: an item loop (ItemRanges: each thread its own range of the items,
// then what is left of the others'), or the same with each thread claiming its next item ahead.
// The team size is per call (num_threads), never a global setting; built without OpenMP, both
// loops run serially.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#if defined(PYATTN_OPENMP)
#include <omp.h>
#endif

namespace pyattn {

// Multiply-adds that make one more thread worth its cost: waking a team and joining it takes a few
// microseconds, in which one core does ~10^5 multiply-adds, so a small call (a decode step of a small
// layer) runs faster on its calling thread alone.
constexpr double kFmasPerThread = 65536;

// Threads worth starting for `fmas` multiply-adds of work split into `items` work items: at most
// `wanted` and at most one per item, at least 1.
inline int threads_for(double fmas, int wanted, int64_t items) {
  const int cap = items < int64_t(wanted) ? int(items) : wanted;
  if (cap <= 1) return 1;
  const double worth = fmas / kFmasPerThread;
  return worth >= double(cap) ? cap : (worth < 2 ? 1 : int(worth));
}

// The calling thread's buffer of at least `elems` elements, one per Tag: it only grows, so a
// caller that runs again and again reuses its memory instead of paying page faults for fresh
// megabytes on every call, and concurrent callers (Python threads) never share one. Allocated by
// the calling thread before a parallel region, which no exception may leave. It starts on a cache
// line (kCacheLine), as the kernels' vector loads of it (packed GEMM panels, K/V rows) assume: a
// 64-byte load that straddles two lines costs two (see pack_weights in bindings_mha.cpp).
constexpr size_t kCacheLine = 64;

// How many elements of T from p to the next cache line (0 when p is on one). Buffers that must
// start on a line are allocated kCacheLine bytes larger and used from p + elements_to_line(p); p is
// T-aligned (an allocation of T), so the distance is a whole number of elements.
template <class T>
size_t elements_to_line(const T* p) {
  return (kCacheLine - reinterpret_cast<uintptr_t>(p) % kCacheLine) % kCacheLine / sizeof(T);
}

template <class Tag, class T>
T* grow_only_scratch(size_t elems) {
  constexpr size_t kSlack = (kCacheLine + sizeof(T) - 1) / sizeof(T);
  thread_local std::vector<T> buffer;
  if (buffer.size() < elems + kSlack) buffer.resize(elems + kSlack);
  return buffer.data() + elements_to_line(buffer.data());
}

// A buffer of n elements of T starting on an Align-byte boundary (a cache line by default), left
// uninitialised: every kernel writes its scratch before reading it (zero-filling it would cost a
// small call a noticeable share of its time). No memory for n = 0 (data() is null then).
template <class T, size_t Align = kCacheLine>
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n)
      : data_(n == 0 ? nullptr : static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(Align)))) {}
  ~AlignedBuffer() {
    if (data_) ::operator delete(data_, std::align_val_t(Align));
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  T* data() { return data_; }

 private:
  T* data_;
};

// Per-thread scratch of one parallel region: one slice per thread, each starting on its own page,
// with kSliceGap untouched bytes between one slice's end and the next one's start. With the slices end
// to end, the thread whose slice comes second runs its items markedly slower whenever both threads
// work: no access crosses a slice, so the likely cause is hardware prefetching past the first slice's
// end into the second's start (its hottest lines, the score block), lines that then move between the
// cores on every key block. The gap is address space only: nothing touches it, so it never gets
// memory behind it. A work item's running state that outlives the item (a split key range's partial
// state) is kept in the thread's slice while the item runs and copied out once at its end, for the
// same reason.
constexpr size_t kPageBytes = 4096;
constexpr size_t kSliceGap = 64 * 1024;

// Elements of T from one thread's slice of `elems` to the next: whole pages, then the gap.
template <class T>
size_t slice_stride(size_t elems) {
  return ((elems * sizeof(T) + kPageBytes - 1) / kPageBytes * kPageBytes + kSliceGap) / sizeof(T);
}

// Elements of T that `threads` slices of `elems` take laid out slice_stride apart: no gap after the
// last one (nothing follows it), nothing at all for empty slices.
template <class T>
size_t slices_span(size_t elems, int threads) {
  return elems == 0 ? 0 : slice_stride<T>(elems) * size_t(threads > 1 ? threads - 1 : 0) + elems;
}

template <class T>
class ThreadSlices {
 public:
  ThreadSlices(size_t elems, int threads) : stride_(slice_stride<T>(elems)), buffer_(slices_span<T>(elems, threads)) {}
  T* slice(int thread) { return buffer_.data() + stride_ * size_t(thread); }

 private:
  size_t stride_;  // elements from one slice to the next
  AlignedBuffer<T, kPageBytes> buffer_;
};

// Forked children. GNU libgomp keeps its pool of worker threads for the next team, and a process
// forked after a team ran (os.fork, multiprocessing's "fork" start method, pre-forking servers)
// inherits that pool without its threads: the child's first parallel region waits for them forever
// (a two-thread call in the child after one in the parent hangs). pyattn therefore notes
// when it starts a team, and a child forked after that runs every loop below on its calling thread;
// results are the same bits (they never depend on the thread count). LLVM's libomp starts a new pool
// in a child, so the rule is libgomp's only. install_fork_guard (runtime.h) registers the child's
// handler when the module loads.
#if defined(PYATTN_OPENMP) && defined(__GNUC__) && !defined(__clang__)
#define PYATTN_FORK_GUARD 1
#endif
struct ForkGuard {
  static std::atomic<bool>& team_started() {
    static std::atomic<bool> started{false};
    return started;
  }
  static std::atomic<bool>& serial() {
    static std::atomic<bool> forced{false};
    return forced;
  }
  static void on_fork_child() {
    if (team_started().load(std::memory_order_relaxed)) serial().store(true, std::memory_order_relaxed);
  }
  // Whether this process may start a team; false in a child forked after its parent started one.
  static bool teams_allowed() { return !serial().load(std::memory_order_relaxed); }
  static void note_team() {
    if (!team_started().load(std::memory_order_relaxed)) team_started().store(true, std::memory_order_relaxed);
  }
};

// The calling thread's index in the current team (0 outside a parallel region).
inline int thread_id() {
#if defined(PYATTN_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// How the item loops below hand out work: thread t owns the items [t * count / parts, (t + 1) *
// count / parts) and runs them in order; once its own are claimed it takes the next unclaimed item
// of the following threads' ranges in turn, so no thread idles while items are left (a causal
// call's items differ in cost; a thread whose core another process takes falls behind). With ranges,
// a thread works on neighbouring heads and reads one stretch of the keys, and a call repeated on the
// same arrays finds its rows in the same core's caches; one shared counter would have the threads
// take turns on each head's query blocks, so that both read every head's K and V. The items' results
// never depend on which thread runs them.
class ItemRanges {
 public:
  ItemRanges(int64_t count, int parts) : parts_(parts > 0 ? parts : 1), cursor_(new Cursor[size_t(parts_)]) {
    for (int p = 0; p < parts_; ++p) {
      cursor_[p].next.store(count * p / parts_, std::memory_order_relaxed);
      cursor_[p].end = count * (p + 1) / parts_;
    }
  }
  // The next item for thread t (its own range first, then the others' in turn), or -1: none left.
  int64_t claim(int t) {
    for (int i = 0; i < parts_; ++i) {
      const int64_t n = take(cursor_[(t + i) % parts_]);
      if (n >= 0) return n;
    }
    return -1;
  }
  // The next item of thread t's own range, or -1 (for claiming ahead: parallel_for_ahead).
  int64_t claim_own(int t) { return take(cursor_[t % parts_]); }

 private:
  struct alignas(kCacheLine) Cursor {  // a line each: every claim writes one
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  // The next item of one range, or -1 (the load first: a finished range is not written again).
  static int64_t take(Cursor& c) {
    if (c.next.load(std::memory_order_relaxed) >= c.end) return -1;
    const int64_t n = c.next.fetch_add(1, std::memory_order_relaxed);
    return n < c.end ? n : -1;
  }
  int parts_;
  std::unique_ptr<Cursor[]> cursor_;
};

// Runs body(n) for n in [0, count) on up to `threads` threads, scheduled by ItemRanges.
template <class F>
void parallel_for(int64_t count, int threads, F&& body) {
#if defined(PYATTN_OPENMP)
  if (threads > 1 && count > 1 && ForkGuard::teams_allowed()) {
    ForkGuard::note_team();
    ItemRanges ranges(count, threads);
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      for (int64_t n = ranges.claim(t); n >= 0; n = ranges.claim(t)) body(n);
    }
    return;
  }
#else
  (void)threads;
#endif
  for (int64_t n = 0; n < count; ++n) body(n);
}

// Runs body(n, next) for n in [0, count) on up to `threads` threads, scheduled like parallel_for,
// where `next` is the item the same thread runs after n (-1: not known yet), claimed before n starts
// so that n's body can prefetch what `next` reads. Claimed ahead only from the thread's own range
// (what a thread takes from the others' ranges it takes one item at a time), so a thread holds at
// most one item in reserve, and only one it would run next anyway.
template <class F>
void parallel_for_ahead(int64_t count, int threads, F&& body) {
  auto run = [&](ItemRanges& ranges, int t) {
    int64_t n = ranges.claim(t);
    while (n >= 0) {
      const int64_t next = ranges.claim_own(t);
      body(n, next);
      n = next >= 0 ? next : ranges.claim(t);
    }
  };
#if defined(PYATTN_OPENMP)
  if (threads > 1 && count > 1 && ForkGuard::teams_allowed()) {
    ForkGuard::note_team();
    ItemRanges ranges(count, threads);
#pragma omp parallel num_threads(threads)
    run(ranges, omp_get_thread_num());
    return;
  }
#else
  (void)threads;
#endif
  ItemRanges ranges(count, 1);
  run(ranges, 0);
}

}  // namespace pyattn
