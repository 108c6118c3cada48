#include "runtime/model/preset.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>

#include "base/quant_formats.h"
#include "runtime/model/preset_hash.h"
#include "tests/unit/kernel_variants.h"
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

// preset.intermediate: the experts' intermediate size scaled down, the shared expert's by the same
// factor; the rest of the shape stays; sizes that are not whole groups of 32 are refused.
TEST(PresetTest, ScalesTheIntermediateSize) {
  PresetOptions o;
  o.experts = 16;
  o.intermediate = 256;
  o.dtype = DType::kBF16;
  auto d = PresetSpec("deepseek-v3", o, nullptr);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->expert_inter, 256);
  EXPECT_EQ(d->shared_inter, 256);  // 2048 of 2048, scaled alike
  EXPECT_EQ(d->hidden, 7168);
  EXPECT_EQ(d->top_k, 8);
  EXPECT_EQ(d->gate.n_group, 8);
  EXPECT_EQ(d->moe_layers.size(), 58u);
  o.intermediate = 96;
  auto q = PresetSpec("qwen3-30b-a3b", o, nullptr);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->expert_inter, 96);
  EXPECT_EQ(q->shared_inter, 0);  // none to scale
  ModelSpec s;
  s.expert_inter = 1280, s.shared_inter = 640;  // a shared expert half the size: stays half
  ASSERT_TRUE(ScaleIntermediate("x", 320, &s).ok());
  EXPECT_EQ(s.shared_inter, 160);
  for (int64_t bad : {16, 100, 800, 2080, -32}) {
    o.intermediate = bad;
    auto e = PresetSpec(bad == 800 ? "qwen3-30b-a3b" : "deepseek-v3", o, nullptr);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find("multiple of 32"), std::string::npos)
        << e.status().message();
  }
  // The default (0) keeps the real size, and with it the budget's expert count.
  o.intermediate = 0;
  o.experts = 0;
  auto full = PresetSpec("deepseek-v3", o, nullptr);
  o.intermediate = 256;
  auto scaled = PresetSpec("deepseek-v3", o, nullptr);
  ASSERT_TRUE(full.ok() && scaled.ok());
  EXPECT_EQ(full->expert_inter, 2048);
  EXPECT_GT(scaled->num_experts, full->num_experts);  // smaller experts: more fit in 4 GB
}

