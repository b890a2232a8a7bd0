// SPDX-License-Identifier: MIT
// The kernels of the avx512bf16 ISA: the avx512 kernels plus the bfloat16 dot products of
// AVX512-BF16 for 16-bit inputs (tile_pairs.inc), kernels.inc compiled with this file's flags
// (CMakeLists.txt).
#define PYATTN_ISA_NS avx512bf16
#define PYATTN_ISA_NAME "avx512bf16"
#define PYATTN_SIMD_AVX512 1
#define PYATTN_SIMD_BF16 1
#include "kernels.inc"
