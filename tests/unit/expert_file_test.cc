// Loading one expert's new weights from a .safetensors file: the expert runs in a GroupedFfn next
// to the layer's other experts bitwise as if it had come from a checkpoint holding the same
// tensors, and every bad file, layer, expert or dtype gives a Status naming the problem.
#include "runtime/model/expert_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "experts/cpu/grouped_ffn.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

constexpr int kLayer = 1;  // an MoE layer of every SmallSpec

struct RawTensor {
  std::string dtype;  // safetensors name
  std::vector<int64_t> shape;
  std::string bytes;
};
using Tensors = std::map<std::string, RawTensor>;

RawTensor Make(DType dt, std::vector<int64_t> shape, const std::vector<float>& v) {
  RawTensor t{DTypeName(dt), std::move(shape), {}};
  for (float f : v) {
    if (dt == DType::kF32) {
      t.bytes.append(reinterpret_cast<const char*>(&f), 4);
    } else {
      const uint16_t h = dt == DType::kBF16 ? F32ToBf16(f) : F32ToF16(f);
      t.bytes.append(reinterpret_cast<const char*>(&h), 2);
    }
  }
  return t;
}

void Write(const std::string& path, const Tensors& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype},
                    {"shape", t.shape},
                    {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  WriteFile(path, MakeSafetensors(text, data));
}

// One MoE layer's tensors under the names its family's checkpoints use, values in +-0.1.
Tensors LayerTensors(const ModelSpec& s, DType dt, uint32_t seed) {
  const std::string p = "model.layers." + std::to_string(kLayer) + ".";
  const int64_t h = s.hidden, in = s.expert_inter, n = s.num_experts, sh = s.shared_inter;
  Tensors t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::vector<float> v = RandomRows(1, numel, seed++);
    for (float& x : v) x *= 0.1f;
    t[p + name] = Make(dt, std::move(shape), v);
  };
  auto separate = [&](const std::string& base, const char* g, const char* u, const char* d,
                      int64_t inter) {
    add(base + g, {inter, h});
    add(base + u, {inter, h});
    add(base + d, {h, inter});
  };
  switch (s.family) {
    case Family::kMixtral:
      add("block_sparse_moe.gate.weight", {n, h});
      for (int e = 0; e < n; ++e) {
        separate("block_sparse_moe.experts." + std::to_string(e), ".w1.weight", ".w3.weight",
                 ".w2.weight", in);
      }
      break;
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kDeepseekV3:
      add("mlp.gate.weight", {n, h});
      for (int e = 0; e < n; ++e) {
        separate("mlp.experts." + std::to_string(e), ".gate_proj.weight", ".up_proj.weight",
                 ".down_proj.weight", in);
      }
      if (s.family == Family::kQwen2Moe) {
        separate("mlp.shared_expert", ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight",
                 sh);
        add("mlp.shared_expert_gate.weight", {1, h});
      }
      if (s.family == Family::kDeepseekV3) {
        separate("mlp.shared_experts", ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight",
                 sh);
        add("mlp.gate.e_score_correction_bias", {n});
      }
      break;
    case Family::kGptOss:
      add("mlp.router.weight", {n, h});
      add("mlp.router.bias", {n});
      add("mlp.experts.gate_up_proj", {n, h, 2 * in});
      add("mlp.experts.gate_up_proj_bias", {n, 2 * in});
      add("mlp.experts.down_proj", {n, in, h});
      add("mlp.experts.down_proj_bias", {n, h});
      break;
    case Family::kStep3p5:
      add("moe.gate.weight", {n, h});
      add("moe.router_bias", {n});
      add("moe.gate_proj.weight", {n, in, h});
      add("moe.up_proj.weight", {n, in, h});
      add("moe.down_proj.weight", {n, h, in});
      separate("share_expert", ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight", sh);
      break;
  }
  return t;
}

