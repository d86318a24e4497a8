// GGUF 32-element blocks multiplied as stored: the inner loops shared by quant_linear.cpp
// (one layer per call) and fused_decode.cpp (a whole decoder layer per call).
//
//   4-bit (Q4_0 / Q4_1): per 32 inputs, 16 bytes of codes (byte j: element j in the low
//   nibble, element j + 16 in the high one, as ggml's dequantize_row_q4_1), w = q * d + m
//   (Q4_0: m = -8 d, exact in float16 while |d| <= 8188);  8-bit (Q8_0): 32 int8 codes, w = q * d.
//   d and m are the file's float16 [N, K / 32] as stored (scale_t): 4 bytes a group where float32
//   took 8, so a 4-bit row is 17 % fewer bytes to stream. Each entry point widens a tile's
//   scales to float32 (exact) once, into a buffer of its thread (TileScales), and the loops read
//   those: the arithmetic is unchanged.
//
// ISA: chosen at build time from the compiler's target flags (the extensions are built with
// -march=native on the machine that runs them, keyed on its CPU flags): AVX-512 (F + BW) when
// defined, else AVX2 + FMA. See block_rows_with for the two ways a call runs (few rows: widen
// in registers; more: widen four weight rows once into an L1 buffer, then register tiles of
// kTileRows x kTileCols).
//
// Two arithmetics, chosen by the caller once per weight object (never per call or row count),
// run by the same loops (block_rows_with, written once over an arithmetic type: F32Fma,
// Bf16Dot):
//   * float32 (block_rows): x float32, weights widened to float32 exactly, float32 FMAs. The
//     only path of float32 models and of CPUs without AVX512-BF16.
//   * bf16 dot products (block_rows_bf16, only where __AVX512BF16__ is defined: a bfloat16
//     model on e.g. AMD Zen 4 / Intel Cooper Lake+): where it rounds, (1) each weight
//     w = q d (+ m) is computed in float32 as above (one FMA) and rounded to bf16 to nearest
//     even (vcvtne2ps2bf16: the bits torch's .to(torch.bfloat16) gives the de-quantized
//     float32 weights, except that float32 denormals become zero); (2) each row of x is
//     rounded to bf16 the same way once per call (round_rows_bf16); (3) `vdpbf16ps` adds
//     the exact products of pairs of bf16 to float32 accumulators (float32 rounding per add).
//     One instruction does 32 multiply-adds where an FMA does 16.
//
// Row independence: every (row of x, weight row) pair is reduced by the same instruction
// sequence whatever the number of rows in the call or the path taken (one accumulator vector
// over K in order, then one horizontal sum; for bf16, one vdpbf16ps chain over K in steps of
// 32), so a row's result is bit-identical alone or inside a batch. The batch-invariance work
// (issue 13) relies on this.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pdq {



constexpr int64_t G = 32;

// A scale or minimum as the file stores it: IEEE binary16 bits. f16 widens one to float32,
// exactly (every binary16 value is a float32 value).
using scale_t = uint16_t;
inline float f16(scale_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  uint32_t u = sign;
  if (e == 0x1F) u |= 0x7F800000u | (f << 13) | (f ? 0x400000u : 0u);  // Inf; NaN made quiet, as vcvtph2ps does
  else if (e != 0) u |= ((e + 112) << 23) | (f << 13);
  else if (f != 0) {  // subnormal: f 2^-24 = (1.f') 2^(e' - 127)
    int top = 9;
    while (!(f & (1u << top))) --top;
    u |= static_cast<uint32_t>(top + 103) << 23 | ((f << (23 - top)) & 0x7FFFFFu);
  }
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// n float16 values widened to float32 (exact), 16 or 8 at a time.
inline void widen_f16(const scale_t* s, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __F16C__
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
#endif
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
  for (; i < n; ++i) out[i] = f16(s[i]);
}

// The scales (and, 4-bit, minimums) of a tile of weight rows, widened to float32 once per tile
// into this thread's buffers: the loops below read floats (a broadcast from memory per group);
// memory and the caches hold halves. Widening each value where it is read instead cost a batch-1
// decode step 12 % (four instructions per scale per group, on a step bound by instructions;
// measured on AMD EPYC Zen 4, docs/decisions.md).
// The thread's buffer is looked up once per call of an entry point (the constructor), not per tile.
struct TileScales {
  const float* d = nullptr;
  const float* m = nullptr;  // = d for 8-bit
  float* buffer;
  int64_t capacity;  // values per tile at most
  explicit TileScales(int64_t most) : capacity(most) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(2 * most)) scratch.resize(static_cast<size_t>(2 * most));
    buffer = scratch.data();
  }
  // n <= capacity values of d (and m) widened
  template <bool Q4>
  void widen(const scale_t* dh, const scale_t* mh, int64_t n) {
    widen_f16(dh, n, buffer);
    if constexpr (Q4) widen_f16(mh, n, buffer + capacity);
    d = buffer;
    m = Q4 ? buffer + capacity : d;
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PDQ_AVX512 1
inline constexpr const char* kIsa = "avx512";
#define PDQ_AVX2_INLINE inline
#define PDQ_AVX2_UNROLL
#else
inline constexpr const char* kIsa = "avx2";
// Forced inlining and unrolling of the small-row register tiles (see tile_registers).
#define PDQ_AVX2_INLINE inline __attribute__((always_inline))
#define PDQ_AVX2_UNROLL _Pragma("GCC unroll 8")
#endif

// pin_x(v): keeps a vector of x, once loaded, in a register for the FMAs of a register tile (an
// empty asm that says it reads and writes v). AVX2 has 16 vector registers; with a tile's
// accumulators and weight vectors in them GCC folded the load of x into each FMA as its memory
// operand instead, so the 6 x 2 tile issued 14 loads per 12 FMAs where 8 do, and the loads, not
// the FMAs, set the pace (`perf annotate` of the tile's loop). Pinned, a 64-row call ran at
// 1.3-1.4x and calls of 2-4 rows at 1.05-1.3x (AMD EPYC Zen 3, docs/decisions.md, "AVX2: x kept
// in registers"). The FMAs and their order are unchanged, so are the bits. AVX-512 builds (32
// registers) already kept x in a register; only an AVX2 __m256 is pinned (the emulated bf16
// build's operands are structures, left alone).
template <typename T>
PDQ_AVX2_INLINE void pin_x(T&) {}
#ifndef PDQ_AVX512
PDQ_AVX2_INLINE void pin_x(__m256& v) { __asm__("" : "+x"(v)); }
#endif

// The 32 weights of one group as four vectors of 8 floats (AVX2; also used to de-quantize).
template <bool Q4>
PDQ_AVX2_INLINE void load_group(const uint8_t* codes, float d, float m, __m256 w[4]) {
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

// One vector of float32 lanes: 16 (AVX-512) or 8 (AVX2).
#ifdef PDQ_AVX512
using vf = __m512;
constexpr int64_t L = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
using vf = __m256;
constexpr int64_t L = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf v) { return hsum(v); }
#endif
constexpr int V = G / L;  // vectors per group

// The 32 weights of group g of one weight row as V vectors, w = q d (+ m).
template <bool Q4>
PDQ_AVX2_INLINE void group_vectors(const uint8_t* codes, const float* d, const float* m, int64_t g, vf w[V]) {
  constexpr int64_t bytes = Q4 ? G / 2 : G;
  const uint8_t* c = codes + g * bytes;
#ifdef PDQ_AVX512
  const __m512 vd = _mm512_set1_ps(d[g]);
  if constexpr (Q4) {
    const __m512 vm = _mm512_set1_ps(m[g]);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i mask = _mm_set1_epi8(0x0F);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))), vd, vm);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))), vd, vm);
  } else {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))), vd);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)))), vd);
  }
#else
  load_group<Q4>(c, d[g], Q4 ? m[g] : 0.f, w);
#endif
}

// Called for each group g of a tile of four weight rows read from the blocks (codes at the tile's
// first row): prefetches the next four rows' codes (one line per 64 bytes, at the same offset).
// The hardware prefetchers lose the four interleaved row streams: a cold 32 MB Q8_0 LM head read
// at 3.6 GB/s per core, where a sequential sum reads 16 GB/s (AVX2 EPYC, docs/decisions.md).
// Prefetching past the caller's rows (another thread's, or the end) is harmless.
#ifndef PDQ_AHEAD
#define PDQ_AHEAD 16  // weight rows ahead (four tiles)
#endif
template <bool Q4>
inline void prefetch_next_tile(const uint8_t* codes, int64_t row_bytes, int64_t g) {
  if constexpr (PDQ_AHEAD == 0) return;
  constexpr int64_t bytes = Q4 ? G / 2 : G;
  if ((g * bytes) % 64 == 0)
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(codes + (PDQ_AHEAD + j) * row_bytes + g * bytes), _MM_HINT_T0);
}

