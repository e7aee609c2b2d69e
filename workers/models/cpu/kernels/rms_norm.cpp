// RMSNorm as transformers' LlamaRMSNorm computes it, in one pass per row instead of eight ops.
//
// transformers: h = float32(x); h = h * rsqrt(mean(h^2) + eps); out = weight * dtype(h). That is
// eight dispatched ops (conversions, pow, mean, add, rsqrt, two multiplies), ~21 us for a decode
// step's [16, 576] in bfloat16, 61 times a step for SmolLM2-135M; here ~5 us. The roundings are
// torch's: h * r is rounded to the input dtype, then multiplied by the weight in float32 and
// rounded again. Only the sum of squares may add up in another order than torch's mean, which
// moves the variance by an ulp at most: a bfloat16 output differs in about one value in 10^5.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "convert.h"

#include <cmath>

namespace {

using agent_rft::from_float;
using agent_rft::to_float;

template <typename T>
void normalise(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  // A decode step's rows take ~2 us on one thread: fan out only when there is more work than that.
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* orow = out + r * hidden;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < hidden; ++d) squares += to_float(xr[d]) * to_float(xr[d]);
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d)
        orow[d] = from_float<T>(to_float(weight[d]) * to_float(from_float<T>(to_float(xr[d]) * inverse)));
    }
  });
}

}  // namespace

// x [..., hidden], contiguous, bfloat16 or float32; weight [hidden], the same dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous input and weight");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight [hidden] for x [..., hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "one dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = weight.size(0), rows = hidden ? x.numel() / hidden : 0;
  if (x.scalar_type() == at::kBFloat16) {
    normalise(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows,
              hidden, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "bfloat16 or float32");
    normalise(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden,
              static_cast<float>(eps));
  }
  return out;
}

namespace {

// The gradient of x through transformers' RMSNorm (the weight frozen, as LoRA trains): with
// h = float32(x), r = rsqrt(mean(h^2) + eps) and n = h * r rounded, the incoming gradient reaches n
// as g = dtype(dy * weight) (autograd's rounding of that product), and
// dx = r * g - h * r^3 * mean(g * h), in float32 with one rounding. One pass per row over x, dy and
// the weight, where autograd ran ~ten ops over float32 copies of the activations.
template <typename T>
void normalise_backward(const T* grad, const T* x, const T* weight, T* out, int64_t rows, int64_t hidden,
                        float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      const T* gr = grad + r * hidden;
      T* orow = out + r * hidden;
      float squares = 0.f, dot = 0.f;
#pragma omp simd reduction(+ : squares, dot)
      for (int64_t d = 0; d < hidden; ++d) {
        const float h = to_float(xr[d]);
        squares += h * h;
        dot += to_float(from_float<T>(to_float(gr[d]) * to_float(weight[d]))) * h;
      }
      const float mean = squares / static_cast<float>(hidden);
      const float inverse = 1.f / std::sqrt(mean + eps);
      const float coefficient = inverse * inverse * inverse * dot / static_cast<float>(hidden);
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) {
        const float g = to_float(from_float<T>(to_float(gr[d]) * to_float(weight[d])));
        orow[d] = from_float<T>(inverse * g - to_float(xr[d]) * coefficient);
      }
    }
  });
}

}  // namespace

// grad and x [..., hidden], contiguous, one dtype (bfloat16 or float32); weight [hidden], the same.
at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(grad.is_contiguous() && x.is_contiguous() && weight.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(grad.sizes() == x.sizes() && weight.dim() == 1 && x.size(-1) == weight.size(0), "shapes");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && grad.scalar_type() == x.scalar_type(), "one dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = weight.size(0), rows = hidden ? x.numel() / hidden : 0;
  if (x.scalar_type() == at::kBFloat16) {
    normalise_backward(grad.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                       out.data_ptr<at::BFloat16>(), rows, hidden, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "bfloat16 or float32");
    normalise_backward(grad.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(),
                       rows, hidden, static_cast<float>(eps));
  }
  return out;
}
