// SPDX-License-Identifier: MIT
// pybind11 module pyattn._core: the attention entries (bindings_sdpa.cpp, where the API contract
// lives), the multi-head layer and GEMM entries (bindings_mha.cpp), the runtime (bindings_runtime.cpp:
// ISA choice, threads, the tuning override, build facts), and here the helpers the Python layer
// shares: the one aligned allocator, the one documented copy, the 16-bit conversions.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention.h"
#include "binding_checks.h"

namespace pyattn {

void bind_runtime(py::module_& m);  // bindings_runtime.cpp
void bind_sdpa(py::module_& m);     // bindings_sdpa.cpp
void bind_mha(py::module_& m);      // bindings_mha.cpp
void bind_merge(py::module_& m);    // bindings_merge.cpp

}  // namespace pyattn

PYBIND11_MODULE(_core, m) {
  using namespace pyattn;
  m.doc() = "pyattn compiled core (private: use the functions of the pyattn package)";
  bind_runtime(m);
  bind_sdpa(m);
  bind_mha(m);
  bind_merge(m);
  m.def(
      "empty_on_line",
      [](const py::dtype& dtype, const std::vector<py::ssize_t>& shape, const std::string& name, int64_t start,
         bool zero) {
        if (start < 0 || start >= int64_t(kCacheLine) || start % dtype.itemsize() != 0)
          fail("start: expected a multiple of the element size in [0, 64)");
        return array_on_line(dtype, shape, name.c_str(), start, zero);
      },
      py::arg("dtype"), py::arg("shape"), py::arg("name"), py::arg("start") = 0, py::arg("zero") = false,
      "A fresh C-contiguous array whose data starts `start` bytes past a 64-byte cache line (a view into a "
      "slightly larger uint8 array), zero-filled if `zero`, else uninitialised; `name` is the argument an "
      "error names.");
  m.def(
      "kernel_layout",
      [](const py::array& x, const std::string& name, bool contiguous_last) {
        return kernel_layout(x, contiguous_last, name.c_str());
      },
      py::arg("x"), py::arg("name"), py::arg("contiguous_last") = true,
      "x itself when the kernels can read it through its strides (element-aligned, and with contiguous_last "
      "a contiguous last axis), else a C-contiguous copy on a cache line.");
  m.def(
      "_convert_half",
      [](const py::array& src, const py::array& dst, py::handle num_threads, bool bfloat16) {
        const int threads = parse_threads(num_threads);
        const bool widen =
            same_dtype(src.dtype(), py::dtype::of<uint16_t>()) && same_dtype(dst.dtype(), py::dtype::of<float>());
        const bool narrow =
            same_dtype(src.dtype(), py::dtype::of<float>()) && same_dtype(dst.dtype(), py::dtype::of<uint16_t>());
        if (!widen && !narrow)
          throw py::type_error("_convert_half: expected uint16 -> float32 or float32 -> uint16 arrays");
        if (!(src.flags() & py::array::c_style) || !(dst.flags() & py::array::c_style) || !dst.writeable())
          throw py::value_error("_convert_half: src and dst must be C-contiguous, dst writeable");
        if (src.size() != dst.size()) throw py::value_error("_convert_half: src and dst must have the same size");
        // The scalar tails read and write whole elements: a float16 view at an odd address would be a
        // misaligned access (undefined behaviour; UBSan stops there).
        auto aligned = [](const py::array& x) {
          return reinterpret_cast<uintptr_t>(x.data()) % size_t(x.itemsize()) == 0;
        };
        const int64_t n = int64_t(src.size());
        if (n > 0 && (!aligned(src) || !aligned(dst)))  // NumPy calls an empty array aligned wherever it points
          throw py::value_error("_convert_half: src and dst must be aligned to their element size");
        if (widen) {
          const uint16_t* s = static_cast<const uint16_t*>(src.data());
          float* d = static_cast<float*>(const_cast<void*>(dst.data()));
          py::gil_scoped_release release;
          convert_half(s, d, n, threads, bfloat16);
        } else {
          const float* s = static_cast<const float*>(src.data());
          uint16_t* d = static_cast<uint16_t*>(const_cast<void*>(dst.data()));
          py::gil_scoped_release release;
          convert_half(s, d, n, threads, bfloat16);
        }
      },
      py::arg("src"), py::arg("dst"), py::arg("num_threads") = py::none(), py::arg("bfloat16") = false,
      "float16 bits (uint16) <-> float32, element by element as IEEE 754 rounds (to nearest even); with "
      "bfloat16=True bfloat16 bits, rounded as ml_dtypes rounds (to nearest even, NaN to the quiet NaN).");
#if defined(PYATTN_VERSION)
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