// Called once per tile of four weight rows (scales, minimums at the tile's first row, float16):
// prefetches the scales and minimums of the four rows PDQ_AHEAD ahead (4 ng halves each, one line
// per 32), which TileScales widens when their tile starts.
template <bool Q4>
inline void prefetch_next_scales(const scale_t* d, const scale_t* m, int64_t ng) {
  if constexpr (PDQ_AHEAD == 0) return;
  for (int64_t i = 0; i < 4 * ng; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(d + PDQ_AHEAD * ng + i), _MM_HINT_T0);
    if constexpr (Q4) _mm_prefetch(reinterpret_cast<const char*>(m + PDQ_AHEAD * ng + i), _MM_HINT_T0);
  }
}

// ---- bf16 values (AVX512-BF16) ---------------------------------------------------------------
// Scalar models of one float32 -> bf16 rounding (vcvtne2ps2bf16: to nearest even, denormals
// flushed, NaN kept quiet) and of bf16 -> float32 (exact).
inline uint16_t bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;  // denormal -> signed zero (the instruction's DAZ/FTZ)
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN -> quiet
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// vbh: 32 bf16 (one vdpbf16ps operand); vacc: its 16 float32 accumulator lanes. Native where
// __AVX512BF16__ is defined; PDQ_BF16_EMULATE (the test build, any CPU) models the three
// instructions in scalar code, lanes as Intel's pseudo-code orders them, so the same loops run
// and their tiling and row independence are tested without the instructions.
#if defined(PDQ_BF16_EMULATE)
#define PDQ_BF16 1
inline constexpr bool kBf16Native = false;
struct vbh { uint16_t e[32]; };  // 32 bf16
struct vacc { float f[16]; };    // 16 float32 lanes
inline vacc bzero() { return vacc{}; }
inline vbh bload(const uint16_t* p) { vbh v; std::memcpy(v.e, p, sizeof v.e); return v; }
inline void bstore(uint16_t* p, vbh v) { std::memcpy(p, v.e, sizeof v.e); }
// 32 float32 -> 32 bf16 in order.
inline vbh bpack(const float* p) { vbh v; for (int i = 0; i < 32; ++i) v.e[i] = bf16_rne(p[i]); return v; }
// Intel SDM, VDPBF16PS: srcdest.fp32[i] += a[2i+1] b[2i+1]; srcdest.fp32[i] += a[2i] b[2i], with
// denormal inputs read as zero and each sum's denormal result flushed to zero (the product itself
// is exact, not flushed: measured on AMD Zen 4, with the native build giving these bits).
inline float bf16_daz(uint16_t h) { return bf16_float((h & 0x7F80u) == 0 ? static_cast<uint16_t>(h & 0x8000u) : h); }
inline float ftz(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
  std::memcpy(&x, &u, 4);
  return x;
}
inline vacc bdot(vacc acc, vbh a, vbh b) {
  for (int i = 0; i < 16; ++i) {
    // the products are exact in float32, so contracting either step into an FMA changes nothing
    const float t = ftz(acc.f[i] + bf16_daz(a.e[2 * i + 1]) * bf16_daz(b.e[2 * i + 1]));
    acc.f[i] = ftz(t + bf16_daz(a.e[2 * i]) * bf16_daz(b.e[2 * i]));
  }
  return acc;
}
// _mm512_reduce_add_ps's order: halves of 8, 4, 2, 1 lanes added pairwise.
inline float bsum(vacc v) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v.f[i] = v.f[i] + v.f[i + w];
  return v.f[0];
}
#elif defined(PDQ_AVX512) && defined(__AVX512BF16__)
#define PDQ_BF16 1
inline constexpr bool kBf16Native = true;
using vbh = __m512bh;
using vacc = __m512;
inline vacc bzero() { return _mm512_setzero_ps(); }
inline vbh bload(const uint16_t* p) { return (vbh)_mm512_loadu_si512(p); }
inline void bstore(uint16_t* p, vbh v) { _mm512_storeu_si512(p, (__m512i)v); }
// _mm512_cvtne2ps_pbh(a, b) puts b's 16 values in the low half: (hi, lo) keeps the order.
inline vbh bpack2(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }
inline vbh bpack(const float* p) { return bpack2(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)); }
inline vacc bdot(vacc acc, vbh a, vbh b) { return _mm512_dpbf16_ps(acc, a, b); }
inline float bsum(vacc v) { return _mm512_reduce_add_ps(v); }
#endif

// ---- The arithmetics of the float loops --------------------------------------------------------
// The loops below (tile_registers, tile_widened, block_rows_with) are written once over an
// arithmetic A, a type that says how one group of 32 weights is widened and what one step of an
// accumulator chain is:
//   A::X, A::W   one element of a row of x as the loops read it / of the widened weight buffer
//   A::Wv        one step's operand vector: A::kStep elements (of x or of w), in element order
//   A::Acc       one step's accumulator vector (float32 lanes)
//   A::kSteps    steps per group of 32 weights (G / kStep)
//   A::group<Q4>(codes, d, m, g, w[kSteps]): the 32 weights of group g of one weight row
//   A::load(p), A::store(p, w): one operand vector from / to memory (x, the widened buffer)
//   A::zero(), A::step(acc, x, w), A::sum(acc): the chain (where it rounds, with A::group)
// x arrives already in A::X (the callers round it once per call for bf16, round_rows_bf16).

// float32: x float32; w = q d (+ m) in float32 by group_vectors (one FMA for 4-bit, one
// multiply for 8-bit, rounding once); a step is one float32 FMA per lane (vfmadd*ps over L
// lanes: acc = w x + acc, one rounding); the sum is vsum (hsum's or _mm512_reduce_add_ps's order).
struct F32Fma {
  using X = float;
  using W = float;
  using Wv = vf;
  using Acc = vf;
  static constexpr int64_t kStep = L;
  static constexpr int kSteps = V;
  template <bool Q4>
  static void group(const uint8_t* codes, const float* d, const float* m, int64_t g, Wv w[kSteps]) {
    group_vectors<Q4>(codes, d, m, g, w);
  }
  static Wv load(const X* p) { return vload(p); }
  static void store(W* p, Wv w) { std::memcpy(p, &w, sizeof(vf)); }
  static Acc zero() { return vzero(); }
  static Acc step(Acc acc, Wv x, Wv w) { return vfma(w, x, acc); }
  static float sum(Acc acc) { return vsum(acc); }
};

#ifdef PDQ_BF16
// bf16 dot products. Where it rounds: (1) each weight w = q d (+ m) is computed in float32
// exactly as the float32 path does (group_vectors), then rounded to bf16 to nearest even
// (`vcvtne2ps2bf16`; the same bits as torch's .to(torch.bfloat16) of the de-quantized float32
// weights, except that the instruction flushes float32 denormals (|w| < 2^-126) to zero);
// (2) each row of x is rounded to bf16 the same way once per call (block_rows_bf16's caller,
// round_rows_bf16); (3) a step is one `vdpbf16ps` over 32 elements: lane i adds the exact
// float32 products of elements 2i+1 then 2i to its accumulator, rounding to float32 per add
// (one instruction does 32 multiply-adds where an FMA does 16); the sum is
// _mm512_reduce_add_ps's order.
struct Bf16Dot {
  using X = uint16_t;
  using W = uint16_t;
  using Wv = vbh;
  using Acc = vacc;
  static constexpr int64_t kStep = G;
  static constexpr int kSteps = 1;
  template <bool Q4>
  static void group(const uint8_t* codes, const float* d, const float* m, int64_t g, Wv w[kSteps]) {
#if !defined(PDQ_BF16_EMULATE)
    if constexpr (Q4) {
      // A 4-bit group has 16 possible weights: round the 16 values q d + m (q = 0..15, one FMA
      // each, as group_vectors computes them) to bf16 once, then look each code up (vpermw).
      // The same bits as widening every weight (fma(q, d, m), then vcvtne2ps2bf16), with 5
      // 512-bit instructions per group instead of 8 (two widenings, two conversions, two FMAs
      // and a pack): the batch-1 decode step is bound by these (docs/decisions.md).
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * (G / 2)));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(raw, mask);                       // elements 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);    // elements 16..31
      const __m512i idx = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
      const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                         14.f, 15.f);
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[g]), _mm512_set1_ps(m[g]));
      const __m256i table16 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(table));
      w[0] = reinterpret_cast<vbh>(_mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(table16)));
      return;
    }
