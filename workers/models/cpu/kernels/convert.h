// What the kernels share: float32's exp for softmax, and conversions: bfloat16 to float32 by a
// shift, float32 to bfloat16 rounded to nearest even as torch rounds, both without branches so that
// the loops calling them vectorise.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace agent_rft {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
  return out;
}

// exp(x) in float32 for x <= 0, or a rounding above it (softmax after subtracting the max or the
// log-sum-exp): 2^n * p(r), r in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' expf coefficients),
// relative error ~1e-7. Written so that the compiler vectorises the loop that calls it (std::exp
// does not vectorise here).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace agent_rft
