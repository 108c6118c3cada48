// Block-scaled expert weights in the CUDA layer, host side (runs without a GPU): the decoders the
// kernels use (experts/cuda/quant_layout.h) against base/quant_formats.h, the device format
// choice and its errors, the device image of CPU-packed FP8 and MXFP4 experts (codes, scales,
// sizes: about the quantized bytes), and the exact kernels' math over that image, emulated on the
// host, bitwise equal to the CPU's grouped FFN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "base/quant_formats.h"
#include "base/thread_pool.h"
#include "experts/cpu/elementwise.h"
#include "experts/cpu/grouped_ffn.h"
#include "experts/cuda/quant_layout.h"
#include "runtime/layer/cuda/device_weights.h"
#include "tests/cuda/quant_layers.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace cuda_plan;
using testing::RandomQuantExpert;

uint32_t Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

TEST(CudaQuantTest, DecodersMatchTheFormats) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    if (IsE4m3NaN(code)) {
      EXPECT_TRUE(std::isnan(Fp8Value(code))) << c;
      continue;
    }
    // The CPU kernels' value: e4m3 x 2^-8, sign of zero included.
    EXPECT_EQ(Bits(Fp8Value(code)), Bits(E4m3ToF32(code) / 256.0f)) << c;
    // Exact in both tensor-core types (the MMA path stores it unrounded).
    EXPECT_EQ(Bf16ToF32(F32ToBf16(Fp8Value(code))), Fp8Value(code)) << c;
    EXPECT_EQ(F16ToF32(F32ToF16(Fp8Value(code))), Fp8Value(code)) << c;
  }
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(Bits(E2m1Value(c)), Bits(E2m1ToF32(static_cast<uint8_t>(c)))) << c;
    EXPECT_EQ(Bits(E2m1Value(c + 16 * 7)), Bits(E2m1Value(c))) << "high bits are ignored";
  }
  for (int s = 0; s < 255; ++s) {
    const auto e = static_cast<uint8_t>(s);
    EXPECT_EQ(Bits(E8m0Value(e)), Bits(E8m0ToF32(e))) << s;
    // MXFP4 on bf16 tensor cores: every code times every scale short of overflow is exact.
    for (uint32_t c = 0; c < 16; ++c) {
      const float v = E2m1Value(c) * E8m0Value(e);
      if (std::isinf(v) || std::fabs(v) > 3.0e38f) continue;
      EXPECT_EQ(Bits(Bf16ToF32(F32ToBf16(v))), Bits(v)) << s << " " << c;
    }
  }
  EXPECT_TRUE(std::isnan(E8m0Value(0xFF)));
  const uint8_t row[2] = {0x21, 0xF3};
  EXPECT_EQ(MxCode(row, 0), 1u);
  EXPECT_EQ(MxCode(row, 1), 2u);
  EXPECT_EQ(MxCode(row, 2), 3u);
  EXPECT_EQ(MxCode(row, 3), 15u);
}