#endif
    vf f[V];
    group_vectors<Q4>(codes, d, m, g, f);
#if defined(PDQ_BF16_EMULATE)
    alignas(64) float p[G];
    for (int v = 0; v < V; ++v) std::memcpy(p + v * L, &f[v], sizeof(vf));
    w[0] = bpack(p);
#else
    w[0] = bpack2(f[0], f[1]);
#endif
  }
  static Wv load(const X* p) { return bload(p); }
  static void store(W* p, Wv w) { bstore(p, w); }
  static Acc zero() { return bzero(); }
  static Acc step(Acc acc, Wv x, Wv w) { return bdot(acc, x, w); }
  static float sum(Acc acc) { return bsum(acc); }
};
#endif

// ---- The loops, once for both arithmetics ------------------------------------------------------
// Reduction order, the same for every (row of x, weight row) pair whatever the call's shape:
// one accumulator, acc = A::step(acc, x[k..k+kStep), w[k..k+kStep)) for k = 0, kStep,
// 2 kStep, ... in order (float32: fma(w, x, acc) over L lanes; bf16: one vdpbf16ps over 32,
// lane i taking elements k+2i and k+2i+1), then one A::sum. Both paths below follow it, so a
// row's result does not depend on how many rows the call has, on the path taken, nor on how
// weight rows are split over threads or tiled.

