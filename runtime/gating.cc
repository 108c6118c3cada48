#include "runtime/gating.h"

#include <algorithm>

#include "experts/cpu/gemm.h"
#include "router/gate.h"
#include "runtime/fast_exp.h"

namespace moerun {

Gating::Gating(const MoeLayerWeights& w, const CpuKernels& kernels, ThreadPool* pool)
    : w_(w), kernels_(kernels), pool_(pool), scratch_(static_cast<size_t>(pool->size())) {
  for (auto& s : scratch_) s.resize(static_cast<size_t>(3 * w.spec.num_experts + 4));
}

void Gating::Run(const float* x, int64_t tokens) {
  const ModelSpec& s = w_.spec;
  const int k = s.top_k;
  const int experts = s.num_experts;
  const int64_t ldl = w_.gate.n_padded();
  logits_.Reserve(static_cast<size_t>(tokens * ldl) * sizeof(float));
  float* logits = logits_.as<float>();
  GemmPacked(kernels_, pool_, tokens, x, s.hidden, w_.gate, logits, ldl, &apack_);
  ids_.resize(static_cast<size_t>(tokens * k));
  weights_.resize(static_cast<size_t>(tokens * k));
  shared_scale_.resize(static_cast<size_t>(tokens));
  const int64_t chunk = 64;
  pool_->ParallelFor((tokens + chunk - 1) / chunk, [&](int64_t c, int worker) {
    auto& scratch = scratch_[static_cast<size_t>(worker)];
    GateScratch gs{scratch.data(), scratch.data() + experts,
                   reinterpret_cast<int32_t*>(scratch.data() + 2 * experts)};
    for (int64_t t = c * chunk; t < std::min(tokens, (c + 1) * chunk); ++t) {
      float* row = logits + t * ldl;
      if (!w_.gate_bias.empty()) {
        for (int e = 0; e < experts; ++e) row[e] = row[e] + w_.gate_bias[static_cast<size_t>(e)];
      }
      Route(s.gate, row, w_.selection_bias.empty() ? nullptr : w_.selection_bias.data(), gs,
            ids_.data() + t * k, weights_.data() + t * k);
      shared_scale_[static_cast<size_t>(t)] = s.shared_gated ? SigmoidF(row[experts]) : 1.0f;
    }
  });
}

}  // namespace moerun
