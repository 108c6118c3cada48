#include "runtime/ep/expert_server.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "base/idle_backoff.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/trace_context.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/ep/parked.h"
#include "runtime/ep/registered_buffer.h"
#include "runtime/model/layer_weights.h"

namespace moerun {

ExpertServer::ExpertServer(Transport* transport, const Placement& placement,
                           const std::vector<int>& layer_ids, const CpuKernels& kernels,
                           ThreadPool* pool, ExpertServerOptions options,
                           ExpertControlPort* control)
    : t_(transport),
      opts_(options),
      ffn_(kernels, pool),
      header_bytes_(HeaderBytes(placement, layer_ids)),
      control_(control) {
  routers_.resize(static_cast<size_t>(placement.num_routers()));
  for (auto& r : routers_) {
    r.header = AlignedBuffer(header_bytes_);
    r.ahead = AlignedBuffer(header_bytes_);
  }
  entries_.reserve(Placement::kMaxSlotsPerRank);
}

Status ExpertServer::ReserveIo(AlignedBuffer& b, size_t bytes) {
  if (bytes <= b.size()) return Status::Ok();
  const HostPinning& pin = compute_.pinning();
  if (pin.unpin && b.data() != nullptr) pin.unpin(b.data());
  MOERUN_RETURN_IF_ERROR(ReserveRegistered(t_, b, bytes));
  if (pin.pin) return pin.pin(b.data(), b.size());
  return Status::Ok();
}

void ExpertServer::ReleaseIo(AlignedBuffer& b) {
  const HostPinning& pin = compute_.pinning();
  if (pin.unpin && b.data() != nullptr) pin.unpin(b.data());
  Unregister(t_, b);
}

ExpertServer::~ExpertServer() {
  // Serve may have ended on an error with transfers still posted (a result send to a router
  // that stopped reading): every one is withdrawn before its buffer is freed.
  bool sends_left = false;
  for (auto& r : routers_) {
    if (r.rows_req.valid()) (void)t_->Cancel(r.rows_req);
    if (r.header_req.valid()) (void)t_->Cancel(r.header_req);
    for (Request* q : {&r.out_req[0], &r.out_req[1], &r.pong_req}) {
      if (!q->valid()) continue;
      (void)t_->Cancel(*q);
      sends_left = true;
    }
    for (AlignedBuffer& b : r.out) ReleaseIo(b);
    for (AlignedBuffer& b : r.in) ReleaseIo(b);
  }
  if (sends_left && !t_->can_withdraw_sends()) {
    // A peer may still read them (mpi): their buffers (results, pongs) live as long as the
    // process. The vector's elements keep their addresses when it is moved.
    ParkForProcess(std::move(routers_));
  }
}

Status ExpertServer::ServeRouter(int r, bool* progressed) {
  const int me = t_->rank();
  RouterState& rs = routers_[static_cast<size_t>(r)];
  // A header taken ahead comes first (its successor's receive is already posted).
  const char* hdr = rs.header.as<char>();
  bool needed = false;
  if (rs.have_ahead) {
    rs.have_ahead = false;
    needed = rs.ahead_needed;
    rs.ahead_needed = false;
    hdr = rs.ahead.as<char>();
    rs.header_at = rs.ahead_at;
  } else {
    if (!rs.header_req.valid()) return Status::Ok();
    MOERUN_ASSIGN_OR_RETURN(const bool done, t_->Test(rs.header_req));
    if (!done) return Status::Ok();
    rs.header_req = Request{};
    rs.header_at = SteadyClock::now();
  }
  *progressed = true;
  EpHeaderFixed h;
  std::memcpy(&h, hdr, sizeof h);
  if (h.magic != kEpMagic) {
    return Status::Corrupt("rank " + std::to_string(me) + ": bad header from router " +
                           std::to_string(r));
  }
  if (h.kind == static_cast<uint32_t>(EpKind::kShutdown)) {
    rs.done = true;
    return Status::Ok();
  }
  if (h.kind == static_cast<uint32_t>(EpKind::kPing)) {
    if (!rs.header_req.valid()) {
      MOERUN_ASSIGN_OR_RETURN(rs.header_req,
                              t_->Irecv(r, kTagHeader, rs.header.data(), header_bytes_));
    }
    MOERUN_RETURN_IF_ERROR(Pong(r, h.seq));
    return Status::Ok();
  }
  if (h.kind == static_cast<uint32_t>(EpKind::kControl) ||
      h.kind == static_cast<uint32_t>(EpKind::kEcho)) {
    if (!rs.header_req.valid()) {
      MOERUN_ASSIGN_OR_RETURN(rs.header_req,
                              t_->Irecv(r, kTagHeader, rs.header.data(), header_bytes_));
    }
    if (h.kind == static_cast<uint32_t>(EpKind::kEcho)) return Echo(r, h);
    MOERUN_RETURN_IF_ERROR(control_->OnMessage(r, h));
    return Status::Ok();
  }
  if (h.kind != static_cast<uint32_t>(EpKind::kDispatch)) {
    return Status::Corrupt("rank " + std::to_string(me) + ": header of unknown kind " +
                           std::to_string(h.kind) + " from router " + std::to_string(r));
  }
  if (!SlotsFit(h)) {
    return Status::Corrupt("rank " + std::to_string(me) + ": header from router " +
                           std::to_string(r) + " has " + std::to_string(h.slots) + " slots");
  }
  const EpEntry* entries = HeaderEntries(hdr);
  entries_.assign(entries, entries + h.slots);
  // The next header may land while this microbatch is computed.
  if (!rs.header_req.valid()) {
    MOERUN_ASSIGN_OR_RETURN(rs.header_req,
                            t_->Irecv(r, kTagHeader, rs.header.data(), header_bytes_));
  }
  return Handle(r, h, entries_.data(), needed);
}

void ExpertServer::DropRouter(int r, const Status& why) {
  spdlog::error(
      "expert rank {}: router {} is gone ({}): what it had in flight is dropped; the "
      "other routers are served",
      t_->rank(), r, why.ToString());
  RouterState& rs = routers_[static_cast<size_t>(r)];
  for (Request* q : {&rs.header_req, &rs.rows_req, &rs.out_req[0], &rs.out_req[1], &rs.pong_req}) {
    if (q->valid()) (void)t_->Cancel(*q);  // sends too: only a backend that can tell withdraws
    *q = Request{};
  }
  if (rs.have_ahead && rs.ahead_needed) {
    // The experts its next header asked the cache for are not needed any more.
    EpHeaderFixed h;
    std::memcpy(&h, rs.ahead.data(), sizeof h);
    const EpEntry* entries = HeaderEntries(rs.ahead.data());
    for (int i = 0; i < h.slots; ++i) {
      if (entries[i].rows > 0) serving_.cache->Done(h.layer, entries[i].expert);
    }
  }
  rs.have_ahead = false;
  rs.ahead_needed = false;
  rs.pre = -1;
  rs.done = true;
  ReleaseKept(rs);
}

void ExpertServer::ReleaseKept(RouterState& rs) {
  if (ExpertCache* cache = serving_.cache) {
    for (const RouterState::Kept& k : rs.kept) cache->Done(k.layer, k.expert);
  }
  rs.kept.clear();
}

void ExpertServer::ReleaseKeptFor(RouterState& rs, const EpHeaderFixed& h) {
  ExpertCache* cache = serving_.cache;
  if (rs.kept.empty() || cache == nullptr) return;
  size_t left = 0;
  for (const RouterState::Kept& k : rs.kept) {
    const auto ahead = static_cast<int32_t>(h.seq - k.seq);
    if (h.layer != k.layer || ahead == 0 || ahead >= 2) {
      cache->Done(k.layer, k.expert);
    } else {
      rs.kept[left++] = k;
    }
  }
  rs.kept.resize(left);
}

Status ExpertServer::Serve() {
  for (int r = 0; r < static_cast<int>(routers_.size()); ++r) {
    RouterState& rs = routers_[static_cast<size_t>(r)];
    MOERUN_ASSIGN_OR_RETURN(rs.header_req,
                            t_->Irecv(r, kTagHeader, rs.header.data(), header_bytes_));
  }
  int alive = static_cast<int>(routers_.size());
  IdleBackoff idle(static_cast<uint64_t>(t_->idle_spins()), t_);
  while (alive > 0) {
    MOERUN_RETURN_IF_ERROR(control_->Poll());
    bool progressed = false;
    for (int r = 0; r < static_cast<int>(routers_.size()); ++r) {
      RouterState& rs = routers_[static_cast<size_t>(r)];
      if (rs.done) continue;
      // A router whose process died (its endpoint failed: ucx) is dropped; the others go on.
      Status s = t_->peer_failed(r) ? Status::Unavailable("its endpoint failed")
                                    : ServeRouter(r, &progressed);
      if (!s.ok()) {
        if (!t_->peer_failed(r)) return s;
        DropRouter(r, s);
      }
      if (rs.done) --alive;
    }
    if (progressed) {
      idle.Progress();
    } else {
      idle.Idle();
    }
  }
  // Control replies are small; one the routers no longer wait for (they have all stopped) is
  // withdrawn after a short wait.
  control_->Drain(DeadlineIn(std::chrono::milliseconds(2000)));
  for (auto& rs : routers_) {
    if (rs.pong_req.valid()) {
      MOERUN_RETURN_IF_ERROR(t_->Wait(rs.pong_req, DeadlineIn(opts_.deadline), "pong send"));
      rs.pong_req = Request{};
    }
    for (Request& q : rs.out_req) {
      if (q.valid()) MOERUN_RETURN_IF_ERROR(t_->Wait(q, DeadlineIn(opts_.deadline), "result send"));
      q = Request{};
    }
  }
  return Status::Ok();
}

Result<float*> ExpertServer::ResultBuffer(int router, size_t bytes) {
  RouterState& rs = routers_[static_cast<size_t>(router)];
  const int slot = rs.next_out;
  rs.next_out ^= 1;
  if (rs.out_req[slot].valid()) {
    MOERUN_RETURN_IF_ERROR(t_->Wait(rs.out_req[slot], DeadlineIn(opts_.deadline), "result send"));
    rs.out_req[slot] = Request{};
  }
  // The rows, then the trailer that says whether they are the answer.
  MOERUN_RETURN_IF_ERROR(ReserveIo(rs.out[slot], bytes + sizeof(EpResultTrailer)));
  return rs.out[slot].as<float>();
}

Status ExpertServer::Echo(int router, const EpHeaderFixed& h) {
  if (h.rows < 0 || h.hidden <= 0 || h.rows * h.hidden * int64_t{4} > kMaxEchoBytes) {
    return Status::Corrupt("rank " + std::to_string(t_->rank()) + ": echo of " +
                           std::to_string(h.rows) + " x " + std::to_string(h.hidden) +
                           " from router " + std::to_string(router));
  }
  RouterState& rs = routers_[static_cast<size_t>(router)];
  const size_t bytes = static_cast<size_t>(h.rows * h.hidden) * sizeof(float);
  const int k = rs.next_in;
  rs.next_in = k ^ 1;
  MOERUN_RETURN_IF_ERROR(ReserveIo(rs.in[k], bytes));
  MOERUN_RETURN_IF_ERROR(
      t_->Recv(router, kTagRows, rs.in[k].data(), bytes, DeadlineIn(opts_.deadline)));
  const int slot = rs.next_out;
  MOERUN_ASSIGN_OR_RETURN(float* out, ResultBuffer(router, bytes));
  std::memcpy(out, rs.in[k].data(), bytes);
  EpResultTrailer answer;
  answer.seq = h.seq;
  std::memcpy(reinterpret_cast<char*>(out) + bytes, &answer, sizeof answer);
  MOERUN_ASSIGN_OR_RETURN(rs.out_req[slot],
                          t_->Isend(router, kTagResult, out, bytes + sizeof(EpResultTrailer)));
  return Status::Ok();
}

Status ExpertServer::Pong(int router, uint32_t seq) {
  RouterState& rs = routers_[static_cast<size_t>(router)];
  if (rs.pong_req.valid()) {
    MOERUN_RETURN_IF_ERROR(t_->Wait(rs.pong_req, DeadlineIn(opts_.deadline), "pong send"));
    rs.pong_req = Request{};
  }
  rs.pong.seq = seq;
  rs.pong.microbatches = served_;
  rs.pong.rows = rows_served_;
  rs.pong.busy_us = busy_us_;
  rs.pong.memory_budget_bytes = opts_.memory_budget_bytes;
  rs.pong.resident_bytes = static_cast<uint64_t>(ProcessResidentBytes());
  rs.pong.pid = static_cast<uint64_t>(::getpid());
  ::gethostname(rs.pong.host, sizeof rs.pong.host - 1);
  if (const ExpertCache* c = serving_.cache) {
    const ExpertCacheStats& st = c->stats();
    rs.pong.cache_budget_bytes = c->options().budget_bytes;
    rs.pong.cache_resident_bytes = st.resident_bytes.load();
    rs.pong.cache_hits = st.hits.load();
    rs.pong.cache_misses = st.misses.load();
    rs.pong.cache_hosted = static_cast<uint32_t>(st.hosted_experts.load());
    rs.pong.cache_resident = static_cast<uint32_t>(st.resident_experts.load());
  }
  MOERUN_ASSIGN_OR_RETURN(rs.pong_req, t_->Isend(router, kTagPong, &rs.pong, sizeof rs.pong));
  return Status::Ok();
}

bool ExpertServer::SlotsFit(const EpHeaderFixed& h) const {
  return h.slots >= 0 && h.slots <= Placement::kMaxSlotsPerRank &&
         sizeof(EpHeaderFixed) + sizeof(EpEntry) * static_cast<size_t>(h.slots) <= header_bytes_;
}

Result<int64_t> ExpertServer::RowsOf(const EpHeaderFixed& h, const EpEntry* entries) const {
  const int me = t_->rank();
  const MoeLayerWeights* lw = serving_.layer(h.layer);
  if (lw == nullptr) {
    return Status::InvalidArgument("rank " + std::to_string(me) + " does not serve layer " +
                                   std::to_string(h.layer));
  }
  const MoeLayerWeights& w = *lw;
  if (h.hidden != w.spec.hidden || h.rows < 0) {
    return Status::Corrupt("rank " + std::to_string(me) + ": header for layer " +
                           std::to_string(h.layer) + " does not match the layer's shape");
  }
  int64_t rows = 0;
  for (int i = 0; i < h.slots; ++i) {
    if (entries[i].rows < 0) return Status::Corrupt("negative row count in a header");
    if (entries[i].expert < 0 || entries[i].expert >= static_cast<int32_t>(w.experts.size())) {
      return Status::Corrupt("rank " + std::to_string(me) + ": header for layer " +
                             std::to_string(h.layer) + " names expert " +
                             std::to_string(entries[i].expert) + " of " +
                             std::to_string(w.experts.size()));
    }
    rows += entries[i].rows;
  }
  if (rows != h.rows) return Status::Corrupt("header row counts do not add up");
  return rows;
}

Status ExpertServer::LookAhead(int router) {
  RouterState& rs = routers_[static_cast<size_t>(router)];
  if (rs.have_ahead || !rs.header_req.valid()) return Status::Ok();
  MOERUN_ASSIGN_OR_RETURN(const bool done, t_->Test(rs.header_req));
  if (!done) return Status::Ok();
  rs.header_req = Request{};
  std::memcpy(rs.ahead.data(), rs.header.data(), header_bytes_);
  rs.have_ahead = true;
  rs.ahead_at = SteadyClock::now();
  EpHeaderFixed h;
  std::memcpy(&h, rs.ahead.data(), sizeof h);
  if (h.magic != kEpMagic || h.kind == static_cast<uint32_t>(EpKind::kShutdown)) {
    return Status::Ok();  // the main loop reports or ends; nothing follows a shutdown
  }
  MOERUN_ASSIGN_OR_RETURN(rs.header_req,
                          t_->Irecv(router, kTagHeader, rs.header.data(), header_bytes_));
  if (h.kind != static_cast<uint32_t>(EpKind::kDispatch) || !SlotsFit(h)) return Status::Ok();
  Result<int64_t> rows = RowsOf(h, HeaderEntries(rs.ahead.data()));
  if (!rows.ok()) return Status::Ok();  // reported when the main loop handles it
  if (serving_.cache != nullptr) {      // loads of missing experts start before the rows are in
    NeedExperts(h, HeaderEntries(rs.ahead.data()));
    rs.ahead_needed = true;
  }
  const size_t bytes = static_cast<size_t>(*rows * h.hidden) * sizeof(float);
  const int k = rs.next_in;
  MOERUN_RETURN_IF_ERROR(ReserveIo(rs.in[k], bytes));
  MOERUN_ASSIGN_OR_RETURN(rs.rows_req, t_->Irecv(router, kTagRows, rs.in[k].data(), bytes));
  rs.pre = k;
  rs.pre_bytes = bytes;
  return Status::Ok();
}

void ExpertServer::NeedExperts(const EpHeaderFixed& h, const EpEntry* entries) {
  ExpertCache* cache = serving_.cache;
  cache->Tick();
  for (int i = 0; i < h.slots; ++i) {
    if (entries[i].rows > 0) cache->Need(h.layer, entries[i].expert);
  }
  (void)cache->Poll();  // start them now (errors come back to the microbatch that needs them)
}

Status ExpertServer::Handle(int router, const EpHeaderFixed& h, const EpEntry* entries,
                            bool needed) {
  const int me = t_->rank();
  MOERUN_ASSIGN_OR_RETURN(const int64_t rows, RowsOf(h, entries));  // checks layer and experts
  ExpertCache* cache = serving_.cache;
  if (cache != nullptr && !needed) NeedExperts(h, entries);
  // This microbatch holds what it needs now.
  ReleaseKeptFor(routers_[static_cast<size_t>(router)], h);
  const MoeLayerWeights& w = *serving_.layer(h.layer);
  const int64_t hidden = w.spec.hidden;

  // Receive the rows (the router puts them into a registered buffer), unless LookAhead has
  // already posted that receive; then take the next header while these rows are computed.
  RouterState& rin = routers_[static_cast<size_t>(router)];
  const size_t bytes = static_cast<size_t>(rows * hidden) * sizeof(float);
  int k = rin.pre;
  if (k >= 0) {
    if (rin.pre_bytes != bytes) return Status::Internal("prefetched rows of another size");
    MOERUN_RETURN_IF_ERROR(t_->Wait(rin.rows_req, DeadlineIn(opts_.deadline), "rows"));
    rin.rows_req = Request{};
    rin.pre = -1;
  } else {
    k = rin.next_in;
    MOERUN_RETURN_IF_ERROR(ReserveIo(rin.in[k], bytes));
    MOERUN_RETURN_IF_ERROR(
        t_->Recv(router, kTagRows, rin.in[k].data(), bytes, DeadlineIn(opts_.deadline)));
  }
  rin.next_in = k ^ 1;
  const AlignedBuffer& in = rin.in[k];
  MOERUN_RETURN_IF_ERROR(LookAhead(router));

  // One grouped pass over every local expert.
  groups_.clear();
  group_ids_.clear();
  group_expert_.clear();
  group_rows_.clear();
  int64_t first = 0;
  const ActParams act = w.spec.RoutedAct(w.layer);
  for (int i = 0; i < h.slots; ++i) {
    const int expert = entries[i].expert;
    const int32_t n = entries[i].rows;
    const ExpertWeights& ew = w.experts[static_cast<size_t>(expert)];
    if (n > 0 && !serving_.hosts(h.layer, expert)) {
      return Status::Internal("rank " + std::to_string(me) + " got rows for expert " +
                              std::to_string(expert) + " of layer " + std::to_string(h.layer) +
                              ", which it does not hold");
    }
    groups_.push_back(ExpertGroup{&ew, act, first, n});
    group_ids_.push_back(expert);
    if (n > 0) {
      group_expert_.push_back(expert);
      group_rows_.push_back(n);
    }
    if (rows_observer_ && n > 0) rows_observer_(h.layer, expert, n);
    first += n;
  }
  if (static_cast<int64_t>(rows_.size()) < rows) {
    const size_t old = rows_.size();
    rows_.resize(static_cast<size_t>(rows));
    std::iota(rows_.begin() + static_cast<std::ptrdiff_t>(old), rows_.end(),
              static_cast<int32_t>(old));
  }
  // Outputs go to one of two send buffers (the previous send from the other may be in flight),
  // straight from the kernels when rows need no padding.
  RouterState& rs = routers_[static_cast<size_t>(router)];
  const int slot = rs.next_out;
  MOERUN_ASSIGN_OR_RETURN(float* out, ResultBuffer(router, bytes));
  EpResultTrailer answer;
  answer.seq = h.seq;
  const auto compute_start = SteadyClock::now();
  last_cache_wait_us_ = 0;
  const int64_t ldy = ffn_.PaddedHidden(hidden);
  if (compute_) {
    MOERUN_RETURN_IF_ERROR(compute_(h.layer, in.as<float>(), group_expert_, group_rows_, out));
  } else if (ldy == hidden) {
    MOERUN_RETURN_IF_ERROR(
        RunGroups(h.layer, in.as<float>(), hidden, out, ldy, &answer, &rs.kept, rin.header_at));
  } else {
    y_.Reserve(static_cast<size_t>(rows * ldy) * sizeof(float));
    const float* y = y_.as<float>();
    MOERUN_RETURN_IF_ERROR(RunGroups(h.layer, in.as<float>(), hidden, y_.as<float>(), ldy, &answer,
                                     &rs.kept, rin.header_at));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out + r * hidden, y + r * ldy, static_cast<size_t>(hidden) * sizeof(float));
    }
  }
  if (answer.code == 0 && serving_.has_updates) RunCanaries(h, entries, in.as<float>(), out);
  const auto compute_end = SteadyClock::now();
  answer.compute_us = static_cast<uint32_t>(std::min<int64_t>(
      UINT32_MAX,
      std::chrono::duration_cast<std::chrono::microseconds>(compute_end - compute_start).count()));
  answer.cache_wait_us = static_cast<uint32_t>(std::min<int64_t>(UINT32_MAX, last_cache_wait_us_));
  answer.header_ns = UnixNanos(rin.header_at);
  answer.compute_start_ns = UnixNanos(compute_start);
  answer.answer_ns = UnixNanos(compute_end);
  std::memcpy(reinterpret_cast<char*>(out) + bytes, &answer, sizeof answer);
  MOERUN_ASSIGN_OR_RETURN(rs.out_req[slot],
                          t_->Isend(router, kTagResult, out, bytes + sizeof(EpResultTrailer)));
  ++served_;
  rows_served_ += static_cast<uint64_t>(rows);
  busy_us_ += answer.compute_us - std::min(answer.compute_us, answer.cache_wait_us);
  return Status::Ok();
}

