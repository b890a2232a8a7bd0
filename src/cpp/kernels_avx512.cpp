// SPDX-License-Identifier: MIT
// The kernels of the avx512 ISA: kernels.inc compiled with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS avx512
#define PYATTN_ISA_NAME "avx512"
#define PYATTN_SIMD_AVX512 1
#include "kernels.inc"
