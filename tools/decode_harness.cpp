// SPDX-License-Identifier: MIT
// A developer's harness for the decode kernel (src/cpp/decode_*.inc): one thread calls the kernel of
// one ISA directly, without the driver, the binding or Python, over one key/value head, and prints
// the CPU time per key row (K + V row) as min / 25th percentile / median over samples of ~100 us
// of consecutive calls (CALLS calls in all).
//
// Why it exists: the 2-vCPU VMs this project is measured on drift by 10-40% within seconds, so
// bench/bench_decode.py (wall clock, two threads, Python in the loop) cannot resolve a kernel change
// of a few per cent. With the K/V rows in L1/L2 (a few hundred keys) the minimum CPU time of a call
// repeats to ~1% between runs a minute apart, though the whole machine still drifts over longer
// spells (the same binary's minimum moved by 25% within an hour on Zen 4): build this file once
// against each tree of the decode kernel and alternate the two binaries, several rounds.
// pip does not build it; it includes kernels.inc like kernels_<isa>.cpp does. It checks the kernel's
// result against float64 before timing (exit 1 if wrong), and CI builds and runs it briefly
// (tools/check_harnesses.sh).
//
// Build and run (from the repository root; AVX2: -DHARNESS_AVX2 and drop -mavx512f):
//   g++ -O3 -std=c++17 -mavx512f -mavx2 -mfma -mf16c -Isrc/cpp tools/decode_harness.cpp -o /tmp/dh
//   /tmp/dh STORAGE ROWS KV_LEN CALLS [PREFETCH [STREAMS [FUSE]]]   e.g.  /tmp/dh f16 4 512 20000
// Two cores streaming from memory (K/V of 100+ MiB each), timed together:
//   t=$(($(date +%s) + 3)); for i in 1 2; do HARNESS_START=$t /tmp/dh f16 4 262144 200 & done; wait
// STORAGE: f32, f16, bf16 or i8 (K/V storage, i8 with a float32 scale per row as KVCache's int8
// storage; compute is float32); ROWS: query rows per key/value
// head (the GQA group times the new tokens); PREFETCH 1: the kernel's software prefetch on, into L2
// (DecodePlan::prefetch_kv, which the planner sets when K/V come from memory), 2: on, into L1
// (DecodePlan::prefetch_to_l1, the planner's choice on Zen 5); STREAMS 1, 2 or 4: parts
// of the key range read side by side (DecodePlan::streams, default 1; the rule in tuning.cpp,
// plan_decode); FUSE 1: a block's K rows read with the previous block's V rows where the kernel
// can (DecodePlan::fuse: one float32 row; AVX-512 only at this head_dim); head_dim = value_dim
// = 128, q_len 1, no mask.
//
// Zen 4 (2026-12-01, a fast spell, AVX-512, one thread, 512 keys), ns per key row, min of 20000
// calls: 4 rows float32 24.6-25.1, float16 25.3, bfloat16 25.3-28.2; 1 row float32 11.2, 8 rows
// 48.7 (two groups of 4). With P.V removed from the kernel (an experiment, not in the tree), 4
// float16 rows take 15.7 (so P.V ~9.7; its 32 FMAs per key row take ~8.6 at one 512-bit FMA per
// cycle), with the softmax removed too 13.4 (the scores: their 32 FMAs, ~8.6, plus the lanes x
// lanes reductions and the score stores).

#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

uint16_t bf16_bits(float x) {  // truncation is fine here: the values only need to be finite
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return uint16_t(bits >> 16);
}

// n elements of E placed as pyattn.KVCache places its storage (_START in src/pyattn/_cache.py):
// `start` bytes past a 64-byte boundary. std::vector's large blocks begin 16 bytes past a page, where
// every other 32-byte load of a float32 row straddles two cache lines: on Zen 3 that made the 4-row
// float32 step ~1.2x slower than the same step on KVCache's aligned storage.
template <class E>
struct Placed {
  std::vector<unsigned char> raw;
  E* data;
  Placed(size_t n, size_t start) : raw(n * sizeof(E) + 128) {
    const size_t to_line = (64 - reinterpret_cast<uintptr_t>(raw.data()) % 64) % 64;
    data = reinterpret_cast<E*>(raw.data() + to_line + start);
  }
};

}  // namespace

