// SPDX-License-Identifier: MIT
// The decode driver (decode_driver.cpp), which the entry point (attention.cpp) hands calls of at
// most kDecodeMaxLen query rows per head.
#pragma once

#include "problem.h"
#include "tuning.h"

namespace pyattn {

// Few query rows per head: lanes along head_dim, all query heads of a GQA group together, the key
// range split across threads when there are too few tasks; planned by plan_decode with `tuning`.
template <class T>
void attend_decode(const AttnArgs<T>& a, const KernelSet<T>& ks, const Tuning& tuning, int num_threads);

}  // namespace pyattn
