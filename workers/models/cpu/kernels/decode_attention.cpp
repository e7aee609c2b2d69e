// Attention for one-token queries (decoding) on the CPU, reading each cached key and value once.
//
// torch's CPU flash attention runs a decode step's attention as small blocked matmuls with the
// query block as their rows: a one-token query (a few query heads per KV head) leaves those
// kernels mostly idle, and a decode step of SmolLM2-135M read its KV cache at ~10 GB/s, half the
// step (benchmarks/engine). Here each (row, KV head) is one task: every key is converted to
// float32 once and dotted with all its query heads, then every value is added once into their
// outputs. Accumulation is float32 throughout; the output is rounded once to the input's dtype.
// A row's result depends on that row alone (never on the batch it runs in).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "convert.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using agent_rft::exp_nonpositive;
using agent_rft::to_float;

// softmax numerators of each query head's scores, in place; returns their sums (0: nothing to attend).
inline void softmax_numerators(float* scores, int64_t group, int64_t length, float* totals) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * length;
    float top = kNegInf;
    for (int64_t l = 0; l < length; ++l) top = std::max(top, sg[l]);
    totals[g] = 0.f;
    if (top == kNegInf) continue;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < length; ++l) {
      const float e = sg[l] == kNegInf ? 0.f : exp_nonpositive(sg[l] - top);
      sg[l] = e;
      sum += e;
    }
    totals[g] = sum;
  }
}

// One (row, KV head): `group` query heads of `dim` values against `length` keys and values.
template <typename T>
struct Task {
  const T* q;  // [group, dim], contiguous
  const T* k;  // key l at k + l * k_stride
  const T* v;
  const bool* keep;  // [length] or null
  T* out;  // [group, dim]
  int64_t k_stride, v_stride;
};

template <typename T>
void attend_generic(const Task<T>& t, int64_t group, int64_t length, int64_t dim, float scale,
                    std::vector<float>& work) {
  work.resize(group * dim * 3 + group * length + group);
  float *qf = work.data(), *row = qf + group * dim, *acc = row + dim, *scores = acc + group * dim,
        *totals = scores + group * length;
  for (int64_t i = 0; i < group * dim; ++i) qf[i] = to_float(t.q[i]) * scale;
  for (int64_t l = 0; l < length; ++l) {
    const bool skip = t.keep && !t.keep[l];
    if (!skip) for (int64_t d = 0; d < dim; ++d) row[d] = to_float(t.k[l * t.k_stride + d]);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      if (!skip) {
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * row[d];
      }
      scores[g * length + l] = skip ? kNegInf : dot;
    }
  }
  softmax_numerators(scores, group, length, totals);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t l = 0; l < length; ++l) {
    if (t.keep && !t.keep[l]) continue;
    for (int64_t d = 0; d < dim; ++d) row[d] = to_float(t.v[l * t.v_stride + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * length + l];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = totals[g] > 0.f ? 1.f / totals[g] : 0.f;
    for (int64_t d = 0; d < dim; ++d) t.out[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv);
  }
}

#if defined(__AVX512F__)
// The same for dim 64 and a group size known at compile time: a key's 64 values are four vectors,
// the group's query heads and output accumulators stay in registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The cache is read from memory (a layer's keys and values are gone from the caches by the next
// step): fetching rows 32 keys ahead (16 measured the same, 8 slower) keeps loads in flight while
// the arithmetic runs, and the values are pulled towards L2 during the key pass, ahead of the
// value pass.
constexpr int64_t kAhead = 32;
template <_mm_hint Hint, typename T>
inline void prefetch_row(const T* p) {  // a prefetch never faults: past the cache's end is fine
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < 64 * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, Hint);
}