// The tensors an expert file for expert `e` holds: its own, or the stacked ones of all experts.
Tensors ExpertTensors(const Tensors& layer, int e) {
  Tensors out;
  for (const auto& [name, t] : layer) {
    const bool own = name.find(".experts." + std::to_string(e) + ".") != std::string::npos;
    bool stacked = false;
    for (const char* s : {".mlp.experts.gate_up_proj", ".mlp.experts.down_proj", ".moe.gate_proj",
                          ".moe.up_proj", ".moe.down_proj"}) {
      stacked = stacked || name.find(s) != std::string::npos;
    }
    if (own || stacked) out[name] = t;
  }
  return out;
}

// y for `rows` rows of x through the groups (each expert in turn over rows_each rows), bit-exact
// per row (GroupedFfn is batch-invariant).
std::vector<float> RunFfn(const ModelSpec& s, const CpuKernels& k,
                          const std::vector<const ExpertWeights*>& experts,
                          const std::vector<float>& x, int64_t rows_each) {
  ThreadPool pool(2);
  GroupedFfn ffn(k, &pool);
  std::vector<ExpertGroup> groups;
  for (size_t g = 0; g < experts.size(); ++g) {
    groups.push_back(ExpertGroup{experts[g], s.RoutedAct(kLayer),
                                 static_cast<int64_t>(g) * rows_each, rows_each});
  }
  const int64_t rows = rows_each * static_cast<int64_t>(experts.size());
  std::vector<int32_t> row_token(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) row_token[static_cast<size_t>(r)] = static_cast<int32_t>(r);
  const int64_t ldy = ffn.PaddedHidden(s.hidden);
  std::vector<float> y(static_cast<size_t>(rows * ldy), -1.0f);
  ffn.Run(groups, x.data(), s.hidden, row_token.data(), y.data(), ldy);
  return y;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

Result<MoeLayerWeights> LoadFull(const std::string& path, const ModelSpec& s, const CpuKernels& k,
                                 std::optional<DType> hold_as = std::nullopt) {
  auto ck = Checkpoint::Open(path);
  if (!ck.ok()) return ck.status();
  LoadOptions o;
  o.layer = kLayer;
  o.hold_as = hold_as;
  return LoadLayer(**ck, s, k, o);
}

// For every family and weight dtype: expert E from its own file, next to a served expert 0, gives
// bitwise what the same expert gives when loaded from a checkpoint holding the same tensors.
TEST(ExpertFileTest, RunsBitwiseLikeTheCheckpointsExpert) {
  const CpuKernels& k = KernelsFor(BestIsa());
  for (Family f : AllFamilies()) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(std::string(FamilyName(f)) + " " + DTypeName(dt));
      TempDir tmp;
      const ModelSpec s = SmallSpec(f);
      const int e = s.num_experts - 2;
      const Tensors layer = LayerTensors(s, dt, 11);
      Write(tmp.File("model.safetensors"), layer);
      Write(tmp.File("expert.safetensors"), ExpertTensors(layer, e));
      auto full = LoadFull(tmp.File("model.safetensors"), s, k);
      ASSERT_TRUE(full.ok()) << full.status().ToString();
      ASSERT_EQ(full->dtype, dt);
      auto got = LoadExpertFile(tmp.File("expert.safetensors"), s, kLayer, e, full->dtype, k);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(got->w13.dtype(), dt);
      EXPECT_EQ(got->bytes(), full->experts[static_cast<size_t>(e)].bytes());
      const auto x = RandomRows(2 * 5, s.hidden, 3);
      const auto want =
          RunFfn(s, k, {&full->experts[0], &full->experts[static_cast<size_t>(e)]}, x, 5);
      const auto have = RunFfn(s, k, {&full->experts[0], &*got}, x, 5);
      EXPECT_TRUE(SameBits(have, want));
      // A different expert computes something else (the comparison can fail).
      const auto other = RunFfn(s, k, {&full->experts[0], &full->experts[1]}, x, 5);
      EXPECT_FALSE(SameBits(other, want));
    }
  }
}

