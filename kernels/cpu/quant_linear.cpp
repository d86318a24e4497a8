// y = x W^T for a few rows of x, with W kept in GGUF's block formats as stored (no re-quantization):
//   4-bit (Q4_0 / Q4_1): per 32 inputs, 16 bytes of codes (byte j: element j in the low nibble,
//   element j + 16 in the high one, as ggml's dequantize_row_q4_1), w = q * d + m
//   (Q4_0: m = -8 d, exact in float32);
//   8-bit (Q8_0): per 32 inputs, 32 int8 codes, w = q * d.
// d and m arrive as float32 [N, K / 32] (the file's fp16, widened exactly).
//
// Why our own kernel: torch 2.13's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm have
// vectorized paths for AVX-512 only; on an AVX2-only CPU they ran 15-50x slower than an fp32
// GEMV (measured, docs/decisions.md). This one widens a group's codes to float32 once in
// registers and multiplies it with up to four rows of x, streaming each weight byte once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int64_t G = 32;

// The 32 weights of one group as four vectors of 8 floats.
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

// R rows of x (row stride K) against output row n: out[r * N] for r < R.
template <bool Q4, int R>
inline void dot_rows(const float* x, const uint8_t* codes, const float* d, const float* m, int64_t K,
                     int64_t N, float* out) {
  constexpr int64_t bytes = Q4 ? G / 2 : G;
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
  for (int r = 0; r < R; ++r) out[r * N] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

template <bool Q4>
torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % G == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == (Q4 ? K / 2 : K), "codes must be [N, K/2] (4-bit) or [N, K] (8-bit)");
  TORCH_CHECK(d.size(0) == N && d.size(1) == K / G && d.scalar_type() == torch::kFloat, "d must be float32 [N, K/32]");
  auto xc = x.contiguous();
  auto cc = codes.contiguous();
  auto dc = d.contiguous();
  auto mc = Q4 ? m.contiguous() : dc;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = cp + n * row_bytes;
      const float* dn = dp + n * ng;
      const float* mn = mp + n * ng;
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) dot_rows<Q4, 4>(xp + r * K, c, dn, mn, K, N, op + r * N + n);
      switch (M - r) {
        case 3: dot_rows<Q4, 3>(xp + r * K, c, dn, mn, K, N, op + r * N + n); break;
        case 2: dot_rows<Q4, 2>(xp + r * K, c, dn, mn, K, N, op + r * N + n); break;
        case 1: dot_rows<Q4, 1>(xp + r * K, c, dn, mn, K, N, op + r * N + n); break;
        default: break;
      }
    }
  });
  return out;
}

// The float32 weights [N, K] (for row counts where a float GEMM is faster, and for tests).
template <bool Q4>
torch::Tensor block_dequantize(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const int64_t N = codes.size(0), K = d.size(1) * G;
  auto cc = codes.contiguous();
  auto dc = d.contiguous();
  auto mc = Q4 ? m.contiguous() : dc;
  auto out = torch::empty({N, K}, d.options());
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    __m256 w[4];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < ng; ++g) {
        load_group<Q4>(cp + n * row_bytes + g * (Q4 ? G / 2 : G), dp[n * ng + g], Q4 ? mp[n * ng + g] : 0.f, w);
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(op + n * K + g * G + 8 * c, w[c]);
      }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &block_linear<true>, "x W^T, W as 4-bit GGUF blocks (w = q d + m), x float32 [M, K]");
  mod.def("q8_linear", &block_linear<false>, "x W^T, W as Q8_0 blocks (w = q d), x float32 [M, K]");
  mod.def("q4_dequantize", &block_dequantize<true>, "float32 [N, K] from 4-bit GGUF blocks");
  mod.def("q8_dequantize", &block_dequantize<false>, "float32 [N, K] from Q8_0 blocks");
}
