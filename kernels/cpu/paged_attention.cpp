// Paged decode attention for CPUs: one query token per sequence over its KV blocks, read in
// place from the paged cache (no gathered copy), fp32 math over fp32 or bf16 KV.
//
// Same contract as kernels/attention.py::paged_decode_attention:
//   query        [batch, num_heads, head_dim]                 float32
//   k_cache      [num_blocks, block_size, num_kv_heads, head_dim]  float32 | bfloat16
//   v_cache      same as k_cache
//   block_tables [batch, max_blocks]                          int64
//   context_lens [batch]                                      int64
//   returns      [batch, num_heads, head_dim]                 float32
//
// Work is split over (sequence, kv head) pairs; each pair serves its group of
// num_heads / num_kv_heads query heads (grouped-query attention), so every K and V row is
// read once per group. Softmax is the usual two passes over a score buffer: scores and their
// max, then exp / sum / weighted V.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for the softmax, written so the compiler vectorizes it (std::exp does not):
// 2^(x log2 e) = 2^n * 2^f with f in [-1/2, 1/2]; 2^f by a degree-6 polynomial (the Cephes
// exp2f coefficients, Moshier 1989), relative error about 2e-7; 2^n by building the exponent
// bits. Inputs here are x - max <= 0; below -87 the result is 0.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int64_t kMaxGroup = 16;   // query heads per KV head handled in one pass
constexpr int64_t kMaxHeadDim = 256;

template <typename KV>
void run(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row = num_kv_heads * head_dim;           // one token's K (or V) across kv heads
  const int64_t block_stride = block_size * row;
  TORCH_CHECK(group <= kMaxGroup && head_dim <= kMaxHeadDim, "group or head_dim too large");

  const float* q = query.data_ptr<float>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    alignas(64) float qs[kMaxGroup * kMaxHeadDim];
    alignas(64) float acc[kMaxGroup * kMaxHeadDim];
    alignas(64) float kv_row[kMaxHeadDim];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / num_kv_heads, g = pair % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(static_cast<size_t>(group * len));
      // the group's queries, pre-scaled
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = q + (b * num_heads + g * group + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qs[h * head_dim + i] = qh[i] * s;
      }
      // pass 1: scores, each K row read once for the whole group
      float m[kMaxGroup];
      for (int64_t h = 0; h < group; ++h) m[h] = -std::numeric_limits<float>::infinity();
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const KV* kb = kc + table[blk] * block_stride + g * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const KV* k = kb + j * row;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) kv_row[i] = to_float(k[i]);
          for (int64_t h = 0; h < group; ++h) {
            const float* qh = qs + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kv_row[i];
            scores[h * len + t0 + j] = dot;
            m[h] = std::max(m[h], dot);
          }
        }
      }
      // softmax weights
      float inv[kMaxGroup];
      for (int64_t h = 0; h < group; ++h) {
        float* sc = scores.data() + h * len;
        const float mh = m[h];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sc[t] = exp_approx(sc[t] - mh);
          sum += sc[t];
        }
        inv[h] = 1.f / sum;
      }
      // pass 2: weighted V, each V row read once for the whole group
      std::memset(acc, 0, sizeof(float) * group * head_dim);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const KV* vb = vc + table[blk] * block_stride + g * head_dim;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const KV* v = vb + j * row;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) kv_row[i] = to_float(v[i]);
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * len + t0 + j];
            float* ah = acc + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) ah[i] += p * kv_row[i];
          }
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* oh = o + (b * num_heads + g * group + h) * head_dim;
        const float* ah = acc + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) oh[i] = ah[i] * inv[h];
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto q = query.to(torch::kFloat32).contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  if (k_cache.scalar_type() == torch::kFloat32) {
    run<float>(q, k_cache, v_cache, tables, lens, scale, out);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32 or bfloat16");
  }
  return out.to(query.scalar_type());
}

// y = x W^T (+ bias) for a few rows of x: decode steps of small batches multiply a handful
// of activations by every weight matrix, which is memory-bound. Each weight row is streamed
// from memory once and dotted with all rows of x while it is in cache; rows of W are split
// across threads. (General matmul libraries tune for large M and read W at about half the
// machine's bandwidth at M = 1 here.)
//   x      [M, K] float32, M <= 16
//   weight [N, K] float32
//   bias   [N] float32 or empty
//   returns [M, N] float32
torch::Tensor linear_small_batch(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bad shapes");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.size(0) <= 64, "at most 64 rows");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto out = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias.defined() && bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* w = wp + n * K;
      const float b = bp ? bp[n] : 0.f;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {  // four rows of x per pass over the weight row
        const float* x0 = xp + m * K;
        const float* x1 = x0 + K;
        const float* x2 = x1 + K;
        const float* x3 = x2 + K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          const float wk = w[k];
          a0 += wk * x0[k];
          a1 += wk * x1[k];
          a2 += wk * x2[k];
          a3 += wk * x3[k];
        }
        op[m * N + n] = a0 + b;
        op[(m + 1) * N + n] = a1 + b;
        op[(m + 2) * N + n] = a2 + b;
        op[(m + 3) * N + n] = a3 + b;
      }
      for (; m < M; ++m) {
        const float* xr = xp + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += w[k] * xr[k];
        op[m * N + n] = acc + b;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("linear_small_batch", &linear_small_batch, "x W^T for a few rows of x (CPU)");
}