// A scaled preset layer is built at the scaled size: its experts and its shared expert.
TEST(PresetTest, ScaledIntermediateLayerHasTheScaledShape) {
  PresetOptions o;
  o.experts = 16;
  o.intermediate = 64;
  auto spec = PresetSpec("deepseek-v3", o, nullptr);
  ASSERT_TRUE(spec.ok());
  const CpuKernels& k = KernelsFor(Isa::kScalar);
  o.layer = 3;
  o.load_expert.assign(16, false);
  o.load_expert[5] = true;
  auto w = BuildPresetLayer(*spec, k, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->experts[5].inter, 64);
  EXPECT_EQ(w->experts[5].w2.k(), 64);
  ASSERT_TRUE(w->shared.has_value());
  EXPECT_EQ(w->shared->inter, 64);
  EXPECT_EQ(w->shared->hidden, 7168);
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

// --- FP8 and MXFP4 presets -----------------------------------------------------------------------

namespace moerun {
namespace {

using ::moerun::testing::AllFamilies;
using ::moerun::testing::RandomRows;
using ::moerun::testing::SmallSpec;
using ::moerun::testing::TestVariants;

// The fast code conversions presets use give F32ToE4m3's and F32ToE2m1's code for every float
// tried: every exponent from 2^-27 to 2^13 with the top 12 mantissa bits in every pattern (which
// includes every tie of both formats) and their neighbours one ulp away, specials, saturation.
TEST(PresetQuantTest, FastCodesEqualTheReferenceConversions) {
  std::vector<float> values = {
      0.0f,     -0.0f,   448.0f,    464.0f,   480.0f,    449.0f,        6.0f,          5.0f, 5.5f,
      7.0f,     1e30f,   1e-45f,    1e-38f,   0.25f,     0.75f,         0.125f,        3.5f, 2.5f,
      0x1p-10f, 0x1p-6f, 0x1.ep-7f, INFINITY, -INFINITY, std::nanf(""), -std::nanf("")};
  for (uint32_t e = 100; e <= 140; ++e) {
    for (uint32_t top = 0; top < 4096; ++top) {
      for (uint32_t low : {0u, 1u, 0x7FFu}) {
        const uint32_t u = e << 23 | top << 11 | low;
        values.push_back(std::bit_cast<float>(u));
        values.push_back(-std::bit_cast<float>(u));
      }
    }
  }
  for (float v : values) {
    ASSERT_EQ(PresetE4m3Code(v), F32ToE4m3(v)) << v;
    ASSERT_EQ(PresetE2m1Code(v), F32ToE2m1(v)) << v;
  }
}

TEST(PresetQuantTest, Scales) {
  EXPECT_EQ(PresetFp8Scale(0.0f), 1.0f);
  EXPECT_EQ(PresetFp8Scale(448.0f), 1.0f);
  EXPECT_EQ(PresetFp8Scale(0.05f), 0.05f / 448.0f);
  EXPECT_EQ(PresetMxfp4Scale(0.0f), 1.0f);
  EXPECT_EQ(PresetMxfp4Scale(6.0f), 1.0f);  // floor(log2 6) = 2: 6 / 1 is e2m1's 6
  EXPECT_EQ(PresetMxfp4Scale(4.0f), 1.0f);  // the largest value lands in [4, 8)
  EXPECT_EQ(PresetMxfp4Scale(3.99f), 0.5f);
  EXPECT_EQ(PresetMxfp4Scale(0.04f), 0x1p-7f);     // 0.04 = 1.28 x 2^-5
  EXPECT_EQ(PresetMxfp4Scale(1e-38f), 0x1p-127f);  // clamped
  EXPECT_EQ(PresetMxfp4Scale(3e38f), 0x1p125f);
}

// Row `row` of a preset expert matrix with `cols` inputs, unquantized (as PresetValue).
std::vector<float> UnquantizedRow(uint64_t seed, int layer, int tensor, int expert, int64_t row,
                                  int64_t cols) {
  std::vector<float> v(static_cast<size_t>(cols));
  const uint64_t rs = preset_hash::RowSeed(seed, layer, tensor, expert, row);
  const float a = std::sqrt(3.0f / static_cast<float>(cols));
  for (int64_t c = 0; c < cols; ++c) v[static_cast<size_t>(c)] = preset_hash::Element(rs, c, a);
  return v;
}

// Checks packed matrix `m` against W [rows][cols] = tensor `tensor` of `expert`, quantized by the
// formats' rules here: FP8 per 128 x 128 block, MXFP4 per row and 32 inputs. `packed_row` maps a
// row of W to its row in `m`.
void ExpectQuantized(const PackedMatrix& m, DType dtype, uint64_t seed, int layer, int tensor,
                     int expert, int64_t rows, int64_t cols,
                     const std::function<int64_t(int64_t)>& packed_row) {
  std::vector<std::vector<float>> w;
  for (int64_t r = 0; r < rows; ++r)
    w.push_back(UnquantizedRow(seed, layer, tensor, expert, r, cols));
  ASSERT_EQ(w[0][5], PresetValue(seed, layer, tensor, expert, 0, 5, cols, DType::kF32));
  const int64_t br = dtype == DType::kF8E4M3 ? 128 : 1;
  const int64_t bc = dtype == DType::kF8E4M3 ? 128 : 32;
  int64_t checked = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t r1 = std::min(rows, r0 + br), c1 = std::min(cols, c0 + bc);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r][c]));
      }
      float scale = amax / 448.0f;
      if (dtype == DType::kF4) {
        int e = 0;
        std::frexp(amax, &e);  // amax = f x 2^e, f in [0.5, 1): floor(log2 amax) = e - 1
        scale = std::ldexp(1.0f, e - 1 - 2);
      }
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t n = packed_row(r);
          const float v = w[r][c] / scale;
          const uint8_t code = dtype == DType::kF8E4M3 ? F32ToE4m3(v) : F32ToE2m1(v);
          ASSERT_EQ(m.ScaleAt(n, c), scale) << r << "," << c;
          ASSERT_EQ(m.CodeAt(n, c), code) << r << "," << c;
          const float dq = (dtype == DType::kF8E4M3 ? E4m3ToF32(code) : E2m1ToF32(code)) * scale;
          ASSERT_EQ(m.At(n, c), dq);
          // Half a step of the format at the largest value (MXFP4: 4 to 6, or saturating).
          ASSERT_LE(std::fabs(dq - w[r][c]), (dtype == DType::kF8E4M3 ? 0.0626f : 0.2501f) * amax)
              << "quantization error";
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, rows * cols);
}

