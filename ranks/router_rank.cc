#include "ranks/router_rank.h"

#include <cstring>
#include <thread>

#include "base/log.h"
#include "ep/protocol.h"

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
                           Deadline deadline) {
  RouterLayer* l = layer(number);
  if (l == nullptr) {
    return Status::InvalidArgument("layer " + std::to_string(number) + " is not served");
  }
  if (health_) health_->Poll();
  return l->Forward(x, tokens, out, deadline);
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
  if (health_) {
    // Late transfers and probes finish before the shutdown message queues behind them.
    health_->StopProbing();
    const Deadline until = DeadlineIn(ep_.deadline);
    while (!health_->idle() && SteadyClock::now() < until) {
      health_->Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    health_.reset();
  }
  MOERUN_RETURN_IF_ERROR(SendShutdown(t_, *placement_, header_bytes_, ep_.deadline));
  LogTransportCounters(*t_);
  return Status::Ok();
}

Status SendShutdown(Transport* t, const Placement& p, size_t header_bytes,
                    std::chrono::milliseconds deadline) {
  std::vector<char> header(header_bytes, 0);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kShutdown);
  std::memcpy(header.data(), &h, sizeof h);
  std::vector<Request> reqs;
  for (int d = p.num_routers(); d < p.num_ranks(); ++d) {
    MOERUN_ASSIGN_OR_RETURN(Request r, t->Isend(d, kTagHeader, header.data(), header.size()));
    reqs.push_back(r);
  }
  return t->WaitAll(reqs, DeadlineIn(deadline), "shutdown");
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
