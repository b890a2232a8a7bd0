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

// int8 quantisation of `rows` rows of `dim` floats (src, contiguous): row r gets the scale
// scales[r] = max |x| / 127 and dst[r * dst_stride + e] = round(x_e / scales[r]) (to nearest even,
// within [-127, 127]); x = scale * q within scale / 2 (rows below 127 * 2^-126, whose scale is
// subnormal and so rounded itself, within 127 * 2^-150 more). A zero row gets scale 0; a row holding Inf or
// NaN gets a NaN scale (its values are lost: attention that reads it gives NaN, as it would have).
void quantize_int8(const float* src, int64_t rows, int64_t dim, int8_t* dst, int64_t dst_stride, float* scales);

}  // namespace pyattn
