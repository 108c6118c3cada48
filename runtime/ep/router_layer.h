// The router side of an expert-parallel MoE layer.
//
// Forward cuts the batch into microbatches. For each: gate and top-k here, plan the dispatch
// (exact rows per expert rank and slot; replicas chosen by in-flight load), send every expert
// rank exactly its rows, compute the shared expert here, and, once microbatch i+1 is on its way,
// collect microbatch i's outputs and combine them in slot order. The output is bitwise identical
// to the single-process MoeLayer for any rank count, placement or microbatch size (the expert
// kernels are batch-invariant and combine sums in a fixed order). Given a BatchStream
// (base/batch_stream.h), the batch grows while it runs: whenever the two-stage pipeline has room
// (fewer than two microbatches in flight), the stream's new rows are dispatched at once as the
// next microbatch, and the stream learns after each combine which tokens are final. Every wait has
// a deadline; a rank that does not answer fails the call with an error naming it. Buffers grow to
// the largest microbatch and are reused. Not reentrant: one Forward at a time.
//
// With a PeerHealth (serving), a dead expert rank does not fail the call: the rank is marked dead
// (the transport failed its endpoint, or it missed the expert-parallel deadline), the
// microbatches in flight are abandoned (their transfers stranded: late answers are dropped) and
// everything not yet combined is dispatched again to the live copies. The MoE forward is
// idempotent, so the answer is the same bits. An expert whose every copy is dead makes the call
// fail with kUnavailable and waiting_for_copies() true until a placement that re-places it is
// switched to (the caller polls the control and calls again).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/batch_stream.h"
#include "base/metrics.h"
#include "experts/cpu/grouped_ffn.h"
#include "router/dispatch_plan.h"
#include "router/gating.h"
#include "router/placement.h"
#include "runtime/ep/peer_health.h"
#include "runtime/ep/stranded.h"
#include "runtime/model/layer_weights.h"
#include "transport/transport.h"

namespace moerun {

struct EpResultTrailer;

struct EpOptions {
  int64_t microbatch_tokens = 0;  // 0: the whole batch is one microbatch
  std::chrono::milliseconds deadline{30000};
  // Per rank, routers included: its node (ranks that share a host share an id); empty: unknown
  // (no off-node counts; so too where every rank is on one node). RankJob fills it at the start
  // barrier.
  std::vector<int> rank_node;
  // >= 0 (and rank_node known): among an expert's copies, one on the router's own node first,
  // within this bound (router/dispatch_plan.h, DispatchLocality::spill); < 0: the least loaded.
  double node_spill = -1;
};

struct EpStats {
  uint64_t microbatches = 0;
  uint64_t retried_calls = 0;         // calls that re-dispatched after a death
  uint64_t retried_microbatches = 0;  // microbatches abandoned in flight and dispatched again
  uint64_t load_retries = 0;          // microbatches sent again: an expert was still loading
  uint64_t rows_sent = 0;
  std::vector<uint64_t> rows_per_rank;  // assignments sent to each rank, cumulative
  // With EpOptions::rank_node: rows sent to ranks on other nodes, and (token, other node) pairs
  // (what a transport that sends a token once per node would send); a row is hidden floats.
  uint64_t off_node_rows = 0;
  uint64_t off_node_token_nodes = 0;
};

class RouterLayer {
 public:
  // `weights` needs the router's tensors only (gate, biases, shared expert); `header_bytes` is
  // the job's HeaderBytes.
  RouterLayer(Transport* transport, std::shared_ptr<const Placement> placement,
              std::shared_ptr<const MoeLayerWeights> weights, const CpuKernels& kernels,
              ThreadPool* pool, size_t header_bytes, EpOptions options);
  ~RouterLayer();

