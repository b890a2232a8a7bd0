// SPDX-License-Identifier: MIT
// Runtime ISA dispatch (dispatch.cpp): the per-ISA kernel tables, the active one, and forcing
// another for tests and benchmarks.
#pragma once

#include "problem.h"

namespace pyattn {

// Per-ISA tables (defined in kernels_<isa>.cpp).
namespace generic {
const KernelTable& kernel_table();
}
#if defined(PYATTN_HAVE_AVX2)
namespace avx2 {
const KernelTable& kernel_table();
}
#endif
#if defined(PYATTN_HAVE_AVX512)
namespace avx512 {
const KernelTable& kernel_table();
}
#endif
#if defined(PYATTN_HAVE_AVX512BF16)
namespace avx512bf16 {
const KernelTable& kernel_table();
}
#endif

const KernelTable& active_kernels();

// The active ISA's kernels for dtype T.
template <class T>
const KernelSet<T>& active_set();
template <>
inline const KernelSet<float>& active_set<float>() {
  return active_kernels().f32;
}
template <>
inline const KernelSet<double>& active_set<double>() {
  return active_kernels().f64;
}
const char* active_isa();
// Names compiled into this build and supported by this CPU, best last; returns the count.
int available_isas(const char** names, int capacity);
// Forces an ISA by name; returns false (and leaves the current choice) if unknown or unsupported.
bool set_isa(const char* name);
bool cpu_supports(const char* name);
bool isa_compiled(const char* name);

}  // namespace pyattn
