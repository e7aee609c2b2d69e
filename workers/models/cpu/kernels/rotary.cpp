// Rotary position embedding of a decode step's queries and keys, straight from the fused q/k/v
// projection's output, in one call instead of transformers' ten ops per layer (slices, a negation,
// two concatenations, four multiplies, two adds; ~60 us of a ~33 ms decode step at 16 rows, 30
// layers: ~1.8 ms a step).
//
// transformers: q * cos + rotate_half(q) * sin, each op rounded to bfloat16: the two products
// are rounded, then their sum. Here the same roundings, in the same order, so the output is
// bit-identical (tests/rl/test_cpu_kernels.py). bfloat16 only: in float32 the compiler may fuse
// a product and the sum (an FMA) and round once where torch rounds twice.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "convert.h"

#include <algorithm>
#include <tuple>

namespace {

using agent_rft::from_float;
using agent_rft::to_float;
using bf16 = c10::BFloat16;

void rotate(const bf16* src, const bf16* cos, const bf16* sin, bf16* dst, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const float x = to_float(src[i]);
    const float partner = i < half ? -to_float(src[i + half]) : to_float(src[i - half]);  // rotate_half
    const float a = to_float(from_float<bf16>(x * to_float(cos[i])));
    const float b = to_float(from_float<bf16>(partner * to_float(sin[i])));
    dst[i] = from_float<bf16>(a + b);
  }
}

}  // namespace

// qkv [rows, 1, (heads + 2 kv_heads) * dim] (q, k, v stacked, contiguous); cos and sin [rows, 1,
// dim]. Returns the rotated queries [rows, kv_heads, heads / kv_heads, dim] (packed for
// decode_attention: query head h reads KV head h / group) and keys [rows, kv_heads, 1, dim].
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                          int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16, "bfloat16");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "qkv [rows, 1, (heads + 2 kv_heads) * dim]");
  const int64_t rows = qkv.size(0), dim = cos.size(-1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(2) == (heads + 2 * kv_heads) * dim, "qkv's width is (heads + 2 kv_heads) * dim");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin [rows, 1, dim]");
  at::Tensor queries = at::empty({rows, kv_heads, heads / kv_heads, dim}, qkv.options());
  at::Tensor keys = at::empty({rows, kv_heads, 1, dim}, qkv.options());
  const bf16* in = qkv.data_ptr<bf16>();
  const bf16* c = cos.data_ptr<bf16>();
  const bf16* s = sin.data_ptr<bf16>();
  bf16* q = queries.data_ptr<bf16>();
  bf16* k = keys.data_ptr<bf16>();
  const int64_t width = qkv.size(2);
  for (int64_t r = 0; r < rows; ++r) {  // ~3 us of work at 16 rows: one thread
    for (int64_t h = 0; h < heads; ++h) rotate(in + r * width + h * dim, c + r * dim, s + r * dim, q + (r * heads + h) * dim, dim);
    for (int64_t h = 0; h < kv_heads; ++h)
      rotate(in + r * width + (heads + h) * dim, c + r * dim, s + r * dim, k + (r * kv_heads + h) * dim, dim);
  }
  return {queries, keys};
}

namespace {

// The gradient of rotate's input: out = x * cos + rotate_half(x) * sin is linear in x, and its
// transpose takes dy to dy * cos + rotate_half^T(dy * sin), where rotate_half^T(y) is
// [y2, -y1] for y = [y1, y2]. float32, one rounding.
void rotate_back(const bf16* grad, const bf16* cos, const bf16* sin, bf16* dst, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    const float partner = to_float(grad[j]) * to_float(sin[j]);
    dst[i] = from_float<bf16>(to_float(grad[i]) * to_float(cos[i]) + (i < half ? partner : -partner));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16, "bfloat16");
  TORCH_CHECK(x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && x.size(3) % 2 == 0, "x [batch, length, heads, dim], cos [batch, length, dim]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == x.size(1) && cos.size(2) == x.size(3) &&
                  (cos.size(0) == x.size(0) || cos.size(0) == 1), "cos and sin [batch or 1, length, dim]");
}

template <typename Op>
at::Tensor over_positions(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, Op op) {
  check_rows(x, cos, sin);
  at::Tensor out = at::empty_like(x);
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), dim = x.size(3);
  const bf16* in = x.data_ptr<bf16>();
  const bf16* c = cos.data_ptr<bf16>();
  const bf16* s = sin.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  const int64_t cos_batch = cos.size(0) == 1 ? 0 : length * dim;
  at::parallel_for(0, batch * length, std::max<int64_t>(1, 16384 / (heads * dim)), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = p / length, l = p % length;
      const bf16* cp = c + b * cos_batch + l * dim;
      const bf16* sp = s + b * cos_batch + l * dim;
      for (int64_t h = 0; h < heads; ++h) op(in + (p * heads + h) * dim, cp, sp, o + (p * heads + h) * dim, dim);
    }
  });
  return out;
}

}  // namespace

// transformers' apply_rotary_pos_emb of one projection's output viewed [batch, length, heads, dim]
// (contiguous: the layout before transformers' transpose), with cos and sin [batch or 1, length,
// dim]: bit-identical, as `rotary` (prefills and the update; ~10 ops per layer otherwise).
at::Tensor rotary_positions(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return over_positions(x, cos, sin, rotate);
}

// Its gradient in x (cos and sin are constants of the positions).
at::Tensor rotary_positions_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin) {
  return over_positions(grad, cos, sin, rotate_back);
}
