// SPDX-License-Identifier: MIT
// The benchmark ceilings' loops for the avx512 ISA: machine_kernels.inc with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS avx512
#define PYATTN_SIMD_AVX512 1
#include "machine_kernels.inc"
