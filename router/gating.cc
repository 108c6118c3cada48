#include "router/gating.h"

#include <algorithm>

#include "base/fast_exp.h"
#include "experts/cpu/gemm.h"

namespace moerun {

Gating::Gating(const GateWeights& w, const CpuKernels& kernels, ThreadPool* pool)
    : w_(w), kernels_(kernels), pool_(pool), scratch_(static_cast<size_t>(pool->size())) {
  for (auto& s : scratch_) s.resize(static_cast<size_t>(3 * w.num_experts + 4));
}

void Gating::Run(const float* x, int64_t tokens) {
  const int k = w_.top_k;
  const int experts = w_.num_experts;
  const int64_t ldl = w_.matrix->n_padded();
  logits_.Reserve(static_cast<size_t>(tokens * ldl) * sizeof(float));
  float* logits = logits_.as<float>();
  GemmPacked(kernels_, pool_, tokens, x, w_.hidden, *w_.matrix, logits, ldl, &apack_);
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
      if (!w_.bias.empty()) {
        for (int e = 0; e < experts; ++e) row[e] = row[e] + w_.bias[static_cast<size_t>(e)];
      }
      Route(w_.spec, row, w_.selection_bias.empty() ? nullptr : w_.selection_bias.data(), gs,
            ids_.data() + t * k, weights_.data() + t * k);
      shared_scale_[static_cast<size_t>(t)] = w_.shared_gated ? SigmoidF(row[experts]) : 1.0f;
    }
  });
}

}  // namespace moerun
