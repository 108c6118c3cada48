#include "runtime/ranks/router_rank.h"

#include <cstring>
#include <mutex>
#include <thread>

#include "base/log.h"
#include "runtime/ep/parked.h"
#include "runtime/ep/protocol.h"

namespace moerun {

RouterRank::RouterRank(Transport* transport, std::shared_ptr<const Placement> placement,
                       const std::map<int, std::shared_ptr<MoeLayerWeights>>& weights,
                       const CpuKernels& kernels, ThreadPool* pool, size_t header_bytes,
                       EpOptions ep, const RouterRankOptions& options)
    : t_(transport), placement_(std::move(placement)), header_bytes_(header_bytes), ep_(ep) {
  for (const auto& [number, w] : weights) {
    owned_.push_back(
        std::make_unique<RouterLayer>(t_, placement_, w, kernels, pool, header_bytes_, ep_));
    by_number_[number] = owned_.back().get();
  }
  if (options.health) {
    health_ = std::make_unique<PeerHealth>(t_, *placement_, header_bytes_, *options.health);
    for (auto& l : owned_) l->set_health(health_.get());
  }
  if (options.control) {
    control_ =
        std::make_unique<RouterControl>(t_, placement_, by_number_, header_bytes_, ep_.deadline);
    control_->set_health(health_.get());
  }
}

RouterRank::~RouterRank() {
  control_.reset();  // it points at the layers
  owned_.clear();
  health_.reset();
}

RouterLayer* RouterRank::layer(int number) const {
  const auto it = by_number_.find(number);
  return it == by_number_.end() ? nullptr : it->second;
}

Status RouterRank::Forward(int number, const float* x, int64_t tokens, float* out,
                           Deadline deadline, BatchStream* stream) {
  RouterLayer* l = layer(number);
  if (l == nullptr) {
    return Status::InvalidArgument("layer " + std::to_string(number) + " is not served");
  }
  if (health_) health_->Poll();
  return l->Forward(x, tokens, out, deadline, stream);
}

Result<int64_t> RouterRank::EchoRoundTrip(int rank, const float* x, int64_t rows, int64_t hidden,
                                          float* out, Deadline deadline) {
  if (rank < placement_->num_routers() || rank >= placement_->num_ranks()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is not an expert rank");
  }
  if (rows < 1 || hidden < 1 || rows * hidden * int64_t{4} > kMaxEchoBytes) {
    return Status::InvalidArgument("an echo of " + std::to_string(rows) + " x " +
                                   std::to_string(hidden) + " floats");
  }
  if (health_ && health_->dead_mask()[static_cast<size_t>(rank)]) {
    return Status::Unavailable("expert rank " + std::to_string(rank) + " is dead");
  }
  // The caller's deadline (a client's) decides only whether the echo starts; once sent, it is
  // waited for by the job's expert-parallel deadline, so that a short one never cancels
  // transfers in flight (their late answer would meet the next receive of the channel).
  if (SteadyClock::now() >= deadline) {
    return Status::DeadlineExceeded("the echo's deadline passed before it was sent");
  }
  const size_t bytes = static_cast<size_t>(rows * hidden) * sizeof(float);
  echo_header_.assign(header_bytes_, 0);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kEcho);
  h.seq = ++echo_seq_;
  h.rows = rows;
  h.hidden = static_cast<int32_t>(hidden);
  std::memcpy(echo_header_.data(), &h, sizeof h);
  echo_in_.resize(bytes / sizeof(float) + sizeof(EpResultTrailer) / sizeof(float));
  const auto t0 = SteadyClock::now();
  Request reqs[3];
  MOERUN_ASSIGN_OR_RETURN(
      reqs[0], t_->Irecv(rank, kTagResult, echo_in_.data(), bytes + sizeof(EpResultTrailer)));
  MOERUN_ASSIGN_OR_RETURN(reqs[1], t_->Isend(rank, kTagHeader, echo_header_.data(), header_bytes_));
  MOERUN_ASSIGN_OR_RETURN(reqs[2], t_->Isend(rank, kTagRows, x, bytes));
  MOERUN_RETURN_IF_ERROR(t_->WaitAll(reqs, DeadlineIn(ep_.deadline), "echo"));
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(SteadyClock::now() - t0).count();
  EpResultTrailer tr;
  std::memcpy(static_cast<void*>(&tr), reinterpret_cast<const char*>(echo_in_.data()) + bytes,
              sizeof tr);
  if (tr.magic != kEpMagic || tr.seq != h.seq || tr.code != 0 ||
      std::memcmp(echo_in_.data(), x, bytes) != 0) {
    return Status::Corrupt("expert rank " + std::to_string(rank) +
                           " did not send the echo's rows back as they were");
  }
  std::memcpy(out, echo_in_.data(), bytes);
  return us;
}

Status RouterRank::Poll() {
  if (health_) health_->Poll();
  return control_ ? control_->Poll() : Status::Ok();
}

Status RouterRank::Finish() {
  if (finished_) return Status::Ok();
  finished_ = true;
  control_.reset();
  by_number_.clear();
  owned_.clear();
  std::vector<bool> dead;
  if (health_) {
    // Late transfers and probes finish before the shutdown message queues behind them.
    health_->StopProbing();
    const Deadline until = DeadlineIn(ep_.deadline);
    while (!health_->idle() && SteadyClock::now() < until) {
      health_->Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    dead = health_->dead_mask();
    health_.reset();
  }
  MOERUN_RETURN_IF_ERROR(SendShutdown(t_, *placement_, header_bytes_, ep_.deadline, dead));
  LogTransportCounters(*t_);
  return Status::Ok();
}

Status SendShutdown(Transport* t, const Placement& p, size_t header_bytes,
                    std::chrono::milliseconds deadline, const std::vector<bool>& dead) {
  // The buffer outlives a send to a frozen rank that cannot be withdrawn (ucx, mpi).
  auto header = std::make_unique<std::vector<char>>(header_bytes, 0);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kShutdown);
  std::memcpy(header->data(), &h, sizeof h);
  std::vector<Request> live, gone;
  for (int d = p.num_routers(); d < p.num_ranks(); ++d) {
    const bool is_dead = static_cast<size_t>(d) < dead.size() && dead[static_cast<size_t>(d)];
    if (is_dead && t->peer_failed(d)) continue;  // its process is gone
    Result<Request> r = t->Isend(d, kTagHeader, header->data(), header->size());
    if (!r.ok() && is_dead) continue;
    MOERUN_ASSIGN_OR_RETURN(Request req, std::move(r));
    (is_dead ? gone : live).push_back(req);
  }
  // A dead rank that is in fact frozen ends too once it runs again, if the job still stands.
  Status s = t->WaitAll(live, DeadlineIn(deadline), "shutdown");
  if (!gone.empty()) {
    (void)t->WaitAll(gone, DeadlineIn(std::chrono::milliseconds(200)), "shutdown of a dead rank",
                     /*cancel_late=*/true);
    if (!t->can_withdraw_sends()) ParkForProcess(std::move(header));
  }
  return s;
}

void LogTransportCounters(const Transport& t) {
  const TransportCounters c = t.counters();
  if (c.put_bytes == 0 && c.eager_bytes == 0) return;
  spdlog::info(
      "{} transport: {:.2f} MiB written by put, {:.2f} MiB in eager messages, {} bytes "
      "copied by the transport, {} registrations ({} on demand)",
      t.name(), static_cast<double>(c.put_bytes) / (1 << 20),
      static_cast<double>(c.eager_bytes) / (1 << 20), c.copied_bytes, c.registrations,
      c.on_demand_registrations);
}

}  // namespace moerun
