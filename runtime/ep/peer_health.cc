#include "runtime/ep/peer_health.h"

#include <cstring>

#include "base/log.h"
#include "runtime/ep/parked.h"

namespace moerun {

PeerHealth::PeerHealth(Transport* transport, const Placement& placement, size_t header_bytes,
                       PeerHealthOptions options)
    : t_(transport),
      placement_(placement),
      header_bytes_(header_bytes),
      opts_(options),
      state_(static_cast<size_t>(placement.num_ranks())),
      ping_headers_(static_cast<size_t>(placement.num_ranks())),
      strands_(transport),
      dead_(static_cast<size_t>(placement.num_ranks()), false),
      retired_(static_cast<size_t>(placement.num_ranks()), false),
      spare_(static_cast<size_t>(placement.num_ranks()), false),
      started_(SteadyClock::now()) {
  const auto now = SteadyClock::now();
  for (int r = placement_.num_routers(); r < placement_.num_ranks(); ++r) {
    ping_headers_[static_cast<size_t>(r)] = AlignedBuffer(header_bytes_);
    state_[static_cast<size_t>(r)].last_pong = now;
    state_[static_cast<size_t>(r)].next_probe = now;
  }
  Refresh();
}

PeerHealth::~PeerHealth() {
  // Receives can always be withdrawn; a send that cannot (mpi) must keep its buffer until the
  // transport is gone, so the buffers of such leftovers are parked for the process's lifetime.
  auto release = [&](Request& r, bool is_send) {
    if (!r.valid()) return;
    (void)t_->Cancel(r);
    if (is_send && !t_->can_withdraw_sends()) {
      ParkForProcess(std::move(ping_headers_[static_cast<size_t>(r.peer)]));
    }
    r = Request{};
  };
  for (State& s : state_) {
    release(s.pong_recv, false);
    release(s.ping_send, true);
  }
  // strands_ withdraws or parks its own.
}

void PeerHealth::Strand(std::vector<Request> requests, std::vector<AlignedBuffer> buffers) {
  for (const Request& r : requests) {
    if (r.valid()) ++state_[static_cast<size_t>(r.peer)].stranded;
  }
  strands_.Add(std::move(requests), std::move(buffers));
  Refresh();
}

Status PeerHealth::SendProbe(int rank) {
  State& s = state_[static_cast<size_t>(rank)];
  char* hdr = ping_headers_[static_cast<size_t>(rank)].as<char>();
  std::memset(hdr, 0, header_bytes_);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kPing);
  h.seq = ++seq_;
  std::memcpy(hdr, &h, sizeof h);
  MOERUN_ASSIGN_OR_RETURN(s.pong_recv, t_->Irecv(rank, kTagPong, &s.pong_in, sizeof s.pong_in));
  s.ping_sent = SteadyClock::now();
  s.ping_deadline = DeadlineIn(opts_.probe_deadline);
  Result<Request> sent = t_->Isend(rank, kTagHeader, hdr, header_bytes_);
  if (!sent.ok()) {
    (void)t_->Cancel(s.pong_recv);
    s.pong_recv = Request{};
    return sent.status();
  }
  s.ping_send = *sent;
  return Status::Ok();
}

