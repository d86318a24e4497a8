// SiLU(g) * u (Elfwing et al., 2017), the MLP's activation in the fused decode step
// (fused_decode.cpp), 8 lanes at a time: g / (1 + exp(-g)) * u with exp as exp_poly (exp_poly.h).
//
// The loop `g / (1 + exp_poly(-g)) * u` it replaces stayed scalar: GCC does not vectorize
// std::floor, nor std::min / std::max of a temporary, under its default -ftrapping-math, and it
// took ~10 % of a 2,048-token prefill on the AMX Xeon (perf, 2026-12-06). Here every rounding is
// written out as that scalar build made it: FMA for x log2e + 1/2 and x log2e - n, for the
// polynomial's steps and for 1 + p 2^n; floor as vroundps. So each lane gives the scalar loop's
// bits, checked for all 2^32 float32 values of g by kernels/cpu/experiments/silu_bits.cpp (the
// product by u is one rounding in both). g > 87 gives g * u (1 + exp(-g) rounds to 1); for
// g < -88 the scalar build divided by a constant the compiler had folded, silu_den_88().
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "exp_poly.h"

// 1 + exp_poly(88) as GCC folded it into the scalar loop's g < -88 branch: each step rounded on
// its own (a constant expression is evaluated without contraction).
constexpr float silu_den_88() {
  const float t = 88.0f * kLog2e;
  const float n = static_cast<float>(static_cast<int32_t>(t + 0.5f));  // floor: t + 1/2 > 0
  const float p = exp2_poly(t - n);
  float scale = 1.0f;
  for (int i = 0; i < static_cast<int>(n); ++i) scale *= 2.0f;
  return 1.0f + p * scale;
}

// SiLU(g) * u on 8 lanes (AVX2 + FMA).
inline __m256 silu_mul8(__m256 g, __m256 u) {
  constexpr float kDen88 = silu_den_88();
  const __m256 log2e = _mm256_set1_ps(kLog2e);
  __m256 x = _mm256_sub_ps(_mm256_setzero_ps(), g);
  x = _mm256_blendv_ps(x, _mm256_set1_ps(88.0f), _mm256_cmp_ps(_mm256_set1_ps(88.0f), x, _CMP_LT_OQ));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_fmsub_ps(x, log2e, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 den = _mm256_fmadd_ps(p, _mm256_castsi256_ps(bits), _mm256_set1_ps(1.0f));
  den = _mm256_blendv_ps(den, _mm256_set1_ps(kDen88), _mm256_cmp_ps(g, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  den = _mm256_blendv_ps(den, _mm256_set1_ps(1.0f), _mm256_cmp_ps(g, _mm256_set1_ps(87.0f), _CMP_GT_OQ));
  return _mm256_mul_ps(_mm256_div_ps(g, den), u);
}
