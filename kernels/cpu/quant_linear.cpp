// y = x W^T for a few rows of x, with W kept in GGUF's block formats as stored (no re-quantization):
//   4-bit (Q4_0 / Q4_1): per 32 inputs, 16 bytes of codes (byte j: element j in the low nibble,
//   element j + 16 in the high one, as ggml's dequantize_row_q4_1), w = q * d + m
//   (Q4_0: m = -8 d, exact in float16 while |d| <= 8188);
//   8-bit (Q8_0): per 32 inputs, 32 int8 codes, w = q * d.
// d and m arrive as float16 [N, K / 32], the file's scales and minimums as stored (quant_block.h
// widens a tile's at a time to float32, exactly).
//
// Why our own kernel: torch 2.13's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm have
// vectorized paths for AVX-512 only; on an AVX2-only CPU they ran 15-50x slower than an fp32
// GEMV (measured, docs/decisions.md). The inner loops (AVX-512 or AVX2, chosen at build) are in
// quant_block.h, shared with the fused decode step; each row of x is computed independently.
// bf16=True (builds with AVX512-BF16, has_bf16): x and the weights rounded to bf16 and bf16 dot
// products (`vdpbf16ps`), the path of a bfloat16 model's fused decode step. int8=True: x
// quantized per 32 inputs to int8 and integer dot products (llama.cpp's q4_1 x q8_1 scheme,
// PD_BLOCK_DOT=int8; quant_block.h, block_rows_q8). amx=True (has_amx): bf16's roundings with the
// dot products on AMX tiles (PD_BLOCK_DOT=amx; quant_block.h, block_rows_amx).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>

#include "quant_block.h"

namespace {

using pdq::G;
using pdq::load_group;

template <bool Q4>
torch::Tensor block_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, bool bf16,
                           bool int8, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % G == 0, "K must be a multiple of 32");
  TORCH_CHECK(codes.size(1) == (Q4 ? K / 2 : K), "codes must be [N, K/2] (4-bit) or [N, K] (8-bit)");
  TORCH_CHECK(d.size(0) == N && d.size(1) == K / G && d.scalar_type() == torch::kHalf, "d must be float16 [N, K/32]");
  TORCH_CHECK(!Q4 || (m.scalar_type() == torch::kHalf && m.sizes() == d.sizes()), "m must be float16 [N, K/32]");
  auto xc = x.contiguous();
  auto cc = codes.contiguous();
  auto dc = d.contiguous();
  auto mc = Q4 ? m.contiguous() : dc;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const pdq::scale_t* dp = reinterpret_cast<const pdq::scale_t*>(dc.data_ptr());
  const pdq::scale_t* mp = reinterpret_cast<const pdq::scale_t*>(mc.data_ptr());
  float* op = out.data_ptr<float>();
  TORCH_CHECK(int(bf16) + int(int8) + int(amx) <= 1, "bf16, int8 and amx are different arithmetics: choose one");
  TORCH_CHECK(!amx || pdq::has_amx(), "amx needs a build with AMX tiles on a CPU and kernel that grant them (has_amx)");
  TORCH_CHECK(!bf16 || pdq::kHasBf16, "bf16 dot products need a build with AVX512-BF16 (has_bf16)");
  if (int8) {
    thread_local pdq::RowsQ8 quantized;  // x quantized per 32 inputs, once per call
    pdq::quantize_rows_q8(xp, M, K, quantized);
    const pdq::RowsQ8& xr = quantized;  // (the workers must read this thread's buffers, not their own)
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { pdq::block_rows_q8<Q4>(xr, M, K, cp, dp, mp, n0, n1, op, N); });
    return out;
  }
#ifdef PDQ_AMX
  if (amx) {
    thread_local std::vector<uint16_t> xv;  // x rounded to bf16 once per call, as B tiles
    if (Q4) pdq::vnni_rows_bf16<true>(xp, M, K, xv);
    else pdq::vnni_rows_bf16<false>(xp, M, K, xv);
    const uint16_t* xvp = xv.data();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      pdq::block_rows_amx<Q4>(xvp, M, K, cp, dp, mp, n0, n1, op, N);
    });
    return out;
  }
