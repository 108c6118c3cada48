// The router's part of an MoE layer for one batch: logits (one FMA chain per token and expert, on
// the CPU kernels), top-k per token, and Qwen2-MoE's shared-expert gate. Per-token results depend
// on nothing but the token (batch-invariant). Buffers grow to the largest batch and are reused.
// Not reentrant: one Run at a time per instance.
#pragma once

#include <cstdint>
#include <vector>

#include "experts/cpu/aligned_buffer.h"
#include "experts/cpu/kernels.h"
#include "runtime/moe_layer.h"
#include "runtime/thread_pool.h"

namespace moerun {

class Gating {
 public:
  Gating(const MoeLayerWeights& w, const CpuKernels& kernels, ThreadPool* pool);

  // x [tokens][hidden].
  void Run(const float* x, int64_t tokens);

  const std::vector<int32_t>& ids() const { return ids_; }                  // [tokens * k]
  const std::vector<float>& weights() const { return weights_; }            // [tokens * k]
  const std::vector<float>& shared_scale() const { return shared_scale_; }  // [tokens]

 private:
  const MoeLayerWeights& w_;
  const CpuKernels& kernels_;
  ThreadPool* pool_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_, shared_scale_;
  AlignedBuffer logits_, apack_;
  std::vector<std::vector<float>> scratch_;
};

}  // namespace moerun