// A 16-bit file serves in an F32 layer (widening is exact); an F32 file whose values a 16-bit
// layer cannot hold exactly is refused, naming the tensor; one whose values it can is accepted.
TEST(ExpertFileTest, HeldDtypeFollowsTheServingLayer) {
  const CpuKernels& k = KernelsFor(BestIsa());
  const ModelSpec s = SmallSpec(Family::kQwen3Moe);
  TempDir tmp;
  const Tensors bf16 = LayerTensors(s, DType::kBF16, 5);
  Write(tmp.File("bf16.safetensors"), ExpertTensors(bf16, 4));
  auto wide = LoadExpertFile(tmp.File("bf16.safetensors"), s, kLayer, 4, DType::kF32, k);
  ASSERT_TRUE(wide.ok()) << wide.status().ToString();
  EXPECT_EQ(wide->w13.dtype(), DType::kF32);
  EXPECT_EQ(wide->w2.dtype(), DType::kF32);
  // The same values stored as F32: bitwise the same expert, held in BF16 or in F32.
  Tensors as_f32;
  for (const auto& [name, t] : ExpertTensors(bf16, 4)) {
    std::vector<float> v;
    for (size_t i = 0; i < t.bytes.size(); i += 2) {
      uint16_t u;
      std::memcpy(&u, t.bytes.data() + i, 2);
      v.push_back(Bf16ToF32(u));
    }
    as_f32[name] = Make(DType::kF32, t.shape, v);
  }
  Write(tmp.File("exact_f32.safetensors"), as_f32);
  auto narrow = LoadExpertFile(tmp.File("exact_f32.safetensors"), s, kLayer, 4, DType::kBF16, k);
  ASSERT_TRUE(narrow.ok()) << narrow.status().ToString();
  auto native = LoadExpertFile(tmp.File("bf16.safetensors"), s, kLayer, 4, DType::kBF16, k);
  ASSERT_TRUE(native.ok());
  const auto x = RandomRows(4, s.hidden, 9);
  EXPECT_TRUE(SameBits(RunFfn(s, k, {&*narrow}, x, 4), RunFfn(s, k, {&*native}, x, 4)));

  Write(tmp.File("f32.safetensors"), ExpertTensors(LayerTensors(s, DType::kF32, 5), 4));
  auto refused = LoadExpertFile(tmp.File("f32.safetensors"), s, kLayer, 4, DType::kBF16, k);
  ASSERT_FALSE(refused.ok());
  const std::string& m = refused.status().message();
  EXPECT_NE(m.find("'model.layers.1.mlp.experts.4.gate_proj.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("BF16 cannot hold exactly"), std::string::npos) << m;
  EXPECT_NE(m.find(tmp.File("f32.safetensors")), std::string::npos) << m;

  auto bad = LoadExpertFile(tmp.File("bf16.safetensors"), s, kLayer, 4, DType::kI32, k);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cannot hold expert weights as I32"), std::string::npos)
      << bad.status().message();
  // A layer of FP8 experts takes updates only in FP8.
  auto fp8 = LoadExpertFile(tmp.File("bf16.safetensors"), s, kLayer, 4, DType::kF8E4M3, k);
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.status().message().find("the experts are held as fp8 but"), std::string::npos)
      << fp8.status().message();
}

// A checkpoint loaded experts-only needs no router, biases or shared expert.
TEST(ExpertFileTest, ExpertsOnlyLoadsNothingElse) {
  const CpuKernels& k = KernelsFor(BestIsa());
  for (Family f : AllFamilies()) {
    SCOPED_TRACE(FamilyName(f));
    const ModelSpec s = SmallSpec(f);
    TempDir tmp;
    Write(tmp.File("e.safetensors"), ExpertTensors(LayerTensors(s, DType::kBF16, 1), 3));
    auto ck = Checkpoint::Open(tmp.File("e.safetensors"));
    ASSERT_TRUE(ck.ok());
    LoadOptions o;
    o.layer = kLayer;
    o.experts_only = true;
    o.load_expert.assign(static_cast<size_t>(s.num_experts), false);
    o.load_expert[3] = true;
    auto w = LoadLayer(**ck, s, k, o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_TRUE(w->gate.empty());
    EXPECT_TRUE(w->gate_bias.empty());
    EXPECT_TRUE(w->selection_bias.empty());
    EXPECT_FALSE(w->shared.has_value());
    EXPECT_EQ(w->dtype, DType::kBF16);
    EXPECT_FALSE(w->experts[3].w13.empty());
    EXPECT_TRUE(w->experts[2].w13.empty());
    // Without experts_only the router is required.
    o.experts_only = false;
    auto full = LoadLayer(**ck, s, k, o);
    ASSERT_FALSE(full.ok());
    EXPECT_EQ(full.status().code(), StatusCode::kNotFound);
  }
}

void ExpectError(const Result<ExpertWeights>& r, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(r.ok());
  for (const auto& p : parts) {
    EXPECT_NE(r.status().message().find(p), std::string::npos)
        << "'" << p << "' not in: " << r.status().message();
  }
}

TEST(ExpertFileTest, ErrorsNameTheProblem) {
  const CpuKernels& k = KernelsFor(BestIsa());
  const ModelSpec s = SmallSpec(Family::kQwen3Moe);
  TempDir tmp;
  const std::string good = tmp.File("e5.safetensors");
  const Tensors five = ExpertTensors(LayerTensors(s, DType::kBF16, 2), 5);
  Write(good, five);
  const DType bf = DType::kBF16;

  ExpectError(LoadExpertFile(tmp.File("absent.safetensors"), s, kLayer, 5, bf, k),
              {tmp.File("absent.safetensors"), "no such file", "expert 5 of layer 1"});
  WriteFile(tmp.File("text.safetensors"), "these are not the weights you are looking for\n");
  ExpectError(LoadExpertFile(tmp.File("text.safetensors"), s, kLayer, 5, bf, k),
              {tmp.File("text.safetensors"), "not a valid .safetensors file"});
  WriteFile(tmp.File("short.safetensors"), "abc");
  ExpectError(LoadExpertFile(tmp.File("short.safetensors"), s, kLayer, 5, bf, k),
              {"not a valid .safetensors file"});
  ExpectError(LoadExpertFile(tmp.path(), s, kLayer, 5, bf, k), {tmp.path(), "not a file"});

  // The file holds expert 5; asked for expert 6, or for layer 0.
  ExpectError(LoadExpertFile(good, s, kLayer, 6, bf, k),
              {"'model.layers.1.mlp.experts.6.gate_proj.weight' is missing", "expert 6 of layer 1",
               good, "the file holds 3 tensors"});
  ExpectError(LoadExpertFile(good, s, 0, 5, bf, k),
              {"'model.layers.0.mlp.experts.5.gate_proj.weight' is missing"});

  Tensors wrong = five;
  const std::string up = "model.layers.1.mlp.experts.5.up_proj.weight";
  wrong[up] = Make(bf, {s.expert_inter, s.hidden + 1},
                   std::vector<float>(static_cast<size_t>(s.expert_inter * (s.hidden + 1))));
  Write(tmp.File("shape.safetensors"), wrong);
  ExpectError(LoadExpertFile(tmp.File("shape.safetensors"), s, kLayer, 5, bf, k),
              {"'" + up + "' has shape [40, 97]", "[40, 96]"});

  Tensors fp8 = five;
  const std::string down = "model.layers.1.mlp.experts.5.down_proj.weight";
  fp8[down] = RawTensor{"F8_E4M3",
                        {s.hidden, s.expert_inter},
                        std::string(static_cast<size_t>(s.hidden * s.expert_inter), '\0')};
  Write(tmp.File("fp8.safetensors"), fp8);
  ExpectError(LoadExpertFile(tmp.File("fp8.safetensors"), s, kLayer, 5, bf, k),
              {"'" + down + "' is F8_E4M3 but its block scales", "_scale_inv' are missing"});
  Tensors i32 = five;
  i32[down] = RawTensor{"I32",
                        {s.hidden, s.expert_inter},
                        std::string(static_cast<size_t>(s.hidden * s.expert_inter * 4), '\0')};
  Write(tmp.File("i32.safetensors"), i32);
  ExpectError(LoadExpertFile(tmp.File("i32.safetensors"), s, kLayer, 5, bf, k),
              {"'" + down + "' has dtype I32"});

  ExpectError(LoadExpertFile(good, s, kLayer, 12, bf, k), {"expert 12 is out of range", "0..11"});
  ExpectError(LoadExpertFile(good, s, kLayer, -1, bf, k), {"expert -1 is out of range"});
  ExpectError(LoadExpertFile(good, s, 2, 5, bf, k), {"beyond the model's 2 layers"});
  ExpectError(LoadExpertFile(good, s, -1, 5, bf, k), {"a layer must be given"});
  const ModelSpec step = SmallSpec(Family::kStep3p5);  // layer 0 is dense
  ExpectError(LoadExpertFile(good, step, 0, 5, bf, k), {"layer 0 is a dense layer"});

  // gpt-oss: a stacked tensor of the wrong expert count; MXFP4 blocks.
  const ModelSpec oss = SmallSpec(Family::kGptOss);
  Tensors stacked = ExpertTensors(LayerTensors(oss, bf, 3), 0);
  const std::string gu = "model.layers.1.mlp.experts.gate_up_proj";
  stacked[gu] =
      Make(bf, {4, oss.hidden, 2 * oss.expert_inter},
           std::vector<float>(static_cast<size_t>(4 * oss.hidden * 2 * oss.expert_inter)));
  Write(tmp.File("oss.safetensors"), stacked);
  ExpectError(LoadExpertFile(tmp.File("oss.safetensors"), oss, kLayer, 2, bf, k),
              {"'" + gu + "' has shape [4, 96, 80]", "[12, 96, 80]"});
  stacked.erase(gu);
  stacked[gu + "_blocks"] = RawTensor{"U8", {1}, std::string(1, '\0')};
  Write(tmp.File("mxfp4.safetensors"), stacked);
  ExpectError(LoadExpertFile(tmp.File("mxfp4.safetensors"), oss, kLayer, 2, bf, k),
              {"'" + gu + "_blocks' is MXFP4"});
}

// tests/serving/make_expert_file.py writes files that load, deterministically, in +-scale.
TEST(ExpertFileTest, PythonWriterMakesLoadableFiles) {
  const std::string python = "/usr/bin/python3";
  if (!std::filesystem::exists(python)) GTEST_SKIP() << "no " << python;
  const std::string script = DataDir() + "/../serving/make_expert_file.py";
  const CpuKernels& k = KernelsFor(BestIsa());
  TempDir tmp;
  auto make = [&](const std::string& family, const std::string& dtype, int seed,
                  const std::string& out) {
    const ProcessResult r = RunProcess(
        {python, script, "--family", family, "--layer", "1", "--expert", "3", "--hidden", "64",
         "--inter", "24", "--dtype", dtype, "--seed", std::to_string(seed), "--scale", "0.5", out});
    EXPECT_EQ(r.exit_code, 0) << r.output;
  };
  const std::pair<const char*, Family> families[] = {{"qwen3", Family::kQwen3Moe},
                                                     {"qwen2_moe", Family::kQwen2Moe},
                                                     {"mixtral", Family::kMixtral},
                                                     {"deepseek_v3", Family::kDeepseekV3}};
  auto spec = [](Family family) {
    ModelSpec s = SmallSpec(family);
    s.hidden = 64;
    s.expert_inter = 24;
    if (s.shared_inter > 0) s.shared_inter = 24;
    return s;
  };
  for (const auto& [name, family] : families) {
    SCOPED_TRACE(name);
    const ModelSpec s = spec(family);
    const std::string a = tmp.File(std::string(name) + ".safetensors");
    make(name, "bf16", 7, a);
    auto w = LoadExpertFile(a, s, kLayer, 3, DType::kBF16, k);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    float lo = 0, hi = 0;
    for (int64_t n = 0; n < w->w2.n(); ++n) {
      for (int64_t j = 0; j < w->w2.k(); ++j) {
        lo = std::min(lo, w->w2.At(n, j));
        hi = std::max(hi, w->w2.At(n, j));
      }
    }
    EXPECT_LT(lo, -0.25f);
    EXPECT_GT(hi, 0.25f);
    EXPECT_LE(hi, 0.5f);
    EXPECT_GE(lo, -0.5f);
    EXPECT_FALSE(LoadExpertFile(a, s, kLayer, 4, DType::kBF16, k).ok());
  }
  // Deterministic in the seed; F32 files serve in F32 layers and are refused by BF16 ones.
  const ModelSpec s = spec(Family::kQwen3Moe);
  const std::string again = tmp.File("again.safetensors"), other = tmp.File("other.safetensors");
  make("qwen3", "bf16", 7, again);
  make("qwen3", "bf16", 8, other);
  EXPECT_EQ(ReadFile(again), ReadFile(tmp.File("qwen3.safetensors")));
  EXPECT_NE(ReadFile(other), ReadFile(again));
  const std::string f32 = tmp.File("f32.safetensors");
  make("qwen3", "f32", 7, f32);
  auto w = LoadExpertFile(f32, s, kLayer, 3, DType::kF32, k);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->w13.dtype(), DType::kF32);
  EXPECT_FALSE(LoadExpertFile(f32, s, kLayer, 3, DType::kBF16, k).ok());
  const ProcessResult bad = RunProcess({python, script, "--family", "llama", tmp.File("x")});
  EXPECT_NE(bad.exit_code, 0);
}

// Update files in the checkpoint's own quantized format: an FP8 or MXFP4 checkpoint's file, read
// for one expert, packs to the same bytes as that expert in the serving layer; a layer holding
// FP8 refuses a BF16 file, and a BF16 layer refuses a quantized one.
TEST(ExpertFileTest, QuantizedUpdateFilesInTheCheckpointsFormat) {
  const CpuKernels& kern = KernelsFor(BestIsa());
  for (const char* name : {"deepseek_v3_fp8", "gpt_oss_mxfp4"}) {
    SCOPED_TRACE(name);
    const auto layer = LoadFixture(name, kern);
    const std::string file = FixtureDir(name) + "/model.safetensors";
    auto e = LoadExpertFile(file, layer->spec, 0, 3, layer->dtype, kern);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const ExpertWeights& want = layer->experts[3];
    ASSERT_EQ(e->w13.bytes(), want.w13.bytes());
    EXPECT_EQ(std::memcmp(e->w13.panel(0), want.w13.panel(0), want.w13.bytes()), 0);
    EXPECT_EQ(std::memcmp(e->w2.panel(0), want.w2.panel(0), want.w2.bytes()), 0);
    auto bf16 = LoadExpertFile(file, layer->spec, 0, 3, DType::kBF16, kern);
    ASSERT_FALSE(bf16.ok());
    EXPECT_NE(bf16.status().message().find("the experts are held as bf16 but"), std::string::npos)
        << bf16.status().ToString();
  }
  const auto fp8 = LoadFixture("deepseek_v3_fp8", kern);
  // The same expert in BF16 (right names and shapes, wrong format for this layer).
  TempDir tmp;
  const std::string base = "model.layers.0.mlp.experts.3.";
  const int64_t h = fp8->spec.hidden, i = fp8->spec.expert_inter;
  const std::vector<float> zeros(static_cast<size_t>(h * i), 0.0f);
  Write(tmp.File("bf16.safetensors"),
        {{base + "gate_proj.weight", Make(DType::kBF16, {i, h}, zeros)},
         {base + "up_proj.weight", Make(DType::kBF16, {i, h}, zeros)},
         {base + "down_proj.weight", Make(DType::kBF16, {h, i}, zeros)}});
  auto plain = LoadExpertFile(tmp.File("bf16.safetensors"), fp8->spec, 0, 3, DType::kF8E4M3, kern);
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.status().message().find("the experts are held as fp8"), std::string::npos)
      << plain.status().ToString();
}

}  // namespace
}  // namespace moerun