#endif
#ifdef PDQ_BF16
  if (bf16) {
    std::vector<uint16_t> xb(static_cast<size_t>(M * K));  // x rounded to bf16 once per call
    pdq::round_rows_bf16(xp, M * K, xb.data());
    const uint16_t* xbp = xb.data();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      pdq::block_rows_bf16<Q4>(xbp, M, K, cp, dp, mp, n0, n1, op, N);
    });
    return out;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    pdq::block_rows<Q4>(xp, M, K, cp, dp, mp, n0, n1, op, N);
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
  TORCH_CHECK(d.scalar_type() == torch::kHalf && codes.size(0) == d.size(0), "d must be float16 [N, K/32]");
  TORCH_CHECK(!Q4 || (m.scalar_type() == torch::kHalf && m.sizes() == d.sizes()), "m must be float16 [N, K/32]");
  auto out = torch::empty({N, K}, d.options().dtype(torch::kFloat));
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const pdq::scale_t* dp = reinterpret_cast<const pdq::scale_t*>(dc.data_ptr());
  const pdq::scale_t* mp = reinterpret_cast<const pdq::scale_t*>(mc.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K, ng = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    __m256 w[4];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < ng; ++g) {
        load_group<Q4>(cp + n * row_bytes + g * (Q4 ? G / 2 : G), pdq::f16(dp[n * ng + g]),
                        Q4 ? pdq::f16(mp[n * ng + g]) : 0.f, w);
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(op + n * K + g * G + 8 * c, w[c]);
      }
  });
  return out;
}

// y = x W^T for float32 weights [N, K] with the block kernel's widened-weights loops (pdq::kTileRows x
// kTileCols register tiles, one accumulator chain per output over K in order): each row's result is the
// same bits whatever the number of rows, which a GEMM library's blocking does not promise. The
// batch-invariant mode's float32 linears (engine/model/batch_invariant.py); K a multiple of 16.
torch::Tensor float_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.size(1) == x.size(1), "w must be float32 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t n = 4 * b0; n < std::min(N, 4 * b1); n += 4) {
      const float* wn = wp + n * K;
      pdq::with_tile_width(static_cast<int>(std::min<int64_t>(4, N - n)), [&](auto nbc) {
        pdq::rows_widened<decltype(nbc)::value>(xp, M, K, wn, op + n, N);
      });
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &block_linear<true>, py::call_guard<py::gil_scoped_release>(),
          "x W^T, W as 4-bit GGUF blocks (w = q d + m), x float32 [M, K]; bf16: x and W rounded to bf16, bf16 dot products; int8: x quantized per 32 inputs to int8, integer dot products; amx: bf16's roundings, AMX tiles",
          py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"), py::arg("bf16") = false, py::arg("int8") = false, py::arg("amx") = false);
  mod.def("q8_linear", &block_linear<false>, py::call_guard<py::gil_scoped_release>(),
          "x W^T, W as Q8_0 blocks (w = q d), x float32 [M, K]; bf16: x and W rounded to bf16, bf16 dot products; int8: x quantized per 32 inputs to int8, integer dot products; amx: bf16's roundings, AMX tiles",
          py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"), py::arg("bf16") = false, py::arg("int8") = false, py::arg("amx") = false);
  mod.def("q4_dequantize", &block_dequantize<true>, py::call_guard<py::gil_scoped_release>(), "float32 [N, K] from 4-bit GGUF blocks");
  mod.def("q8_dequantize", &block_dequantize<false>, py::call_guard<py::gil_scoped_release>(), "float32 [N, K] from Q8_0 blocks");
  mod.def("float_linear", &float_linear, py::call_guard<py::gil_scoped_release>(),
          "x W^T, float32 weights, each row's bits independent of the row count");
  mod.attr("isa") = pdq::kIsa;
  mod.attr("has_bf16") = pdq::kHasBf16;  // bf16=True accepted (AVX512-BF16, or the emulated test build)
  mod.attr("has_amx") = pdq::has_amx();  // amx=True accepted (AMX tiles built and granted by the OS)
}
