// Paged decode attention for CPUs: one query token per sequence over its KV blocks, read in
// place from the paged cache (no gathered copy), fp32 math over fp32 or bf16 KV; with bf16=true
// (a bf16 cache on an AVX512-BF16 build) q.k and p.v as bf16 dot products instead (bfa below).
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "exp_poly.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "quant_block.h"  // pdq::vbh / vacc / bdot: bf16 dot products (native or the emulated test build)
#endif

namespace {

// 8 float32 lanes (GCC/Clang vector extension: AVX/AVX2 registers on x86, two NEON registers
// on Arm), for the loops the auto-vectorizer handles poorly: a dot product's single
// accumulator is a chain of dependent FMAs, so several keys are dotted at once instead.
typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#if defined(__AVX2__)
// out[j] = hsum(a[j]) for j < 8, bit for bit: the same additions as hsum, in the same order, for
// eight vectors at once (a transpose by lane-pair adds and horizontal adds) instead of eight
// scalar reductions. Level 1 adds lane i and i + 4 of each vector (two vectors per register),
// the first hadd forms (b0 + b1) and (b2 + b3), the second their sum; fp addition is
// commutative, so hadd's operand order changes nothing.
inline void hsum8(const v8f a[8], float* out) {
  __m256 p[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 x0 = reinterpret_cast<const __m256&>(a[2 * i]), x1 = reinterpret_cast<const __m256&>(a[2 * i + 1]);
    p[i] = _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));  // s0 s2 s4 s6 s1 s3 s5 s7
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#else
inline void hsum8(const v8f a[8], float* out) {
  for (int j = 0; j < 8; ++j) out[j] = hsum(a[j]);
}
#endif

// max(m, x[0], ..., x[n - 1]) (exact in any order for non-NaN values, so vectorized; a NaN in x
// is skipped, as by std::max(m, x)). Four running maxima of eight lanes each: one chain's
// compare-and-select latency bounded a prefill's softmax (18 % of the AMX prefill attention's
// samples at 2,048 tokens went to its single chain, docs/decisions.md).
inline float max_into(float m, const float* x, int64_t n) {
  int64_t j = 0;
  if (n >= 8) {
    v8f mv = v8f{} + m;
    if (n >= 32) {  // (a decode block's 16 keys stay on one chain: no extra maxima to fold)
      v8f m1 = mv, m2 = mv, m3 = mv;
      for (; j + 32 <= n; j += 32) {
        const v8f x0 = load8(x + j), x1 = load8(x + j + 8), x2 = load8(x + j + 16), x3 = load8(x + j + 24);
        mv = x0 > mv ? x0 : mv;
        m1 = x1 > m1 ? x1 : m1;
        m2 = x2 > m2 ? x2 : m2;
        m3 = x3 > m3 ? x3 : m3;
      }
      mv = m1 > mv ? m1 : mv;  // lane by lane: exact in any order (no NaN reaches these)
      m2 = m3 > m2 ? m3 : m2;
      mv = m2 > mv ? m2 : mv;
    }
    for (; j + 8 <= n; j += 8) {
      const v8f xv = load8(x + j);
      mv = xv > mv ? xv : mv;
    }
    for (int i = 0; i < 8; ++i) m = std::max(m, mv[i]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// out[j] = q . k_j for the n rows k_j = k + j * stride (each `D` floats). Per key: one
// accumulator over the D / 8 vectors in order, then hsum's fixed tree; keys are grouped eight,
// then four, then one at a time from the first. The groupings were meant to give the same bits,
// but on the AVX-512 Xeon (GCC 12, -march=native) a key's score differed in the last bit
// between them (2026-12-06), so every caller groups a row's keys from the block's first key
// the same way, decode and prefill alike (dot_rows2 pairs only whole groups of eight).
template <int64_t DC>
inline void dot_rows(const float* q, const float* k, int64_t stride, int64_t n, int64_t D, float* out) {
  if constexpr (DC > 0 && DC % 8 == 0) {
    constexpr int64_t V = DC / 8;
    v8f qv[V];
    for (int64_t v = 0; v < V; ++v) qv[v] = load8(q + 8 * v);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  // eight keys: eight independent FMA chains, one transposed reduction
      v8f a[8];
      for (int r = 0; r < 8; ++r) a[r] = qv[0] * load8(k + (j + r) * stride);
      for (int64_t v = 1; v < V; ++v)
        for (int r = 0; r < 8; ++r) a[r] += qv[v] * load8(k + (j + r) * stride + 8 * v);
      hsum8(a, out + j);
    }
    for (; j + 4 <= n; j += 4) {  // four keys: four independent FMA chains
      const float* k0 = k + j * stride;
      const float* k1 = k0 + stride;
      const float* k2 = k1 + stride;
      const float* k3 = k2 + stride;
      v8f a0 = qv[0] * load8(k0), a1 = qv[0] * load8(k1), a2 = qv[0] * load8(k2), a3 = qv[0] * load8(k3);
      for (int64_t v = 1; v < V; ++v) {
        a0 += qv[v] * load8(k0 + 8 * v);
        a1 += qv[v] * load8(k1 + 8 * v);
        a2 += qv[v] * load8(k2 + 8 * v);
        a3 += qv[v] * load8(k3 + 8 * v);
      }
      out[j] = hsum(a0);
      out[j + 1] = hsum(a1);
      out[j + 2] = hsum(a2);
      out[j + 3] = hsum(a3);
    }
    for (; j < n; ++j) {
      const float* kj = k + j * stride;
      v8f a = qv[0] * load8(kj);
      for (int64_t v = 1; v < V; ++v) a += qv[v] * load8(kj + 8 * v);
      out[j] = hsum(a);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * stride;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < D; ++i) dot += q[i] * kj[i];
      out[j] = dot;
    }
  }
}

// acc += sum_j p[j] * v_j for the n rows v_j = v + j * stride (each `D` floats).
template <int64_t DC>
inline void axpy_rows(const float* p, const float* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  if constexpr (DC > 0 && DC % 8 == 0) {
    constexpr int64_t V = DC / 8;
    v8f a[V];
    for (int64_t u = 0; u < V; ++u) a[u] = load8(acc + 8 * u);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * stride;
      const float pj = p[j];
      for (int64_t u = 0; u < V; ++u) a[u] += pj * load8(vj + 8 * u);
    }
    for (int64_t u = 0; u < V; ++u) store8(acc + 8 * u, a[u]);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * stride;
      const float pj = p[j];
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) acc[i] += pj * vj[i];
    }
  }
}

#if defined(__AVX512F__) && defined(__FMA__)
#define PDA_PAIRS 1
// Two queries at once on 16 lanes (AVX-512), where two rows read the same key and value rows (in
// a prefill tile, every query and head of a KV head; in decode, the query heads of one KV head):
// lanes 0-7 carry query a's eight accumulator chains, lanes 8-15 query b's, each chain exactly
// the one dot_rows / axpy_rows keep on 8 lanes (the same products, fused multiply-adds and
// order), so the results are those of two single calls, bit for bit, at twice the width: the
// 8-lane loops use half of an AVX-512 core's FMA width.

// outa[j] = hsum(low half of a[j]), outb[j] = hsum(high half) for j < 8: hsum8's additions for
// both halves at once. AVX-512 has no horizontal add; hadd(x, y) within each 128-bit lane is
// (even elements) + (odd elements), the same two operands per sum.
inline __m512 hadd16(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline void hsum8x2(const __m512 a[8], float* outa, float* outb) {
  __m512 p[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: [a key 2i, b key 2i, a key 2i + 1, b key 2i + 1], lane i + lane i + 4
    const __m512 x0 = a[2 * i], x1 = a[2 * i + 1];
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // 128-bit lanes: a's keys 0 2 4 6, b's keys 0 2 4 6, a's keys 1 3 5 7, b's keys 1 3 5 7
  const __m512 s = hadd16(hadd16(p[0], p[1]), hadd16(p[2], p[3]));
  const __m512 r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), s);
  _mm256_storeu_ps(outa, _mm512_castps512_ps256(r));
  _mm256_storeu_ps(outb, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
}

// dot_rows for two queries over the same n key rows (n a multiple of 8): outa[j] = qa . k_j,
// outb[j] = qb . k_j.
template <int64_t DC>
inline void dot_rows2(const float* qa, const float* qb, const float* k, int64_t stride, int64_t n, float* outa,
                      float* outb) {
  static_assert(DC > 0 && DC % 8 == 0);
  constexpr int64_t V = DC / 8;
  __m512 qv[V];
  for (int64_t v = 0; v < V; ++v)
    qv[v] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + 8 * v)), _mm256_loadu_ps(qb + 8 * v), 1);
  for (int64_t j = 0; j + 8 <= n; j += 8) {
    __m512 a[8];  // key j + r in both halves: one broadcast load
    for (int r = 0; r < 8; ++r) a[r] = _mm512_mul_ps(qv[0], _mm512_broadcast_f32x8(_mm256_loadu_ps(k + (j + r) * stride)));
    for (int64_t v = 1; v < V; ++v)
      for (int r = 0; r < 8; ++r)
        a[r] = _mm512_fmadd_ps(qv[v], _mm512_broadcast_f32x8(_mm256_loadu_ps(k + (j + r) * stride + 8 * v)), a[r]);
    hsum8x2(a, outa + j, outb + j);
  }
}

