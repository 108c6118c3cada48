#include "runtime/model/model_spec.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "runtime/model/preset.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using testing::DataDir;
using testing::FixtureDir;
using testing::ReadFile;

std::vector<int> Range(int a, int b) {
  std::vector<int> v;
  for (int i = a; i < b; ++i) v.push_back(i);
  return v;
}

ModelSpec LoadPublished(const std::string& name) {
  auto s = LoadModelSpec(DataDir() + "/hf-configs/" + name);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : ModelSpec{};
}

// The configs the real models publish decide which layers are MoE layers.
TEST(ModelSpecTest, PublishedMixtral) {
  const ModelSpec s = LoadPublished("mixtral-8x7b");
  EXPECT_EQ(s.family, Family::kMixtral);
  EXPECT_EQ(s.num_layers, 32);
  EXPECT_EQ(s.moe_layers, Range(0, 32));
  EXPECT_EQ(s.num_experts, 8);
  EXPECT_EQ(s.top_k, 2);
  EXPECT_EQ(s.hidden, 4096);
  EXPECT_EQ(s.expert_inter, 14336);
  EXPECT_EQ(s.gate.kind, GateKind::kSoftmaxTopK);
  EXPECT_TRUE(s.gate.renormalize);
  EXPECT_EQ(s.shared_inter, 0);
}

TEST(ModelSpecTest, PublishedQwen3) {
  const ModelSpec s = LoadPublished("qwen3-30b-a3b");
  EXPECT_EQ(s.family, Family::kQwen3Moe);
  EXPECT_EQ(s.moe_layers, Range(0, 48));
  EXPECT_EQ(s.num_experts, 128);
  EXPECT_EQ(s.top_k, 8);
  EXPECT_EQ(s.hidden, 2048);
  EXPECT_EQ(s.expert_inter, 768);
  EXPECT_TRUE(s.gate.renormalize);
}

TEST(ModelSpecTest, PublishedDeepseekV3) {
  const ModelSpec s = LoadPublished("deepseek-v3");
  EXPECT_EQ(s.family, Family::kDeepseekV3);
  EXPECT_EQ(s.num_layers, 61);
  EXPECT_EQ(s.moe_layers, Range(3, 61));  // first_k_dense_replace 3: 58 MoE layers
  EXPECT_EQ(s.num_experts, 256);
  EXPECT_EQ(s.top_k, 8);
  EXPECT_EQ(s.hidden, 7168);
  EXPECT_EQ(s.expert_inter, 2048);
  EXPECT_EQ(s.shared_inter, 2048);
  EXPECT_EQ(s.gate.kind, GateKind::kSigmoidTopK);
  EXPECT_EQ(s.gate.n_group, 8);
  EXPECT_EQ(s.gate.topk_group, 4);
  EXPECT_FLOAT_EQ(s.gate.scale, 2.5f);
  EXPECT_TRUE(s.gate.selection_bias);
}

TEST(ModelSpecTest, PublishedGptOss20b) {
  const ModelSpec s = LoadPublished("gpt-oss-20b");
  EXPECT_EQ(s.family, Family::kGptOss);
  EXPECT_EQ(s.moe_layers, Range(0, 24));
  EXPECT_EQ(s.num_experts, 32);
  EXPECT_EQ(s.top_k, 4);
  EXPECT_EQ(s.hidden, 2880);
  EXPECT_EQ(s.expert_inter, 2880);
  EXPECT_EQ(s.gate.kind, GateKind::kTopKSoftmax);
  EXPECT_EQ(s.act, ActKind::kGptOss);
  EXPECT_FLOAT_EQ(s.swiglu_limit, 7.0f);
  EXPECT_TRUE(s.router_bias);
  EXPECT_TRUE(s.expert_bias);
}

TEST(ModelSpecTest, PublishedStep35Flash) {
  const ModelSpec s = LoadPublished("step-3.5-flash");
  EXPECT_EQ(s.family, Family::kStep3p5);
  EXPECT_EQ(s.num_layers, 45);
  EXPECT_EQ(s.moe_layers, Range(3, 45));  // moe_layers_enum "3,...,44": 42 MoE layers
  EXPECT_EQ(s.num_experts, 288);
  EXPECT_EQ(s.top_k, 8);
  EXPECT_EQ(s.hidden, 4096);
  EXPECT_EQ(s.expert_inter, 1280);
  EXPECT_EQ(s.shared_inter, 1280);
  EXPECT_FLOAT_EQ(s.gate.scale, 3.0f);
  EXPECT_TRUE(s.gate.selection_bias);
  EXPECT_EQ(s.gate.n_group, 1);
  EXPECT_FLOAT_EQ(s.RoutedAct(3).limit, 0.0f);
  EXPECT_FLOAT_EQ(s.RoutedAct(43).limit, 7.0f);
  EXPECT_FLOAT_EQ(s.RoutedAct(44).limit, 7.0f);
  EXPECT_FLOAT_EQ(s.SharedAct(43).limit, 0.0f);
  EXPECT_FLOAT_EQ(s.SharedAct(44).limit, 16.0f);
}

