// A rank's device memory by role (runtime/layer/cuda/device_plan.h PlanRankMemory): what
// --plan-memory prints and what a rank's CUDA context allocates. Runs without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_plan.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace cuda_plan;

constexpr size_t kGB = 1000u * 1000u * 1000u;

// DeepSeek-V3's shape: 256 routed experts of inter 2048, top-8, hidden 7168, one shared expert
// (on the router in expert parallelism), 58 MoE layers; 8 expert ranks of 32 slots a layer.
RankMemoryInput DeepSeekExpertRank(int layers, bool tensor_cores) {
  RankMemoryInput in;
  in.role = DeviceRole::kExpertRank;
  in.hidden = 7168;
  in.expert_inter = 2048;
  in.top_k = 8;
  in.experts = 256;
  in.gate_rows = 256;
  in.format = WeightFormat::kFp8;
  in.tensor_cores = tensor_cores;
  in.max_tokens = 8192;
  for (int l = 0; l < layers; ++l) in.layers.push_back(HostedLayer{3 + l, 32, 32});
  return in;
}

// Every region is 256-byte aligned and inside the arena; regions of their own never overlap;
// an alias lies inside the region it reuses.
void ExpectWellFormed(const ArenaPlan& a) {
  std::set<std::string> names;
  for (const auto& r : a.regions) {
    EXPECT_TRUE(names.insert(r.name).second) << r.name;
    EXPECT_EQ(r.offset % 256, 0u) << r.name;
    EXPECT_LE(r.offset + r.bytes, a.total) << r.name;
    if (!r.alias_of.empty()) {
      const ArenaPlan::Region* of = a.Find(r.alias_of);
      ASSERT_NE(of, nullptr) << r.name;
      EXPECT_EQ(r.offset, of->offset) << r.name;
      EXPECT_LE(r.bytes, of->bytes) << r.name;
      continue;
    }
    for (const auto& o : a.regions) {
      if (&o == &r || !o.alias_of.empty() || r.bytes == 0 || o.bytes == 0) continue;
      const bool apart = r.offset + r.bytes <= o.offset || o.offset + o.bytes <= r.offset;
      EXPECT_TRUE(apart) << r.name << " overlaps " << o.name;
    }
  }
}

size_t RegionBytes(const RankMemoryPlan& p, const std::string& name) {
  const ArenaPlan::Region* r = p.arena.Find(name);
  return r == nullptr ? 0 : r->bytes;
}

TEST(DeviceMemoryPlanTest, CpuRouterHoldsNothingOnTheDevice) {
  RankMemoryInput in;
  in.role = DeviceRole::kCpuRouter;
  const auto p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->device_total(), 0u);
  EXPECT_EQ(p->pinned_host, 0u);
  EXPECT_NE(DescribeRankMemory(*p).find("nothing on the device"), std::string::npos);
}

TEST(DeviceMemoryPlanTest, DeepSeekExpertRankStaysUnderFourGigabytesWhateverTheLayers) {
  for (bool tc : {true, false}) {
    const auto all = PlanRankMemory(DeepSeekExpertRank(58, tc));
    const auto one = PlanRankMemory(DeepSeekExpertRank(1, tc));
    ASSERT_TRUE(all.ok() && one.ok());
    // One arena for every layer: the non-weight bytes do not grow with the layers.
    EXPECT_EQ(all->non_weight_bytes(), one->non_weight_bytes());
    EXPECT_LE(all->non_weight_bytes(), 4 * kGB) << (tc ? "tensor cores" : "exact");
    // 8192 tokens x min(top_k 8, 32 slots) rows.
    EXPECT_EQ(all->max_rows, 8192 * 8);
    EXPECT_EQ(all->max_groups, 32);
    // Weights: 58 layers x 32 experts of FP8 codes and their scales.
    const ExpertBytes e = DeviceExpertBytes(WeightFormat::kFp8, 7168, 2048);
    EXPECT_EQ(all->Weight("expert weights"), 58u * 32u * (e.w13 + e.w2));
    EXPECT_EQ(all->Weight("expert scales"), 58u * 32u * (e.s13 + e.s2));
    EXPECT_EQ(all->device_total(), all->weight_bytes() + all->non_weight_bytes());
    // Nothing of the router's.
    for (const char* r : {"x", "out", "logits", "ids", "weights", "slot_row", "row_token"}) {
      EXPECT_EQ(all->arena.Find(r), nullptr) << r;
    }
    EXPECT_EQ(all->Weight("gate"), 0u);
    ExpectWellFormed(all->arena);
  }
}

