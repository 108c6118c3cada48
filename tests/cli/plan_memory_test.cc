// `moerun serve|forward --device cuda --plan-memory`: every rank's device memory by region, from
// the model's shapes alone, on any machine (this one has no GPU). DeepSeek-V3 with FP8 experts
// over 58 layers and 8 expert ranks must keep an expert rank's non-weight memory under 4 GB.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using ::moerun::testing::FixtureDir;
using ::moerun::testing::ProcessResult;
using ::moerun::testing::RunProcess;
using json = nlohmann::json;

const std::string kDeepSeekFp8Config =
    std::string(MOERUN_TEST_DATA) + "/../../configs/deepseek-v3-fp8.yaml";

ProcessResult Moerun(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOERUN_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

// The JSON document of an output that may carry log lines around it.
json PlanOf(const ProcessResult& r) {
  const size_t a = r.output.find("{\n"), b = r.output.rfind('}');
  EXPECT_NE(a, std::string::npos) << r.output;
  if (a == std::string::npos || b == std::string::npos) return json::object();
  return json::parse(r.output.substr(a, b - a + 1));
}

uint64_t RegionBytes(const json& plan, const std::string& name) {
  for (const auto& r : plan["regions"]) {
    if (r["name"] == name) return r["bytes"].get<uint64_t>();
  }
  return 0;
}

TEST(PlanMemoryTest, DeepSeekV3Fp8ExpertRanksStayUnderFourGigabytes) {
  for (const char* math : {"tensor-core", "exact"}) {
    const ProcessResult r =
        Moerun({"serve", "--config", kDeepSeekFp8Config, "--device", "cuda", "--math", math,
                "--max-tokens", "8192", "--ranks", "9", "--plan-memory", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json doc = PlanOf(r);
    EXPECT_EQ(doc["layers"], 58);
    EXPECT_EQ(doc["weights"], "F8_E4M3");
    ASSERT_EQ(doc["plans"].size(), 9u);
    const json& router = doc["plans"][0];
    EXPECT_EQ(router["role"], "cpu router");
    EXPECT_EQ(router["device_bytes"], 0);
    for (size_t i = 1; i < 9; ++i) {
      const json& p = doc["plans"][i];
      EXPECT_EQ(p["role"], "expert");
      EXPECT_LE(p["non_weight_bytes"].get<uint64_t>(), uint64_t{4'000'000'000}) << math;
      EXPECT_EQ(p["max_rows"], 8192 * 8);
      // 58 layers x 32 experts x (3 x 7168 x 2048 FP8 codes).
      EXPECT_EQ(RegionBytes(p, "expert weights"), uint64_t{58} * 32 * 3 * 7168 * 2048);
      EXPECT_EQ(RegionBytes(p, "x"), 0u);  // nothing of the router's
      EXPECT_EQ(RegionBytes(p, "logits"), 0u);
    }
  }
}

TEST(PlanMemoryTest, NonWeightMemoryDoesNotGrowWithTheLayers) {
  const auto non_weight = [](const std::string& layers_flag) {
    const ProcessResult r = Moerun({"forward", "--preset", "deepseek-v3", "--dtype", "fp8",
                                    "--experts", "256", "--device", "cuda", "--ranks", "9",
                                    "--plan-memory", "--json", "--layer", layers_flag});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return PlanOf(r)["plans"][1]["non_weight_bytes"].get<uint64_t>();
  };
  // forward plans one layer; serve all 58 (the test above): the arena is the same.
  const ProcessResult all = Moerun({"serve", "--config", kDeepSeekFp8Config, "--device", "cuda",
                                    "--ranks", "9", "--plan-memory", "--json"});
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_EQ(non_weight("3"), PlanOf(all)["plans"][1]["non_weight_bytes"].get<uint64_t>());
}

TEST(PlanMemoryTest, TableNamesEveryRegionAndTheRouterHoldsNothing) {
  const ProcessResult r = Moerun({"serve", "--config", kDeepSeekFp8Config, "--device", "cuda",
                                  "--ranks", "9", "--plan-memory"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"rank 0 (cpu router)", "nothing on the device", "ranks 1-8 (expert)",
                        "expert weights", "expert scales", "receive", "hidden_act",
                        "reuses receive", "non-weight total", "pinned host"}) {
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  }
}

TEST(PlanMemoryTest, OneProcessPlansTheWholeLayerOfACheckpoint) {
  // The FP8 fixture checkpoint: its quantization_config says the experts are FP8.
  const ProcessResult r = Moerun({"forward", "--model", FixtureDir("deepseek_v3_fp8"), "--device",
                                  "cuda", "--max-tokens", "64", "--plan-memory", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json doc = PlanOf(r);
  EXPECT_EQ(doc["weights"], "F8_E4M3");
  ASSERT_EQ(doc["plans"].size(), 1u);
  const json& p = doc["plans"][0];
  EXPECT_EQ(p["role"], "whole layer");
  EXPECT_GT(RegionBytes(p, "gate"), 0u);
  EXPECT_GT(RegionBytes(p, "x"), 0u);
  EXPECT_GT(RegionBytes(p, "expert scales"), 0u);
  EXPECT_GT(p["graph_buckets"].get<int>(), 0);
}

TEST(PlanMemoryTest, BadInputsExit2WithOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::string fixture = FixtureDir("deepseek_v3");
  const std::vector<Case> cases = {
      {{"serve", "--config", kDeepSeekFp8Config, "--plan-memory"}, "add --device cuda"},
      {{"serve", "--config", kDeepSeekFp8Config, "--device", "cuda", "--plan-memory", "--ranks",
        "1"},
       "at least 2 ranks"},
      {{"serve", "--config", kDeepSeekFp8Config, "--device", "cuda", "--plan-memory",
        "--max-tokens", "0"},
       "--max-tokens"},
      {{"forward", "--model", fixture, "--device", "cuda", "--plan-memory", "--ranks", "2",
        "--routers", "2"},
       "routers"},
      {{"forward", "--model", fixture, "--device", "cuda", "--plan-memory", "--layer", "7"},
       "layer"},
      {{"serve", "--config", kDeepSeekFp8Config, "--device", "cuda", "--json"}, "--plan-memory"},
  };
  for (const auto& c : cases) {
    const ProcessResult r = Moerun(c.args);
    std::string line;
    for (const auto& a : c.args) line += a + " ";
    EXPECT_EQ(r.exit_code, 2) << line << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << line << "\n" << r.output;
  }
}

}  // namespace
}  // namespace moerun
