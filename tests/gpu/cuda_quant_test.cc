// Block-scaled expert weights (FP8 e4m3 with 128 x 128 block scales, MXFP4 e2m1 with e8m0 scales)
// in the CUDA layer, against the CPU layer (the reference) on the same weights:
//   - exact math: within 1e-5 of the CPU, and bitwise (the kernels keep the CPU kernels' block
//     math), on random quantized layers of every family, random presets, and the FP8 / MXFP4
//     fixtures (tests/data/hf-moe/deepseek_v3_fp8, gpt_oss_mxfp4; also against their golden
//     outputs);
//   - tensor cores: FP8 on bf16 and f16, MXFP4 on bf16, within 1e-2; MXFP4 on f16 is refused;
//   - the device holds the quantized bytes (the host-side figure of device_weights.h);
//   - batch invariance, graphs equal to plain launches (RunExperts: cuda_layer_test.cc).
// Every test skips, saying why, on a machine without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "runtime/layer/cuda/device_weights.h"
#include "tests/cuda/gpu_layer_util.h"
#include "tests/cuda/quant_layers.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

cuda_plan::WeightFormat FormatOf(DType t) {
  return t == DType::kF8E4M3 ? cuda_plan::WeightFormat::kFp8 : cuda_plan::WeightFormat::kMxfp4;
}

// The device bytes the host-side layout says the layer's experts take.
size_t ExpectedWeightBytes(const MoeLayerWeights& w, cuda_plan::WeightFormat f) {
  size_t total = 0;
  for (const ExpertWeights& ew : w.experts) {
    if (!ew.w13.empty()) total += cuda_plan::DeviceExpertBytes(f, ew.hidden, ew.inter).total();
  }
  if (w.shared) total += cuda_plan::DeviceExpertBytes(f, w.shared->hidden, w.shared->inter).total();
  return total;
}

// The GPU tests' layers on the host (this test runs without a GPU): GpuSpec's shapes are what
// the tests claim to cover, and an FP8 and an MXFP4 expert of each of their expert shapes gets a
// device image (what Upload does before its copies), so a shape the device format refuses fails
// here, not only on a GPU.
TEST(CudaTestLayers, ShapesCoverTheTilesAndQuantizedImagesBuild) {
  constexpr int64_t kMmaRows = 64;  // the tensor-core kernels' m-tile (ffn_kernels.h kMmaBm)
  std::set<std::pair<int64_t, int64_t>> shapes;  // (hidden, inter)
  for (Family f : AllFamilies()) {
    const ModelSpec s = GpuSpec(f);
    EXPECT_GE(s.hidden, 1024);
    EXPECT_EQ(s.hidden % 8, 0) << "tensor cores load 8 values at a time";
    EXPECT_NE(s.hidden % 32, 0) << "a partial k stage and MXFP4 block";
    EXPECT_NE(s.hidden % cuda_plan::kFp8BlockK, 0) << "a partial FP8 block";
    for (int64_t inter : {s.expert_inter, s.shared_inter}) {
      if (inter == 0) continue;
      EXPECT_GE(inter, 512);
      EXPECT_NE(inter % cuda_plan::kColBlock, 0) << "a partial column tile";
      EXPECT_NE(inter % cuda_plan::kMxBlockK, 0) << "a partial MXFP4 block in GEMM2";
      shapes.insert({s.hidden, inter});
    }
    EXPECT_GE(kTokens * s.top_k / s.num_experts, 3 * kMmaRows) << "m-tiles per expert";
  }
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    for (const auto& [hidden, inter] : shapes) {
      const ExpertWeights ew = RandomQuantExpert(Cpu(), t, hidden, inter, 1);
      const auto img = cuda_plan::BuildExpertImage(ew, FormatOf(t), true, "expert");
      EXPECT_TRUE(img.ok()) << DTypeName(t) << " " << hidden << " x " << inter << ": "
                            << img.status().ToString();
    }
  }
}

class CudaQuantFamilyTest : public ::testing::TestWithParam<std::tuple<Family, DType>> {};

TEST_P(CudaQuantFamilyTest, ExactMathIsTheCpu) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype);
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->weight_bytes(), ExpectedWeightBytes(*w, FormatOf(dtype)));
  EXPECT_NE(gpu->Describe().find(cuda_plan::WeightFormatName(FormatOf(dtype))), std::string::npos)
      << gpu->Describe();
  for (int64_t tokens : {int64_t{1}, int64_t{7}, int64_t{64}, kTokens}) {
    const auto x = RandomRows(tokens, w->spec.hidden, static_cast<uint32_t>(tokens));
    std::vector<int32_t> want_ids;
    const auto want = CpuForward(w, x, tokens, &want_ids);
    const auto got = GpuForward(*gpu, x, tokens);
    const double err = RelativeError(got, want);
    EXPECT_LE(err, 1e-5) << FamilyName(family) << " " << DTypeName(dtype) << " tokens " << tokens;
    EXPECT_TRUE(Bitwise(got, want)) << FamilyName(family) << " " << DTypeName(dtype) << " tokens "
                                    << tokens << " rel err " << err;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    ASSERT_TRUE(gpu->LastRouting(&ids, &weights).ok());
    EXPECT_EQ(ids, want_ids);
  }
}