TEST(CudaQuantTest, FormatChoice) {
  EXPECT_EQ(*ChooseWeightFormat(DType::kF8E4M3, false, DType::kBF16), WeightFormat::kFp8);
  EXPECT_EQ(*ChooseWeightFormat(DType::kF4, false, DType::kBF16), WeightFormat::kMxfp4);
  EXPECT_EQ(*ChooseWeightFormat(DType::kF8E4M3, true, DType::kBF16), WeightFormat::kFp8);
  EXPECT_EQ(*ChooseWeightFormat(DType::kF8E4M3, true, DType::kF16), WeightFormat::kFp8);
  EXPECT_EQ(*ChooseWeightFormat(DType::kF4, true, DType::kBF16), WeightFormat::kMxfp4);
  EXPECT_EQ(*ChooseWeightFormat(DType::kF32, true, DType::kF16), WeightFormat::kF16);
  EXPECT_EQ(*ChooseWeightFormat(DType::kBF16, false, DType::kF16), WeightFormat::kBF16);
  const auto mx_f16 = ChooseWeightFormat(DType::kF4, true, DType::kF16);
  ASSERT_FALSE(mx_f16.ok());
  EXPECT_EQ(mx_f16.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(mx_f16.status().message().find("MXFP4"), std::string::npos);
  EXPECT_NE(mx_f16.status().message().find("f16 tensor cores"), std::string::npos);
  EXPECT_FALSE(ChooseWeightFormat(DType::kBF16, true, DType::kF16).ok());  // rounded twice
  EXPECT_FALSE(ChooseWeightFormat(DType::kF8E5M2, false, DType::kBF16).ok());
  EXPECT_FALSE(ChooseWeightFormat(DType::kF8E4M3, true, DType::kF32).ok());
}

// The sizes the device holds: codes plus scales, about the quantized bytes (host-side figures).
TEST(CudaQuantTest, DeviceBytesAreTheQuantizedBytes) {
  struct Shape {
    const char* name;
    int64_t hidden, inter;
  };
  for (const Shape& s : {Shape{"deepseek-v3", 7168, 2048}, Shape{"qwen3-30b-a3b", 2048, 768},
                         Shape{"gpt-oss-120b", 2880, 2880}, Shape{"mixtral-8x7b", 4096, 14336}}) {
    const double weights = 3.0 * static_cast<double>(s.hidden * s.inter);
    const ExpertBytes bf16 = DeviceExpertBytes(WeightFormat::kBF16, s.hidden, s.inter);
    const ExpertBytes fp8 = DeviceExpertBytes(WeightFormat::kFp8, s.hidden, s.inter);
    const ExpertBytes mx = DeviceExpertBytes(WeightFormat::kMxfp4, s.hidden, s.inter);
    EXPECT_EQ(bf16.total(), static_cast<size_t>(weights) * 2) << s.name;
    EXPECT_EQ(fp8.w13 + fp8.w2, static_cast<size_t>(weights)) << s.name;
    EXPECT_EQ(mx.w13 + mx.w2, static_cast<size_t>(weights) / 2) << s.name;
    EXPECT_LT(DeviceBytesPerWeight(WeightFormat::kFp8, s.hidden, s.inter), 1.001) << s.name;
    EXPECT_DOUBLE_EQ(DeviceBytesPerWeight(WeightFormat::kMxfp4, s.hidden, s.inter), 0.53125)
        << s.name;
    std::printf(
        "%-14s expert %lld x %lld: bf16 %.2f MB, fp8 %.2f MB (%.5f B/weight, scales %zu B), "
        "mxfp4 %.2f MB (%.5f B/weight, scales %zu B)\n",
        s.name, static_cast<long long>(s.hidden), static_cast<long long>(s.inter),
        static_cast<double>(bf16.total()) / 1e6, static_cast<double>(fp8.total()) / 1e6,
        DeviceBytesPerWeight(WeightFormat::kFp8, s.hidden, s.inter), fp8.s13 + fp8.s2,
        static_cast<double>(mx.total()) / 1e6,
        DeviceBytesPerWeight(WeightFormat::kMxfp4, s.hidden, s.inter), mx.s13 + mx.s2);
  }
  // DeepSeek-V3's expert: 44,040,192 weights; 64 x 56 + 112 x 16 FP8 scales.
  const ExpertBytes ds = DeviceExpertBytes(WeightFormat::kFp8, 7168, 2048);
  EXPECT_EQ(ds.s13, size_t{64 * 56 * 4});
  EXPECT_EQ(ds.s2, size_t{112 * 16 * 4});
  EXPECT_EQ(ds.total(), size_t{44040192 + 21504});
  // Padded inter (40 -> 64) and partial blocks (hidden 96).
  const ExpertBytes small = DeviceExpertBytes(WeightFormat::kMxfp4, 96, 40);
  EXPECT_EQ(small.w13, size_t{128 * 48});
  EXPECT_EQ(small.w2, size_t{96 * 32});
  EXPECT_EQ(small.s13, size_t{128 * 3});
  EXPECT_EQ(small.s2, size_t{96 * 2});
}

struct QuantCase {
  DType type;
  int64_t hidden, inter;
  Isa isa;
};

std::vector<QuantCase> Cases() {
  std::vector<QuantCase> out;
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    for (Isa isa : {Isa::kScalar, BestIsa()}) {
      out.push_back({t, 96, 40, isa});    // partial blocks, padded inter
      out.push_back({t, 256, 160, isa});  // the FP8 fixture's shape
      out.push_back({t, 200, 300, isa});  // several row blocks, odd sizes
      out.push_back({t, 130, 129, isa});  // a one-row last block
    }
  }
  return out;
}

