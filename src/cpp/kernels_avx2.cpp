// SPDX-License-Identifier: MIT
// The kernels of the avx2 ISA: kernels.inc compiled with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS avx2
#define PYATTN_ISA_NAME "avx2"
#define PYATTN_SIMD_AVX2 1
#include "kernels.inc"
