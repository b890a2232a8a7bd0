// SPDX-License-Identifier: MIT
// pyattn._machine: the machine's ceilings, measured for the benchmarks (bench/) in a module of its
// own, apart from the attention core: the FMA peak (fma_loop on every thread) and the read bandwidth
// of memory (xor_bytes over a buffer, or over the caller's own arrays, split across threads at
// cache-line boundaries), with the loops of a given ISA (machine_kernels.inc). A benchmark quotes
// pyattn's speed as a fraction of these, measured in the same run.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "parallel.h"
#include "problem.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace py = pybind11;

namespace pyattn {

namespace generic {
double fma_loop(int64_t iterations);
uint64_t xor_bytes(const unsigned char* p, int64_t bytes);
}  // namespace generic
#if defined(PYATTN_HAVE_AVX2)
namespace avx2 {
double fma_loop(int64_t iterations);
uint64_t xor_bytes(const unsigned char* p, int64_t bytes);
}  // namespace avx2
#endif
#if defined(PYATTN_HAVE_AVX512)
namespace avx512 {
double fma_loop(int64_t iterations);
uint64_t xor_bytes(const unsigned char* p, int64_t bytes);
}  // namespace avx512
#endif
#if defined(PYATTN_HAVE_AVX512BF16)
namespace avx512bf16 {
double fma_loop(int64_t iterations);
double dot16_loop(int64_t iterations);
uint64_t xor_bytes(const unsigned char* p, int64_t bytes);
}  // namespace avx512bf16
#endif

namespace {

// One ISA's loops (dot16_loop: the bfloat16 dot product's, where the ISA has one, else null).
struct Loops {
  double (*fma_loop)(int64_t iterations);
  uint64_t (*xor_bytes)(const unsigned char* p, int64_t bytes);
  double (*dot16_loop)(int64_t iterations) = nullptr;
};

// The loops of the ISA named `isa`, which the caller (bench/_common.py) takes from pyattn.get_isa(),
// i.e. one the core has checked this CPU runs. A name this module was not built with is refused.
Loops loops_of(const std::string& isa) {
  if (isa == "generic") return {&generic::fma_loop, &generic::xor_bytes};
#if defined(PYATTN_HAVE_AVX2)
  if (isa == "avx2") return {&avx2::fma_loop, &avx2::xor_bytes};
#endif
#if defined(PYATTN_HAVE_AVX512)
  if (isa == "avx512") return {&avx512::fma_loop, &avx512::xor_bytes};
#endif
#if defined(PYATTN_HAVE_AVX512BF16)
  if (isa == "avx512bf16") return {&avx512bf16::fma_loop, &avx512bf16::xor_bytes, &avx512bf16::dot16_loop};
#endif
  throw std::invalid_argument("isa: this build has no ISA '" + isa + "'");
}

// A large read-only-benchmark buffer, 2 MiB aligned and advised as huge pages on Linux.
class HugeBuffer {
 public:
  explicit HugeBuffer(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
#if defined(__linux__)
    if (posix_memalign(&data_, kHuge, size) != 0) throw std::bad_alloc();
    madvise(data_, size, MADV_HUGEPAGE);
#else
    raw_.resize(size + kHuge);
    void* p = raw_.data();
    size_t space = raw_.size();
    data_ = std::align(kHuge, size, p, space);
#endif
  }
  ~HugeBuffer() {
#if defined(__linux__)
    std::free(data_);
#endif
  }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  void* data() { return data_; }

 private:
  void* data_ = nullptr;
  std::vector<unsigned char> raw_;
};

}  // namespace

// GFLOP/s of a register-only loop (Loops::fma_loop or dot16_loop) on num_threads threads for `seconds`.
double peak_gflops(double (*loop)(int64_t), int num_threads, double seconds) {
  using clock = std::chrono::steady_clock;
  const int threads = std::max(1, num_threads);
  // Calibrate one call to about a millisecond so the loop dominates the clock reads.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = clock::now();
    loop(iters);
    if (std::chrono::duration<double>(clock::now() - t0).count() > 1e-3 || iters > (int64_t(1) << 40)) break;
    iters *= 2;
  }
  double flops = 0;
  const auto t0 = clock::now();
  parallel_for(threads, threads, [&](int64_t) {
    double mine = 0;
    while (std::chrono::duration<double>(clock::now() - t0).count() < seconds) mine += loop(iters);
#if defined(PYATTN_OPENMP)
#pragma omp atomic
#endif
    flops += mine;
  });
  return flops / std::chrono::duration<double>(clock::now() - t0).count() * 1e-9;
}

namespace {

// Thread c's part [lo, hi) of `bytes` split `threads` ways at 64-byte (cache line) boundaries.
std::pair<int64_t, int64_t> thread_part(int64_t bytes, int threads, int64_t c) {
  const int64_t per = ceil_div(ceil_div(bytes, threads), 64) * 64;
  return {std::min(bytes, c * per), std::min(bytes, (c + 1) * per)};
}

volatile uint64_t g_read_sink = 0;  // keeps the XOR reductions observable

}  // namespace

