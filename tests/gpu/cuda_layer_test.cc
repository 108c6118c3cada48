// The CUDA layer against the CPU backend on the same inputs (the CPU is the reference):
//   - exact math: bitwise the CPU's, for every family and weight type, and the golden fixtures at
//     1e-5 of the model families' own reference code;
//   - on layers of GpuSpec's shapes (tests/cuda/gpu_layer_util.h: several row and column tiles,
//     partial tiles, k stages and scale blocks) and up to kTokens tokens;
//   - tensor-core math (bf16, f16): within 1e-2 of the CPU;
//   - both: batch-invariant (a token's bits do not depend on its batch), graphs equal to plain
//     launches, device-generated presets equal to uploaded ones; RunExperts equal to the CPU
//     grouped FFN (f32, FP8 and MXFP4 experts). More on FP8/MXFP4: cuda_quant_test.cc.
// Every test skips, saying why, on a machine without a GPU.
#include <gtest/gtest.h>

#include "tests/cuda/gpu_layer_util.h"
#include "tests/cuda/quant_layers.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

class CudaFamilyTest : public ::testing::TestWithParam<std::tuple<Family, DType>> {};

TEST_P(CudaFamilyTest, ExactMathIsBitwiseTheCpu) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype);
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  for (int64_t tokens : {int64_t{1}, int64_t{7}, int64_t{64}, kTokens}) {
    const auto x = RandomRows(tokens, w->spec.hidden, static_cast<uint32_t>(tokens));
    std::vector<int32_t> want_ids;
    std::vector<float> want_weights;
    const auto want = CpuForward(w, x, tokens, &want_ids, &want_weights);
    const auto got = GpuForward(*gpu, x, tokens);
    EXPECT_TRUE(Bitwise(got, want)) << FamilyName(family) << " " << DTypeName(dtype) << " tokens "
                                    << tokens << " rel err " << RelativeError(got, want);
    // The routing too.
    std::vector<int32_t> ids;
    std::vector<float> weights;
    ASSERT_TRUE(gpu->LastRouting(&ids, &weights).ok());
    EXPECT_EQ(ids, want_ids);
    EXPECT_EQ(weights, want_weights);
  }
}

TEST_P(CudaFamilyTest, TensorCoresAreWithinOnePercentOfTheCpu) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  if (dtype == DType::kF16) GTEST_SKIP() << "f16 weights on bf16 tensor cores: rounded twice";
  const auto w = GpuLayer(family, dtype);
  const auto x = RandomRows(kTokens, w->spec.hidden, 3);
  const auto want = CpuForward(w, x, kTokens);
  for (DType mma : {DType::kBF16, DType::kF16}) {
    if (dtype != DType::kF32 && dtype != mma) continue;
    auto gpu = Make(*w, CudaMath::kTensorCore, mma);
    ASSERT_NE(gpu, nullptr);
    const double err = RelativeError(GpuForward(*gpu, x, kTokens), want);
    EXPECT_LE(err, 1e-2) << FamilyName(family) << " on " << DTypeName(mma);
    RecordProperty(std::string("rel_err_") + DTypeName(mma), std::to_string(err));
  }
}

TEST_P(CudaFamilyTest, BatchInvariantAndGraphsEqualPlainLaunches) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype == DType::kF16 ? DType::kF32 : dtype);
  for (CudaMath math : {CudaMath::kExact, CudaMath::kTensorCore}) {
    auto graphs = Make(*w, math);
    auto plain = Make(*w, math, DType::kBF16, 0);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(plain, nullptr);
    // 150 tokens (the 256-token graph bucket): ~40 rows an expert.
    const int64_t tokens = 150, h = w->spec.hidden;
    const auto x = RandomRows(tokens, h, 11);
    const auto all = GpuForward(*graphs, x, tokens);
    EXPECT_TRUE(Bitwise(all, GpuForward(*plain, x, tokens))) << CudaMathName(math);
    // Each token alone (a graph of the 1-token bucket), and the batch cut in two, give the same
    // bits.
    for (int64_t t = 0; t < tokens; t += 7) {
      const std::vector<float> one(x.begin() + t * h, x.begin() + (t + 1) * h);
      const auto got = GpuForward(*graphs, one, 1);
      EXPECT_EQ(std::memcmp(got.data(), all.data() + t * h, static_cast<size_t>(h) * 4), 0)
          << CudaMathName(math) << " token " << t;
    }
    EXPECT_GT(graphs->graphs_captured(), 0);
    const std::vector<float> tail(x.begin() + 70 * h, x.end());
    const auto got = GpuForward(*graphs, tail, tokens - 70);
    EXPECT_EQ(std::memcmp(got.data(), all.data() + 70 * h, got.size() * 4), 0);
  }
}