// Small M (<= kRegisterRows rows of x): NB weight rows against R rows, groups widened in
// registers. Prefetch: whether this call prefetches the next tile of four weight rows (false
// for the second pair of a tile that rows_registers_wide splits in two).
// (AVX2 builds: always inlined with its loops unrolled, and so are load_group / group_vectors
// (PDQ_AVX2_INLINE). Left to its own choice GCC compiled the one-row tile of the 4-bit float32
// path in quant_linear.cpp with the group's widening as a call and the accumulators on the
// stack: 12 GFLOP/s where two rows ran at 29; inlined, 18-19 (AMD EPYC Zen 3, one thread,
// docs/decisions.md). The instructions of each accumulator chain are unchanged, so are the bits.
// AVX-512 builds keep the compiler's choice, the code measured on those machines.)
template <typename A, bool Q4, int R, int NB, bool Prefetch = true>
PDQ_AVX2_INLINE void tile_registers(const typename A::X* x, int64_t K, const uint8_t* codes, const float* d,
                                    const float* m, int64_t row_bytes, int64_t ng, float* y, int64_t ldy) {
  typename A::Acc acc[R][NB];
  PDQ_AVX2_UNROLL
  for (int r = 0; r < R; ++r)
    PDQ_AVX2_UNROLL
    for (int j = 0; j < NB; ++j) acc[r][j] = A::zero();
  for (int64_t g = 0; g < ng; ++g) {
    if constexpr (Prefetch) prefetch_next_tile<Q4>(codes, row_bytes, g);
    typename A::Wv w[NB][A::kSteps];
    PDQ_AVX2_UNROLL
    for (int j = 0; j < NB; ++j)
      A::template group<Q4>(codes + j * row_bytes, d + j * ng, Q4 ? m + j * ng : d, g, w[j]);
    PDQ_AVX2_UNROLL
    for (int v = 0; v < A::kSteps; ++v)
      PDQ_AVX2_UNROLL
      for (int r = 0; r < R; ++r) {
        typename A::Wv xv = A::load(x + r * K + g * G + v * A::kStep);
        pin_x(xv);
        PDQ_AVX2_UNROLL
        for (int j = 0; j < NB; ++j) acc[r][j] = A::step(acc[r][j], xv, w[j][v]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * ldy + j] = A::sum(acc[r][j]);
}

// Larger M: NB weight rows already widened (w [NB, K] of A::W, row stride K) against R rows.
// (always inlined with its loops unrolled, so the R x NB accumulators stay in registers: left to
// its own choice GCC kept them in memory in block_rows<false> and ran at half the speed)
template <typename A, int R, int NB>
inline __attribute__((always_inline)) void tile_widened(const typename A::X* x, int64_t K, const typename A::W* w,
                                                        float* y, int64_t ldy) {
  typename A::Acc acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[r][j] = A::zero();
  for (int64_t k = 0; k < K; k += A::kStep) {
    typename A::Wv wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = A::load(w + j * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      typename A::Wv xv = A::load(x + r * K + k);
      pin_x(xv);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[r][j] = A::step(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * ldy + j] = A::sum(acc[r][j]);
}

// M <= 4 rows of x against the NB weight rows at codes, as one register tile of M x NB.
template <typename A, bool Q4, int NB, bool Prefetch = true>
inline void rows_registers(const typename A::X* x, int64_t M, int64_t K, const uint8_t* codes, const float* d,
                           const float* m, int64_t row_bytes, int64_t ng, float* y, int64_t ldy) {
  switch (M) {
    case 4: tile_registers<A, Q4, 4, NB, Prefetch>(x, K, codes, d, m, row_bytes, ng, y, ldy); break;
    case 3: tile_registers<A, Q4, 3, NB, Prefetch>(x, K, codes, d, m, row_bytes, ng, y, ldy); break;
    case 2: tile_registers<A, Q4, 2, NB, Prefetch>(x, K, codes, d, m, row_bytes, ng, y, ldy); break;
    default: tile_registers<A, Q4, 1, NB, Prefetch>(x, K, codes, d, m, row_bytes, ng, y, ldy); break;
  }
}

// Rows of x widened in registers: up to four everywhere; with AVX-512's 32 vector registers, up
// to six. A speculative verify step at batch 1 has 1 + drafts rows (up to 9); through the
// widened buffer (below) its fifth row cost a decode step 3.4 ms where each of rows 2-4 cost
// 0.7 ms (AMD EPYC Zen 4, bf16, 2 threads, docs/decisions.md). bf16 (one step a group): 6 x 4
// accumulators, four weight vectors, one of x (29 of 32); eight rows (32 accumulators) were no
// faster than the widened buffer. float32 (two steps a group, 16 lanes): 6 x 4 accumulators
// would need 33, so its weight rows go in pairs (6 x 2 + 4 + 1).
#ifdef PDQ_AVX512
constexpr int kRegisterRows = 6;
#else
constexpr int kRegisterRows = 4;
#endif

// 5 or 6 rows of x (M) against the NB <= 4 weight rows of a tile, each group of each weight row
// widened once in registers as in rows_registers (bf16: one tile; float32: two tiles of two
// weight rows). The accumulator chains are the same, so the bits are.
template <typename A, bool Q4, int NB>
inline void rows_registers_wide(const typename A::X* x, int64_t M, int64_t K, const uint8_t* codes, const float* d,
                                const float* m, int64_t row_bytes, int64_t ng, float* y, int64_t ldy) {
  if constexpr (kRegisterRows > 4) {
    auto run = [&](auto rc) {
      constexpr int R = decltype(rc)::value;
      if constexpr (A::kSteps == 1) {
        tile_registers<A, Q4, R, NB>(x, K, codes, d, m, row_bytes, ng, y, ldy);
      } else {  // the first pair prefetches the next tile's four rows; the second, at codes + 2 rows, not
        tile_registers<A, Q4, R, (NB < 2 ? NB : 2)>(x, K, codes, d, m, row_bytes, ng, y, ldy);
        if constexpr (NB > 2)
          tile_registers<A, Q4, R, NB - 2, false>(x, K, codes + 2 * row_bytes, d + 2 * ng, Q4 ? m + 2 * ng : m,
                                                  row_bytes, ng, y + 2, ldy);
      }
    };
    if (M == 6) run(std::integral_constant<int, 6>{});
    else run(std::integral_constant<int, 5>{});
  }
}

// The register tile above four rows: PDQ_TILE_ROWS rows of x by PDQ_TILE_COLS of the four widened
// weight rows. Any shape gives the same bits (each pair's chain is the same whatever the tile); it
// decides how many vector registers a tile needs: rows x cols accumulators, cols weight vectors and
// one x vector. AVX-512 has 32: 4 x 4 (21). AVX2 has 16, and there 4 x 4 spilled accumulators to
// the stack: one thread, 64 rows, Q4_1 1536x576 / 576x1536 (float32 GFLOP/s, oneDNN's fp32 GEMM
// 81-82 in the same run; AMD EPYC Zen 3, docs/decisions.md "Issue 29's figures by machine
// class"): 4x4 40.9 / 31.3, 4x3 59.6 / 51.4, 3x4 56.4 / 44.9, 4x2 63.9 / 55.7, 6x2 67.2 / 58.0
// (61.1 in a second run), 5x2 68.4 / 60.5, 7x2 66.0 / 61.6, 8x1 44.5 / 37.6. So 6 x 2 (15) there.
#ifndef PDQ_TILE_ROWS
#ifdef PDQ_AVX512
#define PDQ_TILE_ROWS 4
#else
#define PDQ_TILE_ROWS 6
#endif
#endif
#ifndef PDQ_TILE_COLS
#ifdef PDQ_AVX512
#define PDQ_TILE_COLS 4
#else
#define PDQ_TILE_COLS 2
#endif
#endif
constexpr int kTileRows = PDQ_TILE_ROWS;
constexpr int kTileCols = PDQ_TILE_COLS;

// The last M < R rows of a call, as one tile of M rows.
template <typename A, int NB, int R>
inline void rows_widened_tail(const typename A::X* x, int64_t M, int64_t K, const typename A::W* w, float* y,
                              int64_t ldy) {
  if constexpr (R > 1) {
    if (M == R - 1) return tile_widened<A, R - 1, NB>(x, K, w, y, ldy);
    rows_widened_tail<A, NB, R - 1>(x, M, K, w, y, ldy);
  }
}

// The M rows of x [M, K] against NB <= kTileCols widened weight rows (w [NB, K]).
template <typename A, int NB>
inline void rows_widened_cols(const typename A::X* x, int64_t M, int64_t K, const typename A::W* w, float* y,
                              int64_t ldy) {
  constexpr int R = kTileRows;
  int64_t r = 0;
  for (; r + R <= M; r += R) tile_widened<A, R, NB>(x + r * K, K, w, y + r * ldy, ldy);
  if (r < M) rows_widened_tail<A, NB, R>(x + r * K, M - r, K, w, y + r * ldy, ldy);
}

// The M rows of x [M, K] against NB widened weight rows (w [NB, K]): y[r * ldy + j].
template <typename A, int NB>
inline void rows_widened_with(const typename A::X* x, int64_t M, int64_t K, const typename A::W* w, float* y,
                              int64_t ldy) {
  if constexpr (NB <= kTileCols) {
    rows_widened_cols<A, NB>(x, M, K, w, y, ldy);
  } else {
    rows_widened_cols<A, kTileCols>(x, M, K, w, y, ldy);
    rows_widened_with<A, NB - kTileCols>(x, M, K, w + kTileCols * K, y + kTileCols, ldy);
  }
}

// f(std::integral_constant<int, NB>{}) with NB = nb in 1..4: a tile's number of weight rows
// as the compile-time constant the tiles are instantiated on (every block_rows* path and
// quant_linear.cpp's float_linear walk weight rows in fours, with a shorter tail).
template <typename F>
inline void with_tile_width(int nb, F&& f) {
  switch (nb) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Weight rows [n0, n1) against all M rows of x [M, K] (in A::X): y[r * ldy + n], in arithmetic
// A. Weight rows go in fours. Up to kRegisterRows rows of x (4; 6 with AVX-512), each group is
// widened in registers and used at once (the weights are streamed once; a batch-1 decode step
// is bound by these instructions). Above that, the four weight rows are widened once into a
// buffer of A::W (4 K elements, in L1) and every kTileRows x kTileCols tile of (rows of x,
// weight rows) reads it (AVX-512 4 x 4: 16 steps per 8 loads; AVX2 6 x 2: 12 per 8), instead of
// widening again per four rows. (One exception, AVX2 float32 builds, 8-bit blocks: see below.)
template <typename A, bool Q4>
inline void block_rows_with(const typename A::X* x, int64_t M, int64_t K, const uint8_t* codes, const scale_t* d,
                            const scale_t* m, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (M <= 0) return;
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  thread_local std::vector<typename A::W> widened;
  if (M > kRegisterRows) widened.resize(static_cast<size_t>(4 * K));
  TileScales ts(4 * ng);
  for (int64_t n = n0; n < n1; n += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const uint8_t* c = codes + n * row_bytes;
    prefetch_next_scales<Q4>(d + n * ng, m + n * ng, ng);
    ts.widen<Q4>(d + n * ng, m + n * ng, nb * ng);
    const float* dn = ts.d;
    const float* mn = ts.m;
#if !defined(PDQ_AVX512) && !defined(PDQ_Q8_FOURS)
    // AVX2 float32, 8-bit blocks against up to four rows of x: the tile's weight rows one after
    // the other, each as a register tile of M x 1, so the blocks are read front to back in one
    // stream. A Q8_0 block row is twice a 4-bit one, and a tile's four interleaved row streams
    // held the LM head (49152 x 576, 30 MB read from memory at every decode step) to ~5 GB/s on a
    // core that streams 16. One after the other, calls of 1-4 rows ran 1.3-1.8x faster on the head
    // and 1.1-1.5x on 3072 x 576 and 576 x 1536, on 1 and 2 threads, although one row's single
    // accumulator chain then waits on its FMA's latency; the prefetch's distance or hint, and two
    // weight rows at a time, did not help; 4-bit rows, bound by their widening rather than by
    // memory, were 0.73-1.18x so they stay in fours (AMD EPYC Zen 3, docs/decisions.md "AVX2: 8-bit
    // blocks read in one stream"; -DPDQ_Q8_FOURS builds the fours for a comparison). Each (row of
    // x, weight row) chain is unchanged, so are the bits.
    if constexpr (!Q4 && std::is_same_v<A, F32Fma>) {
      if (M <= 4) {
        for (int j = 0; j < nb; ++j)
          rows_registers<A, false, 1, false>(x, M, K, c + j * row_bytes, dn + j * ng, dn, row_bytes, ng, y + n + j, ldy);
        continue;
      }
    }
#endif
    if (M <= kRegisterRows) {
      with_tile_width(nb, [&](auto nbc) {
        if (M <= 4)
          rows_registers<A, Q4, decltype(nbc)::value>(x, M, K, c, dn, mn, row_bytes, ng, y + n, ldy);
        else
          rows_registers_wide<A, Q4, decltype(nbc)::value>(x, M, K, c, dn, mn, row_bytes, ng, y + n, ldy);
      });
      continue;
    }
    for (int j = 0; j < nb; ++j)
      for (int64_t g = 0; g < ng; ++g) {
        if (j == 0) prefetch_next_tile<Q4>(c, row_bytes, g);
        typename A::Wv w[A::kSteps];
        A::template group<Q4>(c + j * row_bytes, dn + j * ng, Q4 ? mn + j * ng : dn, g, w);
        for (int v = 0; v < A::kSteps; ++v) A::store(widened.data() + j * K + g * G + v * A::kStep, w[v]);
      }
    with_tile_width(nb, [&](auto nbc) {
      rows_widened_with<A, decltype(nbc)::value>(x, M, K, widened.data(), y + n, ldy);
    });
  }
}

// ---- Entry points ------------------------------------------------------------------------------
// float32: weight rows [n0, n1) of the blocks against x float32 [M, K]: y[r * ldy + n].
template <bool Q4>
inline void block_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const scale_t* d, const scale_t* m,
                       int64_t n0, int64_t n1, float* y, int64_t ldy) {
  block_rows_with<F32Fma, Q4>(x, M, K, codes, d, m, n0, n1, y, ldy);
}

// float32 weights already widened (w [NB, K], K % L == 0) against x float32 [M, K]:
// y[r * ldy + j] (quant_linear.cpp's float_linear).
template <int NB>
inline void rows_widened(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy) {
  rows_widened_with<F32Fma, NB>(x, M, K, w, y, ldy);
}

#ifdef PDQ_BF16
// Rows of x [n float32, n % 32 == 0] rounded to bf16 (to nearest even).
inline void round_rows_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t k = 0; k < n; k += G) bstore(out + k, bpack(x + k));
}

// bf16 dot products (only where PDQ_BF16 is defined): weight rows [n0, n1) against the M rows
// of x already rounded to bf16 (xb [M, K], round_rows_bf16): y[r * ldy + n]. The loops of
// block_rows; a group is widened as two float32 vectors (four in the AVX2 emulated build)
// packed into one bf16 vector; above four rows the L1 buffer holds bf16 (16 vdpbf16ps per 8
// loads).
template <bool Q4>
inline void block_rows_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint8_t* codes, const scale_t* d,
                            const scale_t* m, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  block_rows_with<Bf16Dot, Q4>(xb, M, K, codes, d, m, n0, n1, y, ldy);
}
#endif
inline constexpr bool kHasBf16 =
#ifdef PDQ_BF16
    true;
#else
    false;
#endif

// ---- AMX tiles (PD_BLOCK_DOT=amx) --------------------------------------------------------------
// The bf16 arithmetic's roundings (Bf16Dot: each weight w = q d (+ m) in float32, then to bf16 to
// nearest even; x to bf16 once per call) with the dot products on Intel AMX tiles (TDPBF16PS,
// Intel SDM vol. 2; Sapphire Rapids and later): per 16 weight rows and 32-wide step of K, one A tile
// holds the 16 rows' bf16 weights (rows as they are, no transpose), one B tile the step of up to 16
// rows of x in the VNNI layout (pairs of K down, rows across; vnni_rows_bf16 lays them out once per
// call), and one C tile of 16 x 16 float32 sums W x^T over K in order. An output is thus one chain
// of TDPBF16PS steps over K whatever the call's shape: its bits do not depend on how many rows of x
// the call has, where in a tile its row or weight row sits, or how the weight rows are split over
// threads (tests/unit/test_quantized_weights.py checks each). The order of the products inside one
// step is the hardware's: no register loop reproduces it (measured by
// kernels/cpu/experiments/amx_probe.cpp), so a model using this arithmetic runs every row on the
// tiles, decode's single rows included (quant_linear.cpp and fused_decode.cpp both do).
#if defined(PDQ_BF16) && !defined(PDQ_BF16_EMULATE) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDQ_AMX 1

// Linux grants a process AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA = 18; the kernel's Documentation/arch/x86/xstate.rst); asked once per process.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Palette 1, every tile 16 rows of 64 bytes: C 16 x 16 float32, A 16 x 32 bf16, B 16 pairs x 16 x 2.
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline const AmxConfig* amx_config() {
  // static, not a local: GCC's _tile_loadconfig passes only the address to its asm, and stores
  // into a local structure were dropped as dead (amx_probe.cpp)
  static const AmxConfig config = [] {
    AmxConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  return &config;
}

constexpr int64_t kAmxTile = 512;  // bf16 elements in one 16 x 64-byte tile
constexpr int64_t kAmxWideSteps = 8;  // steps of K per chunk above 64 rows (block_rows_amx)
constexpr int64_t kAmxWideGroups = 16;  // groups of 16 rows of x per pass above 64 rows (block_rows_amx)

// Where each element of a group of 32 sits in an A-tile row (position q holds element
// amx_element<Q4>(q)), per block type. 4-bit: the order the codes unpack in without a shuffle
// (amx_q4_codes): position 8 l + p holds nibble l of the group's 16-bit word p, element
// 2 p + (l >= 2) + 16 (l odd). 8-bit: element order. B tiles take x in the same order
// (vnni_rows_bf16), so a step still adds the products w_k x_k of its 32 elements.
template <bool Q4>
inline int amx_element(int q) {
  if constexpr (Q4) return 2 * (q % 8) + (q / 16) + 16 * ((q / 8) % 2);
  return q;
}

// The 32 weights of each of two 4-bit groups (codes c, c + 16; scales d[0..1], minimums m[0..1])
// rounded to bf16 in amx_element<true>'s order: each group's 16 values q d + m (one FMA each, as
// group_vectors) rounded once into one table of 32 (vcvtne2ps2bf16, as Bf16Dot::group's), and
// looked up (vpermw) by codes unpacked with a variable shift per 128-bit lane instead of a
// widening shuffle: a batch-1 decode step's weights are bound by these instructions.
inline __m512i amx_q4_codes(const uint8_t* c) {
  const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  const __m512i shift = _mm512_set_epi64(0x000C000C000C000Cll, 0x000C000C000C000Cll, 0x0008000800080008ll,
                                         0x0008000800080008ll, 0x0004000400040004ll, 0x0004000400040004ll, 0, 0);
  return _mm512_srlv_epi16(raw, shift);  // the position's nibble in bits 0..3 of each word
}
inline __m512 amx_q4_table(float d, float m) {
  const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f,
                                     15.f);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
}
inline void amx_q4_groups(const uint8_t* c, const float* d, const float* m, uint16_t* out0, uint16_t* out1) {
  const __m512i table =
      reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(amx_q4_table(d[1], m[1]), amx_q4_table(d[0], m[0])));
  const __m512i low = _mm512_set1_epi16(0x0F), high = _mm512_set1_epi16(0x10);
  const __m512i idx0 = _mm512_and_si512(amx_q4_codes(c), low);
  const __m512i idx1 = _mm512_ternarylogic_epi32(amx_q4_codes(c + 16), low, high, 0xEA);  // (a & b) | c
  _mm512_store_si512(out0, _mm512_permutexvar_epi16(idx0, table));
  _mm512_store_si512(out1, _mm512_permutexvar_epi16(idx1, table));
}
// One group alone (a chunk's odd last step): the same bits.
inline void amx_q4_group(const uint8_t* c, float d, float m, uint16_t* out) {
  const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(amx_q4_table(d, m))));
  const __m512i idx = _mm512_and_si512(amx_q4_codes(c), _mm512_set1_epi16(0x0F));
  _mm512_store_si512(out, _mm512_permutexvar_epi16(idx, table));
}

