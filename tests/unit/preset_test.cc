#include "model/preset.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

// Preset weights are a pure function of their coordinates: these values are the same on every
// machine (a change to the generator breaks every recorded benchmark, so it must be deliberate).
TEST(PresetTest, ValuesArePinned) {
  const float a = PresetValue(1, 0, 1, 3, 5, 7, 2048, DType::kF32);
  const float b = PresetValue(2, 0, 1, 3, 5, 7, 2048, DType::kF32);
  const float c = PresetValue(1, 0, 2, 3, 5, 7, 2048, DType::kF32);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  EXPECT_LE(std::fabs(a), std::sqrt(3.0f / 2048));
  // Pinned values (recorded once; must never change).
  EXPECT_EQ(std::bit_cast<uint32_t>(PresetValue(1, 0, 1, 0, 0, 0, 2048, DType::kF32)), 3172305577u);
  EXPECT_EQ(std::bit_cast<uint32_t>(PresetValue(7, 3, 3, 5, 100, 767, 768, DType::kF32)),
            3161396032u);
  EXPECT_EQ(std::bit_cast<uint32_t>(PresetValue(7, 3, 3, 5, 100, 767, 768, DType::kBF16)),
            3161391104u);
}

TEST(PresetTest, ScalesExpertsToTheBudget) {
  std::string note;
  PresetOptions o;
  auto q = PresetSpec("qwen3-30b-a3b", o, &note);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->num_experts, 128);  // 2.25 GiB of F32 experts fits in 4 GB
  EXPECT_TRUE(note.empty());
  auto d = PresetSpec("deepseek-v3", o, &note);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->num_experts % 8, 0);
  EXPECT_LE(static_cast<double>(d->num_experts) * 3 * 7168 * 2048 * 4, 4.0 * (1 << 30));
  EXPECT_NE(note.find("of 256 experts"), std::string::npos) << note;
  o.dtype = DType::kBF16;
  auto m = PresetSpec("mixtral-8x7b", o, &note);
  EXPECT_EQ(m->num_experts, 8);
  o.experts = 4;
  EXPECT_FALSE(PresetSpec("qwen3-30b-a3b", o, &note).ok());  // top-8 of 4 experts
  o.experts = 12;
  EXPECT_FALSE(PresetSpec("deepseek-v3", o, &note).ok());  // not a multiple of 8 groups
  o.experts = 300;
  EXPECT_FALSE(PresetSpec("step-3.5-flash", o, &note).ok());
  EXPECT_EQ(PresetSpec("llama", o, &note).status().code(), StatusCode::kNotFound);
}

TEST(PresetTest, SameWeightsEveryBuildAndOnlyRequestedExperts) {
  const CpuKernels& k = KernelsFor(Isa::kScalar);
  const ModelSpec s = testing::SmallSpec(Family::kGptOss);
  PresetOptions o;
  o.threads = 3;
  auto a = BuildPresetLayer(s, k, o);
  o.threads = 1;
  o.load_expert.assign(12, false);
  o.load_expert[4] = true;
  auto b = BuildPresetLayer(s, k, o);
  ASSERT_TRUE(a.ok() && b.ok());
  const ExpertWeights& ea = a->experts[4];
  const ExpertWeights& eb = b->experts[4];
  ASSERT_EQ(ea.w13.bytes(), eb.w13.bytes());
  EXPECT_EQ(std::memcmp(ea.w13.panel(0), eb.w13.panel(0), ea.w13.bytes()), 0);
  EXPECT_EQ(std::memcmp(ea.w2.panel(0), eb.w2.panel(0), ea.w2.bytes()), 0);
  EXPECT_EQ(ea.bias_down, eb.bias_down);
  EXPECT_TRUE(b->experts[3].w13.empty());
  EXPECT_FALSE(a->experts[3].w13.empty());
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

// A gate skew makes routing Zipf-like over experts: expert 0 takes far more than its share, the
// share falls with the expert number, and skew 0 leaves the layer as it was.
TEST(PresetTest, GateSkewMakesLowExpertsHot) {
  const CpuKernels& k = KernelsFor(Isa::kScalar);
  ModelSpec spec = testing::SmallSpec(Family::kQwen3Moe);
  PresetOptions o;
  o.seed = 3;
  auto plain = BuildPresetLayer(spec, k, o);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->gate_bias.empty());
  o.gate_skew = 1.5;
  auto skewed = BuildPresetLayer(spec, k, o);
  ASSERT_TRUE(skewed.ok());
  ASSERT_FALSE(skewed->gate_bias.empty());
  EXPECT_EQ(skewed->gate_bias[0], 0.0f);
  EXPECT_FLOAT_EQ(skewed->gate_bias[3], static_cast<float>(-1.5 * std::log(4.0)));

  const int64_t tokens = 2000;
  const auto x = testing::RandomRows(tokens, spec.hidden, 8);
  auto shares = [&](std::shared_ptr<const MoeLayerWeights> w) {
    ThreadPool pool(1);
    MoeLayer layer(std::move(w), k, &pool);
    std::vector<float> out(x.size());
    EXPECT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
    std::vector<double> share(static_cast<size_t>(spec.num_experts), 0.0);
    for (int32_t e : layer.last_routing().ids) share[static_cast<size_t>(e)] += 1.0;
    for (auto& s : share) s /= static_cast<double>(tokens * spec.top_k);
    return share;
  };
  const auto even = shares(std::make_shared<const MoeLayerWeights>(std::move(plain).value()));
  const auto zipf = shares(std::make_shared<const MoeLayerWeights>(std::move(skewed).value()));
  const double fair = 1.0 / spec.num_experts;
  EXPECT_LT(*std::max_element(even.begin(), even.end()), 2.5 * fair);
  EXPECT_GT(zipf[0], 2.5 * fair);  // top-3 of 12: expert 0 is in most tokens' choice
  EXPECT_GT(zipf[0] + zipf[1] + zipf[2], zipf[9] + zipf[10] + zipf[11] + 0.3);

  o.gate_skew = -1;
  EXPECT_FALSE(BuildPresetLayer(spec, k, o).ok());
  o.gate_skew = std::nan("");
  EXPECT_FALSE(BuildPresetLayer(spec, k, o).ok());
}

}  // namespace
}  // namespace moerun
