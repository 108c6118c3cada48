// The GPU route kernel's code (router/cuda/route_warp.h: a warp per token, shuffles, registers
// only), run on the host under an emulated warp, against the CPU gate (router/gate.h): the same
// experts and the same weight bits for every gate kind, group-limited selection, bf16 logits,
// router bias, shared gate and the missing-expert flag, on random, tied, NaN, infinite and zero
// logits.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/fast_exp.h"
#include "router/cuda/route_warp.h"
#include "router/gate.h"

namespace moerun {
namespace {

using route_warp::HostWarp;
using route_warp::TokenArgs;

constexpr float kWarpNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kWarpInf = std::numeric_limits<float>::infinity();

struct WarpCase {
  std::string name;
  GateSpec g;
};

GateSpec WarpSigmoidSpec(int n, int k, int n_group, int topk_group, bool bias, float scale) {
  return GateSpec{GateKind::kSigmoidTopK, n, k, true, 1e-20f, scale, n_group, topk_group, bias};
}

std::vector<WarpCase> WarpCases() {
  std::vector<WarpCase> out;
  auto add = [&](std::string name, GateSpec g) { out.push_back({std::move(name), g}); };
  add("mixtral 8/2", {GateKind::kSoftmaxTopK, 8, 2});
  add("qwen3 128/8", {GateKind::kSoftmaxTopK, 128, 8});
  GateSpec qwen2{GateKind::kSoftmaxTopK, 60, 4};
  qwen2.renormalize = false;
  add("qwen2 60/4 no renorm", qwen2);
  add("deepseek-v3 256/8 groups 4/8", WarpSigmoidSpec(256, 8, 8, 4, true, 2.5f));
  add("step-3.5 288/8 bias", WarpSigmoidSpec(288, 8, 1, 1, true, 3.0f));
  add("gpt-oss 32/4", {GateKind::kTopKSoftmax, 32, 4});
  add("softmax 512/16", {GateKind::kSoftmaxTopK, 512, 16});
  add("step sigmoid no bias", WarpSigmoidSpec(288, 8, 1, 1, false, 3.0f));
  GateSpec step_softmax{GateKind::kSoftmaxTopK, 288, 8, false, 0.0f, 3.0f};
  add("step softmax", step_softmax);
  GateSpec step_bf16 = WarpSigmoidSpec(288, 8, 1, 1, true, 3.0f);
  step_bf16.bf16_logits = true;
  add("step bf16", step_bf16);
  step_softmax.bf16_logits = true;
  add("step softmax bf16", step_softmax);
  GateSpec gptoss_bf16{GateKind::kTopKSoftmax, 32, 4};
  gptoss_bf16.bf16_logits = true;
  add("gpt-oss bf16", gptoss_bf16);
  // Edges of the layout: k = 1, 32 and 64; n not a multiple of 32; one expert.
  add("softmax 64/1", {GateKind::kSoftmaxTopK, 64, 1});
  add("softmax 512/32", {GateKind::kSoftmaxTopK, 512, 32});
  add("softmax 512/64", {GateKind::kSoftmaxTopK, 512, 64});
  add("topk-softmax 512/64", {GateKind::kTopKSoftmax, 512, 64});
  add("topk-softmax 100/33", {GateKind::kTopKSoftmax, 100, 33});
  add("sigmoid 96/32", WarpSigmoidSpec(96, 32, 1, 1, true, 1.0f));
  add("sigmoid 200/64 no bias", WarpSigmoidSpec(200, 64, 1, 1, false, 1.5f));
  add("softmax 33/3", {GateKind::kSoftmaxTopK, 33, 3});
  add("softmax 1/1", {GateKind::kSoftmaxTopK, 1, 1});
  add("topk-softmax 7/7", {GateKind::kTopKSoftmax, 7, 7});
  // Group-limited selection: groups of 16, 15, 32, 2 and 1 experts.
  add("sigmoid 128/8 groups 4/8", WarpSigmoidSpec(128, 8, 8, 4, true, 1.0f));
  add("sigmoid 120/8 groups 3/8", WarpSigmoidSpec(120, 8, 8, 3, true, 1.0f));
  add("sigmoid 160/6 groups 2/5", WarpSigmoidSpec(160, 6, 5, 2, false, 1.0f));
  add("sigmoid 512/16 groups 32/256", WarpSigmoidSpec(512, 16, 256, 32, true, 2.0f));
  add("sigmoid 64/8 groups 16/64", WarpSigmoidSpec(64, 8, 64, 16, true, 1.0f));
  add("sigmoid 256/64 groups 256/256", WarpSigmoidSpec(256, 64, 256, 256, true, 1.0f));
  GateSpec ds_bf16 = WarpSigmoidSpec(256, 8, 8, 4, true, 2.5f);
  ds_bf16.bf16_logits = true;
  ds_bf16.renormalize = false;
  add("deepseek-v3 bf16 no renorm", ds_bf16);
  return out;
}

void RunHostWarp(int slots, const GateSpec& g, const TokenArgs& a) {
  switch (slots) {
    case 1:
      return route_warp::RouteToken<HostWarp, 1>(g, a);
    case 2:
      return route_warp::RouteToken<HostWarp, 2>(g, a);
    case 4:
      return route_warp::RouteToken<HostWarp, 4>(g, a);
    case 8:
      return route_warp::RouteToken<HostWarp, 8>(g, a);
    default:
      return route_warp::RouteToken<HostWarp, 16>(g, a);
  }
}

// Bits equal, or both NaN: the GPU's NaN is canonical, so a NaN's payload is no contract.
bool WarpSameWeight(float a, float b) {
  if (a != a && b != b) return true;
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

// Logits of one trial: `kind` picks random, tied, NaN, infinite or zero patterns.
std::vector<float> WarpLogits(int kind, const GateSpec& g, std::mt19937& rng) {
  const auto n = static_cast<size_t>(g.num_experts);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  auto at = [&]() -> float& { return v[rng() % n]; };
  switch (kind % 16) {
    case 1:  // ties
      for (auto& x : v) x = static_cast<float>(static_cast<int>(x));
      break;
    case 2:
      at() = kWarpNaN;
      break;
    case 3:
      at() = -kWarpInf;
      at() = -kWarpInf;
      break;
    case 4:
      at() = 80.0f;
      break;
    case 5:
      at() = kWarpInf;
      break;
    case 6:  // NaN first: the CPU's softmax max and a group's first value
      v[0] = kWarpNaN;
      break;
    case 7:
      for (auto& x : v) x = kWarpNaN;
      break;
    case 8:
      for (auto& x : v) x = -kWarpInf;
      break;
    case 9:
      for (auto& x : v) x = 0.5f;
      break;
    case 10:  // signed zeros, the largest value among them
      for (auto& x : v) x = (rng() & 1) ? 0.0f : -0.0f;
      at() = -1.0f;
      break;
    case 11:  // NaN at the start of every group, and elsewhere
      for (int q = 0; q < g.n_group; ++q) {
        if (rng() & 1) v[static_cast<size_t>(q * (g.num_experts / g.n_group))] = kWarpNaN;
      }
      at() = kWarpNaN;
      break;
    case 12:  // a few NaN and infinities together
      at() = kWarpNaN;
      at() = kWarpInf;
      at() = -kWarpInf;
      at() = kWarpNaN;
      break;
    case 13:  // +inf in two places (inf + inf, inf - inf)
      at() = kWarpInf;
      at() = kWarpInf;
      break;
    case 14:  // far apart: exp underflows to zero for most
      for (auto& x : v) x = x * 40.0f;
      break;
    default:
      break;
  }
  return v;
}

TEST(RouteWarpTest, SlotsCoverEveryExpertCount) {
  EXPECT_EQ(route_warp::SlotsFor(1), 1);
  EXPECT_EQ(route_warp::SlotsFor(32), 1);
  EXPECT_EQ(route_warp::SlotsFor(33), 2);
  EXPECT_EQ(route_warp::SlotsFor(128), 4);
  EXPECT_EQ(route_warp::SlotsFor(256), 8);
  EXPECT_EQ(route_warp::SlotsFor(288), 16);
  EXPECT_EQ(route_warp::SlotsFor(512), 16);
}

TEST(RouteWarpTest, EqualsTheCpuGateBitwise) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  HostWarp::non_uniform = 0;
  int tokens = 0, flagged = 0;
  for (const WarpCase& c : WarpCases()) {
    const GateSpec& g = c.g;
    const auto n = static_cast<size_t>(g.num_experts);
    const auto k = static_cast<size_t>(g.top_k);
    const int slots = route_warp::SlotsFor(g.num_experts);
    std::vector<float> sel_bias(n), gate_bias(n);
    for (auto& b : sel_bias) b = normal(rng) * 0.05f;
    for (auto& b : gate_bias) b = normal(rng) * 0.5f;
    for (int trial = 0; trial < 320; ++trial) {
      const bool with_gate_bias = trial % 3 == 1, shared_gated = trial % 4 == 2;
      std::vector<float> row = WarpLogits(trial, g, rng);
      row.push_back(shared_gated ? normal(rng) : kWarpNaN);  // the shared gate's logit
      std::vector<float> sel = sel_bias;
      if (trial % 17 == 5) sel[rng() % n] = kWarpNaN;
      const float* sel_ptr = g.selection_bias ? sel.data() : nullptr;
      std::vector<uint8_t> present(n, 1);
      if (trial % 2 == 1) {
        for (auto& p : present) p = (rng() % 4) != 0;
      }

      // The CPU: router bias added first, then the gate function.
      std::vector<float> logits(row.begin(), row.begin() + static_cast<ptrdiff_t>(n));
      if (with_gate_bias) {
        for (size_t i = 0; i < n; ++i) logits[i] = logits[i] + gate_bias[i];
      }
      std::vector<float> probs(n), choice(n);
      std::vector<int32_t> order(n), want_ids(k);
      std::vector<float> want_w(k);
      Route(g, logits.data(), sel_ptr, GateScratch{probs.data(), choice.data(), order.data()},
            want_ids.data(), want_w.data());
      int32_t want_flag = 0;
      for (int32_t id : want_ids) {
        if (!present[static_cast<size_t>(id)]) want_flag = std::max(want_flag, id + 1);
      }
      const float want_scale = shared_gated ? SigmoidF(row[n]) : 1.0f;

      // The warp, at its own slot count and at the largest (padding lanes must not matter).
      for (int s : {slots, route_warp::kMaxSlots}) {
        std::vector<int32_t> ids(k, -1);
        std::vector<float> w(k, -1.0f);
        float scale = -1.0f;
        int32_t flag = 0;
        const TokenArgs a{row.data(),     with_gate_bias ? gate_bias.data() : nullptr,
                          sel_ptr,        shared_gated,
                          present.data(), ids.data(),
                          w.data(),       &scale,
                          &flag};
        RunHostWarp(s, g, a);
        const std::string where = c.name + " trial " + std::to_string(trial) + " slots " +
                                  std::to_string(s) + (with_gate_bias ? " +gate bias" : "");
        ASSERT_EQ(ids, want_ids) << where;
        for (size_t i = 0; i < k; ++i) {
          ASSERT_TRUE(WarpSameWeight(w[i], want_w[i]))
              << where << " weight " << i << ": " << w[i] << " vs " << want_w[i];
        }
        ASSERT_TRUE(WarpSameWeight(scale, want_scale)) << where;
        ASSERT_EQ(flag, want_flag) << where;
        if (s == slots) {
          ++tokens;
          flagged += flag != 0;
        }
      }
    }
  }
  EXPECT_EQ(HostWarp::non_uniform, 0) << "values meant to be uniform differed between lanes";
  EXPECT_GT(flagged, tokens / 10);  // the missing-expert flag was exercised
}

}  // namespace
}  // namespace moerun
