// The fast layer against the plain reference loop, for every family's gate and expert variant,
// every weight type and ISA; and bitwise equality across ISAs and thread counts.
#include <gtest/gtest.h>

#include <cstring>

#include "tests/unit/kernel_variants.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

std::vector<float> RunLayer(const std::shared_ptr<const MoeLayerWeights>& w, const CpuKernels& k,
                            const std::vector<float>& x, int threads) {
  ThreadPool pool(threads);
  MoeLayer layer(w, k, &pool);
  const int64_t t = static_cast<int64_t>(x.size()) / w->spec.hidden;
  std::vector<float> out(x.size());
  const Status s = layer.Forward(x.data(), t, out.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

class LayerTest : public ::testing::TestWithParam<std::tuple<Family, DType>> {};

TEST_P(LayerTest, MatchesReferenceAndIsIdenticalAcrossIsasAndThreads) {
  const auto [family, dtype] = GetParam();
  const int64_t tokens = 37;
  std::vector<float> first;
  for (const auto& v : TestVariants()) {
    SCOPED_TRACE(v.name);
    const CpuKernels& k = *v.kernels;
    const auto w = BuildSmall(family, k, dtype);
    const auto x = RandomRows(tokens, w->spec.hidden, 11);
    const auto out = RunLayer(w, k, x, 2);
    std::vector<float> ref(x.size());
    ReferenceForward(*w, x.data(), tokens, ref.data());
    EXPECT_LE(RelativeError(out, ref), 2e-6);
    for (int threads : {1, 3}) {
      const auto again = RunLayer(w, k, x, threads);
      EXPECT_EQ(std::memcmp(again.data(), out.data(), out.size() * 4), 0) << threads << " threads";
    }
    if (first.empty()) {
      first = out;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), out.data(), out.size() * 4), 0)
          << v.name << " differs from the portable kernels";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, LayerTest,
                         ::testing::Combine(::testing::ValuesIn(AllFamilies()),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16)),
                         [](const auto& tp) {
                           return std::string(FamilyName(std::get<0>(tp.param))) + "_" +
                                  DTypeName(std::get<1>(tp.param));
                         });

TEST(LayerTest, EmptyBatchAndRoutingStats) {
  const CpuKernels& k = KernelsFor(BestIsa());
  const auto w = BuildSmall(Family::kQwen3Moe, k);
  ThreadPool pool(2);
  MoeLayer layer(w, k, &pool);
  EXPECT_TRUE(layer.Forward(nullptr, 0, nullptr).ok());
  const auto x = RandomRows(5, w->spec.hidden, 3);
  std::vector<float> out(x.size());
  ASSERT_TRUE(layer.Forward(x.data(), 5, out.data()).ok());
  EXPECT_EQ(layer.last_routing().ids.size(), 5u * 3u);
  for (int32_t id : layer.last_routing().ids) EXPECT_LT(id, w->spec.num_experts);
}

TEST(LayerTest, UnloadedExpertIsAnErrorNotACrash) {
  const CpuKernels& k = KernelsFor(Isa::kScalar);
  PresetOptions o;
  o.load_expert.assign(12, false);
  o.load_expert[0] = true;
  auto w = BuildPresetLayer(SmallSpec(Family::kMixtral), k, o);
  ASSERT_TRUE(w.ok());
  ThreadPool pool(1);
  MoeLayer layer(std::make_shared<const MoeLayerWeights>(std::move(w).value()), k, &pool);
  const auto x = RandomRows(8, 96, 3);
  std::vector<float> out(x.size());
  const Status s = layer.Forward(x.data(), 8, out.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not loaded"), std::string::npos);
}

}  // namespace
}  // namespace moerun
