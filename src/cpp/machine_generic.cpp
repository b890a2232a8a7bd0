// SPDX-License-Identifier: MIT
// The benchmark ceilings' loops for the generic ISA: machine_kernels.inc with this file's flags (CMakeLists.txt).
#define PYATTN_ISA_NS generic
#include "machine_kernels.inc"