namespace {

// The microbatch is answered with `why` instead of rows.
void AnswerWith(EpResultTrailer* answer, const Status& why, uint32_t flags) {
  answer->code = static_cast<int32_t>(why.code());
  answer->flags = flags;
  const std::string text = why.message();
  const size_t n = std::min(text.size(), sizeof answer->message - 1);
  std::memcpy(answer->message, text.data(), n);
  answer->message[n] = '\0';
}

}  // namespace

Status ExpertServer::RunGroups(int layer, const float* in, int64_t hidden, float* y, int64_t ldy,
                               EpResultTrailer* answer, std::vector<RouterState::Kept>* kept,
                               SteadyClock::time_point header_at) {
  ExpertCache* cache = serving_.cache;
  if (cache == nullptr) {
    ffn_.Run(groups_, in, hidden, rows_.data(), y, ldy);
    return Status::Ok();
  }
  ready_.clear();
  pending_.clear();
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].rows == 0) continue;
    if (cache->resident(layer, group_ids_[i])) {
      ready_.push_back(groups_[i]);
    } else {
      pending_.push_back(i);
    }
  }
  if (!ready_.empty()) ffn_.Run(ready_, in, hidden, rows_.data(), y, ldy);
  Status status;
  if (!pending_.empty()) {
    // Each row's output depends on its expert's weights alone: computing the groups in several
    // passes gives the same bits as one pass. The wait ends half the deadline after the header
    // came (a microbatch queued behind another that waited does not wait as long), so that the
    // router hears why before its deadline would declare this rank dead.
    const auto start = SteadyClock::now();
    const Deadline until = header_at + opts_.deadline / 2;
    while (!pending_.empty()) {
      status = cache->Poll();
      if (!status.ok()) break;
      ready_.clear();
      for (size_t j = 0; j < pending_.size();) {
        const size_t i = pending_[j];
        const Status failed = cache->Failed(layer, group_ids_[i]);
        if (!failed.ok()) {
          AnswerWith(answer, failed.WithContext("rank " + std::to_string(t_->rank())), 0);
          pending_.clear();
          break;
        }
        if (cache->resident(layer, group_ids_[i])) {
          ready_.push_back(groups_[i]);
          pending_[j] = pending_.back();
          pending_.pop_back();
        } else {
          ++j;
        }
      }
      if (answer->code != 0) break;
      if (!ready_.empty()) ffn_.Run(ready_, in, hidden, rows_.data(), y, ldy);
      if (pending_.empty()) break;
      const auto now = SteadyClock::now();
      if (now >= until) {
        // Its load goes on: the router sends these rows again.
        AnswerWith(answer,
                   Status::Unavailable(
                       "rank " + std::to_string(t_->rank()) + ": layer " + std::to_string(layer) +
                       " expert " + std::to_string(group_ids_[pending_.front()]) +
                       " is still loading after " + std::to_string((opts_.deadline / 2).count()) +
                       " ms (expert cache)"),
                   kResultRetry);
        break;
      }
      cache->WaitForLoad(std::min<Deadline>(until, now + std::chrono::milliseconds(2)));
    }
    const auto waited = SteadyClock::now() - start;
    last_cache_wait_us_ = std::chrono::duration_cast<std::chrono::microseconds>(waited).count();
    if (cache_wait_) cache_wait_(std::chrono::duration<double>(waited).count());
  }
  const bool retry = (answer->flags & kResultRetry) != 0;
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].rows == 0) continue;
    if (retry) {
      kept->push_back({layer, group_ids_[i], answer->seq});
    } else {
      cache->Done(layer, group_ids_[i]);
    }
  }
  return status;
}