// Scores of two rows over one block's keys, their maxima updated: row a sees na keys, row b the
// same and possibly more (nb >= na). dot_rows2 over whole groups of eight keys, and each row's
// rest through dot_rows, which groups it as it would alone (see dot_rows on why that matters).
template <int64_t DC>
inline void score_pair(const float* qa, const float* qb, const float* k, int64_t stride, int64_t na, int64_t nb,
                       float* sa, float* sb, float& ma, float& mb) {
  const int64_t n8 = na / 8 * 8;
  dot_rows2<DC>(qa, qb, k, stride, n8, sa, sb);
  dot_rows<DC>(qa, k + n8 * stride, stride, na - n8, DC, sa + n8);
  dot_rows<DC>(qb, k + n8 * stride, stride, nb - n8, DC, sb + n8);
  ma = max_into(ma, sa, na);
  mb = max_into(mb, sb, nb);
}

// axpy_rows for two weight rows over the same n value rows: acca += sum_j pa[j] v_j, accb likewise.
template <int64_t DC>
inline void axpy_rows2(const float* pa, const float* pb, const float* v, int64_t stride, int64_t n, float* acca,
                       float* accb) {
  static_assert(DC > 0 && DC % 16 == 0);
  constexpr int64_t V = DC / 16;
  __m512 a[V], b[V];
  for (int64_t u = 0; u < V; ++u) {
    a[u] = _mm512_loadu_ps(acca + 16 * u);
    b[u] = _mm512_loadu_ps(accb + 16 * u);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * stride;
    const __m512 wa = _mm512_set1_ps(pa[j]), wb = _mm512_set1_ps(pb[j]);
    for (int64_t u = 0; u < V; ++u) {
      const __m512 x = _mm512_loadu_ps(vj + 16 * u);
      a[u] = _mm512_fmadd_ps(wa, x, a[u]);
      b[u] = _mm512_fmadd_ps(wb, x, b[u]);
    }
  }
  for (int64_t u = 0; u < V; ++u) {
    _mm512_storeu_ps(acca + 16 * u, a[u]);
    _mm512_storeu_ps(accb + 16 * u, b[u]);
  }
}
#endif

// exp(x) on 8 lanes, the same method as exp_poly (exp_poly.h); 2^n is built in the exponent bits, and
// n = round(x log2 e) comes from the float "magic number" rounding trick (adding 1.5 * 2^23
// leaves the rounded integer in the low mantissa bits).
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.0f;
  x = x < lo ? lo : x;
  const v8f t = x * kLog2e;
  const v8f magic = v8f{} + 12582912.0f;  // 1.5 * 2^23
  const v8f r = t + magic;
  const v8f n = r - magic;
  const v8f f = t - n;
  v8f p = v8f{} + kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const v8i ni = reinterpret_cast<const v8i&>(r) - reinterpret_cast<const v8i&>(magic);
  const v8i bits = (ni + 127) << 23;
  return p * reinterpret_cast<const v8f&>(bits);
}

// x[t] = exp(x[t] - m) for t < n, in place; returns their sum.
inline float exp_sub_sum(float* x, int64_t n, float m) {
  v8f acc{};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const v8f e = exp8(load8(x + t) - m);
    store8(x + t, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; t < n; ++t) {
    x[t] = exp_poly(x[t] - m);
    sum += x[t];
  }
  return sum;
}

// Ask for the next block's rows (n rows of `width` elements, `stride` apart) ahead of use:
// a block's rows are contiguous only per token, and blocks are scattered, so the hardware
// prefetcher alone leaves each thread waiting on memory at every block.
template <typename T>
inline void prefetch_rows(const T* base, int64_t n, int64_t stride, int64_t width) {
  const char* p = reinterpret_cast<const char*>(base);
  const int64_t bytes = width * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j, p += stride * static_cast<int64_t>(sizeof(T))) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}


// n rows of `width` elements (`row` apart) of one KV block as float32: a float32 cache is read
// in place (stride = row); bf16 rows are widened into dst (stride = width). bf16 is the top
// half of a float32: widen and shift (vectorizes, unlike the element-wise conversion operator).
template <typename KV>
inline const float* block_rows_f32(const KV* base, int64_t n, int64_t row, int64_t width, float* dst,
                                   int64_t& stride) {
  if constexpr (std::is_same_v<KV, float>) {
    stride = row;
    return base;
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(base + j * row);
      uint32_t* d = reinterpret_cast<uint32_t*>(dst + j * width);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
    }
    stride = width;
    return dst;
  }
}

// Work items 0 .. n - 1 over the threads, handed out one at a time as threads come free
// (at::parallel_for's equal contiguous ranges give one thread all the long-context tiles of a
// causal prefill: 3:1 work between two threads). body(next_item) runs once per thread (its
// buffers set up once) and takes items from next_item() until it returns -1. Which thread
// computes an item never changes its result.
template <typename Body>
void for_each_item(int64_t n, Body&& body) {
  std::atomic<int64_t> next{0};
  auto next_item = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next_item); });
}

// Queries per tile of the prefill kernels. tile_arg > 0: that many (a test's choice). Otherwise
// the tile's score rows (tile * group * context_len floats) kept near 1 MiB, so they stay in L2
// between the two passes, clamped to 4..64; with `balance`, also small enough that the work items
// (tiles x KV heads) number at least kItemsPerThread per thread: a 64-query call of SmolLM2 (3 KV
// heads) at a context up to ~1,400 tokens was one tile, 3 items on 2 threads, one thread idle a
// third of the call (AVX2 EPYC, 2 threads: 16-query tiles 19-35 % faster a call at contexts
// 128-1,024, equal at 2,048-4,096; docs/decisions.md). Then the tiles are evened out. Only speed depends on the tile.
constexpr int64_t kItemsPerThread = 6;
inline int64_t prefill_tile(int64_t n, int64_t group, int64_t context_len, int64_t num_kv_heads, int64_t tile_arg,
                            bool balance) {
  if (tile_arg > 0) return std::min<int64_t>(tile_arg, 64);
  int64_t tile = std::clamp<int64_t>((int64_t{1} << 18) / std::max<int64_t>(1, group * context_len), 4, 64);
  if (balance) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t tiles = (kItemsPerThread * threads + num_kv_heads - 1) / num_kv_heads;  // tiles wanted
    tile = std::max<int64_t>(4, std::min(tile, (n + tiles - 1) / tiles));
  }
  const int64_t num_tiles = (n + tile - 1) / tile;
  return (n + num_tiles - 1) / num_tiles;  // even tiles
}

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

  for_each_item(batch * items_per_seq, [&](auto&& next_item) {
    std::vector<float> scores;
    std::vector<float> qs(static_cast<size_t>(qheads * D));
    std::vector<float> acc(static_cast<size_t>(qheads * D));
    // bf16 caches: one block of K or V rows widened to float32 once, read by every query head
    std::vector<float> blk_f(static_cast<size_t>(block_size * width));
    std::vector<float> m(static_cast<size_t>(qheads)), inv(static_cast<size_t>(qheads));
    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t b = item / items_per_seq, g0 = (item % items_per_seq) * heads_per_item;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(static_cast<size_t>(qheads * len));
      for (int64_t h = 0; h < qheads; ++h) {
        const float* qh = q + (b * num_heads + g0 * group + h) * D;
        for (int64_t i = 0; i < D; ++i) qs[h * D + i] = qh[i] * s;
      }
      // A block's rows of this item's KV heads as float32: fp32 caches are read in place
      // (row stride `row`); bf16 rows are widened into blk_f (row stride `width`).
      auto block_rows = [&](const KV* base, int64_t n, int64_t& stride) {
        return block_rows_f32(base, n, row, width, blk_f.data(), stride);
      };
      // Walk the sequence's blocks of one cache (K or V): for each block and query head h,
      // fn(h, rows of h's KV head, row stride, first token, tokens in the block); where 16
      // lanes allow, heads h and h + 1 of one KV head go to pair(h, their rows, stride, t0, n)
      // together instead. The next block's prefetch is spread over the heads (a burst of a
      // whole block's prefetches stalls on the core's miss queue).
      auto for_each_block = [&](const KV* cache, auto&& fn, auto&& pair) {
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
          const int64_t n = std::min(block_size, len - t0);
          const KV* next = t0 + block_size < len ? cache + table[blk + 1] * block_stride + g0 * D : nullptr;
          int64_t stride;
          const float* rows = block_rows(cache + table[blk] * block_stride + g0 * D, n, stride);
#if defined(PDA_PAIRS)
          // pairs only at small batches (an item is one KV head, every head h + 1 < group
          // shares h's rows): at 64 sequences of 512 tokens, beyond the caches, this loop was
          // 1.3x slower a call than the one below even without pairs (AVX-512 Xeon, 2 threads),
          // while at 1 and 2 sequences the pairs made a call 0.91-0.96x
          if constexpr (DC > 0 && DC % 16 == 0)
            if (heads_per_item == 1) {
              for (int64_t h = 0; h < qheads; h += 2) {
                for (int64_t i = h; i < std::min(h + 2, qheads); ++i)
                  if (next) {
                    const int64_t r0 = i * block_size / qheads, r1 = (i + 1) * block_size / qheads;
                    prefetch_rows(next + r0 * row, r1 - r0, row, width);
                  }
                if (h + 1 < qheads)
                  pair(h, rows, stride, t0, n);
                else
                  fn(h, rows, stride, t0, n);
              }
              continue;
            }
#endif
          for (int64_t h = 0; h < qheads; ++h) {
            if (next) {
              const int64_t r0 = h * block_size / qheads, r1 = (h + 1) * block_size / qheads;
              prefetch_rows(next + r0 * row, r1 - r0, row, width);
            }
            fn(h, rows + (h / group) * D, stride, t0, n);
          }
        }
      };
      // pass 1: scores and their max per head
      for (int64_t h = 0; h < qheads; ++h) m[h] = -std::numeric_limits<float>::infinity();
      for_each_block(
          kc,
          [&](int64_t h, const float* k, int64_t stride, int64_t t0, int64_t n) {
            float* sc = scores.data() + h * len + t0;
            dot_rows<DC>(qs.data() + h * D, k, stride, n, D, sc);
            m[h] = max_into(m[h], sc, n);
          },
          [&](int64_t h, const float* k, auto stride, int64_t t0, int64_t n) {
#if defined(PDA_PAIRS)
            if constexpr (DC > 0 && DC % 16 == 0) {
              float* sa = scores.data() + h * len + t0;
              score_pair<DC>(qs.data() + h * D, qs.data() + (h + 1) * D, k, stride, n, n, sa, sa + len, m[h], m[h + 1]);
            }
#endif
          });
      // softmax weights
      for (int64_t h = 0; h < qheads; ++h) inv[h] = 1.f / exp_sub_sum(scores.data() + h * len, len, m[h]);
      // pass 2: weighted V
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(
          vc,
          [&](int64_t h, const float* v, int64_t stride, int64_t t0, int64_t n) {
            axpy_rows<DC>(scores.data() + h * len + t0, v, stride, n, D, acc.data() + h * D);
          },
          [&](int64_t h, const float* v, auto stride, int64_t t0, int64_t n) {
#if defined(PDA_PAIRS)
            if constexpr (DC > 0 && DC % 16 == 0) {
              const float* pa = scores.data() + h * len + t0;
              axpy_rows2<DC>(pa, pa + len, v, stride, n, acc.data() + h * D, acc.data() + (h + 1) * D);
            }
#endif
          });
      for (int64_t h = 0; h < qheads; ++h) {
        float* oh = o + (b * num_heads + g0 * group + h) * D;
        for (int64_t i = 0; i < D; ++i) oh[i] = acc[h * D + i] * inv[h];
      }
    }
  });
}

