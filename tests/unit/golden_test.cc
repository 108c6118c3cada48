// The golden fixtures: every model family's own reference code, every weight type, every ISA.
#include <gtest/gtest.h>

#include "tests/unit/kernel_variants.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

class GoldenTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GoldenTest, MatchesReferenceImplementation) {
  const auto& [name, variant] = GetParam();
  const CpuKernels& kern = VariantKernels(variant);
  const auto w = LoadFixture(name, kern);
  int64_t tokens = 0, hidden = 0;
  const auto x = ReadF32(FixtureDir(name) + "/golden.safetensors", "input", &tokens, &hidden);
  const auto want = ReadF32(FixtureDir(name) + "/golden.safetensors", "output");
  ASSERT_EQ(hidden, w->spec.hidden);
  ThreadPool pool(2);
  MoeLayer layer(w, kern, &pool);
  std::vector<float> out(x.size());
  ASSERT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  const double err = RelativeError(out, want);
  EXPECT_LE(err, 1e-5) << name << " on " << variant;
  RecordProperty("rel_err", std::to_string(err));

  // The plain reference loop agrees as well.
  std::vector<float> ref(x.size());
  ReferenceForward(*w, x.data(), tokens, ref.data());
  EXPECT_LE(RelativeError(ref, want), 1e-5);
}

std::vector<std::tuple<std::string, std::string>> Cases() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& n : FixtureNames()) {
    for (const auto& v : TestVariantNames()) out.emplace_back(n, v);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, GoldenTest, ::testing::ValuesIn(Cases()), [](const auto& tp) {
  return std::get<0>(tp.param) + "_" + std::get<1>(tp.param);
});

TEST(GoldenTest, FixturesKeepTheirWeightTypes) {
  const CpuKernels& kern = KernelsFor(Isa::kScalar);
  EXPECT_EQ(LoadFixture("mixtral_f16", kern)->dtype, DType::kF16);
  EXPECT_EQ(LoadFixture("qwen3_moe_bf16", kern)->dtype, DType::kBF16);
  EXPECT_EQ(LoadFixture("mixtral", kern)->dtype, DType::kF32);
  EXPECT_EQ(LoadFixture("deepseek_v3_fp8", kern)->dtype, DType::kF8E4M3);
  EXPECT_EQ(LoadFixture("deepseek_v3_fp8", kern)->shared->w13.dtype(), DType::kF8E4M3);
  EXPECT_EQ(LoadFixture("gpt_oss_mxfp4", kern)->dtype, DType::kF4);
  EXPECT_EQ(FixtureNames().size(), 10u);
}

}  // namespace
}  // namespace moerun
