#include "launch/serve_router.h"

#include <algorithm>
#include <fstream>
#include <memory>

#include "base/clock.h"
#include "base/host_name.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/peer_log.h"
#include "runtime/migration/placement_control.h"
#include "runtime/service/router_service.h"
#include "runtime/serving/control_endpoint.h"

namespace moerun {

ExpertUpdateMetrics::ExpertUpdateMetrics(MetricsRegistry* metrics) : metrics_(metrics) {
  const char* help = "Expert weight updates that ended, by result";
  promoted_ = metrics_->AddCounter("moerun_expert_updates_total", help, {{"result", "promoted"}});
  rolled_back_ =
      metrics_->AddCounter("moerun_expert_updates_total", help, {{"result", "rolled_back"}});
  failed_ = metrics_->AddCounter("moerun_expert_updates_total", help, {{"result", "failed"}});
}

void ExpertUpdateMetrics::Refresh(const std::vector<ExpertUpdateView>& updates,
                                  const ExpertUpdateResults& results) {
  promoted_->Inc(results.promoted - counted_.promoted);
  rolled_back_->Inc(results.rolled_back - counted_.rolled_back);
  failed_->Inc(results.failed - counted_.failed);
  counted_ = results;
  for (const ExpertUpdateView& u : updates) {
    PerExpert& e = experts_[{u.layer, u.expert}];
    if (e.share == nullptr) {
      const Labels l = {{"layer", std::to_string(u.layer)}, {"expert", std::to_string(u.expert)}};
      e.share = metrics_->AddGauge(
          "moerun_expert_update_canary_share",
          "Share of the expert's rows its new weights compute while in canary (0: none)", l);
      e.rows = metrics_->AddGauge("moerun_expert_update_rows",
                                  "Rows the expert computed since its last update began", l);
      e.canary_rows = metrics_->AddGauge(
          "moerun_expert_update_canary_rows",
          "Rows the expert's new weights computed since its last update began", l);
    }
    e.share->Set(u.state == "canary" ? u.canary : 0.0);
    e.rows->Set(static_cast<double>(u.rows));
    e.canary_rows->Set(static_cast<double>(u.canary_rows));
  }
}

namespace {

ServingOptions ServingOptionsFor(const ServeSetup& s, int rank) {
  const ServingConfig& sc = s.config.serving;
  ServingOptions so;
  so.framed.listen = WithPortOffset(s.listen, rank);
  so.framed.name = "router " + std::to_string(rank) + " serving";
  so.framed.max_frame_bytes = static_cast<uint32_t>(sc.max_frame_bytes);
  so.framed.max_connections = sc.max_connections;
  so.framed.frame_timeout = std::chrono::milliseconds(sc.frame_timeout_ms);
  so.framed.first_frame_timeout = std::chrono::milliseconds(sc.first_frame_timeout_ms);
  so.framed.idle_timeout = std::chrono::milliseconds(sc.idle_timeout_ms);
  so.framed.max_buffered_bytes = sc.max_buffered_bytes;
  so.framed.max_connections_per_peer = sc.max_connections_per_address;
  so.framed.tls = s.tls;
  so.max_inflight_per_connection = sc.max_inflight_per_connection;
  so.default_deadline = std::chrono::milliseconds(sc.default_deadline_ms);
  so.key = s.serving_key;
  so.key_file = sc.key_file;  // re-read when it changes (the old key accepted 60 s more)
  const TracingConfig& tc = s.config.tracing;
  so.tracing.endpoint = tc.endpoint;
  so.tracing.sample = tc.sample;
  so.tracing.slow_ms = tc.slow_ms;
  so.tracing.max_queue_spans = static_cast<size_t>(tc.queue_spans);
  so.tracing.source.router_rank = rank;
  so.tracing.source.host = HostName();
  return so;
}

ServedModel ServedModelFor(const ServeSetup& s) {
  ServedModel m;
  m.layers = s.layers;
  m.hidden = s.hidden;
  m.first_expert_rank = s.config.routers;
  m.expert_ranks = std::max(0, s.ranks + s.config.spare_expert_ranks - s.config.routers);
  // A request larger than the batcher's queue could never be queued: refuse it as invalid.
  m.max_request_tokens =
      std::min(s.config.serving.max_request_tokens, s.config.batching.max_queue_tokens);
  return m;
}

// moectl's endpoint on router 0 (control_listen), or on router r that took the control plane
// over (control_listen's port + r): the rank's views, and with a placement control its commands.
Result<std::unique_ptr<ControlEndpoint>> StartControl(const ServeSetup& s, RankServices& rs,
                                                      PlacementControl* pc, int rank) {
  FramedServerOptions co;
  co.listen = WithPortOffset(s.control_listen, rank);
  co.name = "control";
  co.max_connections = 64;
  co.first_frame_timeout = std::chrono::milliseconds(s.config.serving.first_frame_timeout_ms);
  co.idle_timeout = std::chrono::milliseconds(s.config.serving.idle_timeout_ms);
  co.tls = s.tls;
  ControlProvider provider;
  RankServices* services = &rs;
  provider.status = [services, pc] {
    moerun::v1::StatusResponse st = services->Status();
    if (pc != nullptr) *st.mutable_migration() = pc->Progress();
    return st;
  };
  provider.placement = [services] { return services->PlacementInfo(); };
  provider.stats = [services] { return services->Stats(); };
  provider.plan = [services](const moerun::v1::PlanRequest& r) { return services->Plan(r); };
  if (pc != nullptr) {
    provider.apply = [pc](const moerun::v1::ApplyRequest& r) { return pc->Apply(r); };
    provider.progress = [pc] { return pc->Progress(); };
    provider.expert_update = [pc](const moerun::v1::ExpertUpdateRequest& r) {
      return pc->Update(r);
    };
    provider.expert_action = [pc](const moerun::v1::ExpertActionRequest& r) {
      return pc->Action(r);
    };
    provider.join = [pc](const moerun::v1::JoinRequest& r,
                         std::function<void(Result<moerun::v1::JoinResponse>)> done) {
      pc->Join(r, std::move(done));
    };
  }
  ControlAuthOptions auth;
  auth.token_file = s.config.serving.token_file;  // read again when it changes
  return ControlEndpoint::Start(co, s.token, provider, &rs.metrics(), auth);
}

// One router rank's serving: the RouterService (runtime/service: endpoint, batcher, the loop
// and the request path) and, around it, what the launcher adds: router 0's control endpoint and
// automatic placement, and the rank's metrics.
class RouterServer {
 public:
  RouterServer(RouterRank& router, RankServices& services, const ServeSetup& setup,
               std::atomic<bool>& stop)
      : router_(router), rs_(services), setup_(setup), stop_(stop) {}

