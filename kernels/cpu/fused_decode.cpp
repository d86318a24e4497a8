// A Llama decoder layer's decode step in two calls, over GGUF blocks as stored (quant_block.h):
//
//   attn_in : h = RMSNorm(x); [q k v] = h [Wq Wk Wv]^T (one fused matmul over the three
//             projections' blocks); RoPE on q and k (transformers' rotate_half convention, with
//             the cos/sin the model's rotary embedding gives); k, v written to their KV cache
//             slots (bf16 rounded to nearest even, as torch's .to(bfloat16)); returns q.
//   attn_out: x += attn Wo^T; h = RMSNorm(x); x += (SiLU(h Wg^T) * h Wu^T) Wd^T, in place.
//
// Paged attention between the two is the existing kernel (kernels/cpu/paged_attention.cpp),
// called from Python. All math is float32, except the matmuls of a layer built with bf16 Blocks
// (a bfloat16 model on an AVX512-BF16 CPU): their inputs and weights are rounded to bf16 and
// multiplied with bf16 dot products accumulating in float32, or with int8 Blocks
// (PD_BLOCK_DOT=int8): their inputs are quantized per 32 to int8 and multiplied with integer dot
// products (quant_block.h), or with amx Blocks (PD_BLOCK_DOT=amx): bf16's roundings with the dot
// products on AMX tiles, decode's single rows included; RMSNorm, RoPE, SiLU and the residuals stay
// float32.
//
// Row independence: every row (token) of a step is computed on its own: RMSNorm, RoPE, SiLU
// and the KV write per row, and the matmuls through pdq::block_rows (or block_rows_bf16, fixed
// per Blocks object), whose reduction order for a row does not depend on how many rows the call
// has. A token's output is therefore
// bit-identical alone or inside a batch (tests/unit/test_fused_decode.py checks it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_block.h"
#include "silu.h"

namespace {
// Rows [0, M) of a step's per-row work (norms, RoPE, KV writes, SiLU, residuals, the AMX layout of
// x) split over the threads in ranges of at least kRowGrain rows: a decode step's few rows stay on
// the calling thread, a prefill chunk's hundreds no longer leave the other threads waiting at the
// next matmul (measured on the AMX Xeon: about a quarter of a 2,048-token prefill's CPU time was
// one thread working and the other spinning). Each row's arithmetic is the same whatever the
// split, so its bits are too.
constexpr int64_t kRowGrain = 32;
template <typename F>
inline void for_rows(int64_t M, F&& f) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}
}  // namespace

namespace py = pybind11;

namespace {

// One projection (or several stacked along the output rows) in 32-element blocks. bf16: use
// bf16 dot products (quant_block.h, block_rows_bf16) when the build has them (pdq::kHasBf16);
// chosen once per object (the model's compute dtype), never per call or per row count.
struct Blocks {
  torch::Tensor codes, d, m;
  bool q4, bf16, int8, amx;
  int64_t N, K;

  Blocks(torch::Tensor codes_, torch::Tensor d_, torch::Tensor m_, int64_t bits, bool bf16_ = false, bool int8_ = false,
         bool amx_ = false)
      : codes(codes_.contiguous()), d(d_.contiguous()), m(m_.contiguous()), q4(bits == 4),
        bf16(bf16_ && pdq::kHasBf16), int8(int8_), amx(amx_ && pdq::has_amx()), N(codes_.size(0)),
        K(d_.size(1) * pdq::G) {
    TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
    TORCH_CHECK(int(bf16_) + int(int8_) + int(amx_) <= 1, "bf16, int8 and amx are different arithmetics: choose one");
    TORCH_CHECK(codes.size(1) == (q4 ? K / 2 : K), "codes must be [N, K/2] (4-bit) or [N, K] (8-bit)");
    TORCH_CHECK(d.scalar_type() == torch::kHalf && d.size(0) == N, "d must be float16 [N, K/32] (the file's scales)");
    TORCH_CHECK(!q4 || (m.scalar_type() == torch::kHalf && m.sizes() == d.sizes()), "m must be float16 [N, K/32]");
  }

  // y[M, N] (row stride ldy) = x[M, K] W^T, weight rows split across threads.
  void matmul(const float* x, int64_t M, float* y, int64_t ldy) const {
    const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
    const pdq::scale_t* dp = reinterpret_cast<const pdq::scale_t*>(d.data_ptr());
    const pdq::scale_t* mp = q4 ? reinterpret_cast<const pdq::scale_t*>(m.data_ptr()) : dp;
    if (int8) {
      thread_local pdq::RowsQ8 quantized;  // x quantized per 32 inputs, once per call
      pdq::quantize_rows_q8(x, M, K, quantized);
      const pdq::RowsQ8& xr = quantized;  // (the workers must read this thread's buffers, not their own)
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (q4) pdq::block_rows_q8<true>(xr, M, K, cp, dp, mp, n0, n1, y, ldy);
        else pdq::block_rows_q8<false>(xr, M, K, cp, dp, mp, n0, n1, y, ldy);
      });
      return;
    }
#ifdef PDQ_AMX
    if (amx) {
      thread_local std::vector<uint16_t> xv;  // x rounded to bf16 once per call, as B tiles
      if (q4) pdq::vnni_rows_bf16<true>(x, M, K, xv, false);
      else pdq::vnni_rows_bf16<false>(x, M, K, xv, false);
      uint16_t* xw = xv.data();
      at::parallel_for(0, (M + 15) / 16, kRowGrain / 16, [&](int64_t j0, int64_t j1) {
        const int64_t r0 = 16 * j0, r1 = std::min(M, 16 * j1);
        if (q4) pdq::vnni_rows_bf16_range<true>(x, r0, r1, K, xw);
        else pdq::vnni_rows_bf16_range<false>(x, r0, r1, K, xw);
      });
      const uint16_t* xp = xw;
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (q4) pdq::block_rows_amx<true>(xp, M, K, cp, dp, mp, n0, n1, y, ldy);
        else pdq::block_rows_amx<false>(xp, M, K, cp, dp, mp, n0, n1, y, ldy);
      });
      return;
    }
