// SPDX-License-Identifier: MIT
// The driver: splits one attention call into independent tiles, owns the only OpenMP parallel
// region and the per-thread scratch, and normalises the kernels' running state into the output.
//
// Work split. A task is (batch*head, block of query rows). When there are too few tasks to keep a
// machine busy (short queries, few heads: decode), each task's key range is also split into chunks;
// every chunk produces a partial (m, l, acc) and the chunks are merged in a fixed order with
// log-sum-exp rescaling. The decision depends only on the problem's shape, never on the thread
// count, so the result is bitwise identical for any number of threads. Tasks are handed out
// dynamically, last query blocks first: under a causal mask they are the longest.
//
// Memory: per thread one query block, one score block and one accumulator (O(block_rows * (head_dim
// + key_block + value_dim))); split calls add one partial accumulator per work item, whose count is
// bounded by kTaskTarget tasks' worth. Nothing is O(q_len * kv_len) except the caller's weights.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attention.h"

#if defined(PYATTN_OPENMP)
#include <omp.h>
#endif

namespace pyattn {
namespace {

// Below this many tasks the key range is split: enough independent items for the dynamic schedule
// to balance on machines with up to a few dozen cores.
constexpr int64_t kTaskTarget = 64;
// A chunk of a split key range is at least this many key blocks, so the merge stays negligible.
constexpr int64_t kMinChunkBlocks = 4;
constexpr size_t kAlign = 64;  // cache line

int g_default_threads = 0;

template <class T>
const KernelSet<T>& kernel_set(const KernelTable& t);
template <>
const KernelSet<float>& kernel_set<float>(const KernelTable& t) { return t.f32; }
template <>
const KernelSet<double>& kernel_set<double>(const KernelTable& t) { return t.f64; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t padded(size_t elems, size_t elem_size) {
  const size_t per_line = kAlign / elem_size;
  return (elems + per_line - 1) / per_line * per_line;
}

// A cache-line aligned buffer of n elements of T.
template <class T>
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n) : raw_(n * sizeof(T) + kAlign) {
    void* p = raw_.data();
    size_t space = raw_.size();
    data_ = static_cast<T*>(std::align(kAlign, n * sizeof(T), p, space));
  }
  T* data() { return data_; }

 private:
  std::vector<unsigned char> raw_;
  T* data_ = nullptr;
};

// Carves one item's running state (acc, m, l) out of `base`.
template <class T>
RowState<T> state_at(T* base, int64_t block_rows, int64_t value_dim) {
  const size_t acc = padded(size_t(block_rows * value_dim), sizeof(T));
  const size_t row = padded(size_t(block_rows), sizeof(T));
  return RowState<T>{base, base + acc, base + acc + row};
}

template <class T>
size_t state_elems(int64_t block_rows, int64_t value_dim) {
  return padded(size_t(block_rows * value_dim), sizeof(T)) + 2 * padded(size_t(block_rows), sizeof(T));
}

// out[i][e] = acc[e][i] / l[i]; a row that saw no allowed key (l == 0) becomes zeros.
template <class T>
void finalize(const RowState<T>& s, int64_t block_rows, int64_t rows, int64_t value_dim, T* out,
              int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const T l = s.l[i];
    const T inv = l == T(0) ? T(0) : T(1) / l;
    T* o = out + i * out_stride;
    for (int64_t e = 0; e < value_dim; ++e) o[e] = s.acc[e * block_rows + i] * inv;
  }
}

// Merges the partial states of one task's key chunks (in chunk order) into `out`.
template <class T>
void merge_partials(T* partials, size_t stride, int64_t nsplit, int64_t block_rows, int64_t rows,
                    int64_t value_dim, T* out, int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    bool nan = false;
    for (int64_t c = 0; c < nsplit; ++c) {
      const T mc = state_at(partials + c * stride, block_rows, value_dim).m[i];
      nan = nan || std::isnan(mc);
      m = std::max(m, mc);
    }
    if (nan) m = std::numeric_limits<T>::quiet_NaN();
    T l = 0;
    T* o = out + i * out_stride;
    for (int64_t e = 0; e < value_dim; ++e) o[e] = T(0);
    for (int64_t c = 0; c < nsplit; ++c) {
      const RowState<T> s = state_at(partials + c * stride, block_rows, value_dim);
      if (s.m[i] == -std::numeric_limits<T>::infinity()) continue;  // chunk saw nothing allowed
      const T w = std::exp2(s.m[i] - m);
      l += w * s.l[i];
      for (int64_t e = 0; e < value_dim; ++e) o[e] += w * s.acc[e * block_rows + i];
    }
    const T inv = l == T(0) ? T(0) : T(1) / l;
    for (int64_t e = 0; e < value_dim; ++e) o[e] *= inv;
  }
}

int thread_id() {
#if defined(PYATTN_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Runs body(n) for n in [0, count) on up to `threads` threads, dynamically scheduled.
template <class F>
void parallel_for(int64_t count, int threads, F&& body) {
#if defined(PYATTN_OPENMP)
  if (threads > 1 && count > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t n = 0; n < count; ++n) body(n);
    return;
  }
#else
  (void)threads;
#endif
  for (int64_t n = 0; n < count; ++n) body(n);
}

}  // namespace