// Prefill attention with the decode kernel's arithmetic per query (batch-invariant prefill):
// the n queries are the last n positions of one sequence's context of `context_len` tokens
// (query i sees positions 0 .. context_len - n + i, causal), and each (query, head) is reduced
// by exactly the instruction sequence `run` uses for one decode query over the same context:
// the same scaling of q, dot_rows per block of keys in block order, the max, exp_sub_sum over
// its own contiguous score row, axpy_rows per block of values in block order, the same final
// scale. So a token's attention output is bit-identical whether it was decoded alone or
// prefilled in any chunk (tests/unit/test_batch_invariance.py checks it).
//
// What differs from calling `run` with n queries is the memory traffic: a work item is one KV
// head and a tile of consecutive queries, and each block of K (then V) is read (and, for bf16
// caches, widened to float32) once per tile and used by every query of the tile and every query
// head of the group while it sits in L1 — FlashAttention's tiling of queries over key blocks
// (Dao et al., 2022), kept to a fixed per-query reduction order as batch-invariant kernels do
// ("Defeating Nondeterminism in LLM Inference", He & Thinking Machines Lab, 2025). Per query
// the decode kernel reads its whole context, so a prefill of n tokens read O(n^2) K/V rows;
// here it reads O(n^2 / tile).
//   query       [n, num_heads, head_dim] float32
//   block_table [max_blocks] int64 (the sequence's blocks, covering context_len tokens)
//   returns     [n, num_heads, head_dim] float32
template <typename KV, int64_t DC>
void run_prefill(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& block_table, int64_t context_len, double scale, int64_t tile_arg,
                 torch::Tensor& out) {
  const int64_t n = query.size(0), num_heads = query.size(1);
  const int64_t D = DC > 0 ? DC : query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * D;
  const int64_t block_stride = block_size * row;
  const int64_t prefix = context_len - n;
  const int64_t tile = prefill_tile(n, group, context_len, num_kv_heads, tile_arg, /*balance=*/true);
  const int64_t num_tiles = (n + tile - 1) / tile;

  const float* q = query.data_ptr<float>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  // items: (tile, kv head), the largest tiles (the last queries see the most keys) first
  for_each_item(num_tiles * num_kv_heads, [&](auto&& next_item) {
    const int64_t rows_max = tile * group;
    std::vector<float> scores(static_cast<size_t>(rows_max * context_len));
    std::vector<float> qs(static_cast<size_t>(rows_max * D)), acc(static_cast<size_t>(rows_max * D));
    std::vector<float> blk_f(static_cast<size_t>(block_size * D));
    std::vector<float> m(static_cast<size_t>(rows_max)), inv(static_cast<size_t>(rows_max));
    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t ti = num_tiles - 1 - item / num_kv_heads, g = item % num_kv_heads;
      const int64_t i0 = ti * tile, i1 = std::min(n, i0 + tile), T = i1 - i0;
      const int64_t max_len = prefix + i1;  // the tile's last query's context
      // row k = r * group + h (query r of the tile, head h of the group): its score row, max_len floats
      auto score_at = [&](int64_t k) { return scores.data() + k * max_len; };
      for (int64_t r = 0; r < T; ++r)
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = q + ((i0 + r) * num_heads + g * group + h) * D;
          float* dst = qs.data() + (r * group + h) * D;
          for (int64_t i = 0; i < D; ++i) dst[i] = qh[i] * s;
        }
      auto block_rows = [&](const KV* base, int64_t nb, int64_t& stride) {
        return block_rows_f32(base, nb, row, D, blk_f.data(), stride);
      };
      // Blocks in order; for each, fn(k, rows, stride, t0, n_k) for every row k = r * group + h
      // (query r of the tile, head h of the group) whose query's context reaches the block, n_k
      // being the block's tokens that query sees. Where 16 lanes allow, rows k and k + 1 go to
      // pair(k, rows, stride, t0, n_k, n_k+1) together instead (n_k <= n_k+1: row k + 1's query
      // is the same or the next one).
      auto for_each_block = [&](const KV* cache, auto&& fn, auto&& pair) {
        const int64_t k_end = T * group;
        for (int64_t t0 = 0, blk = 0; t0 < max_len; t0 += block_size, ++blk) {
          const int64_t nb = std::min(block_size, max_len - t0);
          if (t0 + block_size < max_len)
            prefetch_rows(cache + table[blk + 1] * block_stride + g * D, std::min(block_size, max_len - t0 - block_size),
                          row, D);
          int64_t stride;
          const float* rows = block_rows(cache + table[blk] * block_stride + g * D, nb, stride);
          // query r sees t < prefix + i0 + r + 1
          auto seen = [&](int64_t k) { return std::min(nb, prefix + i0 + k / group + 1 - t0); };
          int64_t k = std::max<int64_t>(0, t0 - prefix - i0) * group;
#if defined(PDA_PAIRS)
          if constexpr (DC > 0 && DC % 16 == 0)
            for (; k + 1 < k_end; k += 2) pair(k, rows, stride, t0, seen(k), seen(k + 1));
#endif
          for (; k < k_end; ++k) fn(k, rows, stride, t0, seen(k));
        }
      };
      for (int64_t k = 0; k < T * group; ++k) m[k] = -std::numeric_limits<float>::infinity();
      for_each_block(
          kc,
          [&](int64_t k, const float* kr, int64_t stride, int64_t t0, int64_t nr) {
            float* sc = score_at(k) + t0;
            dot_rows<DC>(qs.data() + k * D, kr, stride, nr, D, sc);
            m[k] = max_into(m[k], sc, nr);
          },
          [&](int64_t k, const float* kr, auto stride, int64_t t0, int64_t na, int64_t nb) {
#if defined(PDA_PAIRS)
            if constexpr (DC > 0 && DC % 16 == 0)
              score_pair<DC>(qs.data() + k * D, qs.data() + (k + 1) * D, kr, stride, na, nb, score_at(k) + t0,
                             score_at(k + 1) + t0, m[k], m[k + 1]);
#endif
          });
      for (int64_t k = 0; k < T * group; ++k)
        inv[k] = 1.f / exp_sub_sum(score_at(k), prefix + i0 + k / group + 1, m[k]);
      std::fill(acc.begin(), acc.begin() + T * group * D, 0.f);
      for_each_block(
          vc,
          [&](int64_t k, const float* v, int64_t stride, int64_t t0, int64_t nr) {
            axpy_rows<DC>(score_at(k) + t0, v, stride, nr, D, acc.data() + k * D);
          },
          [&](int64_t k, const float* v, auto stride, int64_t t0, int64_t na, int64_t nb) {
#if defined(PDA_PAIRS)
            if constexpr (DC > 0 && DC % 16 == 0) {
              float *aa = acc.data() + k * D, *ab = acc.data() + (k + 1) * D;
              axpy_rows2<DC>(score_at(k) + t0, score_at(k + 1) + t0, v, stride, na, aa, ab);
              // the rest of row k + 1's keys continue its chains in order
              if (nb > na) axpy_rows<DC>(score_at(k + 1) + t0 + na, v + na * stride, stride, nb - na, D, ab);
            }
#endif
          });
      for (int64_t r = 0; r < T; ++r)
        for (int64_t h = 0; h < group; ++h) {
          float* oh = o + ((i0 + r) * num_heads + g * group + h) * D;
          const float* a = acc.data() + (r * group + h) * D;
          const float iv = inv[r * group + h];
          for (int64_t i = 0; i < D; ++i) oh[i] = a[i] * iv;
        }
    }
  });
}

