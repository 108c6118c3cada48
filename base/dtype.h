// Element types of tensors, as safetensors names them, and exact conversions to float.
//
// Every safetensors dtype name is recognised so that an unsupported tensor gets a precise error
// ("F8_E4M3 is not supported yet") instead of "unknown dtype". Only F32, BF16 and F16 can feed the
// expert kernels today. Conversions BF16/F16 -> F32 are exact; F32 -> BF16/F16 round to nearest
// even. All functions are pure and thread-safe.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace moerun {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kF4,
  kF6E2M3,
  kF6E3M2,
};

// Parses a safetensors dtype name ("F32", "BF16", "F8_E4M3", ...). nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);
const char* DTypeName(DType t);
// Size in bits of one element (4 for F4, 6 for F6_*).
int DTypeBits(DType t);
// True for the weight types the expert kernels read directly.
inline bool IsKernelWeightType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

inline float Bf16ToF32(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);  // round to nearest even, overflow to inf

// Reads element i of a buffer of type t (F32, BF16 or F16) as float.
inline float LoadAsF32(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(base) + i * 4, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, static_cast<const char*>(base) + i * 2, 2);
      return Bf16ToF32(v);
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, static_cast<const char*>(base) + i * 2, 2);
      return F16ToF32(v);
    }
    default:
      return 0.0f;  // callers check IsKernelWeightType first
  }
}

}  // namespace moerun
