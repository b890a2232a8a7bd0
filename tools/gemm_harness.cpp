// SPDX-License-Identifier: MIT
// A developer's harness for the GEMM micro-kernel (gemm.inc, KernelSet::gemm): one thread runs the
// kernel of one ISA over C (M, N) = A (M, K) @ W.T in the order linear() hands out its tasks (row
// blocks of 16 register tiles, one weight panel each), and, alternating with it, the same register
// tile written plainly here (no bias, no tails, no call per task): the ratio of the two shows what
// the kernel's own code around the k loop costs. Each sample is ~50 ms of calls followed by the
// thread's FMA peak (fma_loop), and rates are given as % of that peak, so that a slow spell of the
// host scales both sides alike (see tools/tile_harness.cpp).
//
// Why it exists: bench/bench_mha.py's GEMM rows move by +-15% run to run on a shared 2-vCPU VM,
// more than the few per cent a change to the tile's prologue or epilogue is worth; one thread's CPU
// time, alternated with the plain tile, resolves them. pip does not build it; CI builds and runs it
// briefly (tools/check_harnesses.sh).
//
// Build and run (from the repository root; AVX2 as here, AVX-512: drop -DHARNESS_AVX2, add -mavx512f):
//   g++ -O3 -std=c++17 -DHARNESS_AVX2 -mavx2 -mfma -mf16c -Isrc/cpp tools/gemm_harness.cpp -o /tmp/gh
//   /tmp/gh M N K SECONDS        e.g.  /tmp/gh 1344 2304 768 10
// float32; M is rounded down to whole register tiles (so both sides do the same work); the plain
// tile's result must equal the kernel's bit for bit (same order of the k sum), or the harness exits 1.
// Environment: TILES = register tiles per task (default 16; linear() takes more when the packed
// weight exceeds twice L2: rows_per_task in gemm.cpp).

#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

using S = pyattn::PYATTN_ISA_NS::Simd<float>;
constexpr int kRows = S::gemm_rows, kVecs = S::gemm_vecs, kLanes = S::lanes;
constexpr int64_t kPanel = int64_t(kVecs) * kLanes;

