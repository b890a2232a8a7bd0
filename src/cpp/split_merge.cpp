// SPDX-License-Identifier: MIT
// Key splits (the merge itself is a template in split_merge.h).

#include "split_merge.h"

#include "tuning.h"

namespace pyattn {

Split split_keys(int64_t tasks, int64_t kv_len, int64_t block, int64_t min_chunk) {
  if (tasks >= kTaskTarget || kv_len <= 0) return {1, kv_len};
  const int64_t n = std::min(ceil_div(kTaskTarget, tasks), ceil_div(kv_len, min_chunk));
  if (n <= 1) return {1, kv_len};
  const int64_t chunk = ceil_div(ceil_div(kv_len, n), block) * block;
  return {ceil_div(kv_len, chunk), chunk};
}

}  // namespace pyattn