  // `deadline` is the caller's (a client's): past it nothing more is dispatched or retried and the
  // call fails with kDeadlineExceeded once what is in flight is collected. It never cuts a wait on
  // the expert ranks: those are waited for by the options' (the job's expert-parallel) deadline
  // alone, so that a rank is late only by the job's own measure. A rank that misses that deadline
  // fails the call with kDeadlineExceeded naming it. With a PeerHealth set, the late
  // transfers are handed to it (they stay posted until the rank catches up) and calls whose plan
  // needs a rank that is not answering fail at once with kUnavailable. Without one the layer
  // keeps them posted itself, so a rank that answers late stays in step with the next calls;
  // once kMaxOwnStrands abandoned microbatches are outstanding, calls fail with kUnavailable.
  // With a `stream`, x and out hold room for the rows it appends (its tokens() at most).
  Status Forward(const float* x, int64_t tokens, float* out, Deadline deadline = Deadline::max(),
                 BatchStream* stream = nullptr);
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
  // Where the last (or current) Forward's time went, summed over its microbatches (valid until
  // the next Forward).
  const BatchTiming& timing();
  // Switches to another placement of the same ranks (call between Forwards: a batch boundary);
  // the expert ranks must already hold every expert it gives them.
  Status SetPlacement(std::shared_ptr<const Placement> placement);
  const Placement& placement() const { return *placement_; }
  int layer() const { return w_->layer; }
  const MoeLayerWeights& weights() const { return *w_; }
  // Rows in flight per rank (what replica choice balances).
  const std::vector<double>& in_flight() const { return in_flight_; }
  // The last Forward failed because an expert it needed has no live copy (its ranks died) yet.
  bool waiting_for_copies() const { return waiting_for_copies_; }
  // Experts of this layer with no live copy now (0 without a PeerHealth).
  int orphans() {
    RefreshLive();
    return orphans_;
  }

 private:
  struct Stage;
  // Microbatches from token `from` on; *done: tokens whose output is final; *tokens grows with
  // the stream.
  Status ForwardFrom(const float* x, int64_t from, int64_t* tokens, float* out, int64_t* done,
                     BatchStream* stream);
  Status Dispatch(Stage& st, const float* x, int64_t t0, int64_t tokens);
  Status Collect(Stage& st, float* out);
  // Posts the receive of rank d's answer, then sends it the stage's header and rows for it (the
  // header already written); the requests join st.reqs.
  Status SendTo(Stage& st, int d);
  // Strands what is in flight; returns the microbatches that were.
  int Abandon(const Status& why);
  // Without a PeerHealth: releases what late ranks have answered of abandoned microbatches;
  // fails while kMaxOwnStrands are still outstanding.
  Status DrainOwnStrands();
  static constexpr size_t kMaxOwnStrands = 8;
  // Rebuilds live_ after a death or a placement switch.
  void RefreshLive();
  // Fails with kUnavailable if a token of x [from, tokens) is routed to an expert with no copy.
  Status CheckOrphans(const float* x, int64_t from, int64_t tokens);
  // Fails with kUnavailable (and sets waiting_for_copies_) if one of the n gate choices `ids`
  // names an expert with no live copy.
  Status NoOrphans(const int32_t* ids, int64_t n);
  // The placement dispatch uses: lp_ without the dead ranks' slots (lp_ without a PeerHealth).
  const LayerPlacement& Live() const { return health_ != nullptr ? live_ : *lp_; }

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
  BatchTiming timing_;
  std::vector<RankTiming> rank_timing_;    // by rank, this Forward's
  std::vector<RankTiming> timed_;          // those with rows, for timing_.ranks
  std::vector<MicrobatchTimes> mb_times_;  // this Forward's first microbatches, for traces
  std::vector<RankTimes> rank_times_;      // and each expert rank's part of them
  // Per rank: its clock's offset to ours, from the round trips (NTP's rule: the sample with the
  // least delay in a window of kOffsetWindow round trips becomes the estimate).
  struct ClockOffset {
    int64_t offset_ns = 0;
    bool known = false;
    int64_t best_delay = INT64_MAX, best_offset = 0;
    int samples = 0;
  };
  static constexpr int kOffsetWindow = 64;
  std::vector<ClockOffset> clock_;
  // Whether the stage's microbatch has its MicrobatchTimes in this Forward's mb_times_.
  bool Traced(const Stage& st) const;
  void RecordRankTimes(const Stage& st, int d, int64_t rows, const EpResultTrailer& tr,
                       SteadyClock::time_point received);
  std::string what_;  // names the layer in errors
  PeerHealth* health_ = nullptr;
  Histogram* dispatch_hist_ = nullptr;
  Histogram* combine_hist_ = nullptr;
  Deadline call_deadline_ = Deadline::max();
  LayerPlacement live_;
  const LayerPlacement* live_for_ = nullptr;
  uint64_t live_generation_ = ~uint64_t{0};
  int orphans_ = 0;
  bool waiting_for_copies_ = false;
  bool answered_failure_ = false;  // the last failed Collect had its answers: the ranks live
  std::vector<int> retry_ranks_;   // Collect: the ranks to send a microbatch again
  SteadyClock::time_point last_load_warning_{};
  std::vector<int> late_;          // ranks whose transfers missed the expert-parallel deadline
  StrandedTransfers own_strands_;  // without a PeerHealth: abandoned microbatches' transfers
  std::function<void(const int32_t*, int64_t, int)> routing_observer_;
};

}  // namespace moerun