void PeerHealth::Poll() {
  const auto now = SteadyClock::now();
  bool changed = false;
  // Stranded transfers: drop the finished ones.
  strands_.Poll([&](const Request& r, const Status& done) {
    if (!done.ok() && !dead(r.peer)) {
      spdlog::warn("a stranded transfer with rank {} failed: {}", r.peer, done.ToString());
    }
    --state_[static_cast<size_t>(r.peer)].stranded;
    changed = true;
  });
  // Probes.
  for (int r = placement_.num_routers(); r < placement_.num_ranks(); ++r) {
    State& s = state_[static_cast<size_t>(r)];
    if (!dead(r) && t_->peer_failed(r)) {
      MarkDead(r,
               "the transport reports its endpoint failed (the process died or its "
               "connection broke)");
      changed = true;
    }
    if (dead(r)) {
      // Nothing more is sent; what is in flight is only tested so that it is released.
      for (Request* q : {&s.ping_send, &s.pong_recv}) {
        if (!q->valid()) continue;
        Result<bool> done = t_->Test(*q);
        if (!done.ok() || *done) *q = Request{};
      }
      continue;
    }
    if (s.ping_send.valid()) {
      Result<bool> done = t_->Test(s.ping_send);
      if (!done.ok() || *done) s.ping_send = Request{};
    }
    if (s.pong_recv.valid()) {
      Result<bool> done = t_->Test(s.pong_recv);
      if (!done.ok()) {
        s.pong_recv = Request{};
        if (t_->peer_failed(r)) {
          MarkDead(r, "its probe failed: " + done.status().ToString());
          changed = true;
          continue;
        }
        spdlog::warn("probe of rank {} failed: {}", r, done.status().ToString());
        s.next_probe = now + opts_.probe_interval;
      } else if (*done) {
        s.pong_recv = Request{};
        s.pong = s.pong_in;
        s.last_pong = now;
        s.next_probe = now + opts_.probe_interval;
        if (s.late) spdlog::info("rank {} answers again", r);
        s.late = false;
        changed = true;
      } else if (!s.late && now >= s.ping_deadline) {
        s.late = true;
        changed = true;
        spdlog::warn("rank {} did not answer a probe within {} ms", r,
                     opts_.probe_deadline.count());
      }
      if (s.late && opts_.dead_after.count() > 0 && now - s.ping_sent >= opts_.dead_after) {
        MarkDead(r, "no answer to a probe for " + std::to_string(opts_.dead_after.count()) + " ms");
        changed = true;
        continue;
      }
    }
    if (probing_ && !s.pong_recv.valid() && !s.ping_send.valid() && now >= s.next_probe) {
      const Status st = SendProbe(r);
      if (!st.ok()) {
        spdlog::warn("cannot probe rank {}: {}", r, st.ToString());
        s.next_probe = now + opts_.probe_interval;
      }
    }
  }
  if (changed) {
    Refresh();
  } else {
    // last_seen_s moves even when nothing changes.
    std::lock_guard<std::mutex> lock(view_mu_);
    for (PeerView& v : view_) {
      v.last_seen_s =
          std::chrono::duration<double>(now - state_[static_cast<size_t>(v.rank)].last_pong)
              .count();
    }
  }
}

bool PeerHealth::idle() const {
  // What is in flight to a dead rank may never finish: it does not count.
  if (strands_.AnyPeer([&](int peer) { return !dead(peer); })) return false;
  for (size_t i = 0; i < state_.size(); ++i) {
    const State& s = state_[i];
    if ((s.ping_send.valid() || s.pong_recv.valid()) && !dead(static_cast<int>(i))) return false;
  }
  return true;
}

bool PeerHealth::MarkDead(int rank, const std::string& why) {
  if (rank < placement_.num_routers() || rank >= placement_.num_ranks() || dead(rank)) {
    return false;
  }
  dead_[static_cast<size_t>(rank)] = true;
  ++dead_generation_;
  dead_count_.fetch_add(1, std::memory_order_relaxed);
  spdlog::error(
      "rank {} is dead ({}): it gets no more work; its experts are served by their "
      "other copies or re-placed",
      rank, why);
  Refresh();
  return true;
}

bool PeerHealth::Retire(int rank, bool spare) {
  if (rank < placement_.num_routers() || rank >= placement_.num_ranks() || dead(rank)) {
    return false;
  }
  dead_[static_cast<size_t>(rank)] = true;
  retired_[static_cast<size_t>(rank)] = true;
  spare_[static_cast<size_t>(rank)] = spare;
  ++dead_generation_;
  (spare ? spare_count_ : retired_count_).fetch_add(1, std::memory_order_relaxed);
  if (!spare) {
    spdlog::info("rank {} is retired: it gets no more work, probes or control messages", rank);
  }
  Refresh();
  return true;
}

