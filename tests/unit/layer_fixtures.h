// Test helpers: small MoE layers of every family (presets scaled down) and fixture layers.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "experts/cpu/kernels.h"
#include "runtime/layer/moe_layer.h"
#include "runtime/layer/reference_layer.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/preset.h"
#include "tests/unit/test_util.h"

namespace moerun::testing {

// A small spec with one family's gate and expert variant (hidden 96, 12-16 experts).
inline ModelSpec SmallSpec(Family family) {
  ModelSpec s;
  s.family = family;
  s.hidden = 96;
  s.num_layers = 2;
  s.moe_layers = {0, 1};
  s.num_experts = 12;
  s.top_k = 3;
  s.expert_inter = 40;
  switch (family) {
    case Family::kMixtral:
    case Family::kQwen3Moe:
      break;
    case Family::kQwen2Moe:
      s.gate.renormalize = false;
      s.shared_inter = 56;
      s.shared_gated = true;
      break;
    case Family::kDeepseekV3:
      s.num_experts = 16;
      s.top_k = 4;
      s.gate.kind = GateKind::kSigmoidTopK;
      s.gate.selection_bias = true;
      s.gate.renorm_eps = 1e-20f;
      s.gate.scale = 2.5f;
      s.gate.n_group = 4;
      s.gate.topk_group = 2;
      s.shared_inter = 40;
      break;
    case Family::kGptOss:
      s.gate.kind = GateKind::kTopKSoftmax;
      s.router_bias = s.expert_bias = true;
      s.act = ActKind::kGptOss;
      s.swiglu_limit = 0.5f;  // small, so the clamps are exercised
      break;
    case Family::kStep3p5:
      s.gate.kind = GateKind::kSigmoidTopK;
      s.gate.selection_bias = true;
      s.gate.renorm_eps = 1e-20f;
      s.gate.scale = 3.0f;
      s.shared_inter = 40;
      s.act = ActKind::kSwiGluClamped;
      s.swiglu_limits = {0.0f, 0.3f};
      s.swiglu_limits_shared = {0.0f, 0.4f};
      s.moe_layers = {1};
      break;
  }
  s.gate.num_experts = s.num_experts;
  s.gate.top_k = s.top_k;
  return s;
}

inline std::vector<Family> AllFamilies() {
  return {Family::kMixtral,    Family::kQwen2Moe, Family::kQwen3Moe,
          Family::kDeepseekV3, Family::kGptOss,   Family::kStep3p5};
}

inline std::shared_ptr<const MoeLayerWeights> BuildSmall(Family f, const CpuKernels& k,
                                                         DType dtype = DType::kF32,
                                                         uint64_t seed = 7) {
  PresetOptions o;
  o.seed = seed;
  o.dtype = dtype;
  auto w = BuildPresetLayer(SmallSpec(f), k, o);
  if (!w.ok()) throw std::runtime_error(w.status().ToString());
  return std::make_shared<const MoeLayerWeights>(std::move(w).value());
}

inline std::shared_ptr<const MoeLayerWeights> LoadFixture(const std::string& name,
                                                          const CpuKernels& k) {
  const std::string dir = FixtureDir(name);
  auto spec = LoadModelSpec(dir);
  if (!spec.ok()) throw std::runtime_error(spec.status().ToString());
  auto ck = Checkpoint::Open(dir);
  if (!ck.ok()) throw std::runtime_error(ck.status().ToString());
  auto w = LoadLayer(**ck, *spec, k, LoadOptions{});
  if (!w.ok()) throw std::runtime_error(w.status().ToString());
  return std::make_shared<const MoeLayerWeights>(std::move(w).value());
}

inline std::vector<float> RandomRows(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  uint32_t s = seed * 2654435761u + 1;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(static_cast<int32_t>(s >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
  }
  return v;
}

// Rows of N(0, 1) values from a seeded generator.
inline std::vector<float> NormalRows(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = d(rng);
  return x;
}

// The fixture's layer in this process (the best kernels): what every expert-parallel run of it
// must equal bitwise.
inline std::vector<float> ForwardOneProcess(const std::string& fixture, const std::vector<float>& x,
                                            int64_t tokens) {
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(2);
  MoeLayer layer(LoadFixture(fixture, k), k, &pool);
  std::vector<float> out(x.size());
  EXPECT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  return out;
}

}  // namespace moerun::testing
