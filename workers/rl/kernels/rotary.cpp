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

#include "convert.h"

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