WeightFormat FormatOf(DType t) {
  return t == DType::kF8E4M3 ? WeightFormat::kFp8 : WeightFormat::kMxfp4;
}

// Element (row, k) of a device matrix (row length ld) as the exact kernels see it: the decoded
// code and its block's scale.
void DeviceWeight(const ExpertImage& img, bool w13, int64_t row, int64_t k, float* v, float* s) {
  const WQuant q = QuantOf(img.format);
  const int64_t ld = w13 ? img.hidden : PaddedInter(img.inter);
  const std::vector<uint8_t>& codes = w13 ? img.w13 : img.w2;
  const std::vector<uint8_t>& scales = w13 ? img.s13 : img.s2;
  const int64_t si = ScaleIndex(q, row, k, ld);
  if (q == WQuant::kFp8) {
    *v = Fp8Value(codes[static_cast<size_t>(row * ld + k)]);
    std::memcpy(s, scales.data() + si * 4, 4);
  } else {
    *v = E2m1Value(MxCode(codes.data() + row * CodeRowBytes(q, ld), k));
    *s = E8m0Value(scales[static_cast<size_t>(si)]);
  }
}

TEST(CudaQuantTest, DeviceImageHoldsTheCodesAndScales) {
  for (const QuantCase& c : Cases()) {
    const CpuKernels& k = KernelsFor(c.isa);
    const ExpertWeights ew = RandomQuantExpert(k, c.type, c.hidden, c.inter, 3);
    const WeightFormat f = FormatOf(c.type);
    auto img = BuildExpertImage(ew, f, false, "expert 0");
    ASSERT_TRUE(img.ok()) << img.status().ToString();
    const ExpertBytes want = DeviceExpertBytes(f, c.hidden, c.inter);
    EXPECT_EQ(img->w13.size(), want.w13);
    EXPECT_EQ(img->w2.size(), want.w2);
    EXPECT_EQ(img->s13.size(), want.s13);
    EXPECT_EQ(img->s2.size(), want.s2);
    EXPECT_EQ(img->bytes(), want.total());
    const int64_t ip = PaddedInter(c.inter), nr = k.nr;
    const std::string what = std::string(DTypeName(c.type)) + " " + std::to_string(c.hidden) + "x" +
                             std::to_string(c.inter) + " " + IsaName(c.isa);
    // Every weight decodes to the CPU's (At: the exact product of value and scale).
    for (int64_t j = 0; j < ip; ++j) {
      for (int up = 0; up < 2; ++up) {
        const int64_t row = up ? UpRow(j) : GateRow(j);
        const int64_t src = 2 * (j / nr) * nr + j % nr + (up ? nr : 0);
        for (int64_t kk = 0; kk < c.hidden; ++kk) {
          float v, s;
          DeviceWeight(*img, true, row, kk, &v, &s);
          if (j >= c.inter) {
            ASSERT_EQ(v, 0.0f) << what << " padding row " << row;
            continue;
          }
          // FP8: (e4m3 / 2^8) x (scale_inv x 2^8) is the same real product as At's.
          ASSERT_EQ(Bits(v * s), Bits(ew.w13.At(src, kk))) << what << " W13 " << j << " " << kk;
        }
      }
    }
    for (int64_t n = 0; n < c.hidden; ++n) {
      for (int64_t kk = 0; kk < ip; ++kk) {
        float v, s;
        DeviceWeight(*img, false, n, kk, &v, &s);
        if (kk >= c.inter) {
          ASSERT_EQ(v, 0.0f) << what << " padding column " << kk;
          continue;
        }
        ASSERT_EQ(Bits(v * s), Bits(ew.w2.At(n, kk))) << what << " W2 " << n << " " << kk;
      }
    }
  }
}