#endif
#ifdef PDQ_BF16
    if (bf16) {
      thread_local std::vector<uint16_t> xb;  // x rounded to bf16 once per call
      xb.resize(static_cast<size_t>(M * K));
      pdq::round_rows_bf16(x, M * K, xb.data());
      const uint16_t* xp = xb.data();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (q4) pdq::block_rows_bf16<true>(xp, M, K, cp, dp, mp, n0, n1, y, ldy);
        else pdq::block_rows_bf16<false>(xp, M, K, cp, dp, mp, n0, n1, y, ldy);
      });
      return;
    }
#endif
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (q4) pdq::block_rows<true>(x, M, K, cp, dp, mp, n0, n1, y, ldy);
      else pdq::block_rows<false>(x, M, K, cp, dp, mp, n0, n1, y, ldy);
    });
  }
};

// RMSNorm (Zhang & Sennrich, 2019) of one row, transformers' Llama formula:
// y = w * (x / sqrt(mean(x^2) + eps)).
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}


template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// RoPE in place on one head: out[i] = x[i] cos[i] - x[i + h] sin[i],
// out[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h] (transformers' rotate_half).
inline void rope_head(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] - b * sin[i];
    x[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

// A call's float32 scratch, grown when a call needs more and never filled: every element a
// call reads it wrote first. One per thread, shared by every layer (a layer's call does not
// keep it past its return): vectors of each layer's own held one copy a layer (~320 MB for
// SmolLM2's 30 at 512 rows) and zero-filled their growth on every resize after a smaller call
// (memset and page faults were ~7 % of an AMX prefill's samples, docs/decisions.md).
class Scratch {
 public:
  float* get(int64_t n) {
    if (static_cast<size_t>(n) > size_) {
      data_.reset(new float[static_cast<size_t>(n)]);  // default-initialized: not zeroed
      size_ = static_cast<size_t>(n);
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  size_t size_ = 0;
};
thread_local Scratch scratch_h, scratch_buf, scratch_act;

class DecodeLayer {
 public:
  DecodeLayer(torch::Tensor norm1, torch::Tensor norm2, double eps, Blocks qkv, Blocks o, Blocks gate_up,
              Blocks down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : norm1_(norm1.to(torch::kFloat).contiguous()), norm2_(norm2.to(torch::kFloat).contiguous()),
        eps_(static_cast<float>(eps)), qkv_(std::move(qkv)), o_(std::move(o)), gate_up_(std::move(gate_up)),
        down_(std::move(down)), nq_(num_heads), nkv_(num_kv_heads), D_(head_dim), H_(norm1.size(0)),
        I_(gate_up_.N / 2) {
    TORCH_CHECK(qkv_.N == (nq_ + 2 * nkv_) * D_ && qkv_.K == H_, "qkv blocks must be [(H + 2 KVH) D, hidden]");
    TORCH_CHECK(o_.N == H_ && o_.K == nq_ * D_, "o_proj blocks must be [hidden, H D]");
    TORCH_CHECK(gate_up_.K == H_ && down_.N == H_ && down_.K == I_, "MLP blocks do not match");
  }

  // x [M, hidden] float32; cos, sin [M, head_dim] float32; caches [blocks, block_size, KVH, D]
  // float32 | bfloat16; slots [M] int64. Returns q [M, num_heads, head_dim] float32.
  torch::Tensor attn_in(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor slots) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H_ && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, hidden]");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == nkv_ && k_cache.size(3) == D_, "bad KV cache");
    const int64_t M = x.size(0), W = qkv_.N;
    auto c = cos.to(torch::kFloat).contiguous();
    auto s = sin.to(torch::kFloat).contiguous();
    auto sl = slots.to(torch::kLong).contiguous();
    const float* xp = x.data_ptr<float>();
    const float* w1 = norm1_.data_ptr<float>();
    float* hp = scratch_h.get(M * H_);
    float* bp = scratch_buf.get(M * W);
    for_rows(M, [&](int64_t r) { rms_norm_row(xp + r * H_, w1, eps_, H_, hp + r * H_); });
    qkv_.matmul(hp, M, bp, W);
    auto q = torch::empty({M, nq_, D_}, x.options());
    float* qp = q.data_ptr<float>();
    const int64_t kv_row = nkv_ * D_;
    TORCH_CHECK(k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16,
                "KV cache must be float32 or bfloat16");
    for_rows(M, [&](int64_t r) {
      float* row = bp + r * W;
      const float* cr = c.data_ptr<float>() + r * D_;
      const float* sr = s.data_ptr<float>() + r * D_;
      for (int64_t hd = 0; hd < nq_ + nkv_; ++hd) rope_head(row + hd * D_, cr, sr, D_);
      std::memcpy(qp + r * nq_ * D_, row, sizeof(float) * nq_ * D_);
      const int64_t slot = sl.data_ptr<int64_t>()[r];
      const float* k = row + nq_ * D_;
      const float* v = k + kv_row;
      if (k_cache.scalar_type() == torch::kFloat) {
        store_row(k, k_cache.data_ptr<float>() + slot * kv_row, kv_row);
        store_row(v, v_cache.data_ptr<float>() + slot * kv_row, kv_row);
      } else {
        store_row(k, k_cache.data_ptr<at::BFloat16>() + slot * kv_row, kv_row);
        store_row(v, v_cache.data_ptr<at::BFloat16>() + slot * kv_row, kv_row);
      }
    });
    return q;
  }

  // x [M, hidden] float32, updated in place; attn [M, num_heads * head_dim] float32.
  void attn_out(torch::Tensor x, torch::Tensor attn) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H_ && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, hidden]");
    const int64_t M = x.size(0);
    auto a = attn.to(torch::kFloat).contiguous().view({M, nq_ * D_});
    float* xp = x.data_ptr<float>();
    float* hp = scratch_h.get(M * H_);
    float* bp = scratch_buf.get(M * 2 * I_);
    float* ap = scratch_act.get(M * I_);
    const float* w2 = norm2_.data_ptr<float>();
    o_.matmul(a.data_ptr<float>(), M, hp, H_);
    for_rows(M, [&](int64_t r) {
      for (int64_t i = r * H_; i < (r + 1) * H_; ++i) xp[i] += hp[i];
      rms_norm_row(xp + r * H_, w2, eps_, H_, hp + r * H_);
    });
    gate_up_.matmul(hp, M, bp, 2 * I_);
    for_rows(M, [&](int64_t r) {
      const float* g = bp + r * 2 * I_;
      const float* u = g + I_;
      float* out = ap + r * I_;
      for (int64_t i = 0; i < I_; i += 8)  // I_ is down_proj's K: a multiple of 32
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    });
    down_.matmul(ap, M, hp, H_);
    for_rows(M, [&](int64_t r) {
      for (int64_t i = r * H_; i < (r + 1) * H_; ++i) xp[i] += hp[i];
    });
  }

 private:
  torch::Tensor norm1_, norm2_;
  float eps_;
  Blocks qkv_, o_, gate_up_, down_;
  int64_t nq_, nkv_, D_, H_, I_;
};