// Rows [row, row + kRows) of C over panel p, the whole k range in registers, from zero.
void plain_tile(const float* a, int64_t k, const float* packed, float* c, int64_t c_stride, int64_t row, int64_t p) {
  const float* bp = packed + p * k * kPanel;
  S::reg acc[kRows][kVecs];
  for (auto& r : acc)
    for (auto& x : r) x = S::zero();
  for (int64_t kk = 0; kk < k; ++kk) {
    S::reg b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = S::load(bp + kk * kPanel + v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const S::reg ab = S::set1(a[(row + i) * k + kk]);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = S::fma(ab, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) S::store(c + (row + i) * c_stride + p * kPanel + v * kLanes, acc[i][v]);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pyattn;
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s M N K SECONDS\n", argv[0]);
    return 2;
  }
  const int64_t m = std::atoll(argv[1]) / kRows * kRows, n = std::atoll(argv[2]), k = std::atoll(argv[3]);
  const double seconds = std::atof(argv[4]);
  if (m < 1 || n < 1 || k < 1 || seconds <= 0) {
    std::fprintf(stderr, "bad arguments (M >= %d)\n", kRows);
    return 2;
  }
  const KernelTable& table = PYATTN_ISA_NS::kernel_table();
  const KernelSet<float>& ks = table.f32;
  const int64_t panels = (n + kPanel - 1) / kPanel, n_padded = panels * kPanel;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  // Cache-line aligned, as pyattn's own buffers are (parallel.h, grow_only_scratch).
  using harness::on_line;
  std::vector<float> a_buf(size_t(m * k) + 16), w(size_t(n * k)), packed_buf(size_t(n_padded * k) + 16);
  std::vector<float> c_kernel_buf(size_t(m * n_padded) + 16), c_plain_buf(size_t(m * n_padded) + 16);
  float* const a = on_line(a_buf);
  float* const packed = on_line(packed_buf);
  float* const c_kernel = on_line(c_kernel_buf);
  float* const c_plain = on_line(c_plain_buf);
  for (int64_t i = 0; i < m * k; ++i) a[i] = normal(gen);
  for (float& x : w) x = normal(gen);
  for (int64_t p = 0; p < panels; ++p) ks.pack_panel(w.data(), k, n, k, p, packed);

  GemmArgs<float> g;
  g.a = a;
  g.a_stride = k;
  g.packed = packed;
  g.c = c_kernel;
  g.c_stride = n_padded;
  g.m = m;
  g.n = n;
  g.k = k;
  const int64_t rows_per_task = (std::getenv("TILES") ? std::atoll(std::getenv("TILES")) : 16) *
                                int64_t(ks.gemm_rows);  // gemm.cpp: kTilesPerTask register tiles
  auto kernel_call = [&] {
    for (int64_t r0 = 0; r0 < m; r0 += rows_per_task)
      for (int64_t p = 0; p < panels; ++p) ks.gemm(g, r0, std::min(m, r0 + rows_per_task), p, p + 1);
  };
  auto plain_call = [&] {
    for (int64_t r0 = 0; r0 < m; r0 += rows_per_task)
      for (int64_t p = 0; p < panels; ++p)
        for (int64_t i = r0; i < std::min(m, r0 + rows_per_task); i += kRows)
          plain_tile(a, k, packed, c_plain, n_padded, i, p);
  };
  kernel_call();
  plain_call();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      if (c_kernel[i * n_padded + j] != c_plain[i * n_padded + j]) {
        std::fprintf(stderr, "C[%lld, %lld]: kernel %.9g, plain tile %.9g\n", (long long)i, (long long)j,
                     double(c_kernel[i * n_padded + j]), double(c_plain[i * n_padded + j]));
        return 1;
      }

  // And against float64 A @ W.T (which the plain tile, reading the same packed panels, cannot
  // check): rows up to ~2e7 multiply-adds, relative to the sum of |products| of each element.
  {
    double err = 0;
    for (const int64_t i : harness::sampled_rows(m, n * k))
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, size = 0;
        for (int64_t x = 0; x < k; ++x) {
          want += double(a[i * k + x]) * double(w[size_t(j * k + x)]);
          size += std::fabs(double(a[i * k + x]) * double(w[size_t(j * k + x)]));
        }
        err = std::max(err, std::fabs(double(c_kernel[i * n_padded + j]) - want) / size);
      }
    if (!harness::agrees(err, 1e-5, "|C - float64 A @ W.T| / sum |products|")) return 1;
  }
  const double flops = 2.0 * double(m) * double(n) * double(k);
  auto sample = [&](auto&& call) {  // % of the FMA peak over ~50 ms of calls
    const double t0 = harness::thread_seconds();
    int calls = 0;
    do {
      call();
      ++calls;
    } while (harness::thread_seconds() - t0 < 0.05);
    const double rate = flops * calls / (harness::thread_seconds() - t0);
    const double p0 = harness::thread_seconds();
    const double done = PYATTN_ISA_NS::fma_loop(100000);
    return rate / (done / (harness::thread_seconds() - p0));
  };
  std::vector<double> kernel, plain, ratio;
  const double t_end = harness::thread_seconds() + seconds;
  while (harness::thread_seconds() < t_end || kernel.size() < 5) {
    kernel.push_back(sample(kernel_call));
    plain.push_back(sample(plain_call));
    ratio.push_back(kernel.back() / plain.back());
  }
  using harness::quantile;
  std::printf(
      "%s %lldx%lldx%lld, tile %dx%d: %% of FMA peak: kernel median %.1f [p25 %.1f p75 %.1f], plain tile %.1f "
      "| kernel / plain per sample pair: median %.3f [p25 %.3f p75 %.3f] (%zu pairs)\n",
      PYATTN_ISA_NAME, (long long)m, (long long)n, (long long)k, kRows, kVecs, 100 * quantile(kernel, 0.5),
      100 * quantile(kernel, 0.25), 100 * quantile(kernel, 0.75), 100 * quantile(plain, 0.5), quantile(ratio, 0.5),
      quantile(ratio, 0.25), quantile(ratio, 0.75), kernel.size());
  return 0;
}
