// SPDX-License-Identifier: MIT
// The kernels of the generic ISA: kernels.inc compiled with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS generic
#define PYATTN_ISA_NAME "generic"
#include "kernels.inc"