// Each preset's full-size spec is the published config's.
TEST(ModelSpecTest, PresetsFollowPublishedConfigs) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"mixtral-8x7b", "mixtral-8x7b"},
      {"qwen3-30b-a3b", "qwen3-30b-a3b"},
      {"deepseek-v3", "deepseek-v3"},
      {"gpt-oss-20b", "gpt-oss-20b"},
      {"step-3.5-flash", "step-3.5-flash"}};
  for (const auto& [preset, config] : pairs) {
    SCOPED_TRACE(preset);
    auto p = PresetFullSpec(preset);
    ASSERT_TRUE(p.ok());
    const ModelSpec c = LoadPublished(config);
    EXPECT_EQ(p->family, c.family);
    EXPECT_EQ(p->hidden, c.hidden);
    EXPECT_EQ(p->num_layers, c.num_layers);
    EXPECT_EQ(p->moe_layers, c.moe_layers);
    EXPECT_EQ(p->num_experts, c.num_experts);
    EXPECT_EQ(p->top_k, c.top_k);
    EXPECT_EQ(p->expert_inter, c.expert_inter);
    EXPECT_EQ(p->shared_inter, c.shared_inter);
    EXPECT_EQ(p->shared_gated, c.shared_gated);
    EXPECT_EQ(p->gate.kind, c.gate.kind);
    EXPECT_EQ(p->gate.renormalize, c.gate.renormalize);
    EXPECT_EQ(p->gate.selection_bias, c.gate.selection_bias);
    EXPECT_EQ(p->gate.n_group, c.gate.n_group);
    EXPECT_EQ(p->gate.topk_group, c.gate.topk_group);
    EXPECT_FLOAT_EQ(p->gate.scale, c.gate.scale);
    EXPECT_EQ(p->act, c.act);
    EXPECT_EQ(p->router_bias, c.router_bias);
    EXPECT_EQ(p->expert_bias, c.expert_bias);
    for (int l : c.moe_layers) {
      EXPECT_FLOAT_EQ(p->RoutedAct(l).limit, c.RoutedAct(l).limit) << l;
      EXPECT_FLOAT_EQ(p->SharedAct(l).limit, c.SharedAct(l).limit) << l;
    }
  }
}

TEST(ModelSpecTest, Fixtures) {
  struct Want {
    const char* dir;
    Family family;
    int experts, top_k;
    int64_t shared;
  };
  for (const Want& w :
       {Want{"mixtral", Family::kMixtral, 8, 2, 0}, Want{"mixtral_f16", Family::kMixtral, 8, 2, 0},
        Want{"qwen2_moe", Family::kQwen2Moe, 8, 2, 80},
        Want{"qwen3_moe", Family::kQwen3Moe, 16, 4, 0},
        Want{"qwen3_moe_bf16", Family::kQwen3Moe, 16, 4, 0},
        Want{"deepseek_v3", Family::kDeepseekV3, 32, 4, 48},
        Want{"gpt_oss", Family::kGptOss, 16, 4, 0}, Want{"step3p5", Family::kStep3p5, 16, 4, 40}}) {
    SCOPED_TRACE(w.dir);
    auto s = LoadModelSpec(FixtureDir(w.dir));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->family, w.family);
    EXPECT_EQ(s->num_experts, w.experts);
    EXPECT_EQ(s->top_k, w.top_k);
    EXPECT_EQ(s->shared_inter, w.shared);
    EXPECT_EQ(s->moe_layers, std::vector<int>{0});
  }
  auto q2 = LoadModelSpec(FixtureDir("qwen2_moe"));
  EXPECT_TRUE(q2->shared_gated);
  EXPECT_FALSE(q2->gate.renormalize);
}

nlohmann::json FixtureConfig(const std::string& dir) {
  return nlohmann::json::parse(ReadFile(FixtureDir(dir) + "/config.json"));
}

Status Parse(const nlohmann::json& j) { return ParseModelSpec(j.dump(), "config.json").status(); }