// The exact kernels' math (ffn_kernels.cu: ExactGemm1/2 with block-scaled weights), on the host:
// per output, products summed per scale block from +0 in k order, each block sum entering the
// output with one fma by its scale; the activation and biases as the kernels apply them.
std::vector<float> EmulateExactFfn(const ExpertImage& img, const ExpertWeights& ew,
                                   const ActParams& act, const std::vector<float>& x,
                                   int64_t rows) {
  const int64_t h = img.hidden, inter = img.inter;
  const int bk = BlockK(QuantOf(img.format));
  auto dot = [&](bool w13, int64_t row, const float* in, int64_t kdim) {
    float acc = 0.0f, sum = 0.0f;
    for (int64_t k = 0; k < kdim; ++k) {
      float v, s;
      DeviceWeight(img, w13, row, k, &v, &s);
      sum = std::fma(in[k], v, sum);
      if ((k + 1) % bk == 0 || k + 1 == kdim) {
        acc = std::fma(sum, s, acc);
        sum = 0.0f;
      }
    }
    return acc;
  };
  std::vector<float> y(static_cast<size_t>(rows * h)), hid(static_cast<size_t>(inter));
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x.data() + m * h;
    for (int64_t j = 0; j < inter; ++j) {
      float g = dot(true, GateRow(j), xr, h), u = dot(true, UpRow(j), xr, h);
      if (!ew.bias_gate.empty()) {
        g = g + ew.bias_gate[static_cast<size_t>(j)];
        u = u + ew.bias_up[static_cast<size_t>(j)];
      }
      hid[static_cast<size_t>(j)] = elementwise::Act(act, g, u);
    }
    for (int64_t n = 0; n < h; ++n) {
      float v = dot(false, n, hid.data(), inter);
      if (!ew.bias_down.empty()) v = v + ew.bias_down[static_cast<size_t>(n)];
      y[static_cast<size_t>(m * h + n)] = v;
    }
  }
  return y;
}

TEST(CudaQuantTest, ExactKernelMathOverTheImageIsBitwiseTheCpu) {
  for (const QuantCase& c : Cases()) {
    const CpuKernels& k = KernelsFor(c.isa);
    ExpertWeights biases;
    biases.bias_gate.assign(static_cast<size_t>(c.inter), 0.0f);
    biases.bias_up = biases.bias_gate;
    biases.bias_down.assign(static_cast<size_t>(c.hidden), 0.0f);
    for (int64_t j = 0; j < c.inter; ++j) {
      biases.bias_gate[static_cast<size_t>(j)] = 0.01f * static_cast<float>(j % 7);
      biases.bias_up[static_cast<size_t>(j)] = -0.02f * static_cast<float>(j % 5);
    }
    for (int64_t n = 0; n < c.hidden; ++n) biases.bias_down[static_cast<size_t>(n)] = 0.001f * n;
    const ExpertWeights* const with_biases = &biases;
    for (const ExpertWeights* b : {static_cast<const ExpertWeights*>(nullptr), with_biases}) {
      const ExpertWeights ew = RandomQuantExpert(k, c.type, c.hidden, c.inter, 5, b);
      auto img = BuildExpertImage(ew, FormatOf(c.type), false, "expert 0");
      ASSERT_TRUE(img.ok()) << img.status().ToString();
      ActParams act;
      if (b != nullptr) {
        act.kind = ActKind::kGptOss;
        act.limit = 0.5f;
      }
      const int64_t rows = 9;
      const auto x = testing::RandomRows(rows, c.hidden, 2);
      const auto got = EmulateExactFfn(*img, ew, act, x, rows);
      ThreadPool pool(1);
      GroupedFfn ffn(k, &pool);
      std::vector<int32_t> row_token(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r)
        row_token[static_cast<size_t>(r)] = static_cast<int32_t>(r);
      const int64_t ldy = ffn.PaddedHidden(c.hidden);
      std::vector<float> want(static_cast<size_t>(rows * ldy));
      const ExpertGroup group{&ew, act, 0, rows};
      ffn.Run({&group, 1}, x.data(), c.hidden, row_token.data(), want.data(), ldy);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(std::memcmp(got.data() + r * c.hidden, want.data() + r * ldy,
                              static_cast<size_t>(c.hidden) * 4),
                  0)
            << DTypeName(c.type) << " " << c.hidden << "x" << c.inter << " " << IsaName(c.isa)
            << (b ? " biases" : "") << " row " << r;
      }
    }
  }
}