template <typename T, int G>
void attend_64(const Task<T>& t, int64_t length, float scale, std::vector<float>& work) {
  work.resize(G * length + G);
  float *scores = work.data(), *totals = scores + G * length;
  __m512 q[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) q[g][c] = _mm512_mul_ps(load16(t.q + g * 64 + c * 16), _mm512_set1_ps(scale));
  for (int64_t l = 0; l < length; ++l) {
    if (t.keep && !t.keep[l]) {
      for (int g = 0; g < G; ++g) scores[g * length + l] = kNegInf;
      continue;
    }
    const T* kl = t.k + l * t.k_stride;
    prefetch_row<_MM_HINT_T0>(kl + kAhead * t.k_stride);
    prefetch_row<_MM_HINT_T1>(t.v + (l + kAhead) * t.v_stride);
    const __m512 k0 = load16(kl), k1 = load16(kl + 16), k2 = load16(kl + 32), k3 = load16(kl + 48);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(q[g][0], k0);
      a = _mm512_fmadd_ps(q[g][1], k1, a);
      a = _mm512_fmadd_ps(q[g][2], k2, a);
      a = _mm512_fmadd_ps(q[g][3], k3, a);
      scores[g * length + l] = _mm512_reduce_add_ps(a);
    }
  }
  softmax_numerators(scores, G, length, totals);
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < length; ++l) {
    if (t.keep && !t.keep[l]) continue;
    const T* vl = t.v + l * t.v_stride;
    prefetch_row<_MM_HINT_T0>(vl + kAhead * t.v_stride);
    const __m512 v0 = load16(vl), v1 = load16(vl + 16), v2 = load16(vl + 32), v3 = load16(vl + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * length + l]);
      acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
    }
  }
  alignas(64) float lanes[64];
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(totals[g] > 0.f ? 1.f / totals[g] : 0.f);
    for (int c = 0; c < 4; ++c) _mm512_store_ps(lanes + c * 16, _mm512_mul_ps(acc[g][c], inv));
    for (int d = 0; d < 64; ++d) t.out[g * 64 + d] = static_cast<T>(lanes[d]);
  }
}
#endif

template <typename T>
void attend_one(const Task<T>& t, int64_t group, int64_t length, int64_t dim, float scale, std::vector<float>& work) {
#if defined(__AVX512F__)
  if (dim == 64) {
    switch (group) {
      case 1: return attend_64<T, 1>(t, length, scale, work);
      case 2: return attend_64<T, 2>(t, length, scale, work);
      case 3: return attend_64<T, 3>(t, length, scale, work);
      case 4: return attend_64<T, 4>(t, length, scale, work);
      case 5: return attend_64<T, 5>(t, length, scale, work);
      case 6: return attend_64<T, 6>(t, length, scale, work);
      default: break;
    }
  }
#endif
  attend_generic(t, group, length, dim, scale, work);
}

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
            const c10::optional<at::Tensor>& keep, double scale, at::Tensor& out) {
  const int64_t rows = key.size(0), heads = key.size(1), length = key.size(2), dim = key.size(3);
  const int64_t group = query.size(2);
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const bool* mask = keep.has_value() ? keep->data_ptr<bool>() : nullptr;
  const int64_t mask_row = keep.has_value() ? keep->stride(0) : 0;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const Task<T> t{q + task * group * dim, k + b * key.stride(0) + h * key.stride(1),
                      v + b * value.stride(0) + h * value.stride(1), mask ? mask + b * mask_row : nullptr,
                      o + task * group * dim, key.stride(2), value.stride(2)};
      attend_one(t, group, length, dim, static_cast<float>(scale), work);
    }
  });
}

}  // namespace

// query [rows, kv heads, query heads per kv head, dim], contiguous; key, value [rows, kv heads,
// length, dim], last dim contiguous (views into a cache with spare room are fine); keep [rows,
// length] bool (true: attend) or none. Returns [rows, kv heads, query heads per kv head, dim].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& keep, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "4-D query, key and value");
  TORCH_CHECK(query.is_contiguous(), "contiguous query");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "key and value contiguous in their last dim");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value of one shape");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(1) == key.size(1) && query.size(3) == key.size(3),
              "query [rows, kv heads, group, dim] against key [rows, kv heads, length, dim]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(), "one dtype");
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->dim() == 2 && keep->stride(1) == 1 &&
                keep->size(0) == key.size(0) && keep->size(1) == key.size(2), "keep: bool [rows, length]");
  }
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(query, key, value, keep, scale, out);
  } else {
    TORCH_CHECK(query.scalar_type() == at::kFloat, "bfloat16 or float32");
    attend<float>(query, key, value, keep, scale, out);
  }
  return out;
}
