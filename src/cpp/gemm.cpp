// SPDX-License-Identifier: MIT
// The GEMM driver of the linear layers: weight packing (panel by panel, gemm.inc) and the threaded
// loop over output tiles.
//
// Tasks are (block of rows, weight panel) pairs, row-block major, so a thread that takes consecutive
// panels of one row block keeps those A rows in its L2. Each C element is produced by one task with
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
  auto body = [&](int64_t t) {
    const int64_t rb = t / groups, p0 = t % groups * group;
    const int64_t r0 = rb * rows_per_task;
    ks.gemm(g, r0, std::min(g.m, r0 + rows_per_task), p0, std::min(panels, p0 + group));
  };
  const int wanted = int(std::max<int64_t>(1, std::min<int64_t>(num_threads > 0 ? num_threads : default_num_threads(), tasks)));
  const int threads = threads_for(double(g.m) * double(g.n) * double(g.k), wanted);
  parallel_for(tasks, threads, body);
}

template void pack_weights<float>(const KernelSet<float>&, const float*, int64_t, int64_t, int64_t, float*);
template void pack_weights<double>(const KernelSet<double>&, const double*, int64_t, int64_t, int64_t, double*);
template void linear<float>(const GemmArgs<float>&, int);
template void linear<double>(const GemmArgs<double>&, int);

}  // namespace pyattn