TEST(DeviceMemoryPlanTest, ExpertRankRegionsAndAliases) {
  const size_t rows = 8192 * 8, h = 7168;
  // Tensor cores: f32 receive -> 16-bit rows; y reuses the f32 receive region.
  const auto tc = PlanRankMemory(DeepSeekExpertRank(2, true));
  ASSERT_TRUE(tc.ok());
  EXPECT_EQ(RegionBytes(*tc, "receive"), rows * h * 4);
  EXPECT_EQ(RegionBytes(*tc, "rows"), rows * h * 2);
  EXPECT_EQ(RegionBytes(*tc, "hidden_act"), rows * 2048 * 2);
  EXPECT_EQ(tc->arena.Find("y")->alias_of, "receive");
  EXPECT_EQ(tc->arena.Find("y")->bytes, rows * h * 4);
  EXPECT_TRUE(tc->arena.Find("rows")->alias_of.empty());  // GEMM1 reads it: never y
  EXPECT_EQ(tc->act_bytes, 2);
  // Exact: GEMM1 reads the f32 rows as they came, y reuses them (GEMM2 runs after GEMM1).
  const auto ex = PlanRankMemory(DeepSeekExpertRank(2, false));
  ASSERT_TRUE(ex.ok());
  EXPECT_EQ(ex->arena.Find("receive"), nullptr);
  EXPECT_EQ(RegionBytes(*ex, "rows"), rows * h * 4);
  EXPECT_EQ(ex->arena.Find("y")->alias_of, "rows");
  EXPECT_EQ(RegionBytes(*ex, "hidden_act"), rows * 2048 * 4);
  // The hidden activations never share memory with what GEMM1 reads or GEMM2 writes.
  for (const auto* p : {&*tc, &*ex}) {
    const auto* act = p->arena.Find("hidden_act");
    const auto* y = p->arena.Find("y");
    EXPECT_TRUE(act->offset >= y->offset + y->bytes || y->offset >= act->offset + act->bytes);
  }
  // Aliases are counted once: the arena is the sum of its own regions (with alignment).
  size_t own = 0;
  for (const auto& r : tc->arena.regions)
    own += r.alias_of.empty() ? (r.bytes + 255) / 256 * 256 : 0;
  EXPECT_EQ((tc->arena.total + 255) / 256 * 256, own);
  // Pinned host: the rank's two receive and two send buffers per router, and the tables.
  EXPECT_EQ(tc->io_buffer_bytes, rows * h * 4);
  EXPECT_GE(tc->pinned_host, 4 * rows * h * 4);
}

TEST(DeviceMemoryPlanTest, RowsPerTokenAreBoundedByTheSlots) {
  RankMemoryInput in = DeepSeekExpertRank(1, true);
  in.max_tokens = 100;
  in.layers = {HostedLayer{3, 3, 3}, HostedLayer{4, 5, 4}, HostedLayer{5, 0, 0}};
  auto p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->max_rows, 100 * 5);  // the layer with 5 slots: at most 5 rows a token
  EXPECT_EQ(p->max_groups, 5);
  EXPECT_EQ(p->Weight("expert weights"),
            7u * (DeviceExpertBytes(WeightFormat::kFp8, 7168, 2048).w13 +
                  DeviceExpertBytes(WeightFormat::kFp8, 7168, 2048).w2));
  in.layers = {HostedLayer{3, 40, 40}};
  p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->max_rows, 100 * 8);  // top_k bounds it
  // Twice the routers: twice the pinned io buffers, the same device bytes.
  in.routers = 2;
  auto two = PlanRankMemory(in);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->device_total(), p->device_total());
  EXPECT_EQ(two->pinned_host - p->pinned_host, 4 * p->io_buffer_bytes);
}

