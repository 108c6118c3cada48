// exp(x) for float in plain arithmetic: about 1 ulp, no libm call, and the same bits on every
// machine and in every vectorised variant (only +, -, * and bit operations; the build disables
// fused contraction; CUDA code is built with --fmad=false). Inputs are clamped to [-87, 88]; NaN
// stays NaN. Internal linkage on purpose: translation units compiled for different ISAs each keep
// their own copy.
#pragma once

#include <bit>
#include <cstdint>

#include "base/host_device.h"

namespace moerun {

MOERUN_HD static inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}
MOERUN_HD static inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

MOERUN_HD static inline float ExpF(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + kMagic;
  const float n = t - kMagic;
  const uint32_t ni = FloatBits(t) - FloatBits(kMagic);
  float r = x - n * 0.693359375f;  // Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4
  r = r - n * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const float scale = BitsFloat((ni + 127u) << 23);
  return y * scale;
}

MOERUN_HD static inline float SigmoidF(float x) { return 1.0f / (1.0f + ExpF(-x)); }

}  // namespace moerun
