// Step-3.5-Flash's router switches (use_moe_router_bias, moe_router_activation, norm_expert_weight,
// need_fp32_gate) in every combination, against the outputs of the authors' modeling_step3p5.py
// itself, executed by scripts/step3p5_authors_goldens.py (tests/data/step3p5-switches: its README
// cites the line that defines each switch), on every ISA.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "tests/unit/kernel_variants.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

std::string CasesDir() { return DataDir() + "/step3p5-switches"; }

std::vector<std::string> CaseNames() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(CasesDir())) {
    if (e.is_directory()) out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

ModelSpec CaseSpec(const std::string& name) {
  auto spec = LoadModelSpec(CasesDir() + "/" + name);
  if (!spec.ok()) throw std::runtime_error(spec.status().ToString());
  return *spec;
}

std::shared_ptr<const MoeLayerWeights> LoadCase(const std::string& name, const CpuKernels& k) {
  const std::string dir = CasesDir() + "/" + name;
  const ModelSpec spec = CaseSpec(name);
  auto ck = Checkpoint::Open(dir);
  if (!ck.ok()) throw std::runtime_error(ck.status().ToString());
  auto w = LoadLayer(**ck, spec, k, LoadOptions{});
  if (!w.ok()) throw std::runtime_error(w.status().ToString());
  return std::make_shared<const MoeLayerWeights>(std::move(w).value());
}

bool Has(const std::string& name, const std::string& part) {
  return name.find(part) != std::string::npos;
}

class Step3p5SwitchesTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
};

TEST_P(Step3p5SwitchesTest, MatchesTheAuthorsCode) {
  const auto& [name, variant] = GetParam();
  const CpuKernels& kern = VariantKernels(variant);
  const auto w = LoadCase(name, kern);
  const std::string golden = CasesDir() + "/" + name + "/golden.safetensors";
  int64_t tokens = 0, hidden = 0;
  const auto x = ReadF32(golden, "input", &tokens, &hidden);
  const auto want = ReadF32(golden, "output");
  ASSERT_EQ(hidden, w->spec.hidden);
  ThreadPool pool(2);
  MoeLayer layer(w, kern, &pool);
  std::vector<float> out(x.size());
  ASSERT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  const double err = RelativeError(out, want);
  EXPECT_LE(err, 1e-5) << name << " on " << variant;
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", err);
  RecordProperty("rel_err", text);

  std::vector<float> ref(x.size());
  ReferenceForward(*w, x.data(), tokens, ref.data());
  EXPECT_LE(RelativeError(ref, want), 1e-5) << name << " (reference loop)";
}

std::vector<std::tuple<std::string, std::string>> SwitchCases() {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const auto& n : CaseNames()) {
    for (const auto& v : TestVariantNames()) out.emplace_back(n, v);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllSwitches, Step3p5SwitchesTest, ::testing::ValuesIn(SwitchCases()),
                         [](const auto& tp) {
                           return std::get<0>(tp.param) + "_" + std::get<1>(tp.param);
                         });

// What each switch turns into (docs/reference-semantics.md, section 6.1).
TEST(Step3p5SwitchesSpecTest, EverySwitchAsTheAuthorsCodeReadsIt) {
  const auto names = CaseNames();
  ASSERT_EQ(names.size(), 16u);
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    const GateSpec g = CaseSpec(name).gate;
    const bool bias = Has(name, "bias1"), softmax = Has(name, "softmax");
    // The router bias branch is sigmoid whatever moe_router_activation says.
    EXPECT_EQ(g.kind, bias || !softmax ? GateKind::kSigmoidTopK : GateKind::kSoftmaxTopK);
    EXPECT_EQ(g.selection_bias, bias);
    // Renormalised on both sigmoid branches (eps 1e-20 only with the bias), never with softmax.
    EXPECT_EQ(g.renormalize, bias || !softmax);
    EXPECT_EQ(g.renorm_eps, bias ? 1e-20f : 0.0f);
    EXPECT_EQ(g.scale, 3.0f);  // on every branch
    // need_fp32_gate false in a bf16 model: bf16 logits.
    EXPECT_EQ(g.bf16_logits, Has(name, "fp32gate0"));
  }
}

TEST(Step3p5SwitchesSpecTest, NormExpertWeightIsNotRead) {
  for (const auto& name : CaseNames()) {
    if (!Has(name, "norm0")) continue;
    std::string other = name;
    other.replace(other.find("norm0"), 5, "norm1");
    const GateSpec a = CaseSpec(name).gate, b = CaseSpec(other).gate;
    EXPECT_EQ(DescribeGate(a), DescribeGate(b)) << name;
    EXPECT_EQ(a.renormalize, b.renormalize) << name;
    EXPECT_EQ(a.renorm_eps, b.renorm_eps) << name;
  }
}

// Keys left out take the defaults of the Step3p5Config that has defaults (vLLM's): router bias,
// softmax (read only without the bias), fp32 gate. The real model sets every one of them.
TEST(Step3p5SwitchesSpecTest, MissingKeysTakeTheConfigClassDefaults) {
  auto j =
      nlohmann::json::parse(ReadFile(CasesDir() + "/bias0_sigmoid_norm1_fp32gate1/config.json"));
  for (const char* key :
       {"use_moe_router_bias", "moe_router_activation", "need_fp32_gate", "norm_expert_weight"}) {
    j.erase(key);
  }
  auto s = ParseModelSpec(j.dump(), "config.json");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->gate.kind, GateKind::kSigmoidTopK);
  EXPECT_TRUE(s->gate.selection_bias);
  EXPECT_FALSE(s->gate.bf16_logits);
  j["use_moe_router_bias"] = false;
  s = ParseModelSpec(j.dump(), "config.json");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->gate.kind, GateKind::kSoftmaxTopK);
  EXPECT_FALSE(s->gate.renormalize);
}

}  // namespace
}  // namespace moerun
