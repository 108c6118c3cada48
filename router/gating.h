// The router's part of an MoE layer for one batch: logits (one FMA chain per token and expert, on
// the experts' CPU matrix kernels), the gate function and top-k per token (router/gate.h), and
// Qwen2-MoE's shared-expert gate. Per-token results depend on nothing but the token
// (batch-invariant). Buffers grow to the largest batch and are reused. Not reentrant: one Run at
// a time per instance.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/thread_pool.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "router/gate.h"

namespace moerun {

// What the gate of one layer needs: its function and sizes, and its tensors (owned by the caller,
// which keeps them valid and unchanged while a Gating uses them).
struct GateWeights {
  GateSpec spec;
  int num_experts = 0;
  int top_k = 0;
  int64_t hidden = 0;
  // Qwen2-MoE: the matrix has one more row, the shared expert's gate (scale = sigmoid of it).
  bool shared_gated = false;
  const PackedMatrix* matrix = nullptr;   // N = num_experts (+1), K = hidden
  std::span<const float> bias;            // router bias, padded to matrix->n_padded(); or empty
  std::span<const float> selection_bias;  // [num_experts] or empty
};

class Gating {
 public:
  Gating(const GateWeights& weights, const CpuKernels& kernels, ThreadPool* pool);

  // x [tokens][hidden].
  void Run(const float* x, int64_t tokens);
  const std::vector<int32_t>& ids() const { return ids_; }                  // [tokens * k]
  const std::vector<float>& weights() const { return weights_; }            // [tokens * k]
  const std::vector<float>& shared_scale() const { return shared_scale_; }  // [tokens]

 private:
  const GateWeights w_;
  const CpuKernels& kernels_;
  ThreadPool* pool_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_, shared_scale_;
  AlignedBuffer logits_, apack_;
  std::vector<std::vector<float>> scratch_;
};

}  // namespace moerun