#if defined(PDQ_BF16)
// ---- bf16 dot products (AVX512-BF16 `vdpbf16ps`, or the emulated test build) ---------------------
// The same kernels with the q.k and p.v products as bf16 pair dot products, for a bf16 KV cache
// (used when the model's linears use them too: PD_BLOCK_DOT=bf16, engine.model.batch_invariant).
// Where it rounds, per (query, head), identically in decode and in the prefill tiles:
//   1. q (scaled, float32) is rounded to bf16 once (vcvtneps2bf16: to nearest even, denormals
//      flushed); K and V are the cache's bf16, exact.
//   2. score of key j: four accumulator chains over the D / 2 pairs of elements (a "word" w:
//      elements 2w, 2w + 1), chain c taking the words w = c, c + 4, c + 8, ... in order, each
//      step one `vdpbf16ps` (lane = key: the exact products of elements 2w + 1 then 2w added to
//      the lane, float32 rounding per add), then (c0 + c1) + (c2 + c3). Keys sit in the 16 lanes,
//      so no horizontal sum is needed: each span of 128 keys is transposed to words x keys once
//      and read by every query head (and, in prefill, every query of the tile) that uses it.
//   3. the max (exact in any order) and the softmax's exp / sum in float32 (exp_round: the
//      Cephes polynomial of exp_poly, every rounding explicit); the weights p then rounded to bf16.
//   4. p.v: one accumulator chain per output element over the context's pairs of keys (2k, 2k + 1)
//      in order (pairs by position in the context, whatever the block size); a step is one
//      `vdpbf16ps` adding p[2k+1] v[2k+1] then p[2k] v[2k]. The partner of a query's last key,
//      when the key count is odd, takes p = 0 (its product is exactly zero, so the sum is that
//      of the real keys alone); past the context's end its V row is read as zeros.
//   5. the output is acc / sum (float32), as in the float32 kernel.
// So a token's attention output is bit-identical decoded or prefilled in any chunk (the same
// functions below do the arithmetic for both). Versus float32 math it differs by the bf16
// rounding of q and p (relative 2^-9 each): bf16 flash-attention on GPUs rounds P the same way.
namespace bfa {
using pdq::vacc;
using pdq::vbh;

// one bf16 into a float buffer's bytes (memcpy: the buffer's objects are floats)
inline void put(uint16_t* p, uint16_t h) { std::memcpy(p, &h, sizeof(h)); }

inline vbh first_of_pairs(vbh v) {  // each lane's second element (2i + 1) set to zero
#if defined(PDQ_BF16_EMULATE)
  for (int i = 0; i < 16; ++i) v.e[2 * i + 1] = 0;
  return v;
#else
  return (vbh)_mm512_and_si512((__m512i)v, _mm512_set1_epi32(0xFFFF));
#endif
}
inline vbh bset1(uint32_t w) {  // one pair (32 bits) in every lane
#if defined(PDQ_BF16_EMULATE)
  vbh v;
  for (int i = 0; i < 16; ++i) {
    v.e[2 * i] = static_cast<uint16_t>(w);
    v.e[2 * i + 1] = static_cast<uint16_t>(w >> 16);
  }
  return v;
#else
  return (vbh)_mm512_set1_epi32(static_cast<int>(w));
#endif
}
inline vacc add(vacc a, vacc b) {
#if defined(PDQ_BF16_EMULATE)
  for (int i = 0; i < 16; ++i) a.f[i] = a.f[i] + b.f[i];
  return a;
#else
  return _mm512_add_ps(a, b);
#endif
}
inline vacc load(const float* p) {
#if defined(PDQ_BF16_EMULATE)
  vacc v;
  std::memcpy(v.f, p, sizeof v.f);
  return v;
#else
  return _mm512_loadu_ps(p);
#endif
}
inline void store(float* p, vacc v) {
#if defined(PDQ_BF16_EMULATE)
  std::memcpy(p, v.f, sizeof v.f);
#else
  _mm512_storeu_ps(p, v);
#endif
}
inline void store_first(float* p, vacc v, int64_t n) {  // lanes 0 .. n - 1 (n <= 16)
#if defined(PDQ_BF16_EMULATE)
  std::memcpy(p, v.f, static_cast<size_t>(n) * sizeof(float));
#else
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
#endif
}
// m[i] = max(m[i], v[i]) for lanes i < n (n <= 16), in memory (16 floats)
inline void max_first(float* m, vacc v, int64_t n) {
#if defined(PDQ_BF16_EMULATE)
  for (int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], v.f[i]);
#else
  const __m512 a = _mm512_loadu_ps(m);
  // max(v, a) returns a when v is NaN, as std::max(a, v) does: a NaN score leaves the maximum alone
  _mm512_storeu_ps(m, _mm512_mask_max_ps(a, static_cast<__mmask16>((1u << n) - 1u), v, a));
#endif
}
inline float max_all(const float* m) {  // the largest of 16 lanes (exact in any order)
  float r = m[0];
  for (int i = 1; i < 16; ++i) r = std::max(r, m[i]);
  return r;
}

// A tile's last step: out's (query r, head h) row = acc's row r group + h (D floats) times
// inv[r group + h], for `rows` = T group rows.
inline void scale_out(const float* acc, const float* inv, int64_t rows, int64_t group, int64_t D, float* out,
                      int64_t o_row) {
  for (int64_t i = 0; i < rows; ++i) {
    float* o = out + i / group * o_row + i % group * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv[i];
  }
}

// Softmax weights (item 3): x[0 .. n) := exp(x - m) as bf16, in place (y = x's memory as uint16:
// y[j] overwrites bytes of x already read), y[n] = 0 (the pad partner of an odd last key);
// returns the sum of the float32 exps. exp as exp_poly (the Cephes polynomial), written so that
// every rounding is explicit: k = round(x log2 e) (to nearest even), f = fma(x, log2 e, -k), the
// polynomial (kExp2Poly, exp_poly.h) by FMAs, 2^k applied by scalef (exact: x >= -87 keeps it
// normal); the sum over 16 lanes (lane = j mod 16, in order), then _mm512_reduce_add_ps's tree.
// No multiply feeds an add, so -ffp-contract cannot change the bits between callers; the
// emulated build does the same operations in scalar code.
inline float exp_round(float* x, int64_t n, float m) {
  uint16_t* y = reinterpret_cast<uint16_t*>(x);
#if defined(PDQ_BF16_EMULATE)
  vacc acc = pdq::bzero();
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t nn = std::min<int64_t>(16, n - j);
    float e[16];
    for (int64_t i = 0; i < nn; ++i) {
      float v;
      std::memcpy(&v, x + j + i, sizeof(v));
      v = std::max(v - m, -87.0f);
      const float k = std::nearbyint(v * kLog2e);
      const float f = std::fma(v, kLog2e, -k);
      float p = kExp2Poly[0];
      for (int c = 1; c < 7; ++c) p = std::fma(p, f, kExp2Poly[c]);
      e[i] = std::ldexp(p, static_cast<int>(k));
    }
    for (int64_t i = 0; i < nn; ++i) {
      acc.f[i] = acc.f[i] + e[i];
      put(y + j + i, pdq::bf16_rne(e[i]));
    }
  }
  put(y + n, 0);
  return pdq::bsum(acc);
#else
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.0f), l2e = _mm512_set1_ps(kLog2e);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
    // max(lo, d) returns d when d is NaN, as std::max(d, lo) does: a NaN score stays NaN
    const __m512 v = _mm512_max_ps(lo, _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + j), mv));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, l2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fmsub_ps(v, l2e, k);
    __m512 p = _mm512_set1_ps(kExp2Poly[0]);
    for (int c = 1; c < 7; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[c]));
    const __m512 e = _mm512_maskz_mov_ps(mask, _mm512_scalef_ps(p, k));
    acc = _mm512_add_ps(acc, e);
    _mm256_mask_storeu_epi16(y + j, mask, (__m256i)_mm512_cvtneps_pbh(e));
  }
  put(y + n, 0);
  return _mm512_reduce_add_ps(acc);
#endif
}

