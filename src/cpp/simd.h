// SPDX-License-Identifier: MIT
// The small SIMD vocabulary the kernels are written against, one flavour per ISA.
//
// kernels.inc is compiled once per ISA (kernels_<isa>.cpp sets PYATTN_ISA_NS and a PYATTN_SIMD_*
// macro, CMake gives the file its -m flags). This header turns that choice into Simd<float> and
// Simd<double>: a register type, its lane count, the register-tile shape of the micro-kernels, and
// the dozen operations they need. Every ISA difference lives here and nowhere else.
//
// Tile shape: the micro-kernels keep `row_vecs` vectors of query rows times `col_tile` keys (or value
// columns) of accumulators in registers; accumulators + row_vecs loads + 1 broadcast must fit the
// register file (32 zmm, 16 ymm) and give at least latency x FMA-ports independent chains (4 cycles
// x 2 ymm pipes = 8 ymm chains on current x86 cores).
//
// exp2: 2^x = 2^n * 2^f with n = round(x), f = x - n in [-1/2, 1/2] (exact, no ln2 splitting needed
// because the kernels work in log2 units), 2^f by a polynomial (float: degree-6 minimax, kExp2Float,
// under 1 ULP; double: degree-13 Taylor in f*ln2, truncation error < 6e-18), and the product with 2^n
// by AVX-512's vscalefps/pd, or on AVX2 by a multiply with 2^n built in the exponent bits (adding
// 1.5*2^23 + 127 rounds x to an integer in the low mantissa bits, already biased, so a left shift by
// the mantissa width is 2^n). Domain: the kernels only call it with x <= 0 (score minus running max)
// or NaN; x < -126 (float) / -1022 (double) return exactly 0 (weights below 2^-126 of
// the row maximum), NaN returns NaN. Those zeros are selected last, from x itself, so the range reduction takes x
// unclamped: for x = -inf or far below the range its n, f and p may be anything (NaN from -inf - -inf) and are
// discarded: no clamp of x, which would cost a vector operation per exp2 on the FMA ports.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(PYATTN_SIMD_AVX512) && defined(PYATTN_EMULATE_AVX512)
#include "simd_emulate_avx512.h"  // test builds only: SIMDe's AVX-512 over AVX2
#elif defined(PYATTN_SIMD_AVX512) || defined(PYATTN_SIMD_AVX2)
#include <immintrin.h>
#endif

