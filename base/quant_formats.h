// The low-bit number formats real MoE checkpoints are published in, and exact conversions.
//
//   e4m3 ("F8_E4M3", the fn variant): sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals
//        at exponent 0; S.1111.111 (0x7F, 0xFF) is NaN; no infinities; largest finite 448.
//   e2m1 ("F4"): sign, 2 exponent bits, 1 mantissa bit; the 16 codes are 0, 0.5, 1, 1.5, 2, 3, 4,
//        6 and the same negated (code 8 is -0).
//   e8m0 (MX scale): 2^(s - 127) for s in 0..254; 0xFF is NaN.
// Block-scaled weights built on them, as checkpoints store them:
//   FP8 (DeepSeek-V3/R1, Qwen3-FP8): W[n][k] = e4m3(code[n][k]) * scale_inv[n / 128][k / 128]
//   MXFP4 (gpt-oss): W[n][k] = e2m1(code[n][k]) * e8m0(scale[n][k / 32])
// Every conversion to float here is exact; the F32 -> code functions (for presets) round to
// nearest even and saturate. Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace moerun {

inline constexpr int kFp8BlockRows = 128;  // weight_block_size [128, 128]
inline constexpr int kMxGroup = 32;        // MXFP4: one scale per 32 input columns
inline constexpr float kE4m3Max = 448.0f;

inline bool IsE4m3NaN(uint8_t c) { return (c & 0x7Fu) == 0x7Fu; }
inline bool IsE8m0NaN(uint8_t s) { return s == 0xFFu; }

// Exact; NaN for the NaN codes.
inline float E4m3ToF32(uint8_t c) {
  const int e = (c >> 3) & 0xF;
  const int m = c & 7;
  float v;
  if (IsE4m3NaN(c)) {
    v = std::nanf("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);  // m/8 * 2^-6
  } else {
    v = std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) * 2^(e-7)
  }
  return (c & 0x80u) ? -v : v;
}

inline float E2m1ToF32(uint8_t c) {
  static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[c & 0xF];
}

// 2^(s - 127), exact (2^-127 is an f32 subnormal); NaN for 0xFF.
inline float E8m0ToF32(uint8_t s) {
  if (IsE8m0NaN(s)) return std::nanf("");
  if (s == 0) return std::bit_cast<float>(0x00400000u);
  return std::bit_cast<float>(static_cast<uint32_t>(s) << 23);
}

// The e8m0 code of a power of two in [2^-127, 2^127]; -1 if `v` is not one.
inline int F32ToE8m0(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  if (u == 0x00400000u) return 0;
  if ((u & 0x807FFFFFu) != 0) return -1;  // negative, or not a power of two
  const int s = static_cast<int>(u >> 23);
  return s >= 1 && s <= 254 ? s : -1;
}

// Nearest e4m3 code (ties to even), saturating at +-448; NaN maps to 0x7F.
uint8_t F32ToE4m3(float v);
// Nearest e2m1 code (ties to even), saturating at +-6.
uint8_t F32ToE2m1(float v);

}  // namespace moerun
