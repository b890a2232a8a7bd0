// SPDX-License-Identifier: MIT
// The bfloat16 pair vocabulary of the avx512bf16 kernels (tile_pairs.inc, the ceilings' dot loop):
// included by simd.h when kernels_avx512bf16.cpp sets PYATTN_SIMD_BF16.
//
// AVX512-BF16's vdpbf16ps multiplies bfloat16 *pairs*: each 32-bit lane of its two sources holds two
// bfloat16 values (element 2i in the low half, 2i + 1 in the high half), and the lane's float32
// accumulator gets both products added: twice the multiply-adds of a float32 FMA per instruction.
// So the reduction axis of a product goes in pairs: head_dim for the scores (a query row's pair of
// dimensions against a key row's), the keys for P.V (a query row's pair of probabilities against a
// value column's pair of keys). The products of two bfloat16 values are exact in float32; each of
// the two additions rounds to nearest even; the instruction treats subnormal inputs and results as
// zero (values below 2^-126 in magnitude, far below anything a softmax weight or score keeps).
// Rounding to bfloat16 (round_pairs) is done in integer arithmetic, nearest even, the way ml_dtypes
// rounds finite values and infinities; it is only given quiet NaNs (from arithmetic), which stay NaN.
#pragma once

namespace pyattn {
namespace PYATTN_ISA_NS {

struct Bf16Pairs {
  using reg = __m512;     // 16 float32 accumulators
  using pairs = __m512i;  // 16 pairs of bfloat16
  static constexpr int lanes = 16;
  static pairs load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint32_t* p, pairs x) { _mm512_storeu_si512(p, x); }
  static pairs broadcast(uint32_t pair) { return _mm512_set1_epi32(int(pair)); }
  // The pair at p (two bfloat16 values, p may be 2-byte aligned only), in every lane.
  static pairs broadcast_at(const uint16_t* p) {
    uint32_t x;
    std::memcpy(&x, p, sizeof x);
    return broadcast(x);
  }
  // acc + a.low * b.low + a.high * b.high in each lane.
  static reg dot(reg acc, pairs a, pairs b) {
    __m512bh x, y;
    std::memcpy(&x, &a, sizeof x);
    std::memcpy(&y, &b, sizeof y);
    return _mm512_dpbf16_ps(acc, x, y);
  }
  // x + 0x7fff + (bit 16 of x) in each lane: its upper half is x rounded to bfloat16.
  static __m512i rounded(reg x) {
    const __m512i u = _mm512_castps_si512(x);
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  }
  // Lane i: bfloat16(lo[i]) | bfloat16(hi[i]) << 16.
  static pairs round_pairs(reg lo, reg hi) {
    return _mm512_or_si512(_mm512_srli_epi32(rounded(lo), 16),
                           _mm512_and_si512(rounded(hi), _mm512_set1_epi32(int(0xffff0000u))));
  }
  // Lane i: lo[i] | hi[i] << 16 from 16 bfloat16 values in lo and 16 in hi (a pair of rows).
  static pairs interleave(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  }
  static __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
};

}  // namespace PYATTN_ISA_NS
}  // namespace pyattn
