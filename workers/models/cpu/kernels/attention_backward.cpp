// The softmax part of causal attention's backward pass, in one pass over the scores.
//
// torch's CPU flash attention runs the update's attention backward as small blocked matmuls and
// took ~5x its forward (a third of a LoRA update of SmolLM2-135M, benchmarks/engine). The update
// (workers/models/cpu/training_attention.py) instead recomputes the scores S = q k^T in float32, takes
// dP = dO v^T, and multiplies P and dS = P * (dP - D) back in large matmuls; what lies between is
// elementwise over [queries, keys] and is this kernel: P = exp(S * scale - lse) where the key is at
// or before the query (0 elsewhere) and dS = P * (dP - D) * scale, both rounded once to bfloat16 for
// the matmuls that follow (in float32 throughout before that).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "convert.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using agent_rft::exp_nonpositive;
using agent_rft::from_float;
using agent_rft::to_float;

}  // namespace

// scores [n, rows, keys] float32, grad_probs [n, rows, keys] bfloat16, lse and delta [n, rows] float32,
// all contiguous; row r of a slice is query position r % queries (query heads stacked by group).
// Returns P and dS, [n, rows, keys] bfloat16.
std::tuple<at::Tensor, at::Tensor> causal_softmax_backward(const at::Tensor& scores, const at::Tensor& grad_probs,
                                                           const at::Tensor& lse, const at::Tensor& delta,
                                                           double scale, int64_t queries) {
  TORCH_CHECK(scores.is_contiguous() && grad_probs.is_contiguous() && lse.is_contiguous() && delta.is_contiguous(),
              "contiguous tensors");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && grad_probs.scalar_type() == at::kBFloat16 &&
                  lse.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat, "dtypes");
  TORCH_CHECK(scores.dim() == 3 && grad_probs.sizes() == scores.sizes(), "shapes");
  const int64_t rows = scores.size(0) * scores.size(1), keys = scores.size(2);
  TORCH_CHECK(lse.numel() == rows && delta.numel() == rows && queries > 0 && scores.size(1) % queries == 0, "rows");
  at::Tensor probs = at::empty(scores.sizes(), scores.options().dtype(at::kBFloat16));
  at::Tensor grad_scores = at::empty_like(probs);
  const float* s = scores.data_ptr<float>();
  const at::BFloat16* dp = grad_probs.data_ptr<at::BFloat16>();
  const float* l = lse.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  at::BFloat16* p_out = probs.data_ptr<at::BFloat16>();
  at::BFloat16* ds_out = grad_scores.data_ptr<at::BFloat16>();
  const float factor = static_cast<float>(scale);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(keys, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t seen = std::min(keys, r % queries + 1);  // keys at or before this query
      const float* sr = s + r * keys;
      const at::BFloat16* dpr = dp + r * keys;
      at::BFloat16* pr = p_out + r * keys;
      at::BFloat16* dsr = ds_out + r * keys;
      const float lr = l[r], dr = d[r];
#pragma omp simd
      for (int64_t j = 0; j < seen; ++j) {
        const float p = exp_nonpositive(sr[j] * factor - lr);
        pr[j] = from_float<at::BFloat16>(p);
        dsr[j] = from_float<at::BFloat16>(p * (to_float(dpr[j]) - dr) * factor);
      }
      std::memset(static_cast<void*>(pr + seen), 0, sizeof(at::BFloat16) * (keys - seen));
      std::memset(static_cast<void*>(dsr + seen), 0, sizeof(at::BFloat16) * (keys - seen));
    }
  });
  return {probs, grad_scores};
}