TEST_P(CudaFamilyTest, PresetOnTheDeviceEqualsTheUploadedPreset) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype);  // GpuSpec's preset, seed 7
  PresetOptions p;
  p.seed = 7;
  p.dtype = dtype;
  CudaLayerOptions o;
  o.math = CudaMath::kExact;
  o.max_tokens = kMaxTokens;
  auto generated = CudaMoeLayer::FromPreset(GpuSpec(family), p, o);
  ASSERT_TRUE(generated.ok()) << generated.status().ToString();
  auto uploaded = Make(*w, CudaMath::kExact);
  ASSERT_NE(uploaded, nullptr);
  const auto x = RandomRows(300, w->spec.hidden, 9);
  EXPECT_TRUE(Bitwise(GpuForward(**generated, x, 300), GpuForward(*uploaded, x, 300)));
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, CudaFamilyTest,
                         ::testing::Combine(::testing::ValuesIn(AllFamilies()),
                                            ::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16)),
                         [](const auto& tp) {
                           return std::string(FamilyName(std::get<0>(tp.param))) + "_" +
                                  DTypeName(std::get<1>(tp.param));
                         });

class CudaGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaGoldenTest, ExactMathMatchesTheReferenceImplementation) {
  SKIP_WITHOUT_GPU();
  const std::string name = GetParam();
  const auto w = LoadFixture(name, Cpu());
  int64_t tokens = 0, hidden = 0;
  const auto x = ReadF32(FixtureDir(name) + "/golden.safetensors", "input", &tokens, &hidden);
  const auto want = ReadF32(FixtureDir(name) + "/golden.safetensors", "output");
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  const auto got = GpuForward(*gpu, x, tokens);
  const double err = RelativeError(got, want);
  EXPECT_LE(err, 1e-5) << name;
  EXPECT_TRUE(Bitwise(got, CpuForward(w, x, tokens))) << name;
  RecordProperty("rel_err", std::to_string(err));
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, CudaGoldenTest, ::testing::ValuesIn(FixtureNames()));

TEST(CudaLayerTest, RunExpertsEqualsTheCpuGroupedFfn) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kF32, DType::kF8E4M3, DType::kF4}) {
    // FP8 and MXFP4: the same layer with block-scaled experts (tests/cuda/quant_layers.h).
    const auto w = GpuLayer(Family::kDeepseekV3, dtype);
    auto gpu = Make(*w, CudaMath::kExact);
    ASSERT_NE(gpu, nullptr);
    const int64_t h = w->spec.hidden;
    // Groups of 1 to 150 rows: one to five 32-row m-tiles, the last one partial.
    const std::vector<int32_t> experts = {3, 0, 9, -1};
    const std::vector<int64_t> rows = {5, 1, 150, 70};
    const int64_t total = 226;
    const auto x = RandomRows(total, h, 4);
    std::vector<float> y(static_cast<size_t>(total * h));
    ASSERT_TRUE(gpu->RunExperts(x.data(), experts, rows, y.data()).ok());
    const std::vector<float> ycpu = CpuGroupedRows(*w, experts, rows, x);
    for (int64_t r = 0; r < total; ++r) {
      ASSERT_EQ(std::memcmp(y.data() + r * h, ycpu.data() + r * h, static_cast<size_t>(h) * 4), 0)
          << DTypeName(dtype) << " row " << r;
    }
    EXPECT_FALSE(gpu->RunExperts(x.data(), {99}, {1}, y.data()).ok());
  }
}

TEST(CudaLayerTest, ErrorsAreClear) {
  SKIP_WITHOUT_GPU();
  const auto w = BuildSmall(Family::kMixtral, Cpu());
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  const int64_t too_many = kMaxTokens + 1;
  std::vector<float> x(static_cast<size_t>(too_many * w->spec.hidden)), out(x.size());
  const Status big = gpu->Forward(x.data(), too_many, out.data());
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument) << big.ToString();
  // An expert this process does not host: routing to it is an error, not garbage.
  PresetOptions p;
  p.seed = 7;
  p.load_expert.assign(static_cast<size_t>(w->spec.num_experts), false);
  p.load_expert[0] = true;
  auto one = BuildPresetLayer(SmallSpec(Family::kMixtral), Cpu(), p);
  ASSERT_TRUE(one.ok());
  auto partial = Make(*one, CudaMath::kExact);
  ASSERT_NE(partial, nullptr);
  const auto xr = RandomRows(64, w->spec.hidden, 1);
  std::vector<float> o(xr.size());
  const Status s = partial->Forward(xr.data(), 64, o.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not loaded"), std::string::npos) << s.ToString();
  CudaLayerOptions bad;
  bad.device = 99;
  EXPECT_FALSE(CudaMoeLayer::Upload(*w, bad).ok());
}

}  // namespace
}  // namespace moerun