namespace pyattn {
namespace PYATTN_ISA_NS {

// Taylor coefficient ln2^k / k!, evaluated at compile time.
constexpr double exp2_coeff(int k) {
  double c = 1.0;
  for (int i = 1; i <= k; ++i) c *= 0.693147180559945309417232121458176568 / i;
  return c;
}

// 2^f on [-1/2, 1/2] for float: the degree-6 minimax polynomial for the relative error (Remez
// exchange in 40-digit arithmetic, coefficients then rounded to float). Its relative error is 1.9e-9,
// and Horner evaluation in float stays under 1 ULP; a Taylor polynomial of the same accuracy takes
// one FMA more.
constexpr float kExp2Float[7] = {1.0f,
                                 0.6931471824645996f,
                                 0.24022646248340607f,
                                 0.05550328642129898f,
                                 0.009618489071726799f,
                                 0.0013399930903688073f,
                                 0.0001534581242594868f};

// Scalar conversions of 16-bit storage formats (tails, the generic path, and the driver).
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // Subnormal half: renormalise.
    exp = 127 - 15 + 1;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    return bits_to_float(sign | (exp << 23) | ((man & 0x3ff) << 13));
  }
  return bits_to_float(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

// float32 to bfloat16 bits as ml_dtypes (Eigen) rounds: the top 16 bits, rounded to nearest even
// (subnormals kept as they are, overflow to inf); a NaN becomes the quiet NaN 0x7fc0 with its sign.
inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t(((x >> 16) & 0x8000u) | 0x7fc0u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// float32 to IEEE binary16 bits, rounded to nearest even as F16C's vcvtps2ph does: values from
// 65520 up become inf; below 2^-14 the result is subnormal (or zero); a NaN stays NaN, quieted, with
// the top bits of its payload.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (ax >= 0x38800000u) {  // a normal half: exponent rebiased (127 -> 15), 23 -> 10 mantissa bits
    const uint32_t r = ax - 0x38000000u;
    return uint16_t(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  const uint32_t e = ax >> 23;         // a subnormal half (or zero): |f| * 2^24 rounded to an integer
  if (e < 102) return uint16_t(sign);  // below 2^-25: rounds to zero
  const uint32_t mant = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;  // 14 .. 24
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return uint16_t(sign | m);
}

// An additive mask value in log2 units (times c = log2 e). A finite value whose product overflows
// (Hugging Face masks use finfo.min) becomes the dtype's lowest/max instead of -inf/+inf, or an
// allowed key would turn into a forbidden one; infinite and NaN values pass through. The vector
// flavours' add_scaled do the same per lane.
template <class T>
inline T mask_to_log2(T value, T c) {
  const T scaled = value * c;
  if (std::isinf(scaled) && std::isfinite(value))
    return value < T(0) ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max();
  return scaled;
}

template <class T>
struct Simd;

#if defined(PYATTN_SIMD_AVX512)

template <>
struct Simd<float> {
  using reg = __m512;
  static constexpr int lanes = 16;
  static constexpr int row_vecs = 4;  // 4x4 zmm accumulators: 16 chains, 8 loads per 16 FMAs
  static constexpr int col_tile = 4;
  // The reduction loops of the two register-tiled products, P.V over the keys (tile_values.inc,
  // value_tile) and the GEMM over k (gemm.inc, gemm_tile), written out 4 steps per trip: the loops'
  // pointer and counter updates are the only scalar work left beside the FMA ports. Each accumulator
  // still sums in order: the same bits.
  static constexpr int reduce_unroll = 4;
  static constexpr int gemm_rows = 6;  // GEMM: 6 rows x 4 zmm = 24 accumulators, 10 loads per 24 FMAs
  static constexpr int gemm_vecs = 4;
  static constexpr int vec_regs = 32;  // architectural vector registers (zmm0-31)
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }  // b when either is NaN (max too)
  static reg abs(reg x) { return _mm512_abs_ps(x); }
  static reg sign_bits(reg x) {  // x's sign bit, the rest 0
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u))));
  }
  static reg xor_sign(reg x, reg sign) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_castps_si512(sign)));
  }
  // c + a*b in the lanes where a != 0 (NaN counts as nonzero), c elsewhere.
  static reg fma_nonzero(reg a, reg b, reg c) {
    return _mm512_mask3_fmadd_ps(a, b, c, _mm512_cmp_ps_mask(a, zero(), _CMP_NEQ_UQ));
  }
  static reg neg_inf_to_zero(reg x) {
    const __mmask16 k = _mm512_cmp_ps_mask(x, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(k, x, zero());
  }
  // Additive masks, one vector of mask values: lanes that allow the key (x != -inf; NaN allows) and
  // lanes that are not exactly 0 (NaN included).
  static uint32_t allowed_lanes(reg x) {
    return _mm512_cmp_ps_mask(x, set1(-std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ);
  }
  static uint32_t nonzero_lanes(reg x) { return _mm512_cmp_ps_mask(x, zero(), _CMP_NEQ_UQ); }
  // Mask words, one 32-bit word per lane (a row's verdicts on 32 keys, bit b = key b): lanes whose
  // word has bit b set keep s, the others become -inf.
  using wreg = __m512i;
  static wreg load_words(const uint32_t* w) { return _mm512_loadu_si512(w); }
  static reg keep_if_bit(wreg w, int b, reg s) {
    return _mm512_mask_mov_ps(set1(-std::numeric_limits<float>::infinity()),
                              _mm512_test_epi32_mask(w, _mm512_set1_epi32(int(1u << b))), s);
  }
  // s + add * c (c = log2 e), where a finite add whose product overflows becomes +-FLT_MAX instead of
  // +-inf (a finfo.min mask must stay finite); infinite and NaN adds pass through.
  static reg add_scaled(reg s, reg m, float c) {
    const reg scaled = mul(m, set1(c));
    const reg clamped = _mm512_min_ps(set1(std::numeric_limits<float>::max()),
                                      _mm512_max_ps(set1(std::numeric_limits<float>::lowest()), scaled));
    const __mmask16 inf = _mm512_cmp_ps_mask(m, set1(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ) |
                          _mm512_cmp_ps_mask(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return add(s, _mm512_mask_blend_ps(inf, clamped, scaled));
  }
  // vrndscaleps gives n = round(x), vscalefps computes p * 2^n in one instruction, and its zero-masking
  // returns 0 for x < -126 (-inf included); NaN stays NaN (max's second operand wins on NaN): fewer
  // instructions than the AVX2 flavour's form (magic-number rounding, 2^n built by a shift and
  // multiplied in), with the same polynomial.
  static reg exp2(reg x) {
    const reg n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = sub(x, n);
    reg p = set1(kExp2Float[6]);
    for (int k = 5; k >= 0; --k) p = fma(p, f, set1(kExp2Float[k]));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, set1(-126.0f), _CMP_NLT_UQ), p, n);
  }
  static float hsum(reg x) { return _mm512_reduce_add_ps(x); }
  static float hmax(reg x) {  // max over lanes (NaN lanes may be dropped: callers check separately)
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));  // AVX-512F only
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(x), hi);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // In-register transpose of a 16 x 16 block: r[i] lane j <-> r[j] lane i (unpack pairs of floats,
  // then of float pairs, then two rounds of 128-bit quarter shuffles).
  static void transpose(reg* r) {
    reg t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 2; ++c) {
        const __m512d a = _mm512_castps_pd(t[4 * i + c]), b = _mm512_castps_pd(t[4 * i + 2 + c]);
        u[4 * i + 2 * c] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * i + 2 * c + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      }
    // u[4g + c], 128-bit quarter L: column 4L + c of rows 4g..4g+3.
    for (int c = 0; c < 4; ++c) {
      const reg alo = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), ahi = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xee);
      const reg blo = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44),
                bhi = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xee);
      r[c] = _mm512_shuffle_f32x4(alo, blo, 0x88);
      r[4 + c] = _mm512_shuffle_f32x4(alo, blo, 0xdd);
      r[8 + c] = _mm512_shuffle_f32x4(ahi, bhi, 0x88);
      r[12 + c] = _mm512_shuffle_f32x4(ahi, bhi, 0xdd);
    }
  }
  // Lane i of the result = hsum(x[i]) for 16 vectors: a transpose folded into the additions (unpack
  // pairs of floats, then of float pairs, then 128-bit quarters twice), 30 shuffles + 15 adds for 16
  // sums instead of 16 separate reductions of 4 dependent steps each.
  // Split in two for callers that form the first level as their vectors come (pair_sum of x[2i] and
  // x[2i+1]) and keep only lanes / 2 vectors: hsum_lanes(x) == hsum_pairs({pair_sum(x[2i], x[2i+1])}).
  static reg pair_sum(reg a, reg b) { return add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
  static reg hsum_lanes(const reg* x) {
    reg h2[8];
    for (int i = 0; i < 8; ++i) h2[i] = pair_sum(x[2 * i], x[2 * i + 1]);
    return hsum_pairs(h2);
  }
  static reg hsum_pairs(const reg* h2) {
    reg h4[4], h8[2];
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(h2[2 * i]), b = _mm512_castps_pd(h2[2 * i + 1]);
      h4[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
      h8[i] = add(_mm512_shuffle_f32x4(h4[2 * i], h4[2 * i + 1], 0x88),
                  _mm512_shuffle_f32x4(h4[2 * i], h4[2 * i + 1], 0xdd));
    return add(_mm512_shuffle_f32x4(h8[0], h8[1], 0x88), _mm512_shuffle_f32x4(h8[0], h8[1], 0xdd));
  }
  // float16 (IEEE binary16) and bfloat16 bit patterns to float32, one vector.
  static reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // lanes int8 values to float32 (exact).
  static reg load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Two vectors' worth of bfloat16 (2 * lanes elements) in one load and two integer operations:
  // `even` gets elements 0, 2, 4, ... (each 32-bit lane's low half shifted up), `odd` 1, 3, 5, ...
  // (the high half kept in place). Half the work of two load_bf16, for callers that can take the
  // elements in that order (the decode kernel, see decode_read.inc).
  static void load_bf16_pair(const uint16_t* p, reg& even, reg& odd) {
    const __m512i w = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u))));
  }
  // float_to_bf16 per lane: bias by 0x7fff plus the kept part's lowest bit (ties to even), keep the
  // top 16 bits (a lane is then at most 0xffff, so vpmovdw's truncation is exact); NaN lanes take
  // the signed quiet NaN instead (their biased sum may have carried out of the lane).
  static void store_bf16(uint16_t* p, reg x) {
    const __m512i b = _mm512_castps_si512(x), top = _mm512_srli_epi32(b, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(top, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
    const __m512i r = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  // Raw bits, the widest load there is (the read-bandwidth ceiling, KernelTable::xor_bytes).
  using breg = __m512i;
  static breg load_bits(const void* p) { return _mm512_loadu_si512(p); }
  static breg xor_bits(breg a, breg b) { return _mm512_xor_si512(a, b); }
};

template <>
struct Simd<double> {
  using reg = __m512d;
  static constexpr int lanes = 8;
  static constexpr int row_vecs = 4;
  static constexpr int col_tile = 4;
  static constexpr int reduce_unroll = 4;  // as float
  static constexpr int gemm_rows = 6;
  static constexpr int gemm_vecs = 4;
  static constexpr int vec_regs = 32;
  static reg zero() { return _mm512_setzero_pd(); }
  static reg set1(double x) { return _mm512_set1_pd(x); }
  static reg load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, reg x) { _mm512_storeu_pd(p, x); }
  static reg add(reg a, reg b) { return _mm512_add_pd(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_pd(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_pd(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_pd(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_pd(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_pd(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_pd(a, b); }
  static reg abs(reg x) { return _mm512_abs_pd(x); }
  static reg sign_bits(reg x) {
    return _mm512_castsi512_pd(
        _mm512_and_si512(_mm512_castpd_si512(x), _mm512_set1_epi64(int64_t(0x8000000000000000ull))));
  }
  static reg xor_sign(reg x, reg sign) {
    return _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(x), _mm512_castpd_si512(sign)));
  }
  static reg fma_nonzero(reg a, reg b, reg c) {
    return _mm512_mask3_fmadd_pd(a, b, c, _mm512_cmp_pd_mask(a, zero(), _CMP_NEQ_UQ));
  }
  static reg neg_inf_to_zero(reg x) {
    const __mmask8 k = _mm512_cmp_pd_mask(x, set1(-std::numeric_limits<double>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_pd(k, x, zero());
  }
  static uint32_t allowed_lanes(reg x) {
    return _mm512_cmp_pd_mask(x, set1(-std::numeric_limits<double>::infinity()), _CMP_NEQ_UQ);
  }
  static uint32_t nonzero_lanes(reg x) { return _mm512_cmp_pd_mask(x, zero(), _CMP_NEQ_UQ); }
  using wreg = __m512i;  // words zero-extended to 64-bit lanes
  static wreg load_words(const uint32_t* w) {
    return _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static reg keep_if_bit(wreg w, int b, reg s) {
    return _mm512_mask_mov_pd(set1(-std::numeric_limits<double>::infinity()),
                              _mm512_test_epi64_mask(w, _mm512_set1_epi64(int64_t(1) << b)), s);
  }
  static reg add_scaled(reg s, reg m, double c) {
    const reg scaled = mul(m, set1(c));
    const reg clamped = _mm512_min_pd(set1(std::numeric_limits<double>::max()),
                                      _mm512_max_pd(set1(std::numeric_limits<double>::lowest()), scaled));
    const __mmask8 inf = _mm512_cmp_pd_mask(m, set1(std::numeric_limits<double>::infinity()), _CMP_EQ_OQ) |
                         _mm512_cmp_pd_mask(m, set1(-std::numeric_limits<double>::infinity()), _CMP_EQ_OQ);
    return add(s, _mm512_mask_blend_pd(inf, clamped, scaled));
  }
  static reg exp2(reg x) {  // as the float flavour
    const reg n = _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = sub(x, n);
    reg p = set1(exp2_coeff(13));
    for (int k = 12; k >= 1; --k) p = fma(p, f, set1(exp2_coeff(k)));
    p = fma(p, f, set1(1.0));
    return _mm512_maskz_scalef_pd(_mm512_cmp_pd_mask(x, set1(-1022.0), _CMP_NLT_UQ), p, n);
  }
  static double hsum(reg x) {
    // By hand: GCC 12's _mm512_reduce_add_pd trips -Wuninitialized inside its own header.
    const __m256d h = _mm256_add_pd(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1));
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static double hmax(reg x) {
    const __m256d h = _mm256_max_pd(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1));
    const __m128d m = _mm_max_pd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1));
    return _mm_cvtsd_f64(_mm_max_sd(m, _mm_unpackhi_pd(m, m)));
  }
  // In-register transpose of an 8 x 8 block (see Simd<float>::transpose).
  static void transpose(reg* r) {
    reg t[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_pd(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_pd(r[2 * i], r[2 * i + 1]);
    }
    // t[2g + c], 128-bit quarter L: column 2L + c of rows 2g, 2g+1.
    for (int c = 0; c < 2; ++c) {
      const reg alo = _mm512_shuffle_f64x2(t[c], t[2 + c], 0x44), ahi = _mm512_shuffle_f64x2(t[c], t[2 + c], 0xee);
      const reg blo = _mm512_shuffle_f64x2(t[4 + c], t[6 + c], 0x44),
                bhi = _mm512_shuffle_f64x2(t[4 + c], t[6 + c], 0xee);
      r[c] = _mm512_shuffle_f64x2(alo, blo, 0x88);
      r[2 + c] = _mm512_shuffle_f64x2(alo, blo, 0xdd);
      r[4 + c] = _mm512_shuffle_f64x2(ahi, bhi, 0x88);
      r[6 + c] = _mm512_shuffle_f64x2(ahi, bhi, 0xdd);
    }
  }
  // Lane i of the result = hsum(x[i]) for 8 vectors (see Simd<float>::hsum_lanes).
  static reg pair_sum(reg a, reg b) { return add(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b)); }
  static reg hsum_lanes(const reg* x) {
    reg h2[4];
    for (int i = 0; i < 4; ++i) h2[i] = pair_sum(x[2 * i], x[2 * i + 1]);
    return hsum_pairs(h2);
  }
  static reg hsum_pairs(const reg* h2) {
    reg h4[2];
    for (int i = 0; i < 2; ++i)
      h4[i] = add(_mm512_shuffle_f64x2(h2[2 * i], h2[2 * i + 1], 0x88),
                  _mm512_shuffle_f64x2(h2[2 * i], h2[2 * i + 1], 0xdd));
    return add(_mm512_shuffle_f64x2(h4[0], h4[1], 0x88), _mm512_shuffle_f64x2(h4[0], h4[1], 0xdd));
  }
};

#elif defined(PYATTN_SIMD_AVX2)

template <>
struct Simd<float> {
  using reg = __m256;
  static constexpr int lanes = 8;
  // 3x4 ymm accumulators + 3 loads + 1 broadcast = all 16 registers (12 chains, 7 loads per 12
  // FMAs; GCC allocates the tiles without a spill). 2x6 loads more per FMA; 4x3 leaves short query
  // blocks with tiles of few, latency-bound chains.
  static constexpr int row_vecs = 3;
  static constexpr int col_tile = 4;
  // Reduction loops kept rolled: with 16 registers, writing them out gains nothing over the
  // out-of-order core's own overlap of the trips.
  static constexpr int reduce_unroll = 1;
  // GEMM: 6 rows x 2 ymm = 12 accumulators + 2 loads + 1 broadcast; each W vector, streamed from L2,
  // serves 6 rows (on CPUs whose best ISA is AVX2, where these kernels run by default, this beats
  // 4 x 3's fewer W loads, most of all for the few rows of a decode step).
  static constexpr int gemm_rows = 6;
  static constexpr int gemm_vecs = 2;
  static constexpr int vec_regs = 16;  // ymm0-15
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }  // b when either is NaN (max too)
  static reg abs(reg x) { return _mm256_andnot_ps(set1(-0.0f), x); }
  static reg sign_bits(reg x) { return _mm256_and_ps(set1(-0.0f), x); }
  static reg xor_sign(reg x, reg sign) { return _mm256_xor_ps(x, sign); }
  static reg fma_nonzero(reg a, reg b, reg c) {
    return _mm256_blendv_ps(c, fma(a, b, c), _mm256_cmp_ps(a, zero(), _CMP_NEQ_UQ));
  }
  static reg neg_inf_to_zero(reg x) {
    const reg is_ninf = _mm256_cmp_ps(x, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_ps(x, zero(), is_ninf);
  }
  static uint32_t allowed_lanes(reg x) {
    return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x, set1(-std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ)));
  }
  static uint32_t nonzero_lanes(reg x) { return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x, zero(), _CMP_NEQ_UQ))); }
  using wreg = __m256i;
  static wreg load_words(const uint32_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  // blendv picks by the sign bit, so bit b is shifted up to it.
  static reg keep_if_bit(wreg w, int b, reg s) {
    return _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), s,
                            _mm256_castsi256_ps(_mm256_sll_epi32(w, _mm_cvtsi32_si128(31 - b))));
  }
  static reg add_scaled(reg s, reg m, float c) {
    const reg scaled = mul(m, set1(c));
    const reg clamped = _mm256_min_ps(set1(std::numeric_limits<float>::max()),
                                      _mm256_max_ps(set1(std::numeric_limits<float>::lowest()), scaled));
    const reg inf = _mm256_or_ps(_mm256_cmp_ps(m, set1(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ),
                                 _mm256_cmp_ps(m, set1(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ));
    return add(s, _mm256_blendv_ps(clamped, scaled, inf));
  }
  static reg exp2(reg x) {
    const reg t = add(x, set1(12582912.0f + 127.0f));
    const reg f = sub(x, sub(t, set1(12582912.0f + 127.0f)));
    reg p = set1(kExp2Float[6]);
    for (int k = 5; k >= 0; --k) p = fma(p, f, set1(kExp2Float[k]));
    const reg pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
    const reg tiny = _mm256_cmp_ps(x, set1(-126.0f), _CMP_LT_OQ);
    return _mm256_blendv_ps(mul(p, pow2n), zero(), tiny);
  }
  static float hsum(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(reg x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // In-register transpose of an 8 x 8 block (unpack pairs of floats, then of float pairs, then swap
  // 128-bit halves).
  static void transpose(reg* r) {
    reg t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < 2; ++c) {
        const __m256d a = _mm256_castps_pd(t[4 * i + c]), b = _mm256_castps_pd(t[4 * i + 2 + c]);
        u[4 * i + 2 * c] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
        u[4 * i + 2 * c + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
      }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }
  // Lane i of the result = hsum(x[i]) for 8 vectors: unpack pairs of floats, then of float pairs,
  // then swap 128-bit halves (a transpose folded into the additions).
  static reg pair_sum(reg a, reg b) { return add(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); }
  static reg hsum_lanes(const reg* x) {
    reg h2[4];
    for (int i = 0; i < 4; ++i) h2[i] = pair_sum(x[2 * i], x[2 * i + 1]);
    return hsum_pairs(h2);
  }
  static reg hsum_pairs(const reg* h2) {
    reg h4[2];
    for (int i = 0; i < 2; ++i) {
      const __m256d a = _mm256_castps_pd(h2[2 * i]), b = _mm256_castps_pd(h2[2 * i + 1]);
      h4[i] = add(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return add(_mm256_permute2f128_ps(h4[0], h4[1], 0x20), _mm256_permute2f128_ps(h4[0], h4[1], 0x31));
  }
  static reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static reg load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void load_bf16_pair(const uint16_t* p, reg& even, reg& odd) {  // as the AVX-512 flavour
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  }
  // float_to_bf16 per lane, as the AVX-512 flavour; the lanes (each at most 0xffff) are packed to
  // 16 bits within each 128-bit half (vpackusdw) and the halves' low quadwords gathered.
  static void store_bf16(uint16_t* p, reg x) {
    const __m256i b = _mm256_castps_si256(x), top = _mm256_srli_epi32(b, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(top, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  using breg = __m256i;
  static breg load_bits(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static breg xor_bits(breg a, breg b) { return _mm256_xor_si256(a, b); }
};

template <>
struct Simd<double> {
  using reg = __m256d;
  static constexpr int lanes = 4;
  // The float tile's shape (see above).
  static constexpr int row_vecs = 3;
  static constexpr int col_tile = 4;
  static constexpr int reduce_unroll = 1;  // as float
  static constexpr int gemm_rows = 6;      // as float
  static constexpr int gemm_vecs = 2;
  static constexpr int vec_regs = 16;
  static reg zero() { return _mm256_setzero_pd(); }
  static reg set1(double x) { return _mm256_set1_pd(x); }
  static reg load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, reg x) { _mm256_storeu_pd(p, x); }
  static reg add(reg a, reg b) { return _mm256_add_pd(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_pd(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_pd(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_pd(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_pd(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_pd(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_pd(a, b); }
  static reg abs(reg x) { return _mm256_andnot_pd(set1(-0.0), x); }
  static reg sign_bits(reg x) { return _mm256_and_pd(set1(-0.0), x); }
  static reg xor_sign(reg x, reg sign) { return _mm256_xor_pd(x, sign); }
  static reg fma_nonzero(reg a, reg b, reg c) {
    return _mm256_blendv_pd(c, fma(a, b, c), _mm256_cmp_pd(a, zero(), _CMP_NEQ_UQ));
  }
  static reg neg_inf_to_zero(reg x) {
    const reg is_ninf = _mm256_cmp_pd(x, set1(-std::numeric_limits<double>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_pd(x, zero(), is_ninf);
  }
  static uint32_t allowed_lanes(reg x) {
    return uint32_t(_mm256_movemask_pd(_mm256_cmp_pd(x, set1(-std::numeric_limits<double>::infinity()), _CMP_NEQ_UQ)));
  }
  static uint32_t nonzero_lanes(reg x) { return uint32_t(_mm256_movemask_pd(_mm256_cmp_pd(x, zero(), _CMP_NEQ_UQ))); }
  using wreg = __m256i;  // words zero-extended to 64-bit lanes
  static wreg load_words(const uint32_t* w) {
    return _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  }
  static reg keep_if_bit(wreg w, int b, reg s) {
    return _mm256_blendv_pd(set1(-std::numeric_limits<double>::infinity()), s,
                            _mm256_castsi256_pd(_mm256_sll_epi64(w, _mm_cvtsi32_si128(63 - b))));
  }
  static reg add_scaled(reg s, reg m, double c) {
    const reg scaled = mul(m, set1(c));
    const reg clamped = _mm256_min_pd(set1(std::numeric_limits<double>::max()),
                                      _mm256_max_pd(set1(std::numeric_limits<double>::lowest()), scaled));
    const reg inf = _mm256_or_pd(_mm256_cmp_pd(m, set1(std::numeric_limits<double>::infinity()), _CMP_EQ_OQ),
                                 _mm256_cmp_pd(m, set1(-std::numeric_limits<double>::infinity()), _CMP_EQ_OQ));
    return add(s, _mm256_blendv_pd(clamped, scaled, inf));
  }
  static reg exp2(reg x) {
    const reg t = add(x, set1(6755399441055744.0 + 1023.0));
    const reg f = sub(x, sub(t, set1(6755399441055744.0 + 1023.0)));
    reg p = set1(exp2_coeff(13));
    for (int k = 12; k >= 1; --k) p = fma(p, f, set1(exp2_coeff(k)));
    p = fma(p, f, set1(1.0));
    const reg pow2n = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(t), 52));
    const reg tiny = _mm256_cmp_pd(x, set1(-1022.0), _CMP_LT_OQ);
    return _mm256_blendv_pd(mul(p, pow2n), zero(), tiny);
  }
  static double hsum(reg x) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
  static double hmax(reg x) {
    const __m128d m = _mm_max_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_max_sd(m, _mm_unpackhi_pd(m, m)));
  }
  // In-register transpose of a 4 x 4 block.
  static void transpose(reg* r) {
    const reg t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const reg t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
  }
  // Lane i of the result = hsum(x[i]) for 4 vectors (see Simd<float>::hsum_lanes).
  static reg pair_sum(reg a, reg b) { return add(_mm256_unpacklo_pd(a, b), _mm256_unpackhi_pd(a, b)); }
  static reg hsum_lanes(const reg* x) {
    const reg h2[2] = {pair_sum(x[0], x[1]), pair_sum(x[2], x[3])};
    return hsum_pairs(h2);
  }
  static reg hsum_pairs(const reg* h2) {
    return add(_mm256_permute2f128_pd(h2[0], h2[1], 0x20), _mm256_permute2f128_pd(h2[0], h2[1], 0x31));
  }
};

#else  // generic: one lane, plain C++ (any architecture); libm's exp2 is exact to < 1 ULP

template <class T>
struct Simd {
  using reg = T;
  static constexpr int lanes = 1;
  static constexpr int row_vecs = 4;  // 4 rows x 4 keys of scalar accumulators
  static constexpr int col_tile = 4;
  static constexpr int reduce_unroll = 1;  // the compiler's choice
  static constexpr int gemm_rows = 4;
  static constexpr int gemm_vecs = 4;
  static constexpr int vec_regs = 0;  // plain scalars: no vector register tiles
  static reg zero() { return T(0); }
  static reg set1(T x) { return x; }
  static reg load(const T* p) { return *p; }
  static void store(T* p, reg x) { *p = x; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }  // not contracted: -ffp-contract=off
  static reg max(reg a, reg b) { return a > b ? a : b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg min(reg a, reg b) { return a < b ? a : b; }  // b when either is NaN, as x86's (max too)
  static reg abs(reg x) { return std::fabs(x); }
  static reg sign_bits(reg x) { return std::signbit(x) ? T(-0.0) : T(0); }
  static reg xor_sign(reg x, reg sign) { return std::signbit(sign) ? -x : x; }
  static reg fma_nonzero(reg a, reg b, reg c) { return a != T(0) ? a * b + c : c; }
  static reg neg_inf_to_zero(reg x) { return x == -std::numeric_limits<T>::infinity() ? T(0) : x; }
  static uint32_t allowed_lanes(reg x) { return x != -std::numeric_limits<T>::infinity(); }
  static uint32_t nonzero_lanes(reg x) { return x != T(0) || std::isnan(x); }
  using wreg = uint32_t;
  static wreg load_words(const uint32_t* w) { return *w; }
  static reg keep_if_bit(wreg w, int b, reg s) { return ((w >> b) & 1u) ? s : -std::numeric_limits<T>::infinity(); }
  static reg add_scaled(reg s, reg m, T c) { return s + mask_to_log2(m, c); }
  static reg exp2(reg x) { return std::exp2(x); }
  static T hsum(reg x) { return x; }
  static reg hsum_lanes(const reg* x) { return x[0]; }
  static T hmax(reg x) { return x; }
  static void transpose(reg*) {}
  static reg load_f16(const uint16_t* p) { return T(half_to_float(*p)); }
  static void store_f16(uint16_t* p, reg x) { *p = float_to_half(float(x)); }
  static reg load_bf16(const uint16_t* p) { return T(bf16_to_float(*p)); }
  static reg load_i8(const int8_t* p) { return T(*p); }
  static void load_bf16_pair(const uint16_t* p, reg& even, reg& odd) {  // one lane: the natural order
    even = load_bf16(p);
    odd = load_bf16(p + 1);
  }
  static void store_bf16(uint16_t* p, reg x) { *p = float_to_bf16(float(x)); }
  using breg = uint64_t;
  static breg load_bits(const void* p) {
    uint64_t x;
    std::memcpy(&x, p, sizeof x);
    return x;
  }
  static breg xor_bits(breg a, breg b) { return a ^ b; }
};

#endif

}  // namespace PYATTN_ISA_NS
}  // namespace pyattn

#if defined(PYATTN_SIMD_BF16)
#include "simd_bf16.h"
#endif

namespace pyattn {
namespace PYATTN_ISA_NS {

// Bit x of the result is set when p[x * stride] != 0, for x < n <= 64 (mask bytes to bits; AVX2
// compares 32 bytes at a time when they are contiguous, which the AVX-512 flavour also has).
inline uint64_t nonzero_bits(const uint8_t* p, int64_t stride, int64_t n) {
  if (stride == 0) return p[0] ? (n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1) : 0;
  uint64_t bits = 0;
  int64_t x = 0;
#if defined(PYATTN_SIMD_AVX2) || defined(PYATTN_SIMD_AVX512)
  if (stride == 1)
    for (; x + 32 <= n; x += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + x));
      const uint32_t zero = uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, _mm256_setzero_si256())));
      bits |= uint64_t(~zero) << x;
    }
#endif
  for (; x < n; ++x) bits |= uint64_t(p[x * stride] != 0) << x;
  return bits;
}

}  // namespace PYATTN_ISA_NS
}  // namespace pyattn