TEST(CudaQuantTest, NoSilentConversions) {
  const CpuKernels& k = KernelsFor(Isa::kScalar);
  const ExpertWeights fp8 = RandomQuantExpert(k, DType::kF8E4M3, 96, 40, 1);
  // An FP8 expert in an MXFP4 or bf16 layer, and the other way round: refused, naming both.
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kBF16, WeightFormat::kF32}) {
    for (bool round : {false, true}) {
      const auto img = BuildExpertImage(fp8, f, round, "expert 7");
      ASSERT_FALSE(img.ok()) << WeightFormatName(f);
      EXPECT_NE(img.status().message().find("expert 7"), std::string::npos);
      EXPECT_NE(img.status().message().find("F8_E4M3"), std::string::npos)
          << img.status().ToString();
    }
  }
  ExpertSource src;
  src.gate = src.up = [](int64_t, float* row) { std::fill(row, row + 96, 0.5f); };
  src.down = [](int64_t, float* row) { std::fill(row, row + 40, 0.25f); };
  const ExpertWeights f32 = PackExpert(k, DType::kF32, 96, 40, src);
  const ExpertWeights bf16 = PackExpert(k, DType::kBF16, 96, 40, src);
  EXPECT_FALSE(BuildExpertImage(f32, WeightFormat::kFp8, true, "the shared expert").ok());
  EXPECT_FALSE(BuildExpertImage(bf16, WeightFormat::kFp8, true, "expert 0").ok());
  EXPECT_FALSE(BuildExpertImage(f32, WeightFormat::kBF16, false, "expert 0").ok());  // exact
  EXPECT_TRUE(BuildExpertImage(f32, WeightFormat::kBF16, true, "expert 0").ok());    // mma
  EXPECT_TRUE(BuildExpertImage(bf16, WeightFormat::kBF16, false, "expert 0").ok());
}