// A layer whose matrices span several FP8 blocks both ways, with partial ones (272 = 2 x 128 +
// 16, 144 = 128 + 16) and a shared expert.
ModelSpec MultiBlockSpec() {
  ModelSpec s = SmallSpec(Family::kDeepseekV3);
  s.hidden = 272;
  s.expert_inter = 144;
  s.shared_inter = 160;
  return s;
}

class PresetQuantDTypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(PresetQuantDTypeTest, WeightsAreTheFormatsQuantizationOfThePresetValues) {
  const DType dtype = GetParam();
  const ModelSpec s = MultiBlockSpec();
  for (const auto& v : TestVariants()) {
    SCOPED_TRACE(v.name);
    const CpuKernels& k = *v.kernels;
    PresetOptions o;
    o.seed = 5;
    o.dtype = dtype;
    o.threads = 2;
    auto w = BuildPresetLayer(s, k, o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ(w->dtype, dtype);
    EXPECT_EQ(w->gate.dtype(), DType::kF32);  // the router stays F32
    const int nr = k.nr;
    const int layer = w->layer;
    auto check = [&](const ExpertWeights& ew, int e, int64_t inter) {
      SCOPED_TRACE("expert " + std::to_string(e));
      ASSERT_EQ(ew.w13.dtype(), dtype);
      ASSERT_EQ(ew.w2.dtype(), dtype);
      auto gate_row = [nr](int64_t j) { return (j / nr) * 2 * nr + j % nr; };
      auto up_row = [nr](int64_t j) { return (j / nr) * 2 * nr + nr + j % nr; };
      ExpectQuantized(ew.w13, dtype, o.seed, layer, 1, e, inter, s.hidden, gate_row);
      ExpectQuantized(ew.w13, dtype, o.seed, layer, 2, e, inter, s.hidden, up_row);
      ExpectQuantized(ew.w2, dtype, o.seed, layer, 3, e, s.hidden, inter,
                      [](int64_t n) { return n; });
    };
    check(w->experts[0], 0, s.expert_inter);
    check(w->experts[15], 15, s.expert_inter);
    ASSERT_TRUE(w->shared.has_value());
    check(*w->shared, -1, s.shared_inter);
  }
}

// The fast layer on quantized presets against the reference loop (which reads the dequantized
// weights), for every family; bitwise equal across ISAs and thread counts.
TEST_P(PresetQuantDTypeTest, LayerMatchesTheReferenceEveryFamilyAndIsa) {
  const DType dtype = GetParam();
  std::vector<ModelSpec> specs;
  for (Family f : AllFamilies()) specs.push_back(SmallSpec(f));
  specs.push_back(MultiBlockSpec());
  for (const ModelSpec& s : specs) {
    SCOPED_TRACE(FamilyName(s.family) + std::string(" hidden ") + std::to_string(s.hidden));
    const int64_t tokens = 29;
    const auto x = RandomRows(tokens, s.hidden, 4);
    std::vector<float> first;
    for (const auto& v : TestVariants()) {
      SCOPED_TRACE(v.name);
      const CpuKernels& k = *v.kernels;
      PresetOptions o;
      o.seed = 9;
      o.dtype = dtype;
      auto built = BuildPresetLayer(s, k, o);
      ASSERT_TRUE(built.ok()) << built.status().ToString();
      auto w = std::make_shared<const MoeLayerWeights>(std::move(built).value());
      std::vector<float> ref(x.size());
      ReferenceForward(*w, x.data(), tokens, ref.data());
      for (int threads : {1, 3}) {
        ThreadPool pool(threads);
        MoeLayer layer(w, k, &pool);
        std::vector<float> out(x.size());
        ASSERT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
        EXPECT_LE(::moerun::testing::RelativeError(out, ref), 1e-5);
        if (first.empty()) first = out;
        EXPECT_EQ(std::memcmp(first.data(), out.data(), out.size() * 4), 0)
            << threads << " threads";
      }
    }
  }
}

TEST_P(PresetQuantDTypeTest, SameBytesEveryBuildAndForARankWithSomeExperts) {
  const DType dtype = GetParam();
  const ModelSpec s = MultiBlockSpec();
  const CpuKernels& k = KernelsFor(BestIsa());
  PresetOptions o;
  o.dtype = dtype;
  o.threads = 3;
  auto a = BuildPresetLayer(s, k, o);
  o.threads = 1;
  auto b = BuildPresetLayer(s, k, o);
  o.load_expert.assign(16, false);
  o.load_expert[2] = o.load_expert[11] = true;
  auto part = BuildPresetLayer(s, k, o);
  o.load_expert.clear();
  o.seed = 2;
  auto other = BuildPresetLayer(s, k, o);
  ASSERT_TRUE(a.ok() && b.ok() && part.ok() && other.ok());
  auto same = [](const ExpertWeights& x, const ExpertWeights& y) {
    return x.w13.bytes() == y.w13.bytes() && x.w2.bytes() == y.w2.bytes() &&
           std::memcmp(x.w13.panel(0), y.w13.panel(0), x.w13.bytes()) == 0 &&
           std::memcmp(x.w2.panel(0), y.w2.panel(0), x.w2.bytes()) == 0;
  };
  for (int e = 0; e < 16; ++e) {
    EXPECT_TRUE(same(a->experts[e], b->experts[e])) << e;
    EXPECT_FALSE(same(a->experts[e], other->experts[e])) << e;
    if (e == 2 || e == 11) {
      EXPECT_TRUE(same(a->experts[e], part->experts[e])) << e;
    } else {
      EXPECT_TRUE(part->experts[e].w13.empty()) << e;
    }
  }
  EXPECT_TRUE(same(*a->shared, *b->shared));
  EXPECT_TRUE(same(*a->shared, *part->shared));
}

// Resident bytes are the formats' own: FP8 1 byte a weight, MXFP4 half a byte and a scale byte
// per 32, plus little (headers, padding), on every kernel variant's panel width.
TEST_P(PresetQuantDTypeTest, ResidentBytesAreTheQuantizedBytes) {
  const DType dtype = GetParam();
  ModelSpec s = SmallSpec(Family::kMixtral);
  s.hidden = 1024;
  s.expert_inter = 512;
  s.num_experts = s.gate.num_experts = 2;
  s.top_k = s.gate.top_k = 1;
  const double want = dtype == DType::kF8E4M3 ? 1.0 : 0.5 + 1.0 / 32;
  for (const auto& v : TestVariants()) {
    SCOPED_TRACE(v.name);
    PresetOptions o;
    o.dtype = dtype;
    auto w = BuildPresetLayer(s, *v.kernels, o);
    ASSERT_TRUE(w.ok());
    const double per_weight = static_cast<double>(w->ExpertBytes()) / (2.0 * 3 * 1024 * 512);
    EXPECT_GE(per_weight, want);
    EXPECT_LE(per_weight, 1.1 * want);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, PresetQuantDTypeTest,
                         ::testing::Values(DType::kF8E4M3, DType::kF4),
                         [](const auto& tp) { return tp.param == DType::kF4 ? "MXFP4" : "FP8"; });

// The default budget (4 GB of expert weights) counts the bytes a type holds, so the narrower
// types keep more of a big model's experts.
TEST(PresetQuantTest, BudgetCountsTheQuantizedBytes) {
  std::string note;
  PresetOptions o;
  int last = 0;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kF4}) {
    SCOPED_TRACE(DTypeName(t));
    o.dtype = t;
    auto d = PresetSpec("deepseek-v3", o, &note);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_GT(d->num_experts, last);
    EXPECT_EQ(d->num_experts % 8, 0);
    const double per = t == DType::kF32 ? 4 : t == DType::kBF16 ? 2 : t == DType::kF4 ? 0.53125 : 1;
    EXPECT_LE((d->num_experts + 1) * 3.0 * 7168 * 2048 * per, 4.0 * (1 << 30));  // + shared
    EXPECT_NE(note.find(DTypeName(t)), std::string::npos) << note;
    last = d->num_experts;
  }
  EXPECT_GE(last, 160);  // MXFP4
  o.dtype = DType::kI8;
  EXPECT_FALSE(PresetSpec("deepseek-v3", o, &note).ok());
}

}  // namespace
}  // namespace moerun
