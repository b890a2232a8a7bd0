// SPDX-License-Identifier: MIT
// The GEMM driver of the linear layers: weight packing (panel by panel, gemm.inc; a bfloat16
// layer's in pairs of k, pack_weights16) and the threaded loop over output tiles.
//
// Tasks are (block of rows, weight panel) pairs, row-block major, so a thread that takes consecutive
// panels of one row block keeps those A rows in its L2. A weight not packed beforehand is packed
// by the tasks themselves, panel by panel into per-thread scratch, or for one or two rows of A read
// as it is (gemm.inc, gemm_short_unpacked). Each C element is produced by one task with
// the full K reduction, so results do not depend on the thread count.

#include <algorithm>

#include "attention.h"
#include "parallel.h"

namespace pyattn {
namespace {

// Rows per task: as many register tiles as the tuning module's rule gives for the weight's size
// (gemm_task_tiles: enough to amortise the panel's trip through L2, more for a weight that does not
// stay in L2 between tasks).
template <class T>
int64_t rows_per_task(const KernelSet<T>& ks, int64_t n, int64_t k) {
  const int64_t row_bytes = k * int64_t(sizeof(T));
  const int64_t packed_bytes = ceil_div(n, ks.gemm_panel) * ks.gemm_panel * row_bytes;
  return gemm_task_tiles(current_tuning().cpu, packed_bytes, row_bytes * ks.gemm_rows) * ks.gemm_rows;
}
// Panels per task for one or two rows (a decode step's projections): the kernel runs up to 4 panels
// in one pass there, and 8 panels of 16 floats are 512 output columns, so a layer of a few hundred
// features still makes several tasks.
constexpr int64_t kShortPanelsPerTask = 8;

// Tag of the calling thread's scratch for the panels linear()'s tasks pack (GemmArgs::w).
struct PackScratch;

}  // namespace

template <class T>
void pack_weights(const KernelSet<T>& ks, const T* w, int64_t w_stride, int64_t n, int64_t k, T* packed) {
  for (int64_t p = 0; p < ceil_div(n, ks.gemm_panel); ++p) ks.pack_panel(w, w_stride, n, k, p, packed);
}

void pack_weights16(const uint16_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t panel, uint32_t* packed) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < ceil_div(n, panel); ++p)
    for (int64_t kp = 0; kp < pairs; ++kp) {
      uint32_t* dst = packed + (p * pairs + kp) * panel;
      for (int64_t c = 0; c < panel; ++c) {
        const int64_t col = p * panel + c;
        if (col >= n) {
          dst[c] = 0;
          continue;
        }
        const uint16_t* row = w + col * w_stride;
        dst[c] = uint32_t(row[2 * kp]) | (2 * kp + 1 < k ? uint32_t(row[2 * kp + 1]) << 16 : 0u);
      }
    }
}

template <class T>
void linear(const GemmArgs<T>& g, int num_threads) {
  if (g.m == 0 || g.n == 0) return;
  const KernelSet<T>& ks = active_set<T>();
  const int64_t panels = ceil_div(g.n, ks.gemm_panel);
  const int64_t task_rows = rows_per_task(ks, g.n, g.k);
  const int64_t row_blocks = ceil_div(g.m, task_rows);
  // One or two rows take several panels per pass (gemm.inc, gemm_short): give a task enough of them.
  const int64_t group = g.m <= 2 ? kShortPanelsPerTask : 1;
  const int64_t groups = ceil_div(panels, group);
  const int64_t tasks = groups * row_blocks;
  const int threads = threads_for(double(g.m) * double(g.n) * double(g.k),
                                  num_threads > 0 ? num_threads : default_num_threads(), tasks);
  // W as given (not packed beforehand): each thread packs the panels of its task into its slice of
  // the calling thread's scratch (allocated here, before the parallel region, which no exception
  // may leave), at most `group` panels of k x panel: L2-sized for the k of a layer.
  // One or two rows read W as it is (gemm.inc, gemm_short_unpacked): packing would double their work.
  const bool as_is = g.packed || g.packed16 || g.m <= 2;
  // The threads' slices slice_stride apart, as ThreadSlices lays them out (parallel.h), never end to
  // end.
  const size_t per_thread = as_is ? 0 : size_t(group * g.k * ks.gemm_panel);
  const size_t stride = slice_stride<T>(per_thread);
  T* const scratch =
      as_is ? nullptr : grow_only_scratch<PackScratch, T>(std::max<size_t>(1, slices_span<T>(per_thread, threads)));
  auto body = [&](int64_t t) {
    const int64_t rb = t / groups, p0 = t % groups * group, p1 = std::min(panels, p0 + group);
    const int64_t r0 = rb * task_rows, r1 = std::min(g.m, r0 + task_rows);
    if (as_is) return ks.gemm(g, r0, r1, p0, p1);
    // The same kernel over the columns of panels [p0, p1), packed first; a panel is packed once per
    // block of task_rows rows, 1/task_rows of the multiply-adds that use it.
    const int64_t col0 = p0 * ks.gemm_panel;
    GemmArgs<T> sub = g;
    sub.w = g.w + col0 * g.w_stride;
    sub.n = std::min(g.n - col0, (p1 - p0) * ks.gemm_panel);
    sub.bias = g.bias ? g.bias + col0 : nullptr;
    sub.c = g.c + col0;
    T* const packed = scratch + stride * size_t(thread_id());
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
