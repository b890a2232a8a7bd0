// SPDX-License-Identifier: MIT
// Test builds only (CMake option PYATTN_EMULATE_AVX512, tools/emulate_avx512.sh): the AVX-512 kernel
// body compiled for AVX2 against SIMDe's portable AVX-512 intrinsics, so the AVX-512 path can be
// tested on a host without AVX-512. Never in a wheel: it is slow, and the point is only that the
// same source runs and gives the answers the native build gives.
//
// SIMDe 0.7.4 (Debian 12's libsimde-dev) lacks native aliases for a few of the intrinsics simd.h
// uses; they are spelled out here lane by lane, with the semantics Intel's guide gives. The
// reductions add in the order GCC's avx512fintrin.h does (upper half + lower half, down to one lane).
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>

namespace pyattn_emulate {

// Lanes of k get a * b + c, the others keep c.
inline simde__m512 mask3_fmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c, simde__mmask16 k) {
  return simde_mm512_mask_mov_ps(c, k, simde_mm512_fmadd_ps(a, b, c));
}
inline simde__m512d mask3_fmadd_pd(simde__m512d a, simde__m512d b, simde__m512d c, simde__mmask8 k) {
  return simde_mm512_mask_mov_pd(c, k, simde_mm512_fmadd_pd(a, b, c));
}

inline float reduce_add_ps(simde__m512 x) {
  float v[16];
  simde_mm512_storeu_ps(v, x);
  float t[8], u[4];
  for (int i = 0; i < 8; ++i) t[i] = v[i + 8] + v[i];
  for (int i = 0; i < 4; ++i) u[i] = t[i + 4] + t[i];
  return (u[0] + u[2]) + (u[1] + u[3]);
}
inline double reduce_add_pd(simde__m512d x) {
  double v[8];
  simde_mm512_storeu_pd(v, x);
  double t[4];
  for (int i = 0; i < 4; ++i) t[i] = v[i + 4] + v[i];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Sixteen float16 (IEEE half) to float32, exact: through F16C, eight at a time.
inline simde__m512 cvtph_ps(simde__m256i h) {
  uint16_t in[16];
  float out[16];
  std::memcpy(in, &h, sizeof(in));
  for (int half = 0; half < 2; ++half) {
    __m128i x;
    std::memcpy(&x, in + 8 * half, sizeof(x));
    _mm256_storeu_ps(out + 8 * half, _mm256_cvtph_ps(x));
  }
  return simde_mm512_loadu_ps(out);
}

// Float32 to float16, rounded to nearest even (the only mode simd.h asks for).
inline simde__m256i cvtps_ph_nearest(simde__m512 x) {
  float in[16];
  uint16_t out[16];
  simde_mm512_storeu_ps(in, x);
  for (int half = 0; half < 2; ++half) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + 8 * half), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(out + 8 * half, &h, sizeof(h));
  }
  simde__m256i r;
  std::memcpy(&r, out, sizeof(r));
  return r;
}

// Lane by lane: N lanes of In in x, each converted by f to Out, packed into a vector R.
template <class R, class Out, class In, int N, class X, class F>
R lanewise(X x, F f) {
  static_assert(sizeof(X) == N * sizeof(In) && sizeof(R) == N * sizeof(Out), "lane counts");
  In in[N];
  Out out[N];
  std::memcpy(in, &x, sizeof(in));
  for (int i = 0; i < N; ++i) out[i] = f(in[i]);
  R r;
  std::memcpy(&r, out, sizeof(r));
  return r;
}

// Sixteen 32-bit lanes truncated to their low 16 bits; zero extensions of sixteen uint16 to uint32
// and of eight uint32 to uint64.
inline simde__m256i cvtepi32_epi16(simde__m512i x) {
  return lanewise<simde__m256i, uint16_t, uint32_t, 16>(x, [](uint32_t v) { return uint16_t(v & 0xFFFFu); });
}
inline simde__m512i cvtepu16_epi32(simde__m256i x) {
  return lanewise<simde__m512i, uint32_t, uint16_t, 16>(x, [](uint16_t v) { return uint32_t(v); });
}
inline simde__m512i cvtepu32_epi64(simde__m256i x) {
  return lanewise<simde__m512i, uint64_t, uint32_t, 8>(x, [](uint32_t v) { return uint64_t(v); });
}
// Sign extension of sixteen int8 to int32, and sixteen int32 to float32 (exact for int8 values).
inline simde__m512i cvtepi8_epi32(simde__m128i x) {
  return lanewise<simde__m512i, int32_t, int8_t, 16>(x, [](int8_t v) { return int32_t(v); });
}
inline simde__m512 cvtepi32_ps(simde__m512i x) {
  return lanewise<simde__m512, float, int32_t, 16>(x, [](int32_t v) { return float(v); });
}

}  // namespace pyattn_emulate

#define _mm512_mask3_fmadd_ps(a, b, c, k) pyattn_emulate::mask3_fmadd_ps((a), (b), (c), (k))
#define _mm512_mask3_fmadd_pd(a, b, c, k) pyattn_emulate::mask3_fmadd_pd((a), (b), (c), (k))
#define _mm512_reduce_add_ps(x) pyattn_emulate::reduce_add_ps(x)
#define _mm512_reduce_add_pd(x) pyattn_emulate::reduce_add_pd(x)
#define _mm512_cvtph_ps(h) pyattn_emulate::cvtph_ps(h)
#define _mm512_cvtps_ph(x, rounding) pyattn_emulate::cvtps_ph_nearest(x)
#define _mm512_cvtepi32_epi16(x) pyattn_emulate::cvtepi32_epi16(x)
#define _mm512_cvtepu16_epi32(x) pyattn_emulate::cvtepu16_epi32(x)
#define _mm512_cvtepu32_epi64(x) pyattn_emulate::cvtepu32_epi64(x)
#define _mm512_cvtepi8_epi32(x) pyattn_emulate::cvtepi8_epi32(x)
#define _mm512_cvtepi32_ps(x) pyattn_emulate::cvtepi32_ps(x)
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4((a), (b), (imm))
#define _mm512_shuffle_f64x2(a, b, imm) simde_mm512_shuffle_f64x2((a), (b), (imm))