// Dword offsets 0, 16, ..., 240: one column of a 16 x 16 tile of dwords, as gather / scatter indices.
inline __m512i tile_column() {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(16));
}

// v[p] dword c = v[c] dword p: a 16 x 16 transpose of dwords (unpacks within 128-bit lanes, then
// 128-bit lanes gathered across the vectors).
inline void transpose16_epi32(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  __m512i u[16];  // u[4 q + k], lane L: column 4 L + k of rows 4 q .. 4 q + 3
  for (int q = 0; q < 16; q += 4) {
    u[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    u[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    u[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    u[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i s1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), s2 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88),
                  s4 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    v[k] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    v[4 + k] = _mm512_shuffle_i32x4(s2, s4, 0x88);
    v[8 + k] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    v[12 + k] = _mm512_shuffle_i32x4(s2, s4, 0xDD);
  }
}

// Rows of x [M float32, K] (K % 32 == 0) rounded to bf16 (to nearest even, as round_rows_bf16)
// into B tiles for weights of block type Q4: rows in groups of 16, per group j and step t of K
// one tile, xv[(j nt + t) 512 + 32 p + 2 r + e] = bf16(x[16 j + r][32 t + amx_element<Q4>(2 p +
// e)]), nt = K / 32. The columns past row M of the last group are left as they were: a C tile's
// column reads its own B column only, and those columns' sums are never read.
template <bool Q4>
inline void vnni_rows_bf16_range(const float* x, int64_t r0, int64_t r1, int64_t K, uint16_t* xv) {
  const int64_t nt = K / G;
  alignas(64) int16_t order[G];
  for (int q = 0; q < G; ++q) order[q] = static_cast<int16_t>(amx_element<Q4>(q));
  const __m512i perm = _mm512_load_si512(order);
  int64_t r = r0;
  // whole groups of 16 rows: per step of K, the 16 rows' dwords transposed into the tile's rows
  // (64 shuffles in place of 16 scatters)
  for (; r % 16 == 0 && r + 16 <= r1; r += 16)
    for (int64_t t = 0; t < nt; ++t) {
      __m512i v[16];
      for (int c = 0; c < 16; ++c)
        v[c] = _mm512_permutexvar_epi16(perm, reinterpret_cast<__m512i>(bpack(x + (r + c) * K + t * G)));
      transpose16_epi32(v);
      uint16_t* tile = xv + ((r / 16) * nt + t) * kAmxTile;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + 32 * p, v[p]);
    }
  // the rest (a partial last group): each row's dwords scattered down its tile column
  const __m512i column = tile_column();  // dword p of a row goes to tile row p
  for (; r < r1; ++r)
    for (int64_t t = 0; t < nt; ++t) {
      const __m512i row = _mm512_permutexvar_epi16(perm, reinterpret_cast<__m512i>(bpack(x + r * K + t * G)));
      _mm512_i32scatter_epi32(xv + ((r / 16) * nt + t) * kAmxTile + 2 * (r % 16), column, row, 4);
    }
}

// xv sized for M rows of K (nj nt tiles), then every row laid out (vnni_rows_bf16_range; a caller
// may instead lay out ranges of rows on several threads: rows write disjoint elements).
template <bool Q4>
inline void vnni_rows_bf16(const float* x, int64_t M, int64_t K, std::vector<uint16_t>& xv, bool lay_out = true) {
  const int64_t nt = K / G, nj = (M + 15) / 16;
  if (xv.size() < static_cast<size_t>(nj * nt * kAmxTile)) xv.resize(static_cast<size_t>(nj * nt * kAmxTile));
  if (lay_out) vnni_rows_bf16_range<Q4>(x, 0, M, K, xv.data());
}

// Tile operations on tile numbers given as template arguments: GCC's AMX intrinsics paste their
// argument into the assembly text, so each number must reach them as a literal.
#define PDQ_T_IF(op, t, ...) if constexpr (T == t) op(t __VA_OPT__(,) __VA_ARGS__);
#define PDQ_T_ALL(op, ...) PDQ_T_IF(op, 0, __VA_ARGS__) PDQ_T_IF(op, 1, __VA_ARGS__) PDQ_T_IF(op, 2, __VA_ARGS__) \
  PDQ_T_IF(op, 3, __VA_ARGS__) PDQ_T_IF(op, 4, __VA_ARGS__) PDQ_T_IF(op, 5, __VA_ARGS__) PDQ_T_IF(op, 6, __VA_ARGS__) \
  PDQ_T_IF(op, 7, __VA_ARGS__)
template <int T> inline void tile_zero() { PDQ_T_ALL(_tile_zero) }
template <int T> inline void tile_load(const void* p) { PDQ_T_ALL(_tile_loadd, p, 64) }
template <int T> inline void tile_store(void* p) { PDQ_T_ALL(_tile_stored, p, 64) }
#define PDQ_DP(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
#define PDQ_DP_B(c, a) PDQ_DP(c, a, 4) PDQ_DP(c, a, 5) PDQ_DP(c, a, 6) PDQ_DP(c, a, 7)
#define PDQ_DP_A(c) PDQ_DP_B(c, 4) PDQ_DP_B(c, 5) PDQ_DP_B(c, 6) PDQ_DP_B(c, 7)
// C tile (0..3) += A tile (4..7) times B tile (4..7), TDPBF16PS.
template <int C, int A, int B> inline void tile_dp() { PDQ_DP_A(0) PDQ_DP_A(1) PDQ_DP_A(2) PDQ_DP_A(3) }
#undef PDQ_DP_A
#undef PDQ_DP_B
#undef PDQ_DP
#undef PDQ_T_ALL
#undef PDQ_T_IF

// f(std::integral_constant<int, i>{}) for i = 0 .. N - 1 in order (tile numbers must be immediates).
template <int N, typename F>
inline void static_for(F&& f) {
  if constexpr (N > 0) {
    static_for<N - 1>(f);
    f(std::integral_constant<int, N - 1>{});
  }
}

// Steps t0 .. t1 - 1 of the chains of NB blocks of 16 weight rows (A tiles: wt + (b kc + t - t0)
// 512, the steps' weights as widened for this chunk) against JB groups of 16 rows of x (B tiles:
// xv + (j nt + t) 512), NB JB <= 4, C tile b JB + j += A b times B j (TDPBF16PS). Several C tiles
// keep several chains in flight: one chain waits out each step's latency (one block at a time ran
// ~2x slower at one row of x). Tiles: C 0..NB JB - 1; B 4 (and 5); A the others, in turn.
template <int NB, int JB>
inline void amx_steps(const uint16_t* wt, int64_t kc, const uint16_t* xv, int64_t nt, int64_t t0, int64_t t1) {
  static_assert(NB * JB <= 4 && (NB == 1 || JB <= 2), "at most four C tiles, and B tiles beside them");
  for (int64_t t = t0; t < t1; ++t) {
    if constexpr (NB == 1) {
      tile_load<4>(wt + (t - t0) * kAmxTile);
      static_for<JB>([&](auto jc) {
        constexpr int j = decltype(jc)::value, tb = 5 + j % 2;
        tile_load<tb>(xv + (j * nt + t) * kAmxTile);
        tile_dp<j, 4, tb>();
      });
    } else {
      static_for<JB>([&](auto jc) {
        constexpr int j = decltype(jc)::value;
        tile_load<4 + j>(xv + (j * nt + t) * kAmxTile);
      });
      static_for<NB>([&](auto bc) {
        constexpr int b = decltype(bc)::value, ta = JB == 1 ? 5 + b % 3 : 6 + b % 2;
        tile_load<ta>(wt + (b * kc + t - t0) * kAmxTile);
        static_for<JB>([&](auto jc) {
          constexpr int j = decltype(jc)::value;
          tile_dp<b * JB + j, ta, 4 + j>();
        });
      });
    }
  }
}

// Steps t0 .. t1 - 1 of weight rows [0, rows) (rows <= 16 NB; codes, d, m at the first; d and m
// widened to float32, TileScales) widened to
// bf16 (the same values as Bf16Dot::group's) as A tiles: wt + (b kc + t - t0) 512 holds block b's
// step t, rows past `rows` zero (their sums are never read). `next` is where the codes after these
// rows start (prefetched once the last step is reached).
template <bool Q4, int NB>
inline void amx_widen(const uint8_t* codes, const float* d, const float* m, int64_t row_bytes, int64_t nt,
                      int rows, const uint8_t* next, int64_t t0, int64_t t1, int64_t kc, uint16_t* wt) {
  constexpr int64_t bytes = Q4 ? G / 2 : G;
  for (int i = 0; i < 16 * NB; ++i) {
    uint16_t* wi = wt + (i / 16) * kc * kAmxTile + (i % 16) * G;
    if (i >= rows) {
      for (int64_t t = t0; t < t1; ++t) std::memset(wi + (t - t0) * kAmxTile, 0, 2 * G);
      continue;
    }
    const uint8_t* ci = codes + i * row_bytes;
    const float* di = d + i * nt;
    const float* mi = Q4 ? m + i * nt : di;
    // this row's next chunk, and the next rows' line at this chunk's offset (as the float32 loops
    // prefetch PDQ_AHEAD rows ahead): a batch-1 step streams every weight once, and the hardware
    // prefetchers lose the 16 NB interleaved row streams
    if (t1 < nt) _mm_prefetch(reinterpret_cast<const char*>(ci + t1 * bytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next + i * row_bytes + t0 * bytes), _MM_HINT_T0);
    for (int64_t t = t0; t < t1; ++t) {
      if constexpr (Q4) {
        if (t + 1 < t1) {
          amx_q4_groups(ci + t * bytes, di + t, mi + t, wi + (t - t0) * kAmxTile, wi + (t + 1 - t0) * kAmxTile);
          ++t;
        } else {
          amx_q4_group(ci + t * bytes, di[t], mi[t], wi + (t - t0) * kAmxTile);
        }
      } else {
        typename Bf16Dot::Wv w[1];
        Bf16Dot::group<Q4>(ci, di, mi, t, w);
        bstore(wi + (t - t0) * kAmxTile, w[0]);
      }
    }
  }
}

// One block pass: weight rows [0, rows) (rows <= 16 NB; codes, d, m at the first) against JB
// groups of 16 rows of x (xv), every output's chain over all nt steps of K in order:
// c[(b JB + j) 256 + 16 i + r] = row 16 b + i of the weights times row 16 j + r of x. K goes in
// chunks of one cache line of codes per weight row (kc steps): the chunk's weights are widened
// (amx_widen) into wt [NB][kc][16][32], which stays in L1, and the chunk's steps run at once, so
// widening and tile work overlap.
template <bool Q4, int NB, int JB>
inline void amx_block(const uint16_t* xv, int64_t nt, const uint8_t* codes, const float* d, const float* m,
                      int64_t row_bytes, int rows, const uint8_t* next, uint16_t* wt, float* c) {
  constexpr int64_t bytes = Q4 ? G / 2 : G, kc = 64 / bytes;
  static_for<NB * JB>([&](auto ci) { tile_zero<decltype(ci)::value>(); });
  for (int64_t t0 = 0; t0 < nt; t0 += kc) {
    const int64_t t1 = std::min(nt, t0 + kc);
    amx_widen<Q4, NB>(codes, d, m, row_bytes, nt, rows, next, t0, t1, kc, wt);
    amx_steps<NB, JB>(wt, kc, xv, nt, t0, t1);
  }
  static_for<NB * JB>([&](auto ci) { tile_store<decltype(ci)::value>(c + decltype(ci)::value * 256); });
}

// Steps t0 .. t1 - 1 of the chains of NB blocks of weight rows, widened for all of K (A tiles:
// wt + (b nt + t) 512, as amx_widen lays them out with t0 = 0 and kc = nt), against JB groups of
// 16 rows of x: the C tiles start from zero at t0 = 0, else from the float32 sums c holds (stored
// by the previous steps: exact, so an output is the same chain over K in order as amx_block's),
// and are stored back to c as amx_block stores them.
template <int NB, int JB>
inline void amx_chain_steps(const uint16_t* wt, const uint16_t* xv, int64_t nt, int64_t t0, int64_t t1, float* c) {
  if (t0 == 0) static_for<NB * JB>([&](auto ci) { tile_zero<decltype(ci)::value>(); });
  else static_for<NB * JB>([&](auto ci) { tile_load<decltype(ci)::value>(c + decltype(ci)::value * 256); });
  amx_steps<NB, JB>(wt + t0 * kAmxTile, nt, xv, nt, t0, t1);
  static_for<NB * JB>([&](auto ci) { tile_store<decltype(ci)::value>(c + decltype(ci)::value * 256); });
}

// Weight rows [n0, n1) of the blocks against the M rows of x laid out by vnni_rows_bf16<Q4> (xv):
// y[r * ldy + n], on AMX tiles (see above). Weight rows go in blocks of 16, rows of x in groups of
// 16. Up to 64 rows of x (decode's steps, speculation's verify rows): up to 16 rows four blocks
// run side by side, up to 32 two, above that one block against up to four groups, K in chunks
// widened as it goes (amx_block). Above 64 rows (prefill): x goes in passes of kAmxWideGroups
// groups (256 rows: 768 KiB of B tiles at K = 1,536, kept in L2); per pass, each two blocks'
// weights are widened once for all of K (96 KiB at K = 1,536), so the widening is paid once per
// 256 rows, not once per 64; then K runs in chunks of kAmxWideSteps steps, every pair of groups
// of the pass against the chunk (2 x 2 C tiles), the float32 sums stored between chunks (exact).
// Either way each output is the same chain over K in order: the bits do not depend on M.
// Measured on the AMX Xeon (SmolLM2's MLP shapes, 2 threads, medians of 5 interleaved runs, in
// GFLOP/s): at 512 and 2,048 rows, passes of 256 rows 1.13-1.34x the same rows in 64-row calls;
// passes of 64 or 128 rows, or one pass of all rows, slower (all of x no longer stays in L2).
// amx_permitted() must have been true.
template <bool Q4>
inline void block_rows_amx(const uint16_t* xv, int64_t M, int64_t K, const uint8_t* codes, const scale_t* d,
                           const scale_t* m, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (M <= 0 || n0 >= n1) return;
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G, nj = (M + 15) / 16;
  alignas(64) float c[4 * 256];
  // c's sums of blocks [0, nb) against groups j0 .. j0 + jb - 1 into y (weight rows from n). A C
  // tile holds [weight row i][row r of x] and y wants row r's 16 weight rows side by side: a
  // 16 x 16 transpose of its dwords (transpose16_epi32) when the group has 8 or more rows of x,
  // else a gather per row (decode's few rows). Copies only: the bits are the tiles'. (The scalar
  // copy this replaced held ~45 % of block_rows_amx's samples in a 470-token prefill, most of them
  // waiting for the tile stores: measured within noise of it, docs/decisions.md.)
  const __m512i down = tile_column();  // element i of column r: 16 i + r
  auto scatter = [&](const float* cs, int64_t n, int rows, int nb, int64_t j0, int jb) {
    for (int b = 0; b < nb; ++b) {
      const __mmask16 keep = static_cast<__mmask16>((1u << std::min(16, rows - 16 * b)) - 1u);
      for (int jj = 0; jj < jb; ++jj) {
        const int nr = static_cast<int>(std::min<int64_t>(16, M - (j0 + jj) * 16));
        const float* cb = cs + (b * jb + jj) * 256;
        float* y0 = y + (j0 + jj) * 16 * ldy + n + 16 * b;
        if (nr >= 8) {
          __m512i v[16];
          for (int i = 0; i < 16; ++i) v[i] = _mm512_load_si512(cb + 16 * i);
          transpose16_epi32(v);
          for (int r = 0; r < nr; ++r) _mm512_mask_storeu_ps(y0 + r * ldy, keep, _mm512_castsi512_ps(v[r]));
        } else {
          for (int r = 0; r < nr; ++r)
            _mm512_mask_storeu_ps(y0 + r * ldy, keep, _mm512_i32gather_ps(down, cb + r, 4));
        }
      }
    }
  };
  TileScales ts(64 * ng);  // a block's (<= 64 rows) scales as float32 (the decode path prefetches the next block's)
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  _tile_loadconfig(amx_config());
  if (nj > 4) {
    // the A tiles of two blocks for all of K, 64-byte aligned (amx_q4_groups' aligned stores)
    std::vector<__m512i> lines(static_cast<size_t>(2 * ng * kAmxTile / 32));
    uint16_t* wide = reinterpret_cast<uint16_t*>(lines.data());
    std::vector<__m512i> sum_lines(static_cast<size_t>((std::min(nj, kAmxWideGroups) + 1) / 2 * 4 * 256 / 16));
    float* sums = reinterpret_cast<float*>(sum_lines.data());
    for (int64_t g0 = 0; g0 < nj; g0 += kAmxWideGroups) {  // x in passes of 256 rows, kept in L2
      const int64_t g1 = std::min(nj, g0 + kAmxWideGroups);
      for (int64_t n = n0; n < n1; n += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, n1 - n));
        const int nb = (rows + 15) / 16;
        const uint8_t* cn = codes + n * row_bytes;
        ts.widen<Q4>(d + n * ng, m + n * ng, rows * ng);
        amx_widen<Q4, 2>(cn, ts.d, ts.m, row_bytes, ng, rows, cn + 32 * row_bytes, 0, ng, ng, wide);
        // K in chunks of kAmxWideSteps steps (the two blocks' 16 KiB of A tiles stay in L1 while
        // every group of x passes), each pair of groups' sums kept in sums between chunks
        for (int64_t t0 = 0; t0 < ng; t0 += kAmxWideSteps) {
          const int64_t t1 = std::min(ng, t0 + kAmxWideSteps);
          for (int64_t j0 = g0; j0 < g1; j0 += 2) {
            const int jb = static_cast<int>(std::min<int64_t>(2, g1 - j0));
            const uint16_t* xj = xv + j0 * ng * kAmxTile;
            float* cj = sums + ((j0 - g0) / 2) * 4 * 256;
            if (nb == 2 && jb == 2) amx_chain_steps<2, 2>(wide, xj, ng, t0, t1, cj);
            else if (nb == 2) amx_chain_steps<2, 1>(wide, xj, ng, t0, t1, cj);
            else if (jb == 2) amx_chain_steps<1, 2>(wide, xj, ng, t0, t1, cj);
            else amx_chain_steps<1, 1>(wide, xj, ng, t0, t1, cj);
          }
        }
        for (int64_t j0 = g0; j0 < g1; j0 += 2)
          scatter(sums + ((j0 - g0) / 2) * 4 * 256, n, rows, nb, j0, static_cast<int>(std::min<int64_t>(2, g1 - j0)));
      }
    }
    _tile_release();
    return;
  }
  const int per = nj == 1 ? 4 : nj == 2 ? 2 : 1;  // blocks of weight rows side by side
  alignas(64) uint16_t wt[4 * (Q4 ? 4 : 2) * kAmxTile];  // 16 KiB: one chunk's A tiles
  for (int64_t n = n0; n < n1; n += 16 * per) {
    const int rows = static_cast<int>(std::min<int64_t>(16 * per, n1 - n));
    const int nb = (rows + 15) / 16;
    const uint8_t* cn = codes + n * row_bytes;
    ts.widen<Q4>(d + n * ng, m + n * ng, rows * ng);
    // the next rows' scales (and minimums), read when their block starts
    for (int64_t off = 0; off < 16 * per * ng; off += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(d + (n + 16 * per) * ng + off), _MM_HINT_T0);
      if constexpr (Q4) _mm_prefetch(reinterpret_cast<const char*>(m + (n + 16 * per) * ng + off), _MM_HINT_T0);
    }
    const float* dn = ts.d;
    const float* mn = ts.m;
    const uint8_t* next = cn + 16 * per * row_bytes;
    const int jb = static_cast<int>(nj);
    auto run = [&](auto nbc, auto jbc) {
      amx_block<Q4, decltype(nbc)::value, decltype(jbc)::value>(xv, ng, cn, dn, mn, row_bytes, rows, next, wt, c);
    };
    if (per == 4) {
      switch (nb) {
        case 4: run(I4{}, I1{}); break;
        case 3: run(I3{}, I1{}); break;
        case 2: run(I2{}, I1{}); break;
        default: run(I1{}, I1{}); break;
      }
    } else if (per == 2) {
      if (nb == 2) run(I2{}, I2{});
      else run(I1{}, I2{});
    } else {
      if (jb == 4) run(I1{}, I4{});  // nj is 3 or 4 here (more takes the path above)
      else run(I1{}, I3{});
    }
    scatter(c, n, rows, nb, 0, jb);
  }
  _tile_release();
}
#endif
// True where PD_BLOCK_DOT=amx can run: built with AMX tiles and granted them by the OS.
inline bool has_amx() {
#ifdef PDQ_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// ---- int8 activations (PD_BLOCK_DOT=int8) ----------------------------------------------------
// llama.cpp's scheme for 4- and 8-bit blocks (ggml-cpu's ggml_vec_dot_q4_1_q8_1 and
// ggml_vec_dot_q8_0_q8_0): each row of x is quantized once per call, per 32 inputs, to int8
// (quantize_rows_q8: dx = max|x| / 127, xq = x * (127 / max|x|) rounded to nearest even), so a
// group's 32 products are integers summed exactly, and
//   sum_j (q_j d + m) x_j  ~  d dx sum_j q_j xq_j  +  m dx sum_j xq_j.
// Where it rounds: (1) x to int8 (relative error up to 1/254 of the group's largest |x|, the
// only approximation); (2) the float32 product d dx per group; (3) one float32 FMA per group and
// lane into the accumulator; (4) the minimum's term, sum_g m[g] (dx sum xq)[g], in float32
// (min_term). The integer dot products take 2 instructions per 32 weights (AVX2 vpmaddubsw +
// vpmaddwd) or 1 (AVX-VNNI / AVX512-VNNI vpdpbusd; the same integers, no lane saturates:
// |q| <= 15 (4-bit, unsigned) or <= 128 (8-bit, taken as |q| against x * sign(q)), |xq| <= 127),
// where the float32 path widens, converts and multiplies 32 weights in 12 (AVX2).
// Row independence holds as for the float32 path: every (row of x, weight row) pair is one
// accumulator chain over the groups in order, then hsum + min_term, whatever the call's shape.
struct RowsQ8 {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32]: dx
  std::vector<float> s;    // [M, K / 32]: dx * sum(xq)
};

