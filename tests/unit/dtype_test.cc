#include "base/dtype.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "experts/cpu/isa.h"

namespace moerun {
namespace {

TEST(DTypeTest, NamesRoundTrip) {
  for (const char* n :
       {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64",
        "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}) {
    const auto t = ParseDType(n);
    ASSERT_TRUE(t.has_value()) << n;
    EXPECT_STREQ(DTypeName(*t), n);
  }
  EXPECT_FALSE(ParseDType("F33").has_value());
  EXPECT_FALSE(ParseDType("f32").has_value());  // names are case-sensitive, as in safetensors
  EXPECT_EQ(DTypeBits(DType::kF4), 4);
  EXPECT_EQ(DTypeBits(DType::kBF16), 16);
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToF32(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(F32ToBf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(F32ToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t v = 0; v < 0x10000; v += 7) {
    const float f = Bf16ToF32(static_cast<uint16_t>(v));
    if (std::isnan(f)) continue;
    EXPECT_EQ(F32ToBf16(f), v);
  }
}

__attribute__((target("f16c"))) uint16_t HardwareF16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float HardwareF32(uint16_t h) { return _cvtsh_ss(h); }

TEST(DTypeTest, F16MatchesHardware) {
  if (!DetectCpu().avx2_fma) GTEST_SKIP() << "no F16C";
  for (uint32_t v = 0; v < 0x10000; ++v) {
    const float want = HardwareF32(static_cast<uint16_t>(v));
    const float got = F16ToF32(static_cast<uint16_t>(v));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << v;
    }
  }
  uint32_t s = 12345;
  for (int i = 0; i < 2000000; ++i) {
    s = s * 1664525u + 1013904223u;
    const float f = std::bit_cast<float>(s);
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), HardwareF16(f)) << f;
  }
  for (float f : {65504.0f, 65519.0f, 65520.0f, 1e-8f, 2.98e-8f, 0x1p-25f, 0x1p-24f, -0x1p-25f}) {
    EXPECT_EQ(F32ToF16(f), HardwareF16(f)) << f;
  }
}

}  // namespace
}  // namespace moerun
