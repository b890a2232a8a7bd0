// SPDX-License-Identifier: MIT
// A developer's harness for the prefill tile kernel (kernels.inc, KernelSet::attend): one thread calls
// the kernel of one ISA directly, without the driver, the binding or Python, for every query block
// of one head, and prints GFLOP/s over samples of consecutive calls, each followed by the same
// thread's FMA peak (fma_loop, registers only), and the median of their ratio per sample, so that
// both share the machine's spell.
//
// Why it exists: bench/bench_sdpa.py runs two threads with Python in the loop on a shared VM whose
// speed drifts by 10-20%; a change of a few per cent in the tile kernel needs CPU time of one
// thread, interleaved with the peak, and A/B builds alternated (as tools/decode_harness.cpp does for
// the decode kernel). pip does not build it; it includes kernels.inc like kernels_<isa>.cpp. It
// checks the output against float64 before timing (exit 1 if wrong), and CI builds and runs it
// briefly (tools/check_harnesses.sh).
//
// Build and run (from the repository root; AVX2 as here, AVX-512: drop -DHARNESS_AVX2, add -mavx512f):
//   g++ -O3 -std=c++17 -DHARNESS_AVX2 -mavx2 -mfma -mf16c -Isrc/cpp tools/tile_harness.cpp -o /tmp/th
//   /tmp/th Q_LEN KV_LEN HEAD_DIM SECONDS [CAUSAL]      e.g.  /tmp/th 1024 1024 64 2
// One head, value_dim = head_dim, float32, no mask (CAUSAL 1: upper-left causal); the query blocks
// are the driver's (row_vecs x lanes rows, the last one narrower). GFLOP/s = 4 * q_len * kv_len *
// head_dim (causal: allowed pairs only) / time. Environment: PREFETCH=1 sets TilePlan::prefetch_kv.

#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  using namespace pyattn;
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: %s Q_LEN KV_LEN HEAD_DIM SECONDS [CAUSAL]\n", argv[0]);
    return 2;
  }
  const int64_t q_len = std::atoll(argv[1]), kv_len = std::atoll(argv[2]), dim = std::atoll(argv[3]);
  const double seconds = std::atof(argv[4]);
  const bool causal = argc == 6 && std::atoi(argv[5]) != 0;
  if (q_len < 1 || kv_len < 1 || dim < 1 || seconds <= 0) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const KernelTable& table = PYATTN_ISA_NS::kernel_table();
  const KernelSet<float>& ks = table.f32;

  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> q(size_t(q_len * dim)), k(size_t(kv_len * dim)), v(size_t(kv_len * dim)), out(size_t(q_len * dim));
  for (float& x : q) x = normal(gen);
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);
  const int64_t zero = 0;
  AttnArgs<float> a;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.out = out.data();
  a.q_offset = a.k_offset = a.v_offset = &zero;
  a.q_stride_l = a.k_stride_s = a.v_stride_s = a.out_stride_l = dim;
  a.batch_heads = a.num_heads = a.group = 1;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.head_dim = a.value_dim = dim;
  a.causal = causal;
  a.scale = 1.0 / std::sqrt(double(dim));
  // PREFETCH=1: the tiles' K/V row prefetch on (TilePlan::prefetch_kv; the planner's choice by sizes).
  TilePlan plan;
  plan.prefetch_kv = std::getenv("PREFETCH") && std::atoi(std::getenv("PREFETCH")) != 0;

  const int64_t block_rows = q_len <= ks.lanes ? ks.lanes : int64_t(ks.lanes) * ks.row_vecs;
  const int64_t key_block = ks.key_block(block_rows);
  // The scratch starts on cache lines, as the driver's does (parallel.h, grow_only_scratch): std::vector
  // promises 16 bytes, and the tiles run 1.24x slower on scores 16 bytes past a line.
  std::vector<float> qt(size_t(dim * block_rows) + 16), st(size_t(key_block * block_rows) + 16);
  std::vector<float> acc(size_t(block_rows * dim) + 16), row_m(size_t(block_rows) + 16), row_l(size_t(block_rows) + 16);
  using harness::on_line;
  Scratch<float> s{on_line(qt), on_line(st), RowState<float>{on_line(acc), on_line(row_m), on_line(row_l)}};
  auto one_call = [&] {
    for (int64_t i0 = 0; i0 < q_len; i0 += block_rows) {
      const Tile t{0, i0, std::min(block_rows, q_len - i0), 0, kv_len};
      const int64_t bm = std::min(block_rows, (t.rows + ks.lanes - 1) / ks.lanes * ks.lanes);
      ks.attend(a, plan, t, bm, s);
      ks.finalize(s.state, bm, t.rows, dim, out.data() + i0 * dim, dim);
    }
  };
  double pairs = 0;
  for (int64_t i = 0; i < q_len; ++i) pairs += causal ? double(std::min(kv_len, i + 1)) : double(kv_len);
  const double flops = 4.0 * pairs * double(dim);

  one_call();  // warm-up, and the result checked against float64 (every row up to ~2e7 multiply-adds)
  {
    double err = 0;
    for (const int64_t i : harness::sampled_rows(q_len, kv_len * dim)) {
      const int64_t keys = causal ? std::min(kv_len, i + 1) : kv_len;
      const std::vector<double> want =
          harness::reference_row(&q[size_t(i * dim)], k.data(), v.data(), keys, dim, dim, a.scale);
      for (int64_t e = 0; e < dim; ++e)
        err = std::max(err, std::fabs(double(out[size_t(i * dim + e)]) - want[size_t(e)]));
    }
    if (!harness::agrees(err, harness::kMaxError, "|out - float64 reference|")) return 1;
  }
  const double t_first = harness::thread_seconds();
  one_call();
  const double first = std::max(harness::thread_seconds() - t_first, 1e-7);
  const int64_t batch = std::max<int64_t>(1, int64_t(2e-3 / first));  // samples of >= ~2 ms
  // Each sample is a block of calls followed by a short FMA-peak loop; their ratio is taken per
  // sample, so that a slow spell of the host (the peak moved by 30% within seconds on Zen 3) scales
  // both sides of it alike.
  std::vector<double> rates, peaks, ratios;
  const double t_end = harness::thread_seconds() + seconds;
  while (harness::thread_seconds() < t_end || rates.size() < 5) {
    const double t0 = harness::thread_seconds();
    for (int64_t c = 0; c < batch; ++c) one_call();
    const double rate = flops * double(batch) / (harness::thread_seconds() - t0) * 1e-9;
    const double p0 = harness::thread_seconds();
    const double done = PYATTN_ISA_NS::fma_loop(100000);
    const double peak = done / (harness::thread_seconds() - p0) * 1e-9;
    rates.push_back(rate);
    peaks.push_back(peak);
    ratios.push_back(rate / peak);
  }
  using harness::quantile;
  std::printf(
      "%s q %lld kv %lld dim %lld%s: GFLOP/s median %.1f max %.1f | FMA peak median %.1f | %% of peak per sample: "
      "median %.1f p75 %.1f [%zu samples] out[0]=%.6g\n",
      PYATTN_ISA_NAME, (long long)q_len, (long long)kv_len, (long long)dim, causal ? " causal" : "",
      quantile(rates, 0.5), quantile(rates, 1), quantile(peaks, 0.5), 100.0 * quantile(ratios, 0.5),
      100.0 * quantile(ratios, 0.75), rates.size(), double(out[0]));
  return 0;
}