int main(int argc, char** argv) {
  using namespace pyattn;
  if (argc < 5 || argc > 8) {
    std::fprintf(stderr, "usage: %s f32|f16|bf16|i8 ROWS KV_LEN CALLS [PREFETCH [STREAMS [FUSE]]]\n", argv[0]);
    return 2;
  }
  const std::string storage_name = argv[1];
  const int64_t rows = std::atoll(argv[2]), kv_len = std::atoll(argv[3]), calls = std::atoll(argv[4]);
  const Storage storage = storage_name == "f16"    ? Storage::f16
                          : storage_name == "bf16" ? Storage::bf16
                          : storage_name == "i8"   ? Storage::i8
                                                   : Storage::same;
  if ((storage == Storage::same && storage_name != "f32") || rows < 1 || rows > 16 || kv_len < 1 || calls < 1) {
    std::fprintf(stderr, "bad arguments (ROWS 1..16, KV_LEN >= 1, CALLS >= 1)\n");
    return 2;
  }
  constexpr int64_t head_dim = 128, value_dim = 128;
  const KernelTable& table = PYATTN_ISA_NS::kernel_table();
  const KernelSet<float>& kernels = table.f32;

  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<size_t>(rows * head_dim)), k(static_cast<size_t>(kv_len * head_dim)),
      v(static_cast<size_t>(kv_len * value_dim));
  for (float& x : q) x = normal(gen);
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);
  // K and V as the kernel reads them: float32, or 16-bit patterns (uint16 storage, as in KVCache).
  Placed<float> k32(k.size(), 0), v32(v.size(), 0);
  Placed<uint16_t> k16(k.size(), 16), v16(v.size(), 16);
  std::copy(k.begin(), k.end(), k32.data);
  std::copy(v.begin(), v.end(), v32.data);
  if (storage == Storage::f16) {
    table.float_to_half(k.data(), k16.data, int64_t(k.size()));
    table.float_to_half(v.data(), v16.data, int64_t(v.size()));
  } else if (storage == Storage::bf16) {
    for (size_t i = 0; i < k.size(); ++i) k16.data[i] = bf16_bits(k[i]);
    for (size_t i = 0; i < v.size(); ++i) v16.data[i] = bf16_bits(v[i]);
  }
  // int8: each row max|x| / 127 and round to nearest (the values need only be those the kernel sees).
  Placed<int8_t> k8(k.size(), 0), v8(v.size(), 0);
  std::vector<float> k_scales(static_cast<size_t>(kv_len)), v_scales(static_cast<size_t>(kv_len));
  auto quantize = [&](const std::vector<float>& x, int8_t* dst, std::vector<float>& scales, int64_t dim) {
    for (int64_t j = 0; j < kv_len; ++j) {
      float amax = 0;
      for (int64_t e = 0; e < dim; ++e) amax = std::max(amax, std::fabs(x[size_t(j * dim + e)]));
      const float scale = amax / 127.0f;
      scales[size_t(j)] = scale;
      for (int64_t e = 0; e < dim; ++e)
        dst[j * dim + e] = int8_t(scale > 0 ? std::nearbyint(x[size_t(j * dim + e)] / scale) : 0);
    }
  };
  if (storage == Storage::i8) {
    quantize(k, k8.data, k_scales, head_dim);
    quantize(v, v8.data, v_scales, value_dim);
  }
  const bool half = storage == Storage::f16 || storage == Storage::bf16, int8 = storage == Storage::i8;

  // One batch entry with `rows` query heads sharing key/value head 0 (a GQA group of `rows`).
  std::vector<int64_t> q_offset(static_cast<size_t>(rows)), kv_offset(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows; ++r) q_offset[size_t(r)] = r * head_dim;
  AttnArgs<float> a;
  a.q = q.data();
  a.k = half ? reinterpret_cast<const float*>(k16.data) : int8 ? reinterpret_cast<const float*>(k8.data) : k32.data;
  a.v = half ? reinterpret_cast<const float*>(v16.data) : int8 ? reinterpret_cast<const float*>(v8.data) : v32.data;
  a.k_scales = int8 ? k_scales.data() : nullptr;
  a.v_scales = int8 ? v_scales.data() : nullptr;
  a.q_offset = q_offset.data();
  a.k_offset = kv_offset.data();
  a.v_offset = kv_offset.data();
  a.q_stride_l = head_dim;
  a.k_stride_s = head_dim;
  a.v_stride_s = value_dim;
  a.batch_heads = rows;
  a.num_heads = rows;
  a.group = rows;
  a.q_len = 1;
  a.kv_len = kv_len;
  a.head_dim = head_dim;
  a.value_dim = value_dim;
  a.scale = 1.0 / std::sqrt(double(head_dim));
  a.kv_storage = storage;
  DecodePlan plan;
  plan.prefetch_kv = argc >= 6 && std::atoi(argv[5]) != 0;  // what the planner sets for K/V from memory
  plan.prefetch_to_l1 = argc >= 6 && std::atoi(argv[5]) == 2;
  plan.streams = argc >= 7 ? std::atoi(argv[6]) : 1;
  plan.fuse = argc >= 8 && std::atoi(argv[7]) != 0;

  const DecodeTile tile{0, 0, 0, rows, 0, kv_len};
  const int64_t value_padded = kernels.decode_padded(value_dim);
  // Scratch and state on cache lines, as the driver's (parallel.h, grow_only_scratch).
  Placed<float> scratch(size_t(kernels.decode_scratch(rows, head_dim, value_dim)), 0);
  Placed<float> acc(size_t(rows * value_padded), 0), m(size_t(rows), 0), l(size_t(rows), 0);
  const RowState<float> state{acc.data, m.data, l.data};

  // HARNESS_START=<unix time, seconds>: wait until then before timing, so that two harness
  // processes started side by side (one per core: the memory contention of a two-thread decode) time
  // their calls together rather than while the other one is still filling its buffers.
  if (const char* start = std::getenv("HARNESS_START")) {
    const double at = std::atof(start);
    timespec ts;
    while (clock_gettime(CLOCK_REALTIME, &ts) == 0 && double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9 < at) {
      const timespec nap{0, 1000000};
      nanosleep(&nap, nullptr);
    }
  }
  // The result checked against float64 on the K/V values as stored (16-bit ones widened back).
  kernels.decode(a, plan, tile, rows, scratch.data, state);
  {
    // 16-bit values widened back, int8 ones times their row's scale.
    auto as_stored = [&](const std::vector<float>& x, const uint16_t* bits, const int8_t* i8,
                         const std::vector<float>& scales, int64_t dim) {
      std::vector<float> seen(x);
      for (size_t i = 0; half && i < x.size(); ++i)
        seen[i] =
            storage == Storage::f16 ? PYATTN_ISA_NS::half_to_float(bits[i]) : PYATTN_ISA_NS::bf16_to_float(bits[i]);
      for (size_t i = 0; int8 && i < x.size(); ++i) seen[i] = float(i8[i]) * scales[i / size_t(dim)];
      return seen;
    };
    const std::vector<float> k_seen = as_stored(k, k16.data, k8.data, k_scales, head_dim),
                             v_seen = as_stored(v, v16.data, v8.data, v_scales, value_dim);
    double err = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<double> want = harness::reference_row(&q[size_t(r * head_dim)], k_seen.data(), v_seen.data(),
                                                              kv_len, head_dim, value_dim, a.scale);
      for (int64_t e = 0; e < value_dim; ++e)
        err = std::max(err, std::fabs(double(acc.data[r * value_padded + e] / l.data[r]) - want[size_t(e)]));
    }
    if (!harness::agrees(err, harness::kMaxError, "|out - float64 reference|")) return 1;
  }
  // Samples of several consecutive calls, at least ~100 us each: a single short call can read as 0
  // from the thread CPU clock on some VMs.
  const double first = [&] {
    const double t0 = harness::thread_seconds();
    kernels.decode(a, plan, tile, rows, scratch.data, state);
    return harness::thread_seconds() - t0;
  }();
  const int64_t batch = first > 0 ? std::max<int64_t>(1, int64_t(100e-6 / first)) : 16;
  const int64_t samples = std::max<int64_t>(1, calls / batch);
  std::vector<double> seconds(static_cast<size_t>(samples));
  for (int64_t n = 0; n < samples; ++n) {
    const double t0 = harness::thread_seconds();
    for (int64_t c = 0; c < batch; ++c) kernels.decode(a, plan, tile, rows, scratch.data, state);
    seconds[static_cast<size_t>(n)] = (harness::thread_seconds() - t0) / double(batch);
  }
  auto per_row = [&](double q) { return harness::quantile(seconds, q) / double(kv_len) * 1e9; };
  std::printf(
      "%s %s rows %lld kv_len %lld prefetch %d streams %d fuse %d: ns per key row min %.2f p25 %.2f median %.2f "
      "(out[0][0] = %.6g)\n",
      PYATTN_ISA_NAME, storage_name.c_str(), static_cast<long long>(rows), static_cast<long long>(kv_len),
      int(plan.prefetch_kv) + int(plan.prefetch_kv && plan.prefetch_to_l1), plan.streams, int(plan.fuse), per_row(0),
      per_row(0.25), per_row(0.5), double(acc.data[0] / l.data[0]));
  return 0;
}
