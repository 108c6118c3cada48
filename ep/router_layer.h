// The router side of an expert-parallel MoE layer.
//
// Forward cuts the batch into microbatches. For each: gate and top-k here, plan the dispatch
// (exact rows per expert rank and slot; replicas chosen by in-flight load), send every expert
// rank exactly its rows, compute the shared expert here, and, once microbatch i+1 is on its way,
// collect microbatch i's outputs and combine them in slot order. The output is bitwise identical
// to the single-process MoeLayer for any rank count, placement or microbatch size (the expert
// kernels are batch-invariant and combine sums in a fixed order). Every wait has a deadline; a
// rank that does not answer fails the call with an error naming it. Buffers grow to the largest
// microbatch and are reused. Not reentrant: one Forward at a time.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/metrics.h"
#include "ep/peer_health.h"
#include "experts/cpu/grouped_ffn.h"
#include "model/layer_weights.h"
#include "router/dispatch_plan.h"
#include "router/gating.h"
#include "router/placement.h"
#include "transport/transport.h"

namespace moerun {

struct EpOptions {
  int64_t microbatch_tokens = 0;  // 0: the whole batch is one microbatch
  std::chrono::milliseconds deadline{30000};
};

struct EpStats {
  uint64_t microbatches = 0;
  uint64_t rows_sent = 0;
  std::vector<uint64_t> rows_per_rank;  // assignments sent to each rank, cumulative
};

class RouterLayer {
 public:
  // `weights` needs the router's tensors only (gate, biases, shared expert); `header_bytes` is
  // the job's HeaderBytes.
  RouterLayer(Transport* transport, std::shared_ptr<const Placement> placement,
              std::shared_ptr<const MoeLayerWeights> weights, const CpuKernels& kernels,
              ThreadPool* pool, size_t header_bytes, EpOptions options);
  ~RouterLayer();

  // `deadline` bounds every wait (with the options' deadline, whichever comes first). A rank that
  // misses it fails the call with kDeadlineExceeded naming it. With a PeerHealth set, the late
  // transfers are handed to it (they stay posted until the rank catches up) and calls whose plan
  // needs a rank that is not answering fail at once with kUnavailable; without one they are
  // cancelled (the caller ends the job).
  Status Forward(const float* x, int64_t tokens, float* out, Deadline deadline = Deadline::max());
  void set_health(PeerHealth* health) { health_ = health; }
  // Seconds spent per microbatch dispatching (gate, plan, gather, send) and collecting (wait for
  // the expert ranks, combine); null to skip.
  void set_timing(Histogram* dispatch, Histogram* combine) {
    dispatch_hist_ = dispatch;
    combine_hist_ = combine;
  }
  // Called once per microbatch with the gate's choices: (ids [tokens][k], tokens, k).
  void set_routing_observer(std::function<void(const int32_t*, int64_t, int)> f) {
    routing_observer_ = std::move(f);
  }
  const EpStats& stats() const { return stats_; }
  // Switches to another placement of the same ranks (call between Forwards: a batch boundary);
  // the expert ranks must already hold every expert it gives them.
  Status SetPlacement(std::shared_ptr<const Placement> placement);
  const Placement& placement() const { return *placement_; }
  int layer() const { return w_->layer; }
  const MoeLayerWeights& weights() const { return *w_; }
  // Rows in flight per rank (what replica choice balances).
  const std::vector<double>& in_flight() const { return in_flight_; }

 private:
  struct Stage;
  Status Dispatch(Stage& st, const float* x, int64_t t0, int64_t tokens);
  Status Collect(Stage& st, float* out);
  void Abandon(const Status& why);

  Transport* t_;
  std::shared_ptr<const Placement> placement_;
  const LayerPlacement* lp_;
  std::shared_ptr<const MoeLayerWeights> w_;
  const CpuKernels& kernels_;
  ThreadPool* pool_;
  size_t header_bytes_;
  EpOptions opts_;
  GroupedFfn shared_ffn_;
  std::vector<int32_t> shared_rows_;
  std::vector<double> in_flight_;
  std::unique_ptr<Stage> stages_[2];
  uint32_t seq_ = 0;
  EpStats stats_;
  std::string what_;  // names the layer in errors
  PeerHealth* health_ = nullptr;
  Histogram* dispatch_hist_ = nullptr;
  Histogram* combine_hist_ = nullptr;
  Deadline call_deadline_ = Deadline::max();
  std::function<void(const int32_t*, int64_t, int)> routing_observer_;
};

}  // namespace moerun
