// What one rank of `moerun serve` offers besides its share of the layer: its metrics registry,
// its HTTP endpoint (/metrics, /health/live, /health/ready on metrics port + rank), and on routers
// the counters the serving path updates and the view moectl's status is made from.
//
// Threads: created on the rank's thread before loading; the HTTP and control threads read it
// (atomics, metrics, or under mu); the rank's thread updates it.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/metrics.h"
#include "moerun/v1/control.pb.h"
#include "router/load_window.h"
#include "router/placement.h"
#include "router/placement_plan.h"
#include "runtime/ep/peer_health.h"
#include "runtime/migration/placement_control.h"
#include "runtime/model/model_spec.h"
#include "runtime/serving/host_port.h"
#include "runtime/serving/http_server.h"
#include "transport/transport.h"

namespace moerun {

class RouterLayer;
class RouterRank;
class ExpertRank;

// A planner report as moectl receives it.
moerun::v1::PlanResponse PlanToProto(const PlanReport& report);

class RankServices : public PlanSource {
 public:
  // Registers the rank's metrics and starts its HTTP endpoint at metrics_listen + rank (with
  // `http`'s idle timeout and connection cap: serving.http_idle_timeout_ms, _max_connections).
  static Result<std::unique_ptr<RankServices>> Start(
      int rank, const Placement& placement, const ModelSpec& spec, const std::vector<int>& layers,
      const Transport* transport, const HostPort& metrics_listen,
      std::chrono::milliseconds load_window = std::chrono::seconds(60),
      HttpServerOptions http = {});
  ~RankServices();

  bool router() const { return router_; }
  MetricsRegistry& metrics() { return metrics_; }
  void set_loaded() { loaded_ = true; }
  // Each rank's node name (RankJob::node_names), once the job is ready: moectl status shows them
  // and the planner's node-aware policies plan on them.
  void set_nodes(std::vector<std::string> names) {
    std::lock_guard<std::mutex> lock(mu_);
    node_names_ = std::move(names);
  }
  void set_draining() { draining_ = true; }
  uint16_t http_port() const;

  // Routers: wires a layer's observers to this rank's counters.
  void Attach(RouterLayer* layer);
  // Routers: every layer of the rank.
  void Attach(RouterRank& router);
  // Expert ranks: counts the rows the host computes.
  void Attach(ExpertRank* host);
  // Routers: called from the router thread between batches and when idle.
  void Refresh(const PeerHealth* health, int64_t queued_requests, int64_t queued_tokens);
  void CountBatch() { requests_.fetch_add(1, std::memory_order_relaxed); }
  // Routers: the totals since the start of microbatches dispatched again after a death and
  // (router 0) of expert copies recoveries re-placed (the metrics follow them).
  void CountRecovery(uint64_t retried_total, uint64_t replaced_total);

  // The placement in use (routers: switched by migrations).
  std::shared_ptr<const Placement> Current() const;
  void SetPlacement(std::shared_ptr<const Placement> placement);
  int64_t expert_bytes() const override { return expert_bytes_.load(); }

  // moectl's answers (router 0).
  moerun::v1::StatusResponse Status() const;
  moerun::v1::PlacementResponse PlacementInfo() const;
  moerun::v1::StatsResponse Stats() const;
  // A planner dry run on the window's loads (since the start when the window is empty).
  Result<moerun::v1::PlanResponse> Plan(const moerun::v1::PlanRequest& request) const override;
  uint64_t WindowAssignments() const override;

 private:
  RankServices() = default;
  bool Ready(std::string* why) const;

  int rank_ = 0;
  bool router_ = false;
  std::string model_;
  std::shared_ptr<const Placement> placement_;  // under mu_: the one in use
  std::vector<int> layers_;
  const Transport* transport_ = nullptr;
  MetricsRegistry metrics_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> loaded_{false}, draining_{false}, answering_{true};
  std::atomic<uint64_t> requests_{0};
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  // Per layer: assignments per logical expert (routers: as the gate chose; expert ranks: rows
  // computed) and, on routers, per rank.
  std::map<int, std::vector<Counter*>> by_expert_;
  std::map<int, std::vector<Counter*>> by_rank_;
  std::map<int, Gauge*> balancedness_;
  std::map<int, std::vector<uint64_t>> rank_seen_;  // what by_rank_ already counts (router thread)
  // Routers, per layer: the sliding window (under mu_; fed by Refresh) and its gauges.
  std::map<int, LoadWindow> windows_;
  std::map<int, std::vector<uint64_t>> expert_seen_;  // what the window already has (router thread)
  std::map<int, Gauge*> window_balancedness_, window_assignments_;
  int gate_groups_ = 1;
  std::atomic<int64_t> expert_bytes_{0};  // one expert's weights (set when a layer attaches)
  Histogram* dispatch_ = nullptr;
  Histogram* combine_ = nullptr;
  Gauge* queue_requests_ = nullptr;
  Gauge* queue_tokens_ = nullptr;
  std::vector<Gauge*> answering_by_rank_;
  Gauge* ranks_dead_ = nullptr;
  Gauge* ranks_retired_ = nullptr;
  Gauge* ranks_spare_ = nullptr;
  Counter* retried_counter_ = nullptr;
  Counter* replaced_counter_ = nullptr;
  std::atomic<uint64_t> retried_{0}, replaced_{0};
  mutable std::mutex mu_;
  std::vector<PeerView> peers_;  // under mu_
  // Refresh's scratch (router thread), so that a refresh allocates nothing.
  std::vector<uint64_t> rank_delta_, expert_delta_;
  std::vector<PeerView> peers_scratch_;
  std::vector<bool> skip_scratch_;  // per expert rank: dead (left out of the window balancedness)
  std::vector<RouterLayer*> ep_layers_;
  std::vector<std::string> node_names_;  // per rank (guarded by mu_)
  // The routers' dispatch bytes over every layer (Refresh sums the layers' stats; the metrics
  // read them): all rows, rows to other nodes, (token, other node) pairs.
  struct DispatchBytes {
    std::atomic<uint64_t> rows{0}, off_node_rows{0}, off_node_token_nodes{0};
  };
  std::shared_ptr<DispatchBytes> dispatch_bytes_ = std::make_shared<DispatchBytes>();
};

}  // namespace moerun
