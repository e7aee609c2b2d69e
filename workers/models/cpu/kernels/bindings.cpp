// The extension's Python bindings (workers/models/cpu/cpu_kernels.py builds every file of this folder into one module).
#include <torch/extension.h>

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& keep, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                          int64_t heads, int64_t kv_heads);
at::Tensor rotary_positions(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_positions_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> causal_softmax_backward(const at::Tensor& scores, const at::Tensor& grad_probs,
                                                           const at::Tensor& lse, const at::Tensor& delta,
                                                           double scale, int64_t queries);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "attention of one-token queries over a KV cache");
  m.def("rms_norm", &rms_norm, "transformers' LlamaRMSNorm in one pass");
  m.def("rms_norm_backward", &rms_norm_backward, "the input's gradient through that norm (frozen weight)");
  m.def("causal_softmax_backward", &causal_softmax_backward, "P and dS of causal attention's backward, from float32 scores");
  m.def("rotary", &rotary, "rotary embedding of a decode step's queries and keys, from the fused q/k/v output");
  m.def("rotary_positions", &rotary_positions, "rotary embedding of one projection's output, [batch, length, heads, dim]");
  m.def("rotary_positions_backward", &rotary_positions_backward, "its gradient");
}