TEST(CudaQuantTest, Fp8ScalesMustBeUniformPerDeviceBlock) {
  const CpuKernels& k = KernelsFor(Isa::kScalar);  // panels of 16 rows: one scale each
  // Scales per 16 rows: they differ within the device's 64-row blocks.
  const ExpertWeights ew = RandomQuantExpert(k, DType::kF8E4M3, 256, 160, 2, nullptr, 16);
  const auto img = BuildExpertImage(ew, WeightFormat::kFp8, false, "expert 2");
  ASSERT_FALSE(img.ok());
  EXPECT_EQ(img.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(img.status().message().find("FP8 scales differ"), std::string::npos)
      << img.status().ToString();
  // 64-row blocks are fine.
  const ExpertWeights ok = RandomQuantExpert(k, DType::kF8E4M3, 256, 160, 2, nullptr, 64);
  EXPECT_TRUE(BuildExpertImage(ok, WeightFormat::kFp8, false, "expert 2").ok());
}

// The GPU tests' quantized layers (tests/cuda/quant_layers.h) run on the CPU, every family, and
// each expert's device image builds (what Upload does before copying).
TEST(CudaQuantTest, GpuTestLayersBuildAndRunOnTheCpu) {
  const CpuKernels& k = KernelsFor(BestIsa());
  for (Family f : testing::AllFamilies()) {
    for (DType t : {DType::kF8E4M3, DType::kF4}) {
      PresetOptions o;
      o.seed = 7;
      auto base = BuildPresetLayer(testing::SmallSpec(f), k, o);
      ASSERT_TRUE(base.ok()) << base.status().ToString();
      const auto w = testing::Quantized(std::move(base).value(), k, t, 7);
      ASSERT_EQ(w->dtype, t);
      for (const ExpertWeights& ew : w->experts) {
        ASSERT_EQ(ew.w13.dtype(), t);
        ASSERT_TRUE(BuildExpertImage(ew, FormatOf(t), true, "expert").ok());
      }
      if (w->shared) {
        ASSERT_TRUE(BuildExpertImage(*w->shared, FormatOf(t), true, "shared").ok());
      }
      ThreadPool pool(1);
      MoeLayer layer(w, k, &pool);
      const auto x = testing::RandomRows(20, w->spec.hidden, 1);
      std::vector<float> out(x.size());
      ASSERT_TRUE(layer.Forward(x.data(), 20, out.data()).ok()) << FamilyName(f);
      double norm = 0;
      for (float v : out) {
        ASSERT_TRUE(std::isfinite(v)) << FamilyName(f) << " " << DTypeName(t);
        norm += static_cast<double>(v) * v;
      }
      EXPECT_GT(norm, 0.0) << FamilyName(f) << " " << DTypeName(t);
    }
  }
}

// What Upload does with the published checkpoints and the presets, short of the copy: every
// expert's device image builds (FP8 scales uniform per device block, MXFP4 scales powers of two),
// and the exact kernels' math over it is bitwise the CPU's.
TEST(CudaQuantTest, FixturesAndPresetsBuildDeviceImages) {
  const CpuKernels& k = KernelsFor(BestIsa());
  std::vector<std::pair<std::string, std::shared_ptr<const MoeLayerWeights>>> layers;
  for (const char* name : {"deepseek_v3_fp8", "gpt_oss_mxfp4"}) {
    if (!std::filesystem::exists(testing::FixtureDir(name) + "/config.json")) {
      ADD_FAILURE() << testing::FixtureDir(name) << " is missing";
      continue;
    }
    layers.emplace_back(name, testing::LoadFixture(name, k));
  }
  for (DType t : {DType::kF8E4M3, DType::kF4}) {
    for (Family f : {Family::kDeepseekV3, Family::kGptOss}) {
      PresetOptions o;
      o.seed = 3;
      o.dtype = t;
      auto w = BuildPresetLayer(testing::SmallSpec(f), k, o);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      layers.emplace_back(std::string("preset ") + FamilyName(f) + " " + DTypeName(t),
                          std::make_shared<const MoeLayerWeights>(std::move(w).value()));
    }
  }
  for (const auto& [name, w] : layers) {
    ASSERT_TRUE(IsBlockScaled(w->dtype)) << name << ": " << DTypeName(w->dtype);
    const WeightFormat f = FormatOf(w->dtype);
    const int64_t rows = 5;
    const auto x = testing::RandomRows(rows, w->spec.hidden, 8);
    for (size_t e = 0; e <= w->experts.size(); ++e) {
      const bool shared = e == w->experts.size();
      if (shared && !w->shared) break;
      const ExpertWeights& ew = shared ? *w->shared : w->experts[e];
      ASSERT_EQ(ew.w13.dtype(), w->dtype) << name << " expert " << e;
      auto img = BuildExpertImage(ew, f, true, "expert");
      ASSERT_TRUE(img.ok()) << name << " expert " << e << ": " << img.status().ToString();
      if (e % 3 != 0 && !shared) continue;  // the math on a few of them
      const ActParams act = shared ? w->spec.SharedAct(w->layer) : w->spec.RoutedAct(w->layer);
      const auto got = EmulateExactFfn(*img, ew, act, x, rows);
      ThreadPool pool(1);
      GroupedFfn ffn(k, &pool);
      std::vector<int32_t> row_token = {0, 1, 2, 3, 4};
      const int64_t h = w->spec.hidden, ldy = ffn.PaddedHidden(h);
      std::vector<float> want(static_cast<size_t>(rows * ldy));
      const ExpertGroup group{&ew, act, 0, rows};
      ffn.Run({&group, 1}, x.data(), h, row_token.data(), want.data(), ldy);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(
            std::memcmp(got.data() + r * h, want.data() + r * ldy, static_cast<size_t>(h) * 4), 0)
            << name << " expert " << e << " row " << r;
      }
    }
  }
}

}  // namespace
}  // namespace moerun