// RMSNorm of each row: x [M, H] float32, weight [H]; returns [M, H] float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto xc = x.to(torch::kFloat).contiguous();
  auto wc = weight.to(torch::kFloat).contiguous();
  const int64_t M = xc.size(0), H = xc.size(1);
  auto out = torch::empty_like(xc);
  for (int64_t r = 0; r < M; ++r)
    rms_norm_row(xc.data_ptr<float>() + r * H, wc.data_ptr<float>(), static_cast<float>(eps), H, out.data_ptr<float>() + r * H);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  py::class_<Blocks>(mod, "Blocks")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool, bool, bool>(), py::arg("codes"),
           py::arg("d"), py::arg("m"), py::arg("bits"), py::arg("bf16") = false, py::arg("int8") = false,
           py::arg("amx") = false)
      .def_readonly("bf16", &Blocks::bf16, "True when this object multiplies with bf16 dot products")
      .def_readonly("int8", &Blocks::int8, "True when this object quantizes its inputs to int8 (integer dot products)")
      .def_readonly("amx", &Blocks::amx, "True when this object multiplies on AMX tiles (bf16 roundings)");
  py::class_<DecodeLayer>(mod, "DecodeLayer")
      .def(py::init<torch::Tensor, torch::Tensor, double, Blocks, Blocks, Blocks, Blocks, int64_t, int64_t, int64_t>())
      .def("attn_in", &DecodeLayer::attn_in, py::call_guard<py::gil_scoped_release>(), "norm, QKV, RoPE, KV write; returns q [M, H, D]")
      .def("attn_out", &DecodeLayer::attn_out, py::call_guard<py::gil_scoped_release>(), "x += o_proj(attn); x += MLP(norm(x)), in place");
  mod.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm per row (float32)");
  mod.attr("isa") = pdq::kIsa;
  mod.attr("has_bf16") = pdq::kHasBf16;  // the build has bf16 dot products (AVX512-BF16, or emulated)
  mod.attr("has_amx") = pdq::has_amx();  // AMX tiles built and granted (PD_BLOCK_DOT=amx)
}