TEST(ModelSpecTest, QwenSparseStepAndDenseLayers) {
  auto j = FixtureConfig("qwen3_moe");
  j["num_hidden_layers"] = 8;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  auto s = ParseModelSpec(j.dump(), "config.json");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->moe_layers, (std::vector<int>{1, 5, 7}));
}

TEST(ModelSpecTest, DeepseekLayerFrequency) {
  auto j = FixtureConfig("deepseek_v3");
  j["num_hidden_layers"] = 10;
  j["first_k_dense_replace"] = 3;
  j["moe_layer_freq"] = 2;
  auto s = ParseModelSpec(j.dump(), "config.json");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->moe_layers, (std::vector<int>{4, 6, 8}));
}

TEST(ModelSpecTest, StepLayerListDefaultsAndErrors) {
  auto j = FixtureConfig("step3p5");
  j["num_hidden_layers"] = 4;
  j.erase("moe_layers_enum");
  auto s = ParseModelSpec(j.dump(), "config.json");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->moe_layers, (std::vector<int>{1, 2, 3}));
  j["moe_layers_enum"] = "1, 3";
  EXPECT_EQ(ParseModelSpec(j.dump(), "c")->moe_layers, (std::vector<int>{1, 3}));
  j["moe_layers_enum"] = "1,9";
  EXPECT_NE(Parse(j).message().find("beyond"), std::string::npos);
  j["moe_layers_enum"] = "1,x";
  EXPECT_FALSE(Parse(j).ok());
  j["moe_layers_enum"] = "1,,2";
  EXPECT_FALSE(Parse(j).ok());
}

TEST(ModelSpecTest, BadConfigsNameTheProblem) {
  struct Case {
    const char* dir;
    std::function<void(nlohmann::json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"mixtral", [](auto& j) { j["num_experts_per_tok"] = 9; }, "larger than the expert count"},
      {"qwen3_moe", [](auto& j) { j["num_experts_per_tok"] = 0; }, "top-k must be positive"},
      {"qwen3_moe", [](auto& j) { j.erase("moe_intermediate_size"); }, "moe_intermediate_size"},
      {"qwen3_moe", [](auto& j) { j["num_experts"] = "sixteen"; }, "num_experts"},
      {"qwen3_moe", [](auto& j) { j["num_experts"] = 16.5; }, "integer"},
      {"qwen3_moe", [](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act"},
      {"qwen3_moe", [](auto& j) { j["model_type"] = "llama"; }, "not supported"},
      {"qwen3_moe", [](auto& j) { j.erase("model_type"); }, "model_type"},
      {"qwen3_moe", [](auto& j) { j["hidden_size"] = -4; }, "hidden size"},
      {"qwen3_moe", [](auto& j) { j["decoder_sparse_step"] = 0; }, "decoder_sparse_step"},
      {"qwen3_moe", [](auto& j) { j["mlp_only_layers"] = "none"; }, "mlp_only_layers"},
      {"deepseek_v3", [](auto& j) { j["n_group"] = 5; }, "does not divide"},
      {"deepseek_v3", [](auto& j) { j["topk_group"] = 9; }, "topk_group"},
      {"deepseek_v3", [](auto& j) { j["topk_group"] = 0; }, "topk_group"},
      {"deepseek_v3", [](auto& j) { j["scoring_func"] = "softmax"; }, "not supported"},
      {"deepseek_v3", [](auto& j) { j["routed_scaling_factor"] = "big"; }, "routed_scaling"},
      {"gpt_oss", [](auto& j) { j.erase("num_local_experts"); }, "num_experts"},
      {"step3p5", [](auto& j) { j["swiglu_limits"] = {-1.0}; }, "swiglu_limits"},
      {"step3p5", [](auto& j) { j["moe_router_activation"] = "relu"; }, "not supported"},
      {"step3p5", [](auto& j) { j["use_moe_router_bias"] = "yes"; }, "use_moe_router_bias"},
      {"step3p5", [](auto& j) { j["norm_expert_weight"] = 1; }, "norm_expert_weight"},
      {"step3p5",
       [](auto& j) {
         j["need_fp32_gate"] = false;
         j["torch_dtype"] = "float16";
       },
       "float16"},
  };
  for (const auto& c : cases) {
    auto j = FixtureConfig(c.dir);
    c.edit(j);
    const Status s = Parse(j);
    EXPECT_FALSE(s.ok()) << c.dir << " " << c.expect;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s.message();
  }
  EXPECT_EQ(ParseModelSpec("{not json", "x").status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(ParseModelSpec("[1,2]", "x").status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(LoadModelSpec("/nonexistent/dir").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace moerun