bool PeerHealth::Revive(int rank) {
  if (!dead(rank)) return false;
  const auto r = static_cast<size_t>(rank);
  const bool was_retired = retired_[r], was_spare = spare_[r];
  // The old process's transfers are withdrawn (the transport then takes the new process in:
  // only ucx can, and its cancelled sends finish or are reaped there).
  State& s = state_[r];
  for (Request* q : {&s.ping_send, &s.pong_recv}) {
    if (q->valid()) (void)t_->Cancel(*q);
  }
  strands_.CancelPeer(rank);
  const auto now = SteadyClock::now();
  s = State{};
  s.last_pong = now;
  s.next_probe = now;
  dead_[r] = false;
  retired_[r] = false;
  spare_[r] = false;
  ++dead_generation_;
  (was_spare     ? spare_count_
   : was_retired ? retired_count_
                 : dead_count_)
      .fetch_sub(1, std::memory_order_relaxed);
  spdlog::info(
      "rank {} is back (a new process joined the job as rank {}): it is probed and "
      "gets work again once a placement gives it experts",
      rank, rank);
  Refresh();
  return true;
}

int PeerHealth::FirstUnusable(const int64_t* rows_per_rank) const {
  for (int r = placement_.num_routers(); r < placement_.num_ranks(); ++r) {
    if (rows_per_rank[r] > 0 && !state_[static_cast<size_t>(r)].usable) return r;
  }
  return -1;
}

void PeerHealth::Refresh() {
  const auto now = SteadyClock::now();
  bool all = true;
  std::lock_guard<std::mutex> lock(view_mu_);
  view_.clear();
  for (int r = placement_.num_routers(); r < placement_.num_ranks(); ++r) {
    State& s = state_[static_cast<size_t>(r)];
    const bool was = s.usable;
    const bool is_dead = dead(r);
    s.usable = !is_dead && !s.late && s.stranded == 0;
    if (!is_dead && was && !s.usable && s.stranded > 0 && !s.late) {
      spdlog::warn("rank {} missed a deadline: its late transfers stay posted until it catches up",
                   r);
    } else if (!is_dead && !was && s.usable) {
      spdlog::info("rank {} is answering again", r);
    }
    all = all && (s.usable || is_dead);
    PeerView v;
    v.rank = r;
    v.answering = s.usable;
    v.stranded = s.stranded > 0;
    v.dead = is_dead;
    v.retired = retired_[static_cast<size_t>(r)];
    v.spare = spare_[static_cast<size_t>(r)];
    v.last_seen_s = std::chrono::duration<double>(now - s.last_pong).count();
    v.microbatches = s.pong.microbatches;
    v.rows = s.pong.rows;
    v.busy_us = s.pong.busy_us;
    v.memory_budget_bytes = s.pong.memory_budget_bytes;
    v.resident_bytes = s.pong.resident_bytes;
    v.pid = s.pong.pid;
    v.host.assign(s.pong.host, strnlen(s.pong.host, sizeof s.pong.host));
    v.cache_budget_bytes = s.pong.cache_budget_bytes;
    v.cache_resident_bytes = s.pong.cache_resident_bytes;
    v.cache_hits = s.pong.cache_hits;
    v.cache_misses = s.pong.cache_misses;
    v.cache_hosted = s.pong.cache_hosted;
    v.cache_resident = s.pong.cache_resident;
    view_.push_back(v);
  }
  all_answering_.store(all, std::memory_order_relaxed);
}

std::vector<PeerView> PeerHealth::Snapshot() const {
  std::lock_guard<std::mutex> lock(view_mu_);
  return view_;
}

void PeerHealth::CopyView(std::vector<PeerView>* out) const {
  std::lock_guard<std::mutex> lock(view_mu_);
  *out = view_;
}

}  // namespace moerun