TEST_P(CudaQuantFamilyTest, TensorCoresAreWithinOnePercentOfTheCpu) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype);
  const int64_t tokens = kTokens;
  const auto x = RandomRows(tokens, w->spec.hidden, 3);
  const auto want = CpuForward(w, x, tokens);
  for (DType mma : {DType::kBF16, DType::kF16}) {
    CudaLayerOptions o;
    o.math = CudaMath::kTensorCore;
    o.mma_type = mma;
    o.max_tokens = kMaxTokens;
    auto gpu = CudaMoeLayer::Upload(*w, o);
    if (dtype == DType::kF4 && mma == DType::kF16) {
      ASSERT_FALSE(gpu.ok()) << "MXFP4 on f16 tensor cores must be refused";
      EXPECT_EQ(gpu.status().code(), StatusCode::kUnsupported);
      EXPECT_NE(gpu.status().message().find("MXFP4"), std::string::npos) << gpu.status().ToString();
      continue;
    }
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    EXPECT_EQ((*gpu)->weight_bytes(), ExpectedWeightBytes(*w, FormatOf(dtype)));
    const double err = RelativeError(GpuForward(**gpu, x, tokens), want);
    EXPECT_LE(err, 1e-2) << FamilyName(family) << " " << DTypeName(dtype) << " on "
                         << DTypeName(mma);
    RecordProperty(std::string("rel_err_") + DTypeName(mma), std::to_string(err));
  }
}

TEST_P(CudaQuantFamilyTest, BatchInvariantAndGraphsEqualPlainLaunches) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  const auto w = GpuLayer(family, dtype);
  for (CudaMath math : {CudaMath::kExact, CudaMath::kTensorCore}) {
    auto graphs = Make(*w, math);
    auto plain = Make(*w, math, DType::kBF16, 0);
    ASSERT_NE(graphs, nullptr);
    ASSERT_NE(plain, nullptr);
    const int64_t tokens = 150, h = w->spec.hidden;
    const auto x = RandomRows(tokens, h, 11);
    const auto all = GpuForward(*graphs, x, tokens);
    EXPECT_TRUE(Bitwise(all, GpuForward(*plain, x, tokens))) << CudaMathName(math);
    for (int64_t t = 0; t < tokens; t += 7) {
      const std::vector<float> one(x.begin() + t * h, x.begin() + (t + 1) * h);
      const auto got = GpuForward(*graphs, one, 1);
      EXPECT_EQ(std::memcmp(got.data(), all.data() + t * h, static_cast<size_t>(h) * 4), 0)
          << CudaMathName(math) << " token " << t;
    }
  }
}

// Random presets quantized by the host (runtime/model/preset.cc): exact math is the CPU layer's,
// and a quantized FromPreset (built on the host, then uploaded) equals Upload.
TEST_P(CudaQuantFamilyTest, PresetsAreTheCpuLayer) {
  SKIP_WITHOUT_GPU();
  const auto [family, dtype] = GetParam();
  PresetOptions p;
  p.seed = 5;
  p.dtype = dtype;
  auto built = BuildPresetLayer(GpuSpec(family), Cpu(), p);
  if (!built.ok())
    GTEST_SKIP() << "no " << DTypeName(dtype) << " presets: " << built.status().ToString();
  ASSERT_EQ(built->dtype, dtype);
  const auto w = std::make_shared<const MoeLayerWeights>(std::move(built).value());
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  const auto x = RandomRows(300, w->spec.hidden, 9);
  const auto want = CpuForward(w, x, 300);
  const auto got = GpuForward(*gpu, x, 300);
  EXPECT_LE(RelativeError(got, want), 1e-5);
  EXPECT_TRUE(Bitwise(got, want));
  CudaLayerOptions o;
  o.math = CudaMath::kExact;
  o.max_tokens = kMaxTokens;
  auto from_preset = CudaMoeLayer::FromPreset(GpuSpec(family), p, o);
  ASSERT_TRUE(from_preset.ok()) << from_preset.status().ToString();
  EXPECT_TRUE(Bitwise(GpuForward(**from_preset, x, 300), got));
  EXPECT_EQ((*from_preset)->weight_bytes(), gpu->weight_bytes());
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, CudaQuantFamilyTest,
                         ::testing::Combine(::testing::ValuesIn(AllFamilies()),
                                            ::testing::Values(DType::kF8E4M3, DType::kF4)),
                         [](const auto& tp) {
                           return std::string(FamilyName(std::get<0>(tp.param))) + "_" +
                                  (std::get<1>(tp.param) == DType::kF8E4M3 ? "fp8" : "mxfp4");
                         });

