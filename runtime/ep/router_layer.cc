#include "runtime/ep/router_layer.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "base/log.h"
#include "base/trace_context.h"
#include "router/combine.h"
#include "runtime/ep/protocol.h"
#include "runtime/ep/registered_buffer.h"

namespace moerun {

struct RouterLayer::Stage {
  Stage(const MoeLayerWeights& w, const CpuKernels& k, ThreadPool* pool)
      : gating(w.Gate(), k, pool) {}
  Gating gating;
  DispatchPlan plan;
  int64_t t0 = 0, tokens = 0;
  AlignedBuffer rows_out, rows_in, shared_y, headers;
  std::vector<Request> reqs;
  std::vector<double> rows_to;  // per rank, to release from in_flight_
  // Per rank: when its header and rows went out, where its answer's receive is in reqs, when
  // that completed, and whether its answer's time was counted.
  std::vector<SteadyClock::time_point> sent_at, done_at;
  std::vector<size_t> recv_index;
  std::vector<uint8_t> timed;
  Deadline ep_deadline;  // the expert-parallel one: missing it marks a rank dead
  uint32_t seq = 0;      // the headers'
  bool active = false;
  int mb_index = -1;  // its MicrobatchTimes in mb_times_, or -1 (not traced)
};

namespace {

// Where rank d's result block starts in a stage's receive buffer (floats): its rows, then its
// trailer's room.
int64_t ResultBlock(const DispatchPlan& plan, int d, int64_t hidden) {
  return plan.rank_offset[static_cast<size_t>(d)] * hidden + d * kResultGapFloats;
}

int64_t MicrosBetween(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration_cast<std::chrono::microseconds>(b - a).count();
}

// The rank whose block carries `row` (blocks are laid out rank after rank; ranks without rows
// have the next one's offset).
int RankOfRow(const DispatchPlan& plan, int64_t row) {
  const auto it = std::upper_bound(plan.rank_offset.begin(), plan.rank_offset.end(), row);
  return static_cast<int>(it - plan.rank_offset.begin()) - 1;
}

}  // namespace

RouterLayer::RouterLayer(Transport* transport, std::shared_ptr<const Placement> placement,
                         std::shared_ptr<const MoeLayerWeights> weights, const CpuKernels& kernels,
                         ThreadPool* pool, size_t header_bytes, EpOptions options)
    : t_(transport),
      placement_(std::move(placement)),
      lp_(placement_->Layer(weights->layer)),
      w_(std::move(weights)),
      kernels_(kernels),
      pool_(pool),
      header_bytes_(header_bytes),
      opts_(options),
      shared_ffn_(kernels, pool),
      in_flight_(static_cast<size_t>(placement_->num_ranks()), 0.0),
      own_strands_(transport) {
  const Placement& pl = *placement_;
  // The node map is used (counts, preference) only where the job spans more than one node.
  if (opts_.rank_node.size() != static_cast<size_t>(pl.num_ranks()) ||
      std::all_of(opts_.rank_node.begin(), opts_.rank_node.end(),
                  [&](int n) { return n == opts_.rank_node[0]; })) {
    opts_.rank_node.clear();
  }
  what_ = "expert-parallel layer " + std::to_string(w_->layer);
  for (auto& s : stages_) s = std::make_unique<Stage>(*w_, kernels_, pool_);
  for (auto& s : stages_) {
    s->headers = AlignedBuffer(header_bytes_ * static_cast<size_t>(pl.num_ranks()));
    s->reqs.reserve(static_cast<size_t>(3 * pl.num_ranks()));
    s->rows_to.assign(static_cast<size_t>(pl.num_ranks()), 0.0);
    s->sent_at.assign(static_cast<size_t>(pl.num_ranks()), {});
    s->recv_index.assign(static_cast<size_t>(pl.num_ranks()), 0);
    s->timed.assign(static_cast<size_t>(pl.num_ranks()), 0);
    s->done_at.reserve(static_cast<size_t>(3 * pl.num_ranks()));
  }
  stats_.rows_per_rank.assign(static_cast<size_t>(pl.num_ranks()), 0);
  rank_timing_.assign(static_cast<size_t>(pl.num_ranks()), RankTiming{});
  timed_.reserve(static_cast<size_t>(pl.num_ranks()));
  mb_times_.reserve(kMaxTracedMicrobatches);
  // One RankTimes per traced microbatch and rank, at most kMaxTracedRankTimes: reserved, so
  // that a batch with more of them than any before it allocates nothing.
  rank_times_.reserve(
      std::min(static_cast<size_t>(kMaxTracedRankTimes),
               static_cast<size_t>(kMaxTracedMicrobatches) * static_cast<size_t>(pl.num_ranks())));
  clock_.assign(static_cast<size_t>(pl.num_ranks()), ClockOffset{});
}

RouterLayer::~RouterLayer() {
  for (auto& s : stages_) {
    for (Request& r : s->reqs) {
      if (r.valid()) (void)t_->Cancel(r);
    }
    Unregister(t_, s->rows_out);
    Unregister(t_, s->rows_in);
  }
}

Status RouterLayer::Forward(const float* x, int64_t tokens, float* out, Deadline deadline,
                            BatchStream* stream) {
  if (lp_ == nullptr) {
    return Status::InvalidArgument("the placement has no entry for layer " +
                                   std::to_string(w_->layer));
  }
  if (tokens < 0 || tokens > (int64_t{1} << 24)) return Status::InvalidArgument("bad batch size");
  waiting_for_copies_ = false;
  if (tokens == 0) return Status::Ok();
  if (health_ == nullptr) MOERUN_RETURN_IF_ERROR(DrainOwnStrands());
  call_deadline_ = deadline;
  timing_ = BatchTiming{};
  mb_times_.clear();
  rank_times_.clear();
  for (size_t d = 0; d < rank_timing_.size(); ++d) {
    rank_timing_[d] = RankTiming{};
    rank_timing_[d].rank = static_cast<int32_t>(d);
  }
  int64_t done = 0;
  while (true) {
    const uint64_t generation = health_ != nullptr ? health_->dead_generation() : 0;
    RefreshLive();
    if (orphans_ > 0) MOERUN_RETURN_IF_ERROR(CheckOrphans(x, done, tokens));
    late_.clear();
    answered_failure_ = false;
    const Status status = ForwardFrom(x, done, &tokens, out, &done, stream);
    if (status.ok()) return status;
    const int abandoned = Abandon(status);
    if (health_ == nullptr) return status;
    // Whoever failed its transfers or missed the expert-parallel deadline is dead.
    for (int r : late_) {
      health_->MarkDead(r, "it missed the " + std::to_string(opts_.deadline.count()) +
                               " ms deadline of " + what_);
    }
    for (int r = placement_->num_routers(); r < placement_->num_ranks(); ++r) {
      if (t_->peer_failed(r)) {
        health_->MarkDead(r, "the transport reports its endpoint failed (the call failed with: " +
                                 status.ToString() + ")");
      }
    }
    if (health_->dead_generation() == generation || SteadyClock::now() >= call_deadline_) {
      return status;
    }
    ++stats_.retried_calls;
    stats_.retried_microbatches += static_cast<uint64_t>(abandoned);
    spdlog::warn(
        "{}: {} microbatch(es) in flight abandoned ({}); dispatching tokens {}..{} again "
        "to the live copies",
        what_, abandoned, status.ToString(), done, tokens);
  }
}

Status RouterLayer::ForwardFrom(const float* x, int64_t from, int64_t* tokens, float* out,
                                int64_t* done, BatchStream* stream) {
  // Two stages: dispatch microbatch i, then collect i - 1 while the expert ranks work on i. With a
  // stream, rows that arrived meanwhile are taken whenever a stage is free, and dispatched at
  // once as the next microbatch.
  int64_t next = from;  // the first token not dispatched yet
  int used = 0;         // stages dispatched: microbatch j went to stages_[j % 2]
  int active = 0;       // of which still in flight (the newest `active` ones)
  // Past the call's deadline nothing more is dispatched, but what is in flight is collected: the
  // expert ranks are waited for by the expert-parallel deadline alone, so that a caller's short
  // deadline (a client's) never abandons transfers or makes a rank look late.
  bool past_deadline = false;
  Status status;
  while (status.ok()) {
    if (stream != nullptr && active < 2 && !past_deadline) {
      *tokens = stream->Extend(*tokens, &call_deadline_);
    }
    const int64_t left = *tokens - next;
    if (left > 0 && active < 2 && !past_deadline)
      past_deadline = SteadyClock::now() >= call_deadline_;
    if (left > 0 && active < 2 && !past_deadline) {
      const int64_t mb =
          opts_.microbatch_tokens > 0 ? std::min(opts_.microbatch_tokens, left) : left;
      Stage& st = *stages_[used % 2];
      const auto t0 = SteadyClock::now();
      status = Dispatch(st, x, next, mb);
      if (!status.ok()) break;
      if (dispatch_hist_) {
        dispatch_hist_->Observe(std::chrono::duration<double>(SteadyClock::now() - t0).count());
      }
      next += mb;
      ++used;
      if (++active < 2) continue;  // another microbatch goes out before this one is collected
    }
    if (active == 0) break;
    const auto t0 = SteadyClock::now();
    Stage& st = *stages_[(used - active) % 2];
    status = Collect(st, out);
    if (!status.ok()) break;
    --active;
    *done = st.t0 + st.tokens;
    if (combine_hist_) {
      combine_hist_->Observe(std::chrono::duration<double>(SteadyClock::now() - t0).count());
    }
    if (stream != nullptr) stream->Done(*done, timing());
  }
  if (status.ok() && past_deadline) {
    return Status::DeadlineExceeded(what_ + ": the call's deadline passed with tokens " +
                                    std::to_string(next) + ".." + std::to_string(*tokens) +
                                    " not dispatched");
  }
  if (!status.ok() && answered_failure_ && active == 2) {
    // The older microbatch was answered with a failure (the rank lives); the newer one is on its
    // way: its answer is taken in too (and computed again later), so that nothing stays in
    // flight. A transfer failure or a missed deadline there counts instead.
    Stage& next_stage = *stages_[(used - 1) % 2];
    if (next_stage.active) {
      const Status answered = status;
      answered_failure_ = false;
      const Status s = Collect(next_stage, out);
      if (s.ok() || answered_failure_) {
        status = answered;
        answered_failure_ = true;
      } else {
        status = s;
      }
    }
  }
  return status;
}

Status RouterLayer::DrainOwnStrands() {
  own_strands_.Poll([&](const Request& r, const Status& done) {
    if (!done.ok()) {
      spdlog::warn("{}: a late transfer with rank {} failed: {}", what_, r.peer, done.ToString());
    }
  });
  if (own_strands_.groups() < kMaxOwnStrands) return Status::Ok();
  std::string ranks;
  for (int r = placement_->num_routers(); r < placement_->num_ranks(); ++r) {
    if (own_strands_.AnyPeer([r](int peer) { return peer == r; })) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  return Status::Unavailable(what_ + ": " + std::to_string(own_strands_.groups()) +
                             " abandoned microbatches still wait for rank(s) " + ranks +
                             ", which missed the deadline and have not caught up");
}

void RouterLayer::RefreshLive() {
  if (health_ == nullptr) {
    orphans_ = 0;
    return;
  }
  if (live_for_ == lp_ && live_generation_ == health_->dead_generation()) return;
  live_ = LiveLayer(*lp_, health_->dead_mask(), &orphans_);
  live_for_ = lp_;
  live_generation_ = health_->dead_generation();
}

Status RouterLayer::CheckOrphans(const float* x, int64_t from, int64_t tokens) {
  const int64_t hidden = w_->spec.hidden;
  const int k = w_->spec.top_k;
  if (from >= tokens) return Status::Ok();
  const int64_t mb = opts_.microbatch_tokens > 0 ? opts_.microbatch_tokens : tokens - from;
  Gating& gating = stages_[0]->gating;
  for (int64_t t0 = from; t0 < tokens; t0 += mb) {
    const int64_t n = std::min(mb, tokens - t0);
    gating.Run(x + t0 * hidden, n);
    MOERUN_RETURN_IF_ERROR(NoOrphans(gating.ids().data(), n * k));
  }
  return Status::Ok();
}

Status RouterLayer::NoOrphans(const int32_t* ids, int64_t n) {
  const LayerPlacement& lp = Live();
  for (int64_t i = 0; i < n; ++i) {
    if (lp.replicas[static_cast<size_t>(ids[i])].empty()) {
      waiting_for_copies_ = true;
      return Status::Unavailable(what_ + ": expert " + std::to_string(ids[i]) +
                                 " has no live copy (its rank died); waiting for it to be "
                                 "re-placed");
    }
  }
  return Status::Ok();
}

Status RouterLayer::SetPlacement(std::shared_ptr<const Placement> placement) {
  if (placement == nullptr || placement->num_ranks() != placement_->num_ranks() ||
      placement->num_routers() != placement_->num_routers() ||
      placement->num_experts() != placement_->num_experts()) {
    return Status::InvalidArgument(what_ +
                                   ": a new placement must keep the job's ranks, "
                                   "routers and experts");
  }
  const LayerPlacement* lp = placement->Layer(w_->layer);
  if (lp == nullptr) return Status::InvalidArgument(what_ + ": the new placement has no entry");
  const size_t slots = (header_bytes_ - sizeof(EpHeaderFixed)) / sizeof(EpEntry);
  if (static_cast<size_t>(lp->MaxSlotsPerRank()) > slots) {
    return Status::InvalidArgument(
        what_ + ": the new placement puts " + std::to_string(lp->MaxSlotsPerRank()) +
        " slots on a rank; this job's headers hold " + std::to_string(slots));
  }
  placement_ = std::move(placement);
  lp_ = lp;
  live_for_ = nullptr;  // rebuilt on the next call
  return Status::Ok();
}

int RouterLayer::Abandon(const Status& why) {
  // Whatever is still in flight stays posted (whatever failed: another microbatch may be on its
  // way to healthy ranks, and a late rank's answers must land somewhere): with the PeerHealth,
  // or in own_strands_ without one.
  (void)why;
  int abandoned = 0;
  for (auto& s : stages_) {
    if (s->active) ++abandoned;
    if (std::any_of(s->reqs.begin(), s->reqs.end(), [](const Request& r) { return r.valid(); })) {
      // The late transfers keep their buffers; this stage starts over with new ones.
      std::vector<AlignedBuffer> bufs;
      bufs.push_back(std::move(s->rows_out));
      bufs.push_back(std::move(s->rows_in));
      bufs.push_back(std::move(s->headers));
      if (health_ != nullptr) {
        health_->Strand(std::move(s->reqs), std::move(bufs));
      } else {
        own_strands_.Add(std::move(s->reqs), std::move(bufs));
      }
      s->reqs = std::vector<Request>();
      s->reqs.reserve(static_cast<size_t>(3 * placement_->num_ranks()));
      s->rows_out = AlignedBuffer();
      s->rows_in = AlignedBuffer();
      s->headers = AlignedBuffer(header_bytes_ * static_cast<size_t>(placement_->num_ranks()));
    }
    s->reqs.clear();
    if (s->active) {
      for (size_t d = 0; d < in_flight_.size(); ++d) in_flight_[d] -= s->rows_to[d];
      s->active = false;
    }
  }
  return abandoned;
}

Status RouterLayer::Dispatch(Stage& st, const float* x, int64_t t0, int64_t tokens) {
  const MoeLayerWeights& w = *w_;
  const int64_t hidden = w.spec.hidden;
  const int k = w.spec.top_k;
  const int ranks = placement_->num_ranks();
  st.t0 = t0;
  st.tokens = tokens;
  const float* xs = x + t0 * hidden;

  // Gate and plan.
  const auto t_gate = SteadyClock::now();
  st.gating.Run(xs, tokens);
  std::fill(st.rows_to.begin(), st.rows_to.end(), 0.0);
  std::copy(in_flight_.begin(), in_flight_.end(), st.rows_to.begin());
  const LayerPlacement& lp = Live();
  if (orphans_ > 0) MOERUN_RETURN_IF_ERROR(NoOrphans(st.gating.ids().data(), tokens * k));
  const bool nodes_known = opts_.rank_node.size() == static_cast<size_t>(ranks);
  DispatchLocality locality;
  if (nodes_known) {
    locality.rank_node = opts_.rank_node;
    locality.node = opts_.rank_node[static_cast<size_t>(t_->rank())];
    locality.spill = opts_.node_spill;
  }
  st.plan.Build(st.gating.ids().data(), tokens, k, lp, st.rows_to,
                nodes_known ? &locality : nullptr);  // rows_to: load after
  if (nodes_known) {
    stats_.off_node_rows += static_cast<uint64_t>(st.plan.off_node_rows);
    stats_.off_node_token_nodes += static_cast<uint64_t>(st.plan.off_node_token_nodes);
  }
  if (routing_observer_) routing_observer_(st.gating.ids().data(), tokens, k);
  for (int d = 0; d < ranks; ++d) {
    st.rows_to[static_cast<size_t>(d)] = static_cast<double>(st.plan.rows_to(d));
    in_flight_[static_cast<size_t>(d)] += st.rows_to[static_cast<size_t>(d)];
    stats_.rows_per_rank[static_cast<size_t>(d)] += static_cast<uint64_t>(st.plan.rows_to(d));
  }
  st.active = true;
  const auto t_dispatch = SteadyClock::now();
  timing_.gate_us += MicrosBetween(t_gate, t_dispatch);
  st.mb_index = -1;
  if (mb_times_.size() < static_cast<size_t>(kMaxTracedMicrobatches)) {
    st.mb_index = static_cast<int>(mb_times_.size());
    MicrobatchTimes& mt = mb_times_.emplace_back();
    mt.layer = w.layer;
    mt.seq = seq_;
    mt.tokens = tokens;
    mt.placement_version = placement_->version();
    mt.gate = t_gate;
    mt.dispatch = t_dispatch;
  }

  // Gather every row into its destination's block.
  const int64_t rows = tokens * k;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  // Both are registered with the transport (an RDMA backend puts rows straight into rows_in at
  // the plan's offsets and sends rows_out without staging).
  MOERUN_RETURN_IF_ERROR(ReserveRegistered(t_, st.rows_out, static_cast<size_t>(rows) * row_bytes));
  MOERUN_RETURN_IF_ERROR(
      ReserveRegistered(t_, st.rows_in,
                        static_cast<size_t>(rows) * row_bytes +
                            static_cast<size_t>(ranks) * sizeof(EpResultTrailer)));
  float* send = st.rows_out.as<float>();
  const int64_t chunk = 256;
  pool_->ParallelFor((rows + chunk - 1) / chunk, [&](int64_t c, int) {
    for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
      std::memcpy(send + r * hidden,
                  xs + static_cast<int64_t>(st.plan.row_token[static_cast<size_t>(r)]) * hidden,
                  row_bytes);
    }
  });

  // Every rank that gets rows: its header, then (SendTo) the receive of its answer is posted
  // and header and rows are sent.
  st.reqs.clear();
  st.ep_deadline = DeadlineIn(opts_.deadline);
  for (int d = placement_->num_routers(); d < ranks; ++d) {
    const int64_t n = st.plan.rows_to(d);
    if (n == 0) continue;
    char* hdr = st.headers.as<char>() + header_bytes_ * static_cast<size_t>(d);
    std::memset(hdr, 0, header_bytes_);
    EpHeaderFixed h;
    h.kind = static_cast<uint32_t>(EpKind::kDispatch);
    h.layer = w.layer;
    h.seq = seq_;
    h.rows = n;
    h.hidden = static_cast<int32_t>(hidden);
    const auto& slots = lp.rank_slots[static_cast<size_t>(d)];
    h.slots = static_cast<int32_t>(slots.size());
    std::memcpy(hdr, &h, sizeof h);
    EpEntry* entries = HeaderEntries(hdr);
    for (size_t i = 0; i < slots.size(); ++i) {
      entries[i].expert = lp.slots[static_cast<size_t>(slots[i])].expert;
      entries[i].rows = st.plan.slot_rows[static_cast<size_t>(slots[i])];
    }
    MOERUN_RETURN_IF_ERROR(SendTo(st, d));
  }
  st.seq = seq_;
  ++seq_;
  ++stats_.microbatches;
  stats_.rows_sent += static_cast<uint64_t>(rows);
  const auto t_sent = SteadyClock::now();
  timing_.dispatch_us += MicrosBetween(t_dispatch, t_sent);
  if (Traced(st)) mb_times_[static_cast<size_t>(st.mb_index)].sent = t_sent;

  // The shared expert runs here while the expert ranks work.
  if (w.shared) {
    if (static_cast<int64_t>(shared_rows_.size()) < tokens) {
      const size_t old = shared_rows_.size();
      shared_rows_.resize(static_cast<size_t>(tokens));
      std::iota(shared_rows_.begin() + static_cast<std::ptrdiff_t>(old), shared_rows_.end(),
                static_cast<int32_t>(old));
    }
    const int64_t ldy = shared_ffn_.PaddedHidden(hidden);
    st.shared_y.Reserve(static_cast<size_t>(tokens * ldy) * sizeof(float));
    const ExpertGroup g{&*w.shared, w.spec.SharedAct(w.layer), 0, tokens};
    shared_ffn_.Run(std::span<const ExpertGroup>(&g, 1), xs, hidden, shared_rows_.data(),
                    st.shared_y.as<float>(), ldy);
    timing_.shared_us += MicrosBetween(t_sent, SteadyClock::now());
  }
  return Status::Ok();
}

Status RouterLayer::SendTo(Stage& st, int d) {
  const int64_t hidden = w_->spec.hidden;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t n = st.plan.rows_to(d);
  const int64_t off = st.plan.rank_offset[static_cast<size_t>(d)];
  MOERUN_ASSIGN_OR_RETURN(
      Request rr, t_->Irecv(d, kTagResult, st.rows_in.as<float>() + ResultBlock(st.plan, d, hidden),
                            static_cast<size_t>(n) * row_bytes + sizeof(EpResultTrailer)));
  st.recv_index[static_cast<size_t>(d)] = st.reqs.size();
  st.timed[static_cast<size_t>(d)] = 0;
  st.reqs.push_back(rr);
  const char* hdr = st.headers.as<char>() + header_bytes_ * static_cast<size_t>(d);
  // The round trip starts before the header goes: stamped after the sends, a router thread
  // descheduled between them could find the rank's own time longer than the round trip.
  st.sent_at[static_cast<size_t>(d)] = SteadyClock::now();
  MOERUN_ASSIGN_OR_RETURN(Request hr, t_->Isend(d, kTagHeader, hdr, header_bytes_));
  st.reqs.push_back(hr);
  MOERUN_ASSIGN_OR_RETURN(Request sr, t_->Isend(d, kTagRows, st.rows_out.as<float>() + off * hidden,
                                                static_cast<size_t>(n) * row_bytes));
  st.reqs.push_back(sr);
  return Status::Ok();
}

Status RouterLayer::Collect(Stage& st, float* out) {
  const MoeLayerWeights& w = *w_;
  const int64_t hidden = w.spec.hidden;
  const int k = w.spec.top_k;
  float* recv = st.rows_in.as<float>();
  Deadline retry_until = Deadline::max();  // set by the first retry
  while (true) {
    // At the deadline the late transfers stay valid in st.reqs: Abandon strands or cancels them.
    st.done_at.assign(st.reqs.size(), SteadyClock::time_point{});
    const auto t_wait = SteadyClock::now();
    if (Traced(st)) {
      MicrobatchTimes& mt = mb_times_[static_cast<size_t>(st.mb_index)];
      if (mt.wait == SteadyClock::time_point{}) mt.wait = t_wait;
    }
    const Status waited =
        t_->WaitAll(st.reqs, st.ep_deadline, what_.c_str(), /*cancel_late=*/false, st.done_at);
    timing_.wait_us += MicrosBetween(t_wait, SteadyClock::now());
    if (!waited.ok()) {
      if (waited.code() == StatusCode::kDeadlineExceeded) {
        for (const Request& r : st.reqs) {
          if (r.valid() && std::find(late_.begin(), late_.end(), r.peer) == late_.end()) {
            late_.push_back(r.peer);
          }
        }
      }
      return waited;
    }
    st.reqs.clear();
    // Every rank's trailer: were its rows the answer?
    std::vector<int>& again = retry_ranks_;
    again.clear();
    Status loading;
    for (int d = placement_->num_routers(); d < placement_->num_ranks(); ++d) {
      const int64_t n = st.plan.rows_to(d);
      if (n == 0) continue;
      EpResultTrailer tr;
      std::memcpy(static_cast<void*>(&tr), recv + ResultBlock(st.plan, d, hidden) + n * hidden,
                  sizeof tr);
      if (tr.magic != kEpMagic || tr.seq != st.seq) {
        return Status::Corrupt(what_ + ": rank " + std::to_string(d) +
                               " answered without the protocol's trailer (microbatch " +
                               std::to_string(st.seq) + "): is every rank the same moerun?");
      }
      if (tr.code == 0) {
        const auto ud = static_cast<size_t>(d);
        if (!st.timed[ud]) {  // once per microbatch, in the pass that received it
          st.timed[ud] = 1;
          RankTiming& rt = rank_timing_[ud];
          rt.rows += n;
          rt.round_trip_us += MicrosBetween(st.sent_at[ud], st.done_at[st.recv_index[ud]]);
          rt.compute_us += tr.compute_us;
          RecordRankTimes(st, d, n, tr, st.done_at[st.recv_index[ud]]);
        }
        continue;
      }
      tr.message[sizeof tr.message - 1] = '\0';
      const auto code = tr.code > 0 && tr.code <= static_cast<int32_t>(StatusCode::kInternal)
                            ? static_cast<StatusCode>(tr.code)
                            : StatusCode::kInternal;
      const Status why(code, what_ + ": " + tr.message);
      if ((tr.flags & kResultRetry) == 0) {
        answered_failure_ = true;  // the rank lives; the batch fails
        return why;
      }
      again.push_back(d);
      if (loading.ok()) loading = why;
    }
    if (again.empty()) break;
    // An expert was still loading there: those ranks get their rows again (the others' answers
    // stand; the rank kept what it needs held, and waits up to half the deadline each time),
    // while another such wait fits in the call's deadline (a call without one: ten deadlines).
    const auto now = SteadyClock::now();
    if (retry_until == Deadline::max()) {
      retry_until = call_deadline_ != Deadline::max() ? call_deadline_ : now + 10 * opts_.deadline;
    }
    if (now + opts_.deadline / 2 >= retry_until) {
      answered_failure_ = true;
      return Status(loading.code(),
                    loading.message() +
                        "; the batch gave up waiting for it (a larger deadline_ms, " +
                        "expert_cache_mib or expert_cache_load_mib_s lets such loads finish)");
    }
    ++stats_.load_retries;
    if (now - last_load_warning_ >= std::chrono::seconds(10)) {
      last_load_warning_ = now;
      spdlog::warn("{}: microbatch {} sent again to {} rank(s) ({}; {} such retries so far)", what_,
                   st.seq, again.size(), loading.ToString(), stats_.load_retries);
    }
    for (int d : again) MOERUN_RETURN_IF_ERROR(SendTo(st, d));
    st.ep_deadline = DeadlineIn(opts_.deadline);
  }
  for (size_t d = 0; d < in_flight_.size(); ++d) in_flight_[d] -= st.rows_to[d];
  st.active = false;

  const auto t_combine = SteadyClock::now();
  const int64_t ldy = shared_ffn_.PaddedHidden(hidden);
  const float* shared = w.shared ? st.shared_y.as<float>() : nullptr;
  const int64_t chunk = 64;
  const int64_t tokens = st.tokens;
  pool_->ParallelFor((tokens + chunk - 1) / chunk, [&](int64_t c, int) {
    const float* rows[64];
    for (int64_t t = c * chunk; t < std::min(tokens, (c + 1) * chunk); ++t) {
      for (int j = 0; j < k; ++j) {
        const int64_t r = st.plan.assignment_row[static_cast<size_t>(t * k + j)];
        rows[j] = recv + r * hidden + RankOfRow(st.plan, r) * kResultGapFloats;
      }
      CombineToken(k, hidden, rows, st.gating.weights().data() + t * k,
                   shared ? shared + t * ldy : nullptr,
                   st.gating.shared_scale()[static_cast<size_t>(t)], out + (st.t0 + t) * hidden);
    }
  });
  const auto t_end = SteadyClock::now();
  timing_.combine_us += MicrosBetween(t_combine, t_end);
  if (Traced(st)) {
    MicrobatchTimes& mt = mb_times_[static_cast<size_t>(st.mb_index)];
    mt.combine = t_combine;
    mt.end = t_end;
  }
  return Status::Ok();
}

bool RouterLayer::Traced(const Stage& st) const {
  return st.mb_index >= 0 && static_cast<size_t>(st.mb_index) < mb_times_.size();
}

void RouterLayer::RecordRankTimes(const Stage& st, int d, int64_t rows, const EpResultTrailer& tr,
                                  SteadyClock::time_point received) {
  const auto ud = static_cast<size_t>(d);
  ClockOffset& c = clock_[ud];
  const SteadyClock::time_point sent = st.sent_at[ud];
  if (tr.header_ns > 0 && tr.answer_ns >= tr.header_ns) {
    // NTP: t0 sent, t1 the rank took the header, t2 it answered, t3 received.
    const int64_t t0 = UnixNanos(sent), t3 = UnixNanos(received);
    const int64_t delay = (t3 - t0) - (tr.answer_ns - tr.header_ns);
    const int64_t offset = ((tr.header_ns - t0) + (tr.answer_ns - t3)) / 2;
    if (delay < c.best_delay) {
      c.best_delay = delay;
      c.best_offset = offset;
    }
    if (!c.known || ++c.samples >= kOffsetWindow) {
      c.offset_ns = c.best_offset;
      c.known = true;
      c.samples = 0;
      c.best_delay = INT64_MAX;
    }
  }
  if (!Traced(st) || rank_times_.size() == rank_times_.capacity()) return;
  RankTimes& r = rank_times_.emplace_back();
  r.microbatch = st.mb_index;
  r.rank = d;
  r.rows = rows;
  r.bytes = 2 * rows * w_->spec.hidden * static_cast<int64_t>(sizeof(float));
  r.sent = sent;
  r.received = received;
  r.header_ns = tr.header_ns;
  r.compute_start_ns = tr.compute_start_ns;
  r.answer_ns = tr.answer_ns;
  r.cache_wait_us = tr.cache_wait_us;
  r.clock_offset_ns = c.offset_ns;
}

const BatchTiming& RouterLayer::timing() {
  timed_.clear();
  for (const RankTiming& r : rank_timing_) {
    if (r.rows > 0) timed_.push_back(r);
  }
  timing_.ranks = timed_;
  timing_.microbatches = mb_times_;
  timing_.rank_times = rank_times_;
  return timing_;
}

}  // namespace moerun
