// One MoE layer on this process's CPU: gate -> top-k -> grouped expert FFN -> combine, over the
// weights a checkpoint or a preset yields (runtime/model/layer_weights.h). Forward is
// batch-invariant: a token's output bits do not depend on the other tokens in the batch, their
// order, or the thread count (see docs/DESIGN.md). Buffers grow to the largest batch seen and are
// reused. Forward is not reentrant: one call at a time per MoeLayer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "experts/cpu/kernels.h"
#include "router/expert_groups.h"
#include "runtime/model/layer_weights.h"

namespace moerun {

class Gating;

// Routing of the last batch, for statistics and tests.
struct Routing {
  std::vector<int32_t> ids;    // [T * k]
  std::vector<float> weights;  // [T * k]
};

class MoeLayer {
 public:
  MoeLayer(std::shared_ptr<const MoeLayerWeights> weights, const CpuKernels& kernels,
           ThreadPool* pool);
  ~MoeLayer();

  // x [tokens][hidden] -> out [tokens][hidden] (row-major, contiguous).
  Status Forward(const float* x, int64_t tokens, float* out);

  const MoeLayerWeights& weights() const { return *w_; }
  const Routing& last_routing() const { return routing_; }
  const CpuKernels& kernels() const { return kernels_; }
  // FLOPs of one forward of `tokens` tokens (gate + routed experts + shared expert).
  double Flops(int64_t tokens) const;

 private:
  std::shared_ptr<const MoeLayerWeights> w_;
  const CpuKernels& kernels_;
  ThreadPool* pool_;
  std::unique_ptr<Gating> gating_;
  GroupedFfn ffn_;
  ExpertGroups groups_;
  Routing routing_;
  std::vector<int32_t> rows_;
  std::vector<ExpertGroup> ffn_groups_;
  AlignedBuffer y_;
};

}  // namespace moerun