// Rows of x [M, K] (K % 32 == 0) quantized per 32 inputs into out (resized).
inline void quantize_rows_q8(const float* x, int64_t M, int64_t K, RowsQ8& out) {
  const int64_t ng = K / G;
  out.q.resize(static_cast<size_t>(M * K));
  out.d.resize(static_cast<size_t>(M * ng));
  out.s.resize(static_cast<size_t>(M * ng));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane interleave
  for (int64_t i = 0; i < M * ng; ++i) {
    const float* xg = x + i * G;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xg + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[c], abs_mask));
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    const float mx = _mm_cvtss_f32(a);
    const __m256 id = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    __m256i q[4];
    for (int c = 0; c < 4; ++c)
      q[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[c], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * G), _mm256_permutevar8x32_epi32(packed, order));
    out.d[i] = mx / 127.f;
    out.s[i] = out.d[i] * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// sum_g m[g] xs[g]: the minimum's term of one (row of x, weight row) pair, the same instruction
// sequence for every pair (not inlined into the tiles, where the compiler could vectorize across
// rows and round differently).
__attribute__((noinline)) inline float min_term(const float* m, const float* xs, int64_t ng) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xs + g), acc);
  float s = hsum(acc);
  for (; g < ng; ++g) s = std::fma(m[g], xs[g], s);
  return s;
}

