// SPDX-License-Identifier: MIT
// The runtime around the kernels (runtime.cpp): the default thread count, the guard for processes
// forked after a parallel region, what OpenMP the build has, and float16/bfloat16 <-> float32
// conversion of whole arrays with the active ISA's kernels, split across threads.
#pragma once

#include <cstdint>

namespace pyattn {

// Registers the handler that makes a child forked after a parallel region run single-threaded
// (ForkGuard, parallel.h); called once, when the module loads.
void install_fork_guard();
// Threads a call without num_threads= uses: set_num_threads(), else OpenMP's default (1 in a child
// forked after a parallel region, or without OpenMP).
int default_num_threads();
void set_default_num_threads(int n);  // 0 = unset (OpenMP default)
bool openmp_enabled();
const char* openmp_runtime();

// float16 <-> float32 conversion of n elements (bfloat16 bits instead with bfloat16), exactly as
// IEEE 754 (and ml_dtypes for bfloat16) rounds, on up to num_threads threads (0: the default).
void convert_half(const uint16_t* src, float* dst, int64_t n, int num_threads, bool bfloat16 = false);
void convert_half(const float* src, uint16_t* dst, int64_t n, int num_threads, bool bfloat16 = false);

}  // namespace pyattn