template <class T>
void scaled_dot_product_attention(const AttnArgs<T>& a, int num_threads) {
  if (a.batch_heads == 0 || a.q_len == 0) return;
  const KernelSet<T>& ks = kernel_set<T>(active_kernels());
  // Short queries use one vector of rows per tile, so decode does not compute padding rows.
  const int64_t block_rows = a.q_len <= ks.lanes ? ks.lanes : int64_t(ks.lanes) * ks.row_vecs;
  const int64_t q_blocks = ceil_div(a.q_len, block_rows);
  const int64_t tasks = a.batch_heads * q_blocks;
  const int64_t key_block = ks.key_block(block_rows);

  int64_t nsplit = 1;
  if (!a.weights && tasks < kTaskTarget && a.kv_len > 0) {
    const int64_t max_chunks = ceil_div(a.kv_len, kMinChunkBlocks * key_block);
    nsplit = std::min(ceil_div(kTaskTarget, tasks), max_chunks);
  }
  const int64_t chunk = nsplit > 1 ? ceil_div(ceil_div(a.kv_len, nsplit), key_block) * key_block : a.kv_len;
  if (nsplit > 1) nsplit = ceil_div(a.kv_len, chunk);
  const int64_t items = tasks * nsplit;

  int threads = num_threads > 0 ? num_threads : default_num_threads();
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, items)));

  const size_t qt_elems = padded(size_t(a.head_dim * block_rows), sizeof(T));
  const size_t st_elems = padded(size_t(key_block * block_rows), sizeof(T));
  const size_t sstate = state_elems<T>(block_rows, a.value_dim);
  const size_t per_thread = qt_elems + st_elems + sstate;
  AlignedBuffer<T> scratch(per_thread * size_t(threads));
  std::unique_ptr<AlignedBuffer<T>> partials;
  if (nsplit > 1) partials.reset(new AlignedBuffer<T>(sstate * size_t(items)));

  auto tile_of = [&](int64_t task) {
    // Last query blocks first: under a causal mask they have the most keys.
    const int64_t qb = q_blocks - 1 - task / a.batch_heads;
    const int64_t i0 = qb * block_rows;
    return Tile{task % a.batch_heads, i0, std::min(block_rows, a.q_len - i0), 0, a.kv_len};
  };

  parallel_for(items, threads, [&](int64_t n) {
    T* mine = scratch.data() + per_thread * size_t(thread_id());
    Scratch<T> s{mine, mine + qt_elems, state_at(mine + qt_elems + st_elems, block_rows, a.value_dim)};
    Tile t = tile_of(n / nsplit);
    if (nsplit > 1) {
      const int64_t c = n % nsplit;
      t.j_begin = c * chunk;
      t.j_end = std::min(a.kv_len, t.j_begin + chunk);
      s.state = state_at(partials->data() + sstate * size_t(n), block_rows, a.value_dim);
      ks.attend(a, t, block_rows, s);
      return;
    }
    ks.attend(a, t, block_rows, s);
    finalize(s.state, block_rows, t.rows, a.value_dim, a.out_rows(t.bh) + t.i0 * a.out_stride_l, a.out_stride_l);
    if (a.weights) ks.write_weights(a, t, block_rows, s);
  });

  if (nsplit > 1) {
    parallel_for(tasks, threads, [&](int64_t task) {
      const Tile t = tile_of(task);
      merge_partials(partials->data() + sstate * size_t(task * nsplit), sstate, nsplit, block_rows, t.rows,
                     a.value_dim, a.out_rows(t.bh) + t.i0 * a.out_stride_l, a.out_stride_l);
    });
  }
}

template void scaled_dot_product_attention<float>(const AttnArgs<float>&, int);
template void scaled_dot_product_attention<double>(const AttnArgs<double>&, int);

int default_num_threads() {
  if (g_default_threads > 0) return g_default_threads;
#if defined(PYATTN_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_default_num_threads(int n) { g_default_threads = n > 0 ? n : 0; }

bool openmp_enabled() {
#if defined(PYATTN_OPENMP)
  return true;
#else
  return false;
#endif
}

const char* openmp_runtime() {
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

double read_bandwidth_gbs(int num_threads, int64_t nbytes) {
  using clock = std::chrono::steady_clock;
  const KernelTable& kt = active_kernels();
  const int threads = std::max(1, num_threads);
  const int64_t n = std::max<int64_t>(nbytes / int64_t(sizeof(float)), 1024);
  AlignedBuffer<float> buf{size_t(n)};
  float* data = buf.data();
  const int64_t per = ceil_div(n, threads);
  // First touch by the thread that will read each part (NUMA placement), values nonzero.
  parallel_for(threads, threads, [&](int64_t c) {
    for (int64_t i = c * per; i < std::min(n, (c + 1) * per); ++i) data[i] = 1.0f;
  });
  double best = 0, sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> sums(size_t(threads), 0.0);
    const auto t0 = clock::now();
    parallel_for(threads, threads, [&](int64_t c) {
      const int64_t b = c * per, e = std::min(n, (c + 1) * per);
      if (e > b) sums[size_t(c)] = kt.read_sum(data + b, e - b);
    });
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    for (double x : sums) sink += x;
    best = std::max(best, double(n) * sizeof(float) / dt * 1e-9);
  }
  return sink == -1.0 ? 0.0 : best;  // sink keeps the sums observable
}

}  // namespace pyattn