// The 32 codes of one group as 32 bytes in element order: 4-bit unsigned 0..15, 8-bit signed.
template <bool Q4>
inline __m256i group_codes(const uint8_t* c) {
  if constexpr (Q4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  }
}

// 8 int32 lanes, lane i = sum of the products of elements 4i..4i+3 (exact).
template <bool Q4>
inline __m256i group_dot(__m256i w, __m256i xq) {
  __m256i u = w, s = xq;
  if constexpr (!Q4) {  // unsigned x signed: |q| against xq * sign(q)
    u = _mm256_sign_epi8(w, w);
    s = _mm256_sign_epi8(xq, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// NB weight rows against R quantized rows of x. Decoded: the weight rows' codes are already
// bytes in element order (w, row stride K), else they are read from the blocks (codes).
template <bool Q4, bool Decoded, int R, int NB>
inline __attribute__((always_inline)) void tile_q8(const RowsQ8& xr, int64_t r0, int64_t K, const uint8_t* codes,
                                                   const int8_t* w, const float* d, const float* m,
                                                   int64_t row_bytes, int64_t ng, float* y, int64_t ldy) {
  __m256 acc[R][NB];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  const int8_t* xq = xr.q.data() + r0 * K;
  const float* xd = xr.d.data() + r0 * ng;
  constexpr int64_t bytes = Q4 ? G / 2 : G;
  for (int64_t g = 0; g < ng; ++g) {
    if constexpr (!Decoded) prefetch_next_tile<Q4>(codes, row_bytes, g);
    __m256i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      wv[j] = Decoded ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + g * G))
                      : group_codes<Q4>(codes + j * row_bytes + g * bytes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * G));
      const float dx = xd[r * ng + g];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot<Q4>(wv[j], xv)), _mm256_set1_ps(d[j * ng + g] * dx),
                                    acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      y[r * ldy + j] = hsum(acc[r][j]) + (Q4 ? min_term(m + j * ng, xr.s.data() + (r0 + r) * ng, ng) : 0.f);
}