// The published formats, loaded from the fixtures by the CPU loader, on the device.
class CudaQuantFixtureTest : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(CudaQuantFixtureTest, ExactMathIsTheCpuAndTheReference) {
  SKIP_WITHOUT_GPU();
  const auto [name, dtype] = GetParam();
  if (!std::filesystem::exists(FixtureDir(name) + "/config.json")) {
    GTEST_SKIP() << FixtureDir(name) << " is missing";
  }
  const auto w = LoadFixture(name, Cpu());
  ASSERT_EQ(w->dtype, dtype) << name << ": the loader must keep the experts quantized";
  int64_t tokens = 0, hidden = 0;
  const auto x = ReadF32(FixtureDir(name) + "/golden.safetensors", "input", &tokens, &hidden);
  const auto golden = ReadF32(FixtureDir(name) + "/golden.safetensors", "output");
  const auto cpu = CpuForward(w, x, tokens);
  auto gpu = Make(*w, CudaMath::kExact);
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->weight_bytes(), ExpectedWeightBytes(*w, FormatOf(dtype)));
  const auto got = GpuForward(*gpu, x, tokens);
  const double err_cpu = RelativeError(got, cpu), err_ref = RelativeError(got, golden);
  EXPECT_LE(err_cpu, 1e-5) << name;
  EXPECT_TRUE(Bitwise(got, cpu)) << name << " rel err vs cpu " << err_cpu;
  EXPECT_LE(err_ref, 1e-5) << name;
  RecordProperty("rel_err_vs_cpu", std::to_string(err_cpu));
  RecordProperty("rel_err_vs_reference", std::to_string(err_ref));
  RecordProperty("device_weight_bytes", std::to_string(gpu->weight_bytes()));
  // Tensor cores (bf16): within 1e-2.
  auto tc = Make(*w, CudaMath::kTensorCore);
  ASSERT_NE(tc, nullptr);
  const double err_tc = RelativeError(GpuForward(*tc, x, tokens), cpu);
  EXPECT_LE(err_tc, 1e-2) << name;
  RecordProperty("rel_err_tensor_core_bf16", std::to_string(err_tc));
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaQuantFixtureTest,
    ::testing::Values(std::make_tuple(std::string("deepseek_v3_fp8"), DType::kF8E4M3),
                      std::make_tuple(std::string("gpt_oss_mxfp4"), DType::kF4)),
    [](const auto& tp) { return std::get<0>(tp.param); });

TEST(CudaQuantLayerTest, MixedTypesAreRefused) {
  SKIP_WITHOUT_GPU();
  // An FP8 layer with one bf16 expert: an error naming the expert, not a silent conversion.
  PresetOptions o;
  o.seed = 3;
  auto base = BuildPresetLayer(SmallSpec(Family::kMixtral), Cpu(), o);
  ASSERT_TRUE(base.ok());
  MoeLayerWeights w = std::move(base).value();
  o.dtype = DType::kBF16;
  auto bf16 = BuildPresetLayer(SmallSpec(Family::kMixtral), Cpu(), o);
  ASSERT_TRUE(bf16.ok());
  for (size_t e = 0; e < w.experts.size(); ++e) {
    w.experts[e] = e == 4 ? std::move(bf16->experts[e])
                          : RandomQuantExpert(Cpu(), DType::kF8E4M3, w.experts[e].hidden,
                                              w.experts[e].inter, static_cast<uint32_t>(e));
  }
  w.dtype = DType::kF8E4M3;
  for (CudaMath math : {CudaMath::kExact, CudaMath::kTensorCore}) {
    CudaLayerOptions opts;
    opts.math = math;
    opts.max_tokens = 16;
    auto gpu = CudaMoeLayer::Upload(w, opts);
    ASSERT_FALSE(gpu.ok());
    EXPECT_NE(gpu.status().message().find("expert 4"), std::string::npos)
        << gpu.status().ToString();
    EXPECT_NE(gpu.status().message().find("BF16"), std::string::npos) << gpu.status().ToString();
  }
}

}  // namespace
}  // namespace moerun