inline uint32_t word(const uint16_t* p) {  // elements p[0] (low half) and p[1]
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// y[0 .. n) = x[0 .. n) rounded to bf16 (vcvtneps2bf16; the emulated build: bf16_rne).
inline void round_bf16(const float* x, int64_t n, uint16_t* y) {
  int64_t j = 0;
#if !defined(PDQ_BF16_EMULATE)
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
#endif
  for (; j < n; ++j) y[j] = pdq::bf16_rne(x[j]);
}

// q (D floats) times s, rounded to bf16: D / 2 words.
inline void round_query(const float* q, float s, int64_t D, uint16_t* out) {
  alignas(64) float tmp[256];
  for (int64_t i0 = 0; i0 < D; i0 += 256) {
    const int64_t m = std::min<int64_t>(256, D - i0);
    for (int64_t i = 0; i < m; ++i) tmp[i] = q[i0 + i] * s;  // the float32 kernel's scaling
    round_bf16(tmp, m, out + i0);
  }
}

// Up to 16 keys' rows (rows[i], D elements each; n <= 16) transposed to words x keys:
// kt[w * 16 + i] = word w of key i (elements 2w, 2w + 1), 0 for i >= n.
inline void key_words(const uint16_t* const* rows, int64_t n, int64_t D, uint32_t* kt) {
  const int64_t W = D / 2;
#if defined(PDQ_BF16_EMULATE)
  for (int64_t w = 0; w < W; ++w)
    for (int64_t i = 0; i < 16; ++i) kt[w * 16 + i] = i < n ? word(rows[i] + 2 * w) : 0u;
#else
  for (int64_t w0 = 0; w0 < W; w0 += 16) {  // a 16 x 16 transpose of 32-bit words per 16 words
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_loadu_si512(rows[i] + 2 * w0) : _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i + 1 of words 4L, 4L + 1 / 4L + 2, 4L + 3
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // u[4i + j], lane L: rows 4i .. 4i + 3 of word 4L + j
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // word 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j]
      const __m512i p0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), p1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
      const __m512i q0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), q1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
      _mm512_storeu_si512(kt + (w0 + j) * 16, _mm512_shuffle_i32x4(p0, q0, 0x88));
      _mm512_storeu_si512(kt + (w0 + 4 + j) * 16, _mm512_shuffle_i32x4(p0, q0, 0xDD));
      _mm512_storeu_si512(kt + (w0 + 8 + j) * 16, _mm512_shuffle_i32x4(p1, q1, 0x88));
      _mm512_storeu_si512(kt + (w0 + 12 + j) * 16, _mm512_shuffle_i32x4(p1, q1, 0xDD));
    }
  }
#endif
}

// n keys' V rows (rows[i], D elements each) as pairs of keys: vp[k * D + d] = v[2k][d] |
// v[2k + 1][d] << 16 for k < ceil(n / 2), a missing row 2k + 1 (>= n) as zeros.
inline void value_pairs(const uint16_t* const* rows, int64_t n, int64_t D, uint32_t* vp) {
  for (int64_t k = 0; 2 * k < n; ++k) {
    const uint16_t* a = rows[2 * k];
    const uint16_t* b = 2 * k + 1 < n ? rows[2 * k + 1] : nullptr;
    uint32_t* out = vp + k * D;
    int64_t d = 0;
#if !defined(PDQ_BF16_EMULATE)
    for (; d + 16 <= D; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d))), 16)
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_or_si512(lo, hi));
    }
#endif
    for (; d < D; ++d) out[d] = static_cast<uint32_t>(a[d]) | (b ? static_cast<uint32_t>(b[d]) << 16 : 0u);
  }
}