template <bool Q4, bool Decoded, int NB>
inline void rows_q8(const RowsQ8& xr, int64_t M, int64_t K, const uint8_t* codes, const int8_t* w, const float* d,
                    const float* m, int64_t row_bytes, int64_t ng, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 2 <= M; r += 2) tile_q8<Q4, Decoded, 2, NB>(xr, r, K, codes, w, d, m, row_bytes, ng, y + r * ldy, ldy);
  if (r < M) tile_q8<Q4, Decoded, 1, NB>(xr, r, K, codes, w, d, m, row_bytes, ng, y + r * ldy, ldy);
}

// block_rows with int8 activations: weight rows [n0, n1) against the M rows of x quantized by
// quantize_rows_q8 (xr): y[r * ldy + n]. Weight rows go in fours, rows of x in twos (2 x 4
// accumulators). Up to two rows of x the codes are unpacked in registers; above, four weight
// rows are unpacked once into an L1 buffer of bytes and every tile reads it.
template <bool Q4>
inline void block_rows_q8(const RowsQ8& xr, int64_t M, int64_t K, const uint8_t* codes, const scale_t* d,
                          const scale_t* m, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (M <= 0) return;
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  thread_local std::vector<int8_t> unpacked;
  if (M > 2) unpacked.resize(static_cast<size_t>(4 * K));
  TileScales ts(4 * ng);
  for (int64_t n = n0; n < n1; n += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, n1 - n));
    const uint8_t* c = codes + n * row_bytes;
    prefetch_next_scales<Q4>(d + n * ng, m + n * ng, ng);
    ts.widen<Q4>(d + n * ng, m + n * ng, nb * ng);
    const float* dn = ts.d;
    const float* mn = ts.m;
    if (M <= 2) {
      with_tile_width(nb, [&](auto nbc) {
        rows_q8<Q4, false, decltype(nbc)::value>(xr, M, K, c, nullptr, dn, mn, row_bytes, ng, y + n, ldy);
      });
      continue;
    }
    for (int j = 0; j < nb; ++j)
      for (int64_t g = 0; g < ng; ++g) {
        if (j == 0) prefetch_next_tile<Q4>(c, row_bytes, g);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(unpacked.data() + j * K + g * G),
                            group_codes<Q4>(c + j * row_bytes + g * (Q4 ? G / 2 : G)));
      }
    const int8_t* w = unpacked.data();
    with_tile_width(nb, [&](auto nbc) {
      rows_q8<Q4, true, decltype(nbc)::value>(xr, M, K, c, w, dn, mn, row_bytes, ng, y + n, ldy);
    });
  }
}

}  // namespace pdq
