// SPDX-License-Identifier: MIT
// The GEMM driver of the linear layers: weight packing (panel by panel, gemm.inc) and the threaded
// loop over output tiles.
//
// Tasks are (block of rows, weight panel) pairs, row-block major, so a thread that takes consecutive
// panels of one row block keeps those A rows in its L2. A weight not packed beforehand is packed
// by the tasks themselves, panel by panel into per-thread scratch. Each C element is produced by one task with
// the full K reduction, so results do not depend on the thread count.

#include <algorithm>

#include "attention.h"
#include "parallel.h"

namespace pyattn {
namespace {

// Rows per task: 16 register tiles (96 rows on AVX2/AVX-512) amortise the panel's trip through L2.
constexpr int64_t kTilesPerTask = 16;
// Panels per task for one or two rows (a decode step's projections): the kernel runs up to 4 panels
// in one pass there (AVX2, one row), and 8 panels of 16 floats are 512 output columns, so an
// E = 768 projection still makes 6 tasks.
constexpr int64_t kShortPanelsPerTask = 8;

// Tag of the calling thread's scratch for the panels linear()'s tasks pack (GemmArgs::w).
struct PackScratch;

}  // namespace

template <class T>
void pack_weights(const KernelSet<T>& ks, const T* w, int64_t w_stride, int64_t n, int64_t k, T* packed) {
  for (int64_t p = 0; p < ceil_div(n, ks.gemm_panel); ++p) ks.pack_panel(w, w_stride, n, k, p, packed);
}

template <class T>
void linear(const GemmArgs<T>& g, int num_threads) {
  if (g.m == 0 || g.n == 0) return;
  const KernelSet<T>& ks = active_set<T>();
  const int64_t panels = ceil_div(g.n, ks.gemm_panel);
  const int64_t rows_per_task = kTilesPerTask * ks.gemm_rows;
  const int64_t row_blocks = ceil_div(g.m, rows_per_task);
  // One or two rows take several panels per pass (gemm.inc, gemm_short): give a task enough of them.
  const int64_t group = g.m <= 2 ? kShortPanelsPerTask : 1;
  const int64_t groups = ceil_div(panels, group);
  const int64_t tasks = groups * row_blocks;
  const int threads =
      threads_for(double(g.m) * double(g.n) * double(g.k), num_threads > 0 ? num_threads : default_num_threads(), tasks);
  // W as given (not packed beforehand): each thread packs the panels of its task into its slice of
  // the calling thread's scratch (allocated here, before the parallel region, which no exception
  // may leave), at most `group` panels of k x panel: L2-sized for the k of a layer.
  const size_t per_thread = g.packed ? 0 : size_t(group * g.k * ks.gemm_panel);
  T* const scratch = g.packed ? nullptr : grow_only_scratch<PackScratch, T>(std::max<size_t>(1, per_thread * size_t(threads)));
  auto body = [&](int64_t t) {
    const int64_t rb = t / groups, p0 = t % groups * group, p1 = std::min(panels, p0 + group);
    const int64_t r0 = rb * rows_per_task, r1 = std::min(g.m, r0 + rows_per_task);
    if (g.packed) return ks.gemm(g, r0, r1, p0, p1);
    // The same kernel over the columns of panels [p0, p1), packed first; a panel is packed once per
    // block of rows_per_task rows, 1/rows_per_task of the multiply-adds that use it.
    const int64_t col0 = p0 * ks.gemm_panel;
    GemmArgs<T> sub = g;
    sub.w = g.w + col0 * g.w_stride;
    sub.n = std::min(g.n - col0, (p1 - p0) * ks.gemm_panel);
    sub.bias = g.bias ? g.bias + col0 : nullptr;
    sub.c = g.c + col0;
    T* const packed = scratch + per_thread * size_t(thread_id());
    for (int64_t p = 0; p < p1 - p0; ++p) ks.pack_panel(sub.w, sub.w_stride, sub.n, sub.k, p, packed);
    sub.packed = packed;
    ks.gemm(sub, r0, r1, 0, p1 - p0);
  };
  parallel_for(tasks, threads, body);
}

template void pack_weights<float>(const KernelSet<float>&, const float*, int64_t, int64_t, int64_t, float*);
template void pack_weights<double>(const KernelSet<double>&, const double*, int64_t, int64_t, int64_t, double*);
template void linear<float>(const GemmArgs<float>&, int);
template void linear<double>(const GemmArgs<double>&, int);

}  // namespace pyattn