  Status Start();
  Status Run();

 private:
  void StartPlacementControl();
  void StartCoordinating();  // router 0 at the start, another router when it takes over
  void TakeOver();           // router r > 0, once the routers below it are gone
  void Tick();               // between batches and when idle, after the router rank's poll

  RouterRank& router_;
  RankServices& rs_;
  const ServeSetup& setup_;
  std::atomic<bool>& stop_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<PlacementControl> placement_control_;  // router 0 (before control_: it uses it)
  std::unique_ptr<ControlEndpoint> control_;
  Counter* load_retries_ = nullptr;
  uint64_t load_retries_seen_ = 0;
  Gauge* version_ = nullptr;                             // routers with a RouterControl
  Gauge* migration_running_ = nullptr;                   // router 0
  Gauge* migration_bytes_ = nullptr;                     // router 0
  Gauge* migration_to_move_ = nullptr;                   // router 0
  std::unique_ptr<ExpertUpdateMetrics> update_metrics_;  // router 0
  std::chrono::steady_clock::time_point updates_refreshed_{};
  std::chrono::steady_clock::time_point peer_log_flushed_{};
};

void RouterServer::StartPlacementControl() {
  RouterControl* rc = router_.control();
  if (rc == nullptr) return;
  RankServices* rs = &rs_;
  rc->set_on_switch([rs](std::shared_ptr<const Placement> p) { rs->SetPlacement(std::move(p)); });
  rc->set_expert_bytes(rs_.expert_bytes());
  version_ = rs_.metrics().AddGauge("moerun_placement_version",
                                    "Version of the placement this router uses");
  version_->Set(static_cast<double>(rc->placement()->version()));
  if (router_.rank() == 0) StartCoordinating();
}

void RouterServer::StartCoordinating() {
  RouterControl* rc = router_.control();
  placement_control_ = std::make_unique<PlacementControl>(&rs_, rc, setup_.config.rebalance,
                                                          setup_.config.files_allow);
  migration_running_ =
      rs_.metrics().AddGauge("moerun_migration_running", "1 while a migration runs");
  migration_bytes_ = rs_.metrics().AddGauge("moerun_migration_bytes_loaded",
                                            "Bytes of expert weights the last migration loaded");
  migration_to_move_ = rs_.metrics().AddGauge(
      "moerun_migration_bytes_to_move",
      "Bytes of expert weights the last migration loads in all (progress: loaded / to move)");
  update_metrics_ = std::make_unique<ExpertUpdateMetrics>(&rs_.metrics());
}

Status RouterServer::Start() {
  const int rank = router_.rank();
  rs_.Attach(router_);
  StartPlacementControl();
  RouterServiceOptions so;
  so.serving = ServingOptionsFor(setup_, rank);
  so.model = ServedModelFor(setup_);
  so.batching = setup_.config.batching;
  so.drain_timeout = std::chrono::seconds(setup_.config.serving.drain_timeout_s);
  MOERUN_ASSIGN_OR_RETURN(service_, RouterService::Start(router_, std::move(so), &rs_.metrics()));
  load_retries_ = rs_.metrics().AddCounter(
      "moerun_microbatches_resent_for_loads_total",
      "Microbatches sent again because an expert rank was still loading an expert they need "
      "(its expert cache; it waits half the deadline before it says so)");
  // The ranks' view (spare, dead, answering) before anyone can ask: moectl status right after
  // ready must not show a view that only the first Tick fills (spare slots once read "ready").
  rs_.Refresh(router_.health(), 0, 0);
  if (rank != 0) return Status::Ok();
  if (setup_.token.empty()) {
    spdlog::warn("no control token file (serving.token_file or --token-file): moectl is off");
  } else {
    MOERUN_ASSIGN_OR_RETURN(control_, StartControl(setup_, rs_, placement_control_.get(), 0));
  }
  spdlog::info("serving {} layer(s) of {} on {} ranks at {}; ready in {:.2f} s; stop with SIGTERM",
               router_.layers().size(), setup_.family, setup_.ranks,
               FormatHostPort(WithPortOffset(setup_.listen, rank)), SecondsSince(setup_.started));
  if (!setup_.ready_file.empty()) std::ofstream(setup_.ready_file) << "ready\n";
  return Status::Ok();
}

void RouterServer::TakeOver() {
  const int rank = router_.rank();
  StartCoordinating();
  if (setup_.token.empty()) return;
  auto control = StartControl(setup_, rs_, placement_control_.get(), rank);
  if (!control.ok()) {
    spdlog::error("router {}: took the control plane over, but moectl's endpoint did not open: {}",
                  rank, control.status().ToString());
    return;
  }
  control_ = std::move(control).value();
  HostPort where = setup_.control_listen;
  where.port = control_->port();
  spdlog::warn("router {} coordinates the job now: moectl --target {}", rank,
               FormatHostPort(where));
}

void RouterServer::Tick() {
  if (!placement_control_ && router_.rank() != 0 && router_.control() != nullptr &&
      router_.control()->coordinator() == router_.rank()) {
    TakeOver();
  }
  if (placement_control_) {
    placement_control_->Tick();
    const MigrationView mv = router_.control()->Progress();
    migration_running_->Set(mv.state == "running" ? 1.0 : 0.0);
    migration_bytes_->Set(static_cast<double>(mv.bytes_loaded));
    migration_to_move_->Set(static_cast<double>(mv.bytes_to_move));
    // The updates' views are copied: 5 times a second is plenty for a 1 s scrape.
    const auto now = std::chrono::steady_clock::now();
    if (now - updates_refreshed_ >= std::chrono::milliseconds(200)) {
      updates_refreshed_ = now;
      RouterControl* rc = router_.control();
      update_metrics_->Refresh(rc->Updates(), rc->update_results());
    }
  }
  if (version_ != nullptr) {
    version_->Set(static_cast<double>(router_.control()->placement()->version()));
  }
  // The counts of peers' events whose lines were held (base/peer_log.h), once their interval ends.
  if (const auto now = std::chrono::steady_clock::now();
      now - peer_log_flushed_ >= std::chrono::seconds(1)) {
    peer_log_flushed_ = now;
    FlushPeerLog();
  }
  uint64_t retried = 0, load_retries = 0;
  for (const auto& [number, l] : router_.layers()) {
    retried += l->stats().retried_microbatches;
    load_retries += l->stats().load_retries;
  }
  if (load_retries_ != nullptr && load_retries > load_retries_seen_) {
    load_retries_->Inc(load_retries - load_retries_seen_);
    load_retries_seen_ = load_retries;
  }
  rs_.CountRecovery(retried, router_.control() ? router_.control()->experts_replaced() : 0);
  const BatcherStats st = service_->stats();
  rs_.Refresh(router_.health(), static_cast<int64_t>(st.queued_requests), st.queued_tokens);
}

Status RouterServer::Run() {
  RouterServiceHooks hooks;
  hooks.tick = [this] { Tick(); };
  hooks.on_batch = [this](int64_t, bool ok) {
    if (ok) rs_.CountBatch();
  };
  hooks.on_drain = [this] { rs_.set_draining(); };
  const Status failed = service_->Run(stop_, std::move(hooks));
  if (control_) control_->Stop();
  if (!failed.ok()) return failed;
  const BatcherStats st = service_->stats();
  spdlog::info("router {} stopping: {} batches, {} requests, {} tokens served, {} expired",
               router_.rank(), st.batches, st.requests, st.tokens, st.expired);
  return Status::Ok();
}

}  // namespace

Status ServeRouter(RouterRank& router, RankServices& services, const ServeSetup& setup,
                   std::atomic<bool>& stop) {
  RouterServer server(router, services, setup, stop);
  MOERUN_RETURN_IF_ERROR(server.Start());
  return server.Run();
}

}  // namespace moerun