// Scores of nkeys keys (kt: key_words of each 16 keys in turn) for NH query heads (item 2): head
// h's words at q + h * qs, its scores stored from out + h * os, and folded into its running
// maximum mx + 16 h (16 lanes; a maximum is exact in any order).
template <int64_t W, int NH>
inline void score_keys(const uint16_t* q, int64_t qs, const uint32_t* kt, int64_t nkeys, float* out, int64_t os,
                       float* mx) {
  static_assert(W % 4 == 0, "four chains");
  for (int64_t j = 0; j < nkeys; j += 16, kt += 16 * W) {
    const int64_t n = std::min<int64_t>(16, nkeys - j);
    vacc c0[NH], c1[NH], c2[NH], c3[NH];
    for (int h = 0; h < NH; ++h) c0[h] = c1[h] = c2[h] = c3[h] = pdq::bzero();
#pragma GCC unroll 8
    for (int64_t w = 0; w < W; w += 4) {
      const vbh k0 = pdq::bload(reinterpret_cast<const uint16_t*>(kt + w * 16));
      const vbh k1 = pdq::bload(reinterpret_cast<const uint16_t*>(kt + (w + 1) * 16));
      const vbh k2 = pdq::bload(reinterpret_cast<const uint16_t*>(kt + (w + 2) * 16));
      const vbh k3 = pdq::bload(reinterpret_cast<const uint16_t*>(kt + (w + 3) * 16));
      for (int h = 0; h < NH; ++h) {
        const uint16_t* qh = q + h * qs + 2 * w;
        c0[h] = pdq::bdot(c0[h], bset1(word(qh)), k0);
        c1[h] = pdq::bdot(c1[h], bset1(word(qh + 2)), k1);
        c2[h] = pdq::bdot(c2[h], bset1(word(qh + 4)), k2);
        c3[h] = pdq::bdot(c3[h], bset1(word(qh + 6)), k3);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const vacc sc = add(add(c0[h], c1[h]), add(c2[h], c3[h]));
      store_first(out + h * os + j, sc, n);
      max_first(mx + 16 * h, sc, n);
    }
  }
}

// score_keys for any number of heads (three at a time share each load of a key word)
template <int64_t W>
inline void score_heads(const uint16_t* q, int64_t qs, int64_t nh, const uint32_t* kt, int64_t nkeys, float* out,
                        int64_t os, float* mx) {
  int64_t h = 0;
  for (; h + 3 <= nh; h += 3) score_keys<W, 3>(q + h * qs, qs, kt, nkeys, out + h * os, os, mx + 16 * h);
  for (; h + 2 <= nh; h += 2) score_keys<W, 2>(q + h * qs, qs, kt, nkeys, out + h * os, os, mx + 16 * h);
  for (; h < nh; ++h) score_keys<W, 1>(q + h * qs, qs, kt, nkeys, out + h * os, os, mx + 16 * h);
}

// acc_h[0 .. D) += sum over keys j < nkeys of p_h[j] v[j], by pairs (2k, 2k + 1), for NH query
// heads (item 4): head h's bf16 weights at p + h * ps (p_h[nkeys] = 0 when nkeys is odd), its
// accumulators at acc + h * as; vp value_pairs of consecutive pairs. When nkeys is odd the last
// pair's second key is read as zeros: it may be a later token that this query must not see (as a
// decode query never reads it: 0 x Inf would be NaN). The heads share each load of vp, and their
// NH x D / 16 chains are independent (one chain alone would wait on the instruction's latency).
template <int64_t DC, int NH>
inline void weigh_values(const uint16_t* p, int64_t ps, int64_t nkeys, const uint32_t* vp, float* acc, int64_t as) {
  constexpr int64_t C = DC / 16;
  const int64_t npairs = (nkeys + 1) / 2;
  vacc a[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < C; ++c) a[h][c] = load(acc + h * as + 16 * c);
  for (int64_t k = 0; k < npairs; ++k) {
    vbh pk[NH];
    for (int h = 0; h < NH; ++h) pk[h] = bset1(word(p + h * ps + 2 * k));
#pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) {
      vbh v = pdq::bload(reinterpret_cast<const uint16_t*>(vp + k * DC + 16 * c));
      if (2 * k + 1 == nkeys) v = first_of_pairs(v);
      for (int h = 0; h < NH; ++h) a[h][c] = pdq::bdot(a[h][c], pk[h], v);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < C; ++c) store(acc + h * as + 16 * c, a[h][c]);
}

// weigh_values for any number of heads (three at a time; two for head_dim 128, whose 8 chains a
// head fill the registers sooner)
template <int64_t DC>
inline void weigh_heads(const uint16_t* p, int64_t ps, int64_t nh, int64_t nkeys, const uint32_t* vp, float* acc,
                        int64_t as) {
  int64_t h = 0;
  if constexpr (DC <= 64)
    for (; h + 3 <= nh; h += 3) weigh_values<DC, 3>(p + h * ps, ps, nkeys, vp, acc + h * as, as);
  for (; h + 2 <= nh; h += 2) weigh_values<DC, 2>(p + h * ps, ps, nkeys, vp, acc + h * as, as);
  for (; h < nh; ++h) weigh_values<DC, 1>(p + h * ps, ps, nkeys, vp, acc + h * as, as);
}

// Keys whose K (then V) one pass lays out for the tile's queries (key_words, value_pairs): the
// loops over keys run this long per call. A multiple of 16, so chunks of 16 keys and pairs of
// keys sit at the same positions whatever the block size.
constexpr int64_t kSpan = 128;

// Prefetching of a head's K and V rows (each D bf16 elements, a cache line or more, one per token,
// the tokens' rows `row` apart inside scattered blocks, so the hardware prefetchers miss them).
// Pass 1 asks for K kAheadKeys keys ahead of the transpose, into L1, and for the V rows of the
// keys it transposes, into L2, when the head's V fits kStageV bytes (pass 2 then reads V from
// L2); above that (long prefill contexts) pass 2 asks for the next span's V itself. Measured on
// AMD EPYC Zen 4 (docs/decisions.md, "Decode attention's rows prefetched"): one decode query over
// 576 keys of 30 layers' caches, not in L2, ran 3x slower than over one layer's cache kept hot.
constexpr int64_t kAheadKeys = 16;
constexpr int64_t kStageV = int64_t{256} << 10;

// Rows of keys [t0, t1) (clipped at n) of one head's cache (cache at its first element; table,
// block_size, block_stride, row as Tile::run's) asked for with __builtin_prefetch locality L.
// Each key's address is computed on its own (a division each): the same addresses computed once
// per block came out as a burst and gained nothing (docs/decisions.md), the spread-out ones did.
template <int L>
inline void prefetch_keys(const uint16_t* cache, int64_t t0, int64_t t1, int64_t n, int64_t D, const int64_t* table,
                          int64_t block_size, int64_t block_stride, int64_t row) {
  for (int64_t t = t0; t < std::min(t1, n); ++t) {
    const char* p = reinterpret_cast<const char*>(cache + table[t / block_size] * block_stride + (t % block_size) * row);
    for (int64_t b = 0; b < 2 * D; b += 64) __builtin_prefetch(p + b, 0, L);
  }
}

// One KV head g of one sequence, for T consecutive queries of it (the last one's context is
// max_len tokens, query r's is max_len - T + 1 + r): items 1-5 above. Decode (T = 1) and the
// prefill tiles both run this, so a query's arithmetic is the same code whatever the call.
// Scratch buffers live in the struct (one per thread), grown as needed.
template <int64_t DC>
struct Tile {
  static constexpr int64_t D = DC, W = DC / 2;
  std::vector<float> scores, acc, mx, inv;
  std::vector<uint16_t> qw;
  std::vector<uint32_t> kt, vp;
  const uint16_t* rows_[kSpan];

  //   q: the T x group query rows (float32, unscaled), head h of query r at q + r * q_row + h * D
  //   k, v: the caches (bf16 as uint16) at this KV head's first element; block_stride, row
  //   table: the sequence's block ids; out: like q, o_row apart
  void run(const float* q, int64_t q_row, int64_t T, int64_t group, int64_t max_len, const uint16_t* k,
           const uint16_t* v, int64_t block_size, int64_t block_stride, int64_t row, const int64_t* table, float s,
           float* out, int64_t o_row) {
    const int64_t rows = T * group;
    const int64_t first = max_len - T + 1;  // query 0's context
    scores.resize(static_cast<size_t>(rows * max_len + 1));
    acc.assign(static_cast<size_t>(rows * D), 0.f);
    mx.assign(static_cast<size_t>(rows * 16), -std::numeric_limits<float>::infinity());
    inv.resize(static_cast<size_t>(rows));
    qw.resize(static_cast<size_t>(rows * D));
    kt.resize(static_cast<size_t>(kSpan * W));
    vp.resize(static_cast<size_t>(kSpan / 2 * D));
    // the rows of keys t0 .. t0 + n - 1 of one cache
    auto rows_at = [&](const uint16_t* cache, int64_t t0, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        rows_[i] = cache + table[t / block_size] * block_stride + (t % block_size) * row;
      }
      return rows_;
    };
    for (int64_t r = 0; r < T; ++r)
      for (int64_t h = 0; h < group; ++h) round_query(q + r * q_row + h * D, s, D, qw.data() + (r * group + h) * D);
    auto row_of = [&](int64_t r) { return scores.data() + r * group * max_len; };  // query r's head 0
    const bool stage_v = max_len * D * 2 <= kStageV;
    prefetch_keys<3>(k, 0, kAheadKeys, max_len, D, table, block_size, block_stride, row);
    // pass 1: scores and their maxima, kSpan keys at a time
    for (int64_t t0 = 0; t0 < max_len; t0 += kSpan) {
      const int64_t len = std::min(kSpan, max_len - t0);
      const uint16_t* const* kr = rows_at(k, t0, len);
      for (int64_t c0 = 0; c0 < len; c0 += 16) {
        const int64_t t = t0 + c0;
        prefetch_keys<3>(k, t + kAheadKeys, t + kAheadKeys + 16, max_len, D, table, block_size, block_stride, row);
        if (stage_v) prefetch_keys<2>(v, t, t + 16, max_len, D, table, block_size, block_stride, row);
        key_words(kr + c0, std::min<int64_t>(16, len - c0), D, kt.data() + c0 * W);
      }
      for (int64_t r = std::max<int64_t>(0, t0 - first + 1); r < T; ++r) {  // query r sees t < first + r
        const int64_t nr = std::min(len, first + r - t0);
        score_heads<W>(qw.data() + r * group * D, D, group, kt.data(), nr, row_of(r) + t0, max_len,
                       mx.data() + r * group * 16);
      }
    }
    // softmax weights as bf16, in place
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t L = first + i / group;
      inv[i] = 1.f / exp_round(scores.data() + i * max_len, L, max_all(mx.data() + i * 16));
    }
    // pass 2: weighted V, the same spans of keys
    const uint16_t* p16 = reinterpret_cast<const uint16_t*>(scores.data());
    if (!stage_v) prefetch_keys<3>(v, 0, kSpan, max_len, D, table, block_size, block_stride, row);
    for (int64_t t0 = 0; t0 < max_len; t0 += kSpan) {
      const int64_t len = std::min(kSpan, max_len - t0);
      if (!stage_v) prefetch_keys<2>(v, t0 + kSpan, t0 + 2 * kSpan, max_len, D, table, block_size, block_stride, row);
      value_pairs(rows_at(v, t0, len), len, D, vp.data());
      for (int64_t r = std::max<int64_t>(0, t0 - first + 1); r < T; ++r) {
        const int64_t nr = std::min(len, first + r - t0);
        weigh_heads<DC>(p16 + 2 * r * group * max_len + t0, 2 * max_len, group, nr, vp.data(),
                        acc.data() + r * group * D, D);
      }
    }
    scale_out(acc.data(), inv.data(), T * group, group, D, out, o_row);
  }
};
}  // namespace bfa