TEST(DeviceMemoryPlanTest, TheExpertCacheBudgetBoundsTheWeights) {
  RankMemoryInput in = DeepSeekExpertRank(58, true);
  in.expert_cache_bytes = size_t{20} << 30;
  const auto p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->weight_bytes(), size_t{20} << 30);
  EXPECT_EQ(p->Weight("expert cache"), size_t{20} << 30);
  in.expert_cache_bytes = size_t{1} << 50;  // larger than every hosted expert: all resident
  const auto q = PlanRankMemory(in);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->Weight("expert cache"), 0u);
  EXPECT_GT(q->Weight("expert weights"), 0u);
}

TEST(DeviceMemoryPlanTest, PlainWeightsAndBiases) {
  RankMemoryInput in;
  in.role = DeviceRole::kExpertRank;
  in.hidden = 64;
  in.expert_inter = 40;  // padded to 64
  in.top_k = 2;
  in.experts = 4;
  in.gate_rows = 4;
  in.expert_bias = true;
  in.format = WeightFormat::kBF16;
  in.tensor_cores = true;
  in.max_tokens = 16;
  in.layers = {HostedLayer{0, 2, 2}};
  const auto p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->Weight("expert weights"), 2u * (2 * 64 * 64 + 64 * 64) * 2);
  EXPECT_EQ(p->Weight("expert scales"), 0u);
  EXPECT_EQ(p->Weight("expert biases"), 2u * (2 * 64 + 64) * 4);
  EXPECT_EQ(p->act_stride, 64);
  EXPECT_EQ(RegionBytes(*p, "hidden_act"), 16u * 2 * 64 * 2);
}

TEST(DeviceMemoryPlanTest, WholeLayerHoldsTheRouterAndEveryExpert) {
  RankMemoryInput in;
  in.role = DeviceRole::kWholeLayer;
  in.hidden = 7168;
  in.expert_inter = 2048;
  in.shared_inter = 2048;
  in.top_k = 8;
  in.experts = 256;
  in.gate_rows = 256;
  in.selection_bias = true;
  in.format = WeightFormat::kBF16;
  in.tensor_cores = true;
  in.max_tokens = 8192;
  in.graph_max_tokens = 256;
  in.layers = {HostedLayer{3, 256, 256}};
  const auto p = PlanRankMemory(in);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->Weight("gate"), 256u * 7168 * 4);
  EXPECT_EQ(p->Weight("router biases"), 256u * 4);
  EXPECT_EQ(p->Weight("shared expert"), DeviceExpertBytes(WeightFormat::kBF16, 7168, 2048).total());
  for (const char* r : {"x", "out", "logits", "ids", "weights", "rows", "y", "hidden_act", "groups",
                        "run_groups", "present", "flags"}) {
    EXPECT_NE(p->arena.Find(r), nullptr) << r;
  }
  EXPECT_EQ(p->max_rows, 8192 * 9);  // top-8 plus the shared expert's row
  EXPECT_EQ(p->graph_buckets, 9);    // 1, 2, 4, ..., 256
  ExpectWellFormed(p->arena);
  // The whole-layer arena is the layer arena plus the group tables.
  LayerShape s;
  s.max_tokens = 8192;
  s.hidden = 7168;
  s.experts = 256;
  s.top_k = 8;
  s.gate_rows = 256;
  s.shared = true;
  s.max_inter_padded = 2048;
  s.act_bytes = 2;
  EXPECT_GT(p->arena.total, PlanLayerArena(s).total);
  EXPECT_LT(p->arena.total, PlanLayerArena(s).total + (1u << 20));
}

