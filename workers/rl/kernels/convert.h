// Conversions the kernels share: bfloat16 to float32 by a shift, float32 to bfloat16 rounded to
// nearest even as torch rounds, both without branches so that the loops calling them vectorise.
#pragma once

#include <c10/util/BFloat16.h>

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

}  // namespace agent_rft