// GB/s of reading every byte of the given buffers once (best of `repeats` passes).
double read_buffers_gbs(const Loops& kt, const std::vector<std::pair<const void*, int64_t>>& buffers, int num_threads,
                        int repeats) {
  using clock = std::chrono::steady_clock;
  const int threads = std::max(1, num_threads);
  int64_t total = 0;
  for (const auto& b : buffers) total += b.second;
  double best = 0;
  for (int rep = 0; rep < std::max(1, repeats); ++rep) {
    std::vector<uint64_t> x(size_t(threads), 0);
    const auto t0 = clock::now();
    parallel_for(threads, threads, [&](int64_t c) {
      for (const auto& b : buffers) {  // each thread reads its part of every buffer
        const auto part = thread_part(b.second, threads, c);
        x[size_t(c)] ^= kt.xor_bytes(static_cast<const unsigned char*>(b.first) + part.first, part.second - part.first);
      }
    });
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    for (uint64_t v : x) g_read_sink = g_read_sink ^ v;
    best = std::max(best, double(total) / dt * 1e-9);
  }
  return best;
}

// GB/s of reading a fresh nbytes buffer (best of 5 passes).
double read_bandwidth_gbs(const Loops& kt, int num_threads, int64_t nbytes) {
  const int threads = std::max(1, num_threads);
  const int64_t n = std::max<int64_t>(nbytes, 4096);
  // Backed by transparent huge pages where the OS offers them, like NumPy's large arrays (NumPy
  // madvises them): with 4 KiB pages the hardware prefetchers stop at every page boundary and the
  // "ceiling" would be measured well below what attention on NumPy arrays can reach. Whether the
  // OS grants them depends on memory fragmentation; read_buffers_gbs on the arrays themselves
  // measures the ceiling of exactly those pages.
  HugeBuffer buf{size_t(n)};
  unsigned char* data = static_cast<unsigned char*>(buf.data());
  // First touch by the thread that will read each part (NUMA placement), values nonzero.
  parallel_for(threads, threads, [&](int64_t c) {
    const auto part = thread_part(n, threads, c);
    if (part.second > part.first) std::memset(data + part.first, 1, size_t(part.second - part.first));
  });
  return read_buffers_gbs(kt, {{data, n}}, threads, 5);
}

}  // namespace pyattn

namespace {

// The loops of `isa` (None: the ISA the core runs, pyattn.get_isa()); an ISA this CPU does not run
// (pyattn.available_isas()) is refused, so that no loop can fault.
pyattn::Loops loops_for(const py::object& isa) {
  const py::module_ core = py::module_::import("pyattn._core");
  if (isa.is_none()) return pyattn::loops_of(core.attr("isa")().cast<std::string>());
  const std::string name = py::str(isa);
  for (const py::handle n : core.attr("available_isas")())
    if (n.cast<std::string>() == name) return pyattn::loops_of(name);
  throw py::value_error("isa: '" + name + "' is not an ISA this CPU runs (see pyattn.available_isas())");
}

}  // namespace

PYBIND11_MODULE(_machine, m) {
  using pyattn::Loops;
  m.doc() = "The machine's ceilings for pyattn's benchmarks (private).";
  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds, const py::object& isa) {
        const Loops loops = loops_for(isa);
        py::gil_scoped_release release;
        return pyattn::peak_gflops(loops.fma_loop, threads, seconds);
      },
      py::arg("num_threads"), py::arg("seconds") = 0.5, py::arg("isa") = py::none(),
      "float32 FMA throughput of an ISA's register-only loop on num_threads threads, GFLOP/s.");
  m.def(
      "dot16_peak_gflops",
      [](int threads, double seconds, const py::object& isa) {
        const Loops loops = loops_for(isa);
        if (!loops.dot16_loop) throw py::value_error("isa: this ISA has no bfloat16 dot product (avx512bf16 has)");
        py::gil_scoped_release release;
        return pyattn::peak_gflops(loops.dot16_loop, threads, seconds);
      },
      py::arg("num_threads"), py::arg("seconds") = 0.5, py::arg("isa") = py::none(),
      "bfloat16 dot-product (vdpbf16ps) throughput of a register-only loop, GFLOP/s (2 flops per\n"
      "multiply-add, as the float32 loop counts them); ValueError for an ISA without it.");
  m.def(
      "read_bandwidth_gbs",
      [](int threads, int64_t nbytes, const py::object& isa) {
        if (nbytes <= 0) throw py::value_error("nbytes must be positive");
        const Loops loops = loops_for(isa);
        py::gil_scoped_release release;
        return pyattn::read_bandwidth_gbs(loops, threads, nbytes);
      },
      py::arg("num_threads"), py::arg("nbytes") = int64_t(1) << 30, py::arg("isa") = py::none(),
      "Streaming read bandwidth of a fresh buffer, GB/s (best of 5).");
  m.def(
      "read_buffers_gbs",
      [](const py::list& arrays, int threads, int repeats, const py::object& isa) {
        if (repeats < 1) throw py::value_error("repeats must be at least 1");
        const Loops loops = loops_for(isa);
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
        return pyattn::read_buffers_gbs(loops, spans, threads, repeats);
      },
      py::arg("arrays"), py::arg("num_threads"), py::arg("repeats") = 5, py::arg("isa") = py::none(),
      "GB/s of reading these C-contiguous arrays once, each split across num_threads threads (best of\n"
      "`repeats` passes; bench_decode --cold uses one pass over a large buffer to evict the caches).");
}
