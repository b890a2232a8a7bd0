// SPDX-License-Identifier: MIT
// The benchmark ceilings' loops for the avx2 ISA: machine_kernels.inc with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS avx2
#define PYATTN_SIMD_AVX2 1
#include "machine_kernels.inc"
