// SPDX-License-Identifier: MIT
// The driver of pyattn.merge_attention_states: rows shared out over the threads in blocks, each
// block merged by the active ISA's kernel (merge_states.inc). The result of a row depends on its
// parts only, so it does not depend on the thread count.

#include "attention.h"
#include "parallel.h"

namespace pyattn {

// Rows per work item: enough to make a thread's start-up worth it, few enough to share out.
constexpr int64_t kMergeRowsPerItem = 64;

template <class T>
void merge_attention_states(const MergeArgs<T>& m, int num_threads) {
  if (m.rows == 0) return;
  const KernelSet<T>& ks = active_set<T>();
  const int64_t items = ceil_div(m.rows, kMergeRowsPerItem);
  const int threads_wanted = num_threads > 0 ? num_threads : default_num_threads();
  const double work = double(m.rows) * double(m.parts) * double(m.value_dim + 8);
  const int threads = threads_for(work, threads_wanted, items);
  parallel_for(items, threads, [&](int64_t n) {
    const int64_t begin = n * kMergeRowsPerItem;
    ks.merge_states(m, begin, std::min(m.rows, begin + kMergeRowsPerItem));
  });
}

template void merge_attention_states<float>(const MergeArgs<float>&, int);
template void merge_attention_states<double>(const MergeArgs<double>&, int);

}  // namespace pyattn
