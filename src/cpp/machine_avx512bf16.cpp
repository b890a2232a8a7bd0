// SPDX-License-Identifier: MIT
// The benchmark ceilings' loops for the avx512bf16 ISA (the vdpbf16ps loop too): machine_kernels.inc
// with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS avx512bf16
#define PYATTN_SIMD_AVX512 1
#define PYATTN_SIMD_BF16 1
#include "machine_kernels.inc"
