#include "base/dtype.h"

#include <array>

namespace moerun {
namespace {

struct DTypeInfo {
  DType type;
  const char* name;
  int bits;
};

constexpr std::array<DTypeInfo, 19> kInfos = {{
    {DType::kBool, "BOOL", 8},      {DType::kU8, "U8", 8},          {DType::kI8, "I8", 8},
    {DType::kI16, "I16", 16},       {DType::kU16, "U16", 16},       {DType::kF16, "F16", 16},
    {DType::kBF16, "BF16", 16},     {DType::kI32, "I32", 32},       {DType::kU32, "U32", 32},
    {DType::kF32, "F32", 32},       {DType::kF64, "F64", 64},       {DType::kI64, "I64", 64},
    {DType::kU64, "U64", 64},       {DType::kF8E4M3, "F8_E4M3", 8}, {DType::kF8E5M2, "F8_E5M2", 8},
    {DType::kF8E8M0, "F8_E8M0", 8}, {DType::kF4, "F4", 4},          {DType::kF6E2M3, "F6_E2M3", 6},
    {DType::kF6E3M2, "F6_E3M2", 6},
}};

}  // namespace

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kInfos) {
    if (name == info.name) return info.type;
  }
  return std::nullopt;
}

const char* DTypeName(DType t) {
  for (const auto& info : kInfos) {
    if (info.type == t) return info.name;
  }
  return "?";
}

int DTypeBits(DType t) {
  for (const auto& info : kInfos) {
    if (info.type == t) return info.bits;
  }
  return 0;
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | (exp + 127 - 15) << 23 | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t F32ToF16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... maps to f16 subnormal units
    uint32_t half = m >> (shift - 0);
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t v = abs - (112u << 23);  // rebias exponent 127 -> 15
  const uint32_t rem = v & 0x1fffu;
  v >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
  return static_cast<uint16_t>(sign | v);
}

}  // namespace moerun
