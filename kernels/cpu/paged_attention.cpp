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
// Work is split over sequences (or, at small batch, (sequence, kv head) pairs); every query
// head sharing a KV head (grouped-query attention) is served from one read of its K and V rows. Softmax is the usual two passes over a score buffer: scores and their
// max, then exp / sum / weighted V.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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

// DC: head_dim known at compile time (64, 128), so the per-head loops unroll fully and the
// accumulators stay in registers; DC = 0 takes head_dim at run time.
template <typename KV, int64_t DC>
void run(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const int64_t D = DC > 0 ? DC : query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row = num_kv_heads * D;                  // one token's K (or V) across kv heads
  const int64_t block_stride = block_size * row;
  TORCH_CHECK(group <= kMaxGroup && D <= kMaxHeadDim, "group or head_dim too large");

  const float* q = query.data_ptr<float>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  // A work item is one sequence and a range of its KV heads: all of them when there are
  // enough sequences to keep every thread busy (each token's K and V rows are then read
  // whole and in order), one when the batch is small (so every thread has work).
  const int64_t heads_per_item = batch >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t width = heads_per_item * D;            // the contiguous part of a row an item reads
  const int64_t qheads = heads_per_item * group;       // query heads an item serves

  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qs(static_cast<size_t>(qheads * D));
    std::vector<float> acc(static_cast<size_t>(qheads * D));
    // one block of K or V rows in float32, converted once and read by every query head
    std::vector<float> blk_f(static_cast<size_t>(block_size * width));
    std::vector<float> m(static_cast<size_t>(qheads)), inv(static_cast<size_t>(qheads));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, g0 = (item % items_per_seq) * heads_per_item;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(static_cast<size_t>(qheads * len));
      for (int64_t h = 0; h < qheads; ++h) {
        const float* qh = q + (b * num_heads + g0 * group + h) * D;
        for (int64_t i = 0; i < D; ++i) qs[h * D + i] = qh[i] * s;
      }
      auto load_block = [&](const KV* base, int64_t n) {
        float* dst = blk_f.data();
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (std::is_same_v<KV, at::BFloat16>) {
            // bf16 is the top half of a float32: widen and shift (vectorizes, unlike the
            // element-wise conversion operator)
            const uint16_t* src = reinterpret_cast<const uint16_t*>(base + j * row);
            uint32_t* d = reinterpret_cast<uint32_t*>(dst + j * width);
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
          } else {
            const KV* src = base + j * row;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) dst[j * width + i] = to_float(src[i]);
          }
        }
      };
      // pass 1: scores
      for (int64_t h = 0; h < qheads; ++h) m[h] = -std::numeric_limits<float>::infinity();
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        if (t0 + block_size < len) __builtin_prefetch(kc + table[blk + 1] * block_stride + g0 * D);
        load_block(kc + table[blk] * block_stride + g0 * D, n);
        for (int64_t h = 0; h < qheads; ++h) {
          const float* qh = qs.data() + h * D;
          const float* kb = blk_f.data() + (h / group) * D;
          float* sc = scores.data() + h * len + t0;
          float mh = m[h];
          for (int64_t j = 0; j < n; ++j) {
            const float* k = kb + j * width;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < D; ++i) dot += qh[i] * k[i];
            sc[j] = dot;
            mh = std::max(mh, dot);
          }
          m[h] = mh;
        }
      }
      // softmax weights
      for (int64_t h = 0; h < qheads; ++h) {
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
      // pass 2: weighted V
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const int64_t n = std::min(block_size, len - t0);
        if (t0 + block_size < len) __builtin_prefetch(vc + table[blk + 1] * block_stride + g0 * D);
        load_block(vc + table[blk] * block_stride + g0 * D, n);
        for (int64_t h = 0; h < qheads; ++h) {
          const float* vb = blk_f.data() + (h / group) * D;
          const float* p = scores.data() + h * len + t0;
          float a[kMaxHeadDim];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] = acc[h * D + i];
          for (int64_t j = 0; j < n; ++j) {
            const float pj = p[j];
            const float* v = vb + j * width;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += pj * v[i];
          }
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) acc[h * D + i] = a[i];
        }
      }
      for (int64_t h = 0; h < qheads; ++h) {
        float* oh = o + (b * num_heads + g0 * group + h) * D;
        for (int64_t i = 0; i < D; ++i) oh[i] = acc[h * D + i] * inv[h];
      }
    }
  });
}

template <typename KV>
void dispatch(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  switch (query.size(2)) {
    case 64: return run<KV, 64>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
    case 128: return run<KV, 128>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
    default: return run<KV, 0>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
  }
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
    dispatch<float>(q, k_cache, v_cache, tables, lens, scale, out);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
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
// One weight element as float32: bf16 (stored as its 16 bits) is the top half of a float32.
inline float weight_at(const float* w, int64_t k) { return w[k]; }
inline float weight_at(const uint16_t* w, int64_t k) {
  const uint32_t bits = static_cast<uint32_t>(w[k]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename W>
void linear_rows(const float* xp, const W* wp, const float* bp, float* op, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const W* w = wp + n * K;
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
          const float wk = weight_at(w, k);
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
        for (int64_t k = 0; k < K; ++k) acc += weight_at(w, k) * xr[k];
        op[m * N + n] = acc + b;
      }
    }
  });
}

// x W^T + b for a few rows of x, streaming each weight row once for all of them (decode at
// small batch is a matrix-vector product: weight bandwidth is the whole cost).
//   x [M, K] float32 (M <= 64), weight [N, K] float32 or bfloat16, bias [N] float32 or empty
//   returns [M, N] float32
torch::Tensor linear_small_batch(torch::Tensor x, torch::Tensor weight, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bad shapes");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16,
              "weight must be float32 or bfloat16");
  TORCH_CHECK(x.size(0) <= 64, "at most 64 rows");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto out = torch::empty({M, N}, xc.options());
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel()) {
    bc = bias.to(torch::kFloat32).contiguous();
    bp = bc.data_ptr<float>();
  }
  if (wc.scalar_type() == torch::kFloat32) {
    linear_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), bp, out.data_ptr<float>(), M, K, N);
  } else {
    linear_rows(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), bp,
                out.data_ptr<float>(), M, K, N);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("linear_small_batch", &linear_small_batch, "x W^T for a few rows of x (CPU)");
}