TEST(DeviceMemoryPlanTest, BadInputsAreRefused) {
  RankMemoryInput in = DeepSeekExpertRank(1, true);
  in.max_tokens = 0;
  EXPECT_EQ(PlanRankMemory(in).status().code(), StatusCode::kInvalidArgument);
  in = DeepSeekExpertRank(1, true);
  in.layers.clear();
  EXPECT_EQ(PlanRankMemory(in).status().code(), StatusCode::kInvalidArgument);
  in = DeepSeekExpertRank(1, true);
  in.top_k = 300;
  EXPECT_EQ(PlanRankMemory(in).status().code(), StatusCode::kInvalidArgument);
  in = DeepSeekExpertRank(1, true);
  in.layers[0].experts = 33;  // more experts than slots
  EXPECT_EQ(PlanRankMemory(in).status().code(), StatusCode::kInvalidArgument);
  in = DeepSeekExpertRank(2, true);
  in.role = DeviceRole::kWholeLayer;  // one layer only
  EXPECT_EQ(PlanRankMemory(in).status().code(), StatusCode::kInvalidArgument);
}

TEST(DeviceMemoryPlanTest, AliasesMustFitAnExistingRegion) {
  ArenaPlan a;
  a.Add("a", 1000);
  EXPECT_EQ(a.AddAlias("b", "a", 1000), 0);
  EXPECT_EQ(a.AddAlias("c", "a", 1001), -1);
  EXPECT_EQ(a.AddAlias("d", "missing", 1), -1);
  EXPECT_EQ(a.AddAlias("e", "b", 1), -1);  // not an alias of an alias
  EXPECT_EQ(a.total, 1000u);
}

// An expert rank's context from its plan: without a GPU a clear error; with one, an experts-only
// layer in the shared arena (with y over the rows it read) gives the whole layer's bits.
TEST(DeviceMemoryPlanTest, ExpertRankContextGivesTheWholeLayersBits) {
  const auto w = testing::BuildSmall(Family::kDeepseekV3, KernelsFor(Isa::kScalar));
  for (CudaMath math : {CudaMath::kExact, CudaMath::kTensorCore}) {
    CudaLayerOptions o;
    o.math = math;
    o.max_tokens = 32;
    RankMemoryInput in;
    in.role = DeviceRole::kExpertRank;
    in.hidden = w->spec.hidden;
    in.expert_inter = w->spec.expert_inter;
    in.top_k = w->spec.top_k;
    in.experts = w->spec.num_experts;
    in.gate_rows = w->spec.num_experts;
    in.format = *ChooseWeightFormat(w->dtype, math == CudaMath::kTensorCore, o.mma_type);
    in.tensor_cores = math == CudaMath::kTensorCore;
    in.max_tokens = o.max_tokens;
    in.layers = {HostedLayer{w->layer, w->spec.num_experts, w->spec.num_experts}};
    const auto plan = PlanRankMemory(in);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    auto ctx = CudaRankContext::Create(o, *plan);
    if (ProbeCuda().devices.empty()) {
      ASSERT_FALSE(ctx.ok());
      EXPECT_NE(ctx.status().message().find("cuda"), std::string::npos) << ctx.status().ToString();
      continue;
    }
    ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
    auto experts = CudaMoeLayer::Upload(*w, *ctx);
    auto whole = CudaMoeLayer::Upload(*w, o);
    ASSERT_TRUE(experts.ok()) << experts.status().ToString();
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    const std::vector<int32_t> ids = {3, 0, 9};
    const std::vector<int64_t> rows = {5, 1, 40};
    const int64_t total = 46, h = w->spec.hidden;
    const auto x = testing::RandomRows(total, h, 4);
    std::vector<float> a(static_cast<size_t>(total * h)), b(a.size());
    ASSERT_TRUE((*experts)->RunExperts(x.data(), ids, rows, a.data()).ok());
    ASSERT_TRUE((*whole)->RunExperts(x.data(), ids, rows, b.data()).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << CudaMathName(math);
    // No router on an expert rank; no more rows than the plan holds.
    std::vector<float> out(static_cast<size_t>(h));
    EXPECT_EQ((*experts)->Forward(x.data(), 1, out.data()).code(), StatusCode::kInvalidArgument);
    const std::vector<int64_t> too_many = {plan->max_rows + 1};
    std::vector<float> big(static_cast<size_t>((plan->max_rows + 1) * h));
    EXPECT_EQ((*experts)->RunExperts(big.data(), {3}, too_many, big.data()).code(),
              StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace moerun
