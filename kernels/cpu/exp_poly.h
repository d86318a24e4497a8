// exp(x) written so the compiler vectorizes it (std::exp does not): 2^(x log2 e) = 2^n * 2^f
// with f in [-1/2, 1/2]; 2^f by a degree-6 polynomial (the Cephes exp2f coefficients, Moshier
// 1989), relative error about 2e-7; 2^n by building the exponent bits; x clamped to [-87, 88]
// (below -87 the result is about 0). Used by the paged attention's softmax; the fused
// decode step's SiLU (silu.h, silu_mul8) writes the same steps out for 8 lanes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

inline constexpr float kLog2e = 1.44269504088896341f;

// 2^f for f in [-1/2, 1/2]: the Cephes exp2f polynomial's coefficients, highest degree first, and
// its Horner steps p = p f + c (each a multiply and an add: the compiler contracts them to FMAs in
// a loop, a constant expression keeps both roundings).
inline constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                       5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
constexpr float exp2_poly(float f) {
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  return p;
}

inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * kLog2e;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  const float p = exp2_poly(f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
