// The GPU route kernel's gate math (router/cuda/route_token.h), run on the host, against the CPU
// gate (router/gate.h): the same experts and the same weight bits, including ties, NaN and -inf.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

#include "router/cuda/route_token.h"
#include "router/gate.h"

namespace moerun {
namespace {

std::vector<GateSpec> Specs() {
  std::vector<GateSpec> out;
  GateSpec mixtral{GateKind::kSoftmaxTopK, 8, 2};
  GateSpec qwen3{GateKind::kSoftmaxTopK, 128, 8};
  GateSpec qwen2 = qwen3;
  qwen2.num_experts = 60;
  qwen2.top_k = 4;
  qwen2.renormalize = false;
  GateSpec deepseek{GateKind::kSigmoidTopK, 256, 8, true, 1e-20f, 2.5f, 8, 4, true};
  GateSpec step{GateKind::kSigmoidTopK, 288, 8, true, 1e-20f, 3.0f, 1, 1, true};
  GateSpec gptoss{GateKind::kTopKSoftmax, 32, 4};
  GateSpec big{GateKind::kSoftmaxTopK, 512, 16};
  // Step-3.5 without router bias (sigmoid; softmax), and with bf16 logits (need_fp32_gate false).
  GateSpec step_sigmoid{GateKind::kSigmoidTopK, 288, 8, true, 0.0f, 3.0f, 1, 1, false};
  GateSpec step_softmax{GateKind::kSoftmaxTopK, 288, 8, false, 0.0f, 3.0f, 1, 1, false};
  GateSpec step_bf16 = step, step_softmax_bf16 = step_softmax, gptoss_bf16 = gptoss;
  step_bf16.bf16_logits = step_softmax_bf16.bf16_logits = gptoss_bf16.bf16_logits = true;
  return {mixtral,      qwen3,        qwen2,     deepseek,          step,       gptoss, big,
          step_sigmoid, step_softmax, step_bf16, step_softmax_bf16, gptoss_bf16};
}

TEST(RouteTokenTest, EqualsTheCpuGateBitwise) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const GateSpec& g : Specs()) {
    const auto n = static_cast<size_t>(g.num_experts);
    std::vector<float> bias(n);
    for (auto& b : bias) b = normal(rng) * 0.05f;
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> logits(n);
      for (auto& v : logits) v = normal(rng);
      if (trial % 5 == 1) {  // ties
        for (size_t i = 0; i < n; ++i) logits[i] = static_cast<float>(static_cast<int>(logits[i]));
      }
      if (trial % 7 == 2) logits[rng() % n] = std::numeric_limits<float>::quiet_NaN();
      if (trial % 11 == 3) logits[rng() % n] = -std::numeric_limits<float>::infinity();
      if (trial % 13 == 4) logits[rng() % n] = 80.0f;
      const float* sel = g.selection_bias ? bias.data() : nullptr;

      std::vector<float> probs(n), choice(n);
      std::vector<int32_t> order(n);
      std::vector<int32_t> want_ids(static_cast<size_t>(g.top_k));
      std::vector<float> want_w(want_ids.size());
      Route(g, logits.data(), sel, GateScratch{probs.data(), choice.data(), order.data()},
            want_ids.data(), want_w.data());

      std::vector<float> logit = logits, p2(n);
      std::vector<int32_t> o2(n);
      std::vector<uint32_t> taken(n / 32 + 1);
      std::vector<int32_t> ids(want_ids.size());
      std::vector<float> w(want_w.size());
      route_token::Route(g, logit.data(), sel,
                         route_token::Scratch{p2.data(), o2.data(), taken.data()}, ids.data(),
                         w.data());
      ASSERT_EQ(ids, want_ids) << DescribeGate(g) << " trial " << trial;
      ASSERT_EQ(std::memcmp(w.data(), want_w.data(), w.size() * 4), 0)
          << DescribeGate(g) << " trial " << trial;
    }
  }
}

}  // namespace
}  // namespace moerun