#if defined(PDQ_AMX)
// ---- attention on AMX tiles (PD_BLOCK_DOT=amx) -------------------------------------------------
// bfa's roundings (q scaled then to bf16, K and V the cache's bf16, the softmax's exp_round, the
// weights p to bf16, acc / sum) with q.k and p.v on Intel AMX tiles (TDPBF16PS, Intel SDM vol. 2),
// for a model whose linears run on them (pdq::block_rows_amx). Rows of a tile are the (query,
// head) rows of a work item, 16 at a time, in the order bfa::Tile keeps them:
//   1. scores: C[row][key] for 16 rows x 16 keys is one chain of TDPBF16PS steps over head_dim in
//      steps of 32 elements, from zero: A = 16 rows of q's bf16 (as laid out, no transpose), B =
//      16 keys' words (bfa::key_words: words down, keys across: already the VNNI layout).
//   2. the maximum and exp_round over the row's own keys, as bfa; the weights past the row's last
//      key set to zero up to the next multiple of 32 keys.
//   3. p.v: C[row][16 elements of V] += one TDPBF16PS per 32 keys of the context in order (A = 16
//      rows' weights, B = 16 pairs of keys x 16 elements, bfa::value_pairs' layout), the running
//      sums stored as float32 between spans of keys (exact). Where some rows of a tile see fewer of
//      a chunk's keys than others (the causal diagonal of a prefill tile), the chunk runs once per
//      query with the V rows past that query's last key set to zero, and only that query's rows
//      are kept: a row's chunk of weights and values is then exactly what a decode query of the
//      same context multiplies (its V past the context is zero too), and a later token's V (an Inf
//      included) never meets an earlier query's zero weight.
// Each C element depends only on its own A row and B column, so a (query, head) row's bits do not
// depend on which other rows share its tile: decoded alone, in a batch or in a prefill tile of any
// size, a query's output is the same (tests/unit/test_batch_invariance.py). The products' order
// inside one step is the hardware's, so these bits differ from bfa's (vdpbf16ps) ones.
namespace amxa {

constexpr int64_t kChunk = 32;  // keys per p.v step (16 pairs: one TDPBF16PS's depth)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scores of 16 rows (A: q rows of DC bf16 each, `a` with stride DC elements) against n16 chunks
// of 16 keys (kt: bfa::key_words of each 16 keys in turn, DC / 2 words x 16 keys each), stored to
// s + 16 c for chunk c, rows ls floats apart. Four C tiles at once share each A tile.
template <int64_t DC>
inline void qk_chunks(const uint16_t* a, const uint32_t* kt, int64_t n16, float* s, int64_t ls) {
  constexpr int64_t W = DC / 2;
  for (int64_t c = 0; c < n16; c += 4) {
    const int64_t nc = std::min<int64_t>(4, n16 - c);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* b = kt + c * 16 * W;
    for (int64_t st = 0; st < DC / 32; ++st) {
      _tile_loadd(4, a + 32 * st, DC * 2);
      _tile_loadd(5, b + st * 256, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nc > 1) {
        _tile_loadd(6, b + 16 * W + st * 256, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nc > 2) {
        _tile_loadd(7, b + 32 * W + st * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (nc > 3) {
        _tile_loadd(5, b + 48 * W + st * 256, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* sc = s + 16 * c;
    _tile_stored(0, sc, ls * 4);
    if (nc > 1) _tile_stored(1, sc + 16, ls * 4);
    if (nc > 2) _tile_stored(2, sc + 32, ls * 4);
    if (nc > 3) _tile_stored(3, sc + 48, ls * 4);
  }
}

// cout[16 rows][DC] = cin + p.v over n32 chunks of 32 keys: p the 16 rows' bf16 weights (row
// stride ps elements), vp bfa::value_pairs of the chunks' keys (DC words per pair of keys); c
// rows DC floats apart. Per 64 elements of V, four C tiles share each A tile.
template <int64_t DC>
inline void pv_chunks(const uint16_t* p, int64_t ps, const uint32_t* vp, int64_t n32, const float* cin, float* cout) {
  for (int64_t h = 0; h < DC; h += 64) {
    _tile_loadd(0, cin + h, DC * 4);
    _tile_loadd(1, cin + h + 16, DC * 4);
    _tile_loadd(2, cin + h + 32, DC * 4);
    _tile_loadd(3, cin + h + 48, DC * 4);
    for (int64_t c = 0; c < n32; ++c) {
      _tile_loadd(4, p + kChunk * c, ps * 2);
      const uint32_t* b = vp + c * 16 * DC + h;
      _tile_loadd(5, b, DC * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, DC * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, DC * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, DC * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, cout + h, DC * 4);
    _tile_stored(1, cout + h + 16, DC * 4);
    _tile_stored(2, cout + h + 32, DC * 4);
    _tile_stored(3, cout + h + 48, DC * 4);
  }
}

// bfa::Tile's contract (the same run()), the dot products on AMX tiles (items 1-3 above). One
// per thread: it configures the thread's tiles when made and releases them when destroyed
// (pdq::amx_permitted() must have been true).
template <int64_t DC>
struct Tile {
  static constexpr int64_t D = DC, W = DC / 2;
  std::vector<float> scores, acc, inv, tmp;
  std::vector<uint16_t> qw;
  std::vector<uint32_t> kt, vp, vz;
  const uint16_t* rows_[bfa::kSpan];

  Tile() { _tile_loadconfig(pdq::amx_config()); }
  ~Tile() { _tile_release(); }
  Tile(const Tile&) = delete;
  Tile& operator=(const Tile&) = delete;

  void run(const float* q, int64_t q_row, int64_t T, int64_t group, int64_t max_len, const uint16_t* k,
           const uint16_t* v, int64_t block_size, int64_t block_stride, int64_t row, const int64_t* table, float s,
           float* out, int64_t o_row) {
    const int64_t rows = T * group, rows_pad = round_up(rows, 16);
    const int64_t first = max_len - T + 1;  // query 0's context
    const int64_t ls = round_up(max_len, kChunk);  // a row's floats of scores (then 2 ls bf16 weights)
    if (scores.size() < static_cast<size_t>(rows_pad * ls)) scores.resize(static_cast<size_t>(rows_pad * ls));
    acc.assign(static_cast<size_t>(rows_pad * D), 0.f);
    inv.resize(static_cast<size_t>(rows));
    tmp.resize(static_cast<size_t>(16 * D));
    qw.assign(static_cast<size_t>(rows_pad * D), 0);
    kt.resize(static_cast<size_t>(bfa::kSpan * W));
    vp.resize(static_cast<size_t>(bfa::kSpan / 2 * D));
    vz.resize(static_cast<size_t>(bfa::kSpan / 2 * D));
    auto rows_at = [&](const uint16_t* cache, int64_t t0, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        rows_[i] = cache + table[t / block_size] * block_stride + (t % block_size) * row;
      }
      return rows_;
    };
    for (int64_t r = 0; r < T; ++r)
      for (int64_t h = 0; h < group; ++h)
        bfa::round_query(q + r * q_row + h * D, s, D, qw.data() + (r * group + h) * D);
    // the queries of rows a0 .. a0 + 15 (the last real one): the first's and last's context
    auto first_query = [&](int64_t a0) { return a0 / group; };
    auto last_query = [&](int64_t a0) { return (std::min(rows, a0 + 16) - 1) / group; };
    // K and V rows prefetched as bfa::Tile::run does (bfa::prefetch_keys)
    const bool stage_v = max_len * D * 2 <= bfa::kStageV;
    bfa::prefetch_keys<3>(k, 0, bfa::kAheadKeys, max_len, D, table, block_size, block_stride, row);
    // pass 1: scores, 128 keys at a time
    for (int64_t t0 = 0; t0 < max_len; t0 += bfa::kSpan) {
      const int64_t len = std::min(bfa::kSpan, max_len - t0);
      const uint16_t* const* kr = rows_at(k, t0, len);
      for (int64_t c0 = 0; c0 < len; c0 += 16) {
        const int64_t t = t0 + c0;
        bfa::prefetch_keys<3>(k, t + bfa::kAheadKeys, t + bfa::kAheadKeys + 16, max_len, D, table, block_size,
                              block_stride, row);
        if (stage_v) bfa::prefetch_keys<2>(v, t, t + 16, max_len, D, table, block_size, block_stride, row);
        bfa::key_words(kr + c0, std::min<int64_t>(16, len - c0), D, kt.data() + c0 * W);
      }
      for (int64_t a0 = 0; a0 < rows; a0 += 16) {
        const int64_t nk = std::min(len, first + last_query(a0) - t0);  // keys the tile's last query sees
        if (nk <= 0) continue;
        qk_chunks<DC>(qw.data() + a0 * D, kt.data(), (nk + 15) / 16, scores.data() + a0 * ls + t0, ls);
      }
    }
    // softmax weights as bf16, in place, zero past each row's keys up to ls
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t L = first + i / group;
      float* x = scores.data() + i * ls;
      inv[i] = 1.f / bfa::exp_round(x, L, max_into(-std::numeric_limits<float>::infinity(), x, L));
      uint16_t* y = reinterpret_cast<uint16_t*>(x);
      std::fill(y + L, y + ls, uint16_t{0});
    }
    // pass 2: weighted V, the same spans of keys
    const uint16_t* p16 = reinterpret_cast<const uint16_t*>(scores.data());
    if (!stage_v) bfa::prefetch_keys<3>(v, 0, bfa::kSpan, max_len, D, table, block_size, block_stride, row);
    for (int64_t t0 = 0; t0 < max_len; t0 += bfa::kSpan) {
      const int64_t len = std::min(bfa::kSpan, max_len - t0);
      if (!stage_v)
        bfa::prefetch_keys<2>(v, t0 + bfa::kSpan, t0 + 2 * bfa::kSpan, max_len, D, table, block_size, block_stride,
                              row);
      bfa::value_pairs(rows_at(v, t0, len), len, D, vp.data());
      const int64_t pairs = (len + 1) / 2, padded = round_up(len, kChunk) / 2;
      std::fill(vp.begin() + pairs * D, vp.begin() + padded * D, 0u);
      for (int64_t a0 = 0; a0 < rows; a0 += 16) {
        const int64_t r0 = first_query(a0), r1 = last_query(a0);
        const int64_t lmin = first + r0 - t0, lmax = first + r1 - t0;  // keys of this span they see
        if (lmax <= 0) continue;
        const uint16_t* pa = p16 + a0 * 2 * ls + t0;
        float* ca = acc.data() + a0 * D;
        // chunks every row sees whole (past the span's end only past the context's: zero pairs)
        const int64_t common = lmin >= len ? round_up(len, kChunk) : std::max<int64_t>(0, lmin) / kChunk * kChunk;
        if (common > 0) pv_chunks<DC>(pa, 2 * ls, vp.data(), common / kChunk, ca, ca);
        for (int64_t r = r0; r <= r1; ++r) {  // the rest, query by query
          const int64_t L = std::min(len, first + r - t0);
          if (L <= common) continue;
          const int64_t end = round_up(L, kChunk) / 2;  // pairs the chunks hold
          std::copy(vp.begin() + common / 2 * D, vp.begin() + end * D, vz.begin() + common / 2 * D);
          if (L % 2) {  // the last key's partner: zero
            uint32_t* w = vz.data() + L / 2 * D;
            for (int64_t d = 0; d < D; ++d) w[d] &= 0xFFFFu;
          }
          std::fill(vz.begin() + (L + 1) / 2 * D, vz.begin() + end * D, 0u);
          pv_chunks<DC>(pa + common, 2 * ls, vz.data() + common / 2 * D, (L - common + kChunk - 1) / kChunk, ca,
                        tmp.data());
          for (int64_t i = std::max(a0, r * group); i < std::min(a0 + 16, (r + 1) * group); ++i)
            std::copy(tmp.begin() + (i - a0) * D, tmp.begin() + (i - a0 + 1) * D, acc.begin() + i * D);
        }
      }
    }
    bfa::scale_out(acc.data(), inv.data(), T * group, group, D, out, o_row);
  }
};
}  // namespace amxa
#endif  // PDQ_AMX

// run's bf16 twin (see bfa above): decode queries, one per sequence; a work item is one
// (sequence, KV head), computed by TileT (bfa::Tile, or amxa::Tile on AMX) as a tile of one query.
template <int64_t DC, template <int64_t> class TileT = bfa::Tile>
void run_bf16(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  static_assert(DC % 32 == 0, "head_dim a multiple of 32");
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t row = num_kv_heads * DC, block_stride = block_size * row;
  const float* q = query.data_ptr<float>();
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for_each_item(batch * num_kv_heads, [&](auto&& next_item) {
    TileT<DC> tile;
    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t b = item / num_kv_heads, g = item % num_kv_heads;
      const int64_t at = (b * num_heads + g * group) * DC;
      tile.run(q + at, 0, 1, group, lens[b], kc + g * DC, vc + g * DC, block_size, block_stride, row,
               tables + b * max_blocks, static_cast<float>(scale), o + at, 0);
    }
  });
}

// run_prefill's bf16 twin: work items (tile of queries, KV head), each a TileT, so every
// query is reduced exactly as run_bf16<DC, TileT> reduces it.
template <int64_t DC, template <int64_t> class TileT = bfa::Tile>
void run_prefill_bf16(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_table, int64_t context_len, double scale, int64_t tile_arg,
                      torch::Tensor& out) {
  static_assert(DC % 32 == 0, "head_dim a multiple of 32");
  const int64_t n = query.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * DC, block_stride = block_size * row;
  const int64_t prefix = context_len - n;
  const int64_t tile = prefill_tile(n, group, context_len, num_kv_heads, tile_arg, /*balance=*/false);
  const int64_t num_tiles = (n + tile - 1) / tile;
  const float* q = query.data_ptr<float>();
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t* table = block_table.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  // items: (tile, kv head), the largest tiles (the last queries see the most keys) first
  for_each_item(num_tiles * num_kv_heads, [&](auto&& next_item) {
    TileT<DC> t;
    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t ti = num_tiles - 1 - item / num_kv_heads, g = item % num_kv_heads;
      const int64_t i0 = ti * tile, i1 = std::min(n, i0 + tile);
      const int64_t at = (i0 * num_heads + g * group) * DC;
      t.run(q + at, num_heads * DC, i1 - i0, group, prefix + i1, kc + g * DC, vc + g * DC, block_size, block_stride,
            row, table, static_cast<float>(scale), o + at, num_heads * DC);
    }
  });
}
#endif  // PDQ_BF16

template <typename KV>
void dispatch(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  switch (query.size(2)) {
    case 64: return run<KV, 64>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
    case 128: return run<KV, 128>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
    default: return run<KV, 0>(query, k_cache, v_cache, block_tables, context_lens, scale, out);
  }
}

template <typename KV>
void dispatch_prefill(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_table, int64_t context_len, double scale, int64_t tile,
                      torch::Tensor& out) {
  switch (query.size(2)) {
    case 64: return run_prefill<KV, 64>(query, k_cache, v_cache, block_table, context_len, scale, tile, out);
    case 128: return run_prefill<KV, 128>(query, k_cache, v_cache, block_table, context_len, scale, tile, out);
    default: return run_prefill<KV, 0>(query, k_cache, v_cache, block_table, context_len, scale, tile, out);
  }
}

}  // namespace

// Whether bf16=true can run: the build has bf16 dot products (AVX512-BF16, or the emulated test
// build) and the call has a bf16 cache and head_dim 64 or 128.
bool bf16_supported(const torch::Tensor& query, const torch::Tensor& k_cache) {
#if defined(PDQ_BF16)
  return k_cache.scalar_type() == torch::kBFloat16 && (query.size(2) == 64 || query.size(2) == 128);
#else
  (void)query;
  (void)k_cache;
  return false;
#endif
}

// Whether amx=true can run: bf16=true can, and the build has AMX tiles which the OS granted.
bool amx_supported(const torch::Tensor& query, const torch::Tensor& k_cache) {
#if defined(PDQ_AMX)
  return bf16_supported(query, k_cache) && pdq::has_amx();
#else
  (void)query;
  (void)k_cache;
  return false;
#endif
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale, bool bf16,
                                     bool amx) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head_dim differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(!bf16 || bf16_supported(query, k_cache),
              "bf16 dot products need a build with them (has_bf16), a bf16 cache and head_dim 64 or 128");
  TORCH_CHECK(!amx || amx_supported(query, k_cache),
              "amx needs a build with AMX tiles granted by the OS (has_amx), a bf16 cache and head_dim 64 or 128");
  auto q = query.to(torch::kFloat32).contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
#if defined(PDQ_AMX)
  if (amx) {
    if (q.size(2) == 64) run_bf16<64, amxa::Tile>(q, k_cache, v_cache, tables, lens, scale, out);
    else run_bf16<128, amxa::Tile>(q, k_cache, v_cache, tables, lens, scale, out);
    return out.to(query.scalar_type());
  }
#endif
#if defined(PDQ_BF16)
  if (bf16) {
    if (q.size(2) == 64) run_bf16<64>(q, k_cache, v_cache, tables, lens, scale, out);
    else run_bf16<128>(q, k_cache, v_cache, tables, lens, scale, out);
    return out.to(query.scalar_type());
  }
#endif
  if (k_cache.scalar_type() == torch::kFloat32) {
    dispatch<float>(q, k_cache, v_cache, tables, lens, scale, out);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32 or bfloat16");
  }
  return out.to(query.scalar_type());
}

// Batch-invariant prefill attention (run_prefill above): query [n, H, D] are the last n positions
// of a context of context_len tokens already in the cache; tile <= 0 picks the tile size. bf16:
// run_prefill_bf16, the arithmetic of paged_decode_attention(..., bf16=true); amx: on AMX tiles
// (amxa), the arithmetic of paged_decode_attention(..., amx=true).
torch::Tensor paged_prefill_attention_tiled(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                            torch::Tensor block_table, int64_t context_len, double scale,
                                            int64_t tile, bool bf16, bool amx) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head_dim differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(context_len >= query.size(0), "context_len must cover the queries");
  TORCH_CHECK(!bf16 || bf16_supported(query, k_cache),
              "bf16 dot products need a build with them (has_bf16), a bf16 cache and head_dim 64 or 128");
  TORCH_CHECK(!amx || amx_supported(query, k_cache),
              "amx needs a build with AMX tiles granted by the OS (has_amx), a bf16 cache and head_dim 64 or 128");
  auto q = query.to(torch::kFloat32).contiguous();
  auto table = block_table.to(torch::kInt64).contiguous();
  TORCH_CHECK(table.dim() == 1 && table.size(0) * k_cache.size(1) >= context_len, "block_table too short");
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out.to(query.scalar_type());
#if defined(PDQ_AMX)
  if (amx) {
    if (q.size(2) == 64) run_prefill_bf16<64, amxa::Tile>(q, k_cache, v_cache, table, context_len, scale, tile, out);
    else run_prefill_bf16<128, amxa::Tile>(q, k_cache, v_cache, table, context_len, scale, tile, out);
    return out.to(query.scalar_type());
  }
#endif
#if defined(PDQ_BF16)
  if (bf16) {
    if (q.size(2) == 64) run_prefill_bf16<64>(q, k_cache, v_cache, table, context_len, scale, tile, out);
    else run_prefill_bf16<128>(q, k_cache, v_cache, table, context_len, scale, tile, out);
    return out.to(query.scalar_type());
  }
#endif
  if (k_cache.scalar_type() == torch::kFloat32) {
    dispatch_prefill<float>(q, k_cache, v_cache, table, context_len, scale, tile, out);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    dispatch_prefill<at::BFloat16>(q, k_cache, v_cache, table, context_len, scale, tile, out);
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

// RMSNorm (Zhang & Sennrich, 2019) in one pass per row, as transformers' Llama computes it:
// y = weight * (x / sqrt(mean(x^2) + eps)), all in float32. The module does it in five or
// six tensor ops, each a pass over memory plus a dispatch; at decode batch sizes the
// dispatches are most of the cost.
//   x [M, H] float32, weight [H] float32; returns [M, H] float32
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "bad shapes");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 only");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t M = xc.size(0), H = xc.size(1);
  auto out = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * H;
      float* orow = op + m * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * r);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm over the last dimension (CPU, float32)");
  m.def("paged_decode_attention", &paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        "paged decode attention (CPU); bf16: q.k and p.v as bf16 dot products (has_bf16, bf16 cache); amx: the same "
        "roundings on AMX tiles (has_amx)", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("bf16") = false, py::arg("amx") = false);
  m.def("paged_prefill_attention_tiled", &paged_prefill_attention_tiled, py::call_guard<py::gil_scoped_release>(),
        "batch-invariant prefill attention: the decode kernel's per-query arithmetic, K/V read once per query tile (CPU)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"),
        py::arg("scale"), py::arg("tile"), py::arg("bf16") = false, py::arg("amx") = false);
#if defined(PDQ_BF16)
  m.attr("has_bf16") = true;  // bf16=true accepted (AVX512-BF16, or the emulated test build)
#else
  m.attr("has_bf16") = false;
#endif
#if defined(PDQ_AMX)
  m.attr("has_amx") = pdq::has_amx();  // amx=true accepted (AMX tiles, granted by the OS)
#else
  m.attr("has_amx") = false;
#endif
  m.def("linear_small_batch", &linear_small_batch, py::call_guard<py::gil_scoped_release>(), "x W^T for a few rows of x (CPU)");
}
