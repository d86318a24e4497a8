// GGUF 32-element blocks multiplied as stored: the inner loops shared by quant_linear.cpp
// (one layer per call) and fused_decode.cpp (a whole decoder layer per call).
//
//   4-bit (Q4_0 / Q4_1): per 32 inputs, 16 bytes of codes (byte j: element j in the low
//   nibble, element j + 16 in the high one, as ggml's dequantize_row_q4_1), w = q * d + m
//   (Q4_0: m = -8 d, exact in float32);  8-bit (Q8_0): 32 int8 codes, w = q * d.
//   d and m are float32 [N, K / 32] (the file's fp16, widened exactly).
//
// ISA: chosen at build time from the compiler's target flags (the extensions are built with
// -march=native on the machine that runs them, keyed on its CPU flags): AVX-512 (F + BW) when
// defined, else AVX2 + FMA. Both widen a group's codes to float32 in registers once and
// multiply it with up to four rows of x, streaming each weight byte once per call.
//
// Row independence: every row of x is reduced by the same instruction sequence whatever the
// number of rows in the call (rows are handled in fours with separate accumulators, and the
// reduction never splits K by the row count), so a row's result is bit-identical alone or
// inside a batch. The batch-invariance work (issue 13) relies on this.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pdq {

constexpr int64_t G = 32;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PDQ_AVX512 1
inline constexpr const char* kIsa = "avx512";
#else
inline constexpr const char* kIsa = "avx2";
#endif

// The 32 weights of one group as four vectors of 8 floats (AVX2; also used to de-quantize).
template <bool Q4>
inline void load_group(const uint8_t* codes, float d, float m, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d);
  if constexpr (Q4) {
    const __m256 vm = _mm256_set1_ps(m);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * c));
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), vd);
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x (row stride K) against one weight row: out[r * ldo] for r < R.
template <bool Q4, int R>
inline void dot_rows(const float* x, const uint8_t* codes, const float* d, const float* m, int64_t K,
                     int64_t ldo, float* out) {
  constexpr int64_t bytes = Q4 ? G / 2 : G;
#ifdef PDQ_AVX512
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 vd = _mm512_set1_ps(d[g]);
    __m512 w0, w1;
    if constexpr (Q4) {
      const __m512 vm = _mm512_set1_ps(m[g]);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * bytes));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(raw, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm);
    } else {
      const uint8_t* c = codes + g * bytes;
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))), vd);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)))), vd);
    }
    const float* xg = x + g * G;
    for (int r = 0; r < R; ++r) {
      const float* xr = xg + r * K;
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#else
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < K / G; ++g) {
    load_group<Q4>(codes + g * bytes, d[g], Q4 ? m[g] : 0.f, w);
    const float* xg = x + g * G;
    for (int r = 0; r < R; ++r) {
      const float* xr = xg + r * K;
      acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
}

// Weight rows [n0, n1) against all M rows of x [M, K]: y[r * ldy + n]. Rows of x go in fours
// (each weight row is read once per four rows of x, from cache after the first).
template <bool Q4>
inline void block_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* d,
                       const float* m, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const float* dn = d + n * ng;
    const float* mn = Q4 ? m + n * ng : d;
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) dot_rows<Q4, 4>(x + r * K, c, dn, mn, K, ldy, y + r * ldy + n);
    switch (M - r) {
      case 3: dot_rows<Q4, 3>(x + r * K, c, dn, mn, K, ldy, y + r * ldy + n); break;
      case 2: dot_rows<Q4, 2>(x + r * K, c, dn, mn, K, ldy, y + r * ldy + n); break;
      case 1: dot_rows<Q4, 1>(x + r * K, c, dn, mn, K, ldy, y + r * ldy + n); break;
      default: break;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PDQ_VNNI 1
// 4-bit blocks against int8 activations, llama.cpp's q4_1 x q8_1 scheme (ggml-cpu's
// ggml_vec_dot_q4_1_q8_1): each row of x is quantized per 32 inputs to int8 (dx = max|x| / 127,
// round to nearest), so a group's dot product is one VNNI instruction on the unsigned codes:
//   sum_j (q_j d + m) x_j  ~  d dx sum_j q_j xq_j  +  m (dx sum_j xq_j).
// Not exact: the activation rounding changes results (the quality gate measures it).
// xq [M, K] int8, xs [M, K/32] = dx, xsum [M, K/32] = dx * sum xq; out[r * ldo].
// sum_g m[g] xsum[g], the same instruction sequence for every row (not inlined into the
// R-row loop, where the compiler could vectorize across rows and round differently).
__attribute__((noinline)) inline float min_term(const float* m, const float* xsum, int64_t ng) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xsum + g), acc);
  float s = hsum(acc);
  for (; g < ng; ++g) s = std::fma(m[g], xsum[g], s);
  return s;
}

template <int R>
inline void dot_rows_vnni(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* codes,
                          const float* d, const float* m, int64_t K, int64_t ldo, float* out) {
  const int64_t ng = K / G;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < ng; ++g) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16));
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * G));
      const __m256i isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d[g] * xs[r * ng + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(acc[r]) + min_term(m, xsum + r * ng, ng);
}

// Per-32 int8 quantization of one row of x [K]: xq, dx and dx * sum(xq) per group.
inline void quantize_row_q8(const float* x, int64_t K, int8_t* xq, float* xs, float* xsum) {
  for (int64_t g = 0; g < K / G; ++g) {
    float amax = 0.f;
    for (int j = 0; j < G; ++j) amax = std::max(amax, std::fabs(x[g * G + j]));
    const float dx = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < G; ++j) {
      const int q = static_cast<int>(std::nearbyint(x[g * G + j] * id));
      xq[g * G + j] = static_cast<int8_t>(q);
      sum += q;
    }
    xs[g] = dx;
    xsum[g] = dx * static_cast<float>(sum);
  }
}
#endif

}  // namespace pdq
