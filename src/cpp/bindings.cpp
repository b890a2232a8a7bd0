// SPDX-License-Identifier: MIT
// pybind11 module pyattn._core: the attention entries (bindings_sdpa.cpp, where the API contract
// lives), the multi-head layer and GEMM entries (bindings_mha.cpp), and the runtime: ISA choice,
// threads, conversions, the one aligned allocator.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "binding_checks.h"

namespace pyattn {
namespace {

std::vector<std::string> isa_list() {
  const char* names[8];
  const int n = available_isas(names, 8);
  return std::vector<std::string>(names, names + n);
}

std::string compiler_string() {
#if defined(__clang__)
  std::string v = __clang_version__;
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return "clang " + v;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

void apply_env_isa() {
  const char* env = std::getenv("PYATTN_ISA");
  if (!env || !*env) return;
  if (!isa_compiled(env)) {
    std::string built;
    for (const auto& n : isa_list()) built += (built.empty() ? "" : ", ") + n;
    throw py::import_error("PYATTN_ISA='" + std::string(env) + "' is not an ISA this build of pyattn has; use one of: " + built);
  }
  if (!set_isa(env)) {
    std::string avail;
    for (const auto& n : isa_list()) avail += (avail.empty() ? "" : ", ") + n;
    throw py::import_error("PYATTN_ISA='" + std::string(env) + "' is not supported by this CPU; available: " + avail);
  }
}

}  // namespace

void bind_sdpa(py::module_& m);  // bindings_sdpa.cpp
void bind_mha(py::module_& m);   // bindings_mha.cpp

}  // namespace pyattn

PYBIND11_MODULE(_core, m) {
  using namespace pyattn;
  m.doc() = "pyattn compiled core (private: use the functions of the pyattn package)";
  apply_env_isa();
  install_fork_guard();

  bind_sdpa(m);
  bind_mha(m);
  m.def("isa", []() { return std::string(active_isa()); }, "Name of the kernel ISA in use.");
  m.def("available_isas", &isa_list, "ISAs compiled into this build and supported by this CPU, worst to best.");
  m.def(
      "_set_isa",
      [](const std::string& name) {
        if (!isa_compiled(name.c_str())) throw py::value_error("isa: unknown ISA '" + name + "'");
        if (!set_isa(name.c_str())) throw py::value_error("isa: this CPU does not support '" + name + "'");
      },
      py::arg("name"), "Force a kernel ISA (for tests and benchmarks).");
  m.def("set_num_threads", [](int n) {
    if (n < 0) throw py::value_error("num_threads must be >= 1, or 0 to restore the default");
    set_default_num_threads(n);
  });
  m.def("get_num_threads", &default_num_threads);
  // The test switches: each takes the values its docstring lists, refuses others with ValueError
  // (switch_value, attention.cpp) and returns the previous setting.
  auto def_switch = [&m](const char* name, int (*set)(int), const char* arg, const std::string& doc) {
    m.def(name, set, py::arg(arg), (doc + " (for tests). Returns the previous setting; other values raise ValueError.").c_str());
  };
  def_switch("_set_prefetch", &set_prefetch, "mode",
             "What the query tiles and the decode kernel prefetch: -1 decided per call from the cache sizes "
             "(default), 0 nothing, 1 always K/V rows ahead (the tiles: the next key block's; the decode kernel: "
             "16 KiB ahead in each stream), 2 always the next work item's rows (tiles; the decode kernel then "
             "prefetches nothing)");
  def_switch("_set_group_tiles", &set_group_tiles, "on",
             "Whether the query tiles take the heads of a GQA group together (1, the default) or head by head (0)");
  def_switch("_set_pack_heads", &set_pack_heads, "mode",
             "Whether the query tiles copy the rows of K/V heads that interleave in memory (a (batch, seq, "
             "heads, head_dim) array viewed heads first) into a per-thread buffer, head by head: -1 decided per "
             "call from the sizes (the default), 0 never, 1 whenever they interleave");
  def_switch("_set_decode_heads", &set_decode_heads, "mode",
             "Whether decode calls over K/V heads that interleave in memory (a (batch, seq, heads, head_dim) "
             "array viewed heads first) read every head's rows of a key block in turn: -1 by rule (the "
             "default: wherever they interleave; on Zen 5 only for 16-bit K/V with fewer than 4 query rows per "
             "K/V row), 0 never (head by head), 1 wherever they interleave");
  def_switch("_set_decode_block16", &set_decode_block16, "keys",
             "Keys per block of the decode kernel for 16-bit K/V: -1 decided per call (the default), 32 or 64 "
             "always");
  def_switch("_set_decode_prefetch_level", &set_decode_prefetch_level, "level",
             "Where the decode kernel's software prefetches put K/V rows, when it prefetches: -1 decided per "
             "call (the default), 1 L1 or 2 L2 always");
  def_switch("_set_decode_fuse", &set_decode_fuse, "mode",
             "Whether the decode kernel reads a block's K rows together with the previous block's V rows where "
             "it can: -1 decided per call (the default), 0 never, 1 wherever it can");
  def_switch("_set_decode_streams", &set_decode_streams, "streams",
             "How many parts of a work item's keys the decode kernel reads side by side: -1 decided per call "
             "(the default), 1, 2 or 4 always");
  m.def(
      "empty_on_line",
      [](const py::dtype& dtype, const std::vector<py::ssize_t>& shape, const std::string& name, int64_t start, bool zero) {
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
  m.def("_set_packed_mask_limit", &set_packed_mask_limit, py::arg("nbytes"),
        "Largest packed (bit) copy of a boolean mask a call makes; 0 makes the kernels read mask bytes "
        "(for tests). Returns the previous limit. A negative nbytes raises ValueError.");
  m.def(
      "_convert_half",
      [](const py::array& src, const py::array& dst, int threads, bool bfloat16) {
        const bool widen = same_dtype(src.dtype(), py::dtype::of<uint16_t>()) && same_dtype(dst.dtype(), py::dtype::of<float>());
        const bool narrow = same_dtype(src.dtype(), py::dtype::of<float>()) && same_dtype(dst.dtype(), py::dtype::of<uint16_t>());
        if (!widen && !narrow) throw py::type_error("_convert_half: expected uint16 -> float32 or float32 -> uint16 arrays");
        if (!(src.flags() & py::array::c_style) || !(dst.flags() & py::array::c_style) || !dst.writeable())
          throw py::value_error("_convert_half: src and dst must be C-contiguous, dst writeable");
        if (src.size() != dst.size()) throw py::value_error("_convert_half: src and dst must have the same size");
        // The scalar tails read and write whole elements: a float16 view at an odd address would be a
        // misaligned access (undefined behaviour; UBSan stops there).
        auto aligned = [](const py::array& x) { return reinterpret_cast<uintptr_t>(x.data()) % size_t(x.itemsize()) == 0; };
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
      py::arg("src"), py::arg("dst"), py::arg("num_threads") = 0, py::arg("bfloat16") = false,
      "float16 bits (uint16) <-> float32, element by element as IEEE 754 rounds (to nearest even); with "
      "bfloat16=True bfloat16 bits, rounded as ml_dtypes rounds (to nearest even, NaN to the quiet NaN).");
  m.def("cache_bytes", &cache_bytes, py::arg("level"),
        "Bytes of this CPU's level 1-3 data cache per core, from CPUID (0 where it does not say).");
  m.def("cpu_vendor", []() { return std::string(cpu_vendor()); }, "CPUID's vendor string, '' off x86.");
  m.def("cpu_family", &cpu_family, "CPUID's display family (0x19: AMD Zen 3/4, 0x1A: Zen 5), 0 off x86.");
  m.def("cpu_is_intel", &cpu_is_intel, "An Intel core (CPUID vendor 'GenuineIntel'), which has rules of its own.");
  m.def("cpu_is_amd_zen5_on", &cpu_is_amd_zen5_on,
        "An AMD core of family 1Ah or later (Zen 5 on), which has per-core rules of its own.");
  m.def("openmp_runtime", []() { return std::string(openmp_runtime()); });
  m.def("openmp_enabled", &openmp_enabled);
  m.def("compiler", &compiler_string);
  m.def("isa_flags", []() { return std::string(PYATTN_ISA_FLAGS); }, "Compiler flags of each ISA's kernels.");
  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds) {
        py::gil_scoped_release release;
        return fma_peak_gflops(threads, seconds);
      },
      py::arg("num_threads"), py::arg("seconds") = 0.5, "float32 FMA throughput of the active ISA, GFLOP/s.");
  m.def(
      "read_bandwidth_gbs",
      [](int threads, int64_t nbytes) {
        if (nbytes <= 0) throw py::value_error("nbytes must be positive");
        py::gil_scoped_release release;
        return read_bandwidth_gbs(threads, nbytes);
      },
      py::arg("num_threads"), py::arg("nbytes") = int64_t(1) << 30, "Streaming read bandwidth, GB/s (best of 5).");
  m.def(
      "read_buffers_gbs",
      [](const py::list& arrays, int threads, int repeats) {
        if (repeats < 1) throw py::value_error("repeats must be at least 1");
        std::vector<py::buffer_info> infos;
        std::vector<std::pair<const void*, int64_t>> spans;
        for (const auto& item : arrays) {
          infos.push_back(py::reinterpret_borrow<py::buffer>(item).request());
          const py::buffer_info& b = infos.back();
          int64_t expected = b.itemsize;
          for (int64_t d = b.ndim - 1; d >= 0; --d) {
            if (b.shape[size_t(d)] > 1 && b.strides[size_t(d)] != expected)
              throw py::value_error("arrays: every array must be C-contiguous");
            expected *= b.shape[size_t(d)];
          }
          spans.emplace_back(b.ptr, int64_t(b.size) * b.itemsize);
        }
        py::gil_scoped_release release;
        return read_buffers_gbs(spans, threads, repeats);
      },
      py::arg("arrays"), py::arg("num_threads"), py::arg("repeats") = 5,
      "GB/s of reading these C-contiguous arrays once, each split across num_threads threads (best of\n"
      "`repeats` passes; bench_decode --cold uses one pass over a large buffer to evict the caches).");
  m.attr("DECODE_MAX_Q_LEN") = pyattn::kDecodeMaxLen;
#if defined(PYATTN_VERSION)
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