void ExpertServer::RunCanaries(const EpHeaderFixed& h, const EpEntry* entries, const float* in,
                               float* out) {
  const MoeLayerWeights& w = *serving_.layer(h.layer);
  const int64_t hidden = w.spec.hidden;
  const ActParams act = w.spec.RoutedAct(w.layer);
  int64_t first = 0;
  for (int i = 0; i < h.slots; ++i) {
    const int64_t n = entries[i].rows;
    canary_rows_.clear();
    const ExpertWeights* updated =
        n > 0 ? control_->CanaryRows(h.layer, entries[i].expert, first, n, &canary_rows_) : nullptr;
    first += n;
    if (canary_rows_.empty()) continue;
    const auto m = static_cast<int64_t>(canary_rows_.size());
    const int64_t ldy = ffn_.PaddedHidden(hidden);
    canary_y_.Reserve(static_cast<size_t>(m * ldy) * sizeof(float));
    const ExpertGroup g{updated, act, 0, m};
    ffn_.Run(std::span<const ExpertGroup>(&g, 1), in, hidden, canary_rows_.data(),
             canary_y_.as<float>(), ldy);
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(out + static_cast<int64_t>(canary_rows_[static_cast<size_t>(r)]) * hidden,
                  canary_y_.as<float>() + r * ldy, static_cast<size_t>(hidden) * sizeof(float));
    }
  }
}

}  // namespace moerun
