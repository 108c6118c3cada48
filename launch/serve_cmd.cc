#include "launch/serve_cmd.h"
#include "base/exit_code.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <mutex>

#include "base/log.h"
#include "launch/cuda_setup.h"
#include "launch/job_launch.h"
#include "launch/layer_flags.h"
#include "launch/rank_services.h"
#include "launch/serve_config.h"
#include "layer/cuda/cuda_device.h"
#include "migration/placement_control.h"
#include "migration/router_control.h"
#include "model/layer_loader.h"
#include "ranks/expert_rank.h"
#include "serving/batcher.h"
#include "serving/control_endpoint.h"
#include "serving/host_port.h"
#include "serving/serving_endpoint.h"

namespace moerun {
namespace {

std::atomic<bool> g_stop{false};

extern "C" void OnStopSignal(int) { g_stop.store(true); }

struct ServeFlags {
  std::string config;
  std::string transport;
  std::string ready_file;
  std::string pid_file;
  std::string listen, control_listen, metrics_listen, token_file;
  DeviceFlags dev;  // --device cuda: expert ranks compute on their local GPU
};

Result<std::vector<int>> ResolveLayers(const ModelSpec& spec, const std::vector<int>& wanted) {
  if (wanted.empty()) {
    MOERUN_ASSIGN_OR_RETURN(int l, ResolveMoeLayer(spec, -1));
    return std::vector<int>{l};
  }
  if (wanted.size() == 1 && wanted[0] == -1) return spec.moe_layers;
  std::vector<int> out;
  for (int l : wanted) {
    MOERUN_ASSIGN_OR_RETURN(int r, ResolveMoeLayer(spec, l));
    out.push_back(r);
  }
  return out;
}

// Many connections need many descriptors: take the hard limit.
void RaiseDescriptorLimit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &rl);
  }
}

// Per rank of this process (one under mpirun; all of them with inproc).
struct Ranks {
  std::mutex mu;
  std::map<int, std::unique_ptr<RankServices>> by_rank;
  RankServices* Get(int rank) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_rank.find(rank);
    return it == by_rank.end() ? nullptr : it->second.get();
  }
};

int RunServe(const ServeFlags& f) {
  auto config = LoadServeConfig(f.config);
  if (!config.ok()) return FailWith(config.status());
  ServeConfig c = *config;
  // Flags override the config's addresses.
  if (!f.transport.empty()) {
    if (f.transport != "mpi" && f.transport != "ucx" && f.transport != "inproc") {
      return FailWith(Status::InvalidArgument("--transport must be mpi, ucx or inproc, not '" +
                                              f.transport + "'"));
    }
    c.transport = f.transport;
  }
  if (!f.listen.empty()) c.serving.listen = f.listen;
  if (!f.control_listen.empty()) c.serving.control_listen = f.control_listen;
  if (!f.metrics_listen.empty()) c.serving.metrics_listen = f.metrics_listen;
  if (!f.token_file.empty()) c.serving.token_file = f.token_file;
  const ServingConfig& sc = c.serving;
  auto listen = ParseHostPort(sc.listen);
  if (!listen.ok()) return FailWith(listen.status().WithContext("serving listen address"));
  auto control_listen = ParseHostPort(sc.control_listen);
  if (!control_listen.ok()) {
    return FailWith(control_listen.status().WithContext("control listen address"));
  }
  auto metrics_listen = ParseHostPort(sc.metrics_listen);
  if (!metrics_listen.ok()) {
    return FailWith(metrics_listen.status().WithContext("metrics listen address"));
  }
  std::string token;
  if (!sc.token_file.empty()) {
    auto t = ReadTokenFile(sc.token_file);
    if (!t.ok()) return FailWith(t.status());
    token = *t;
  }
  const int env_rank = RankFromEnvironment();
  InitLogging(env_rank, env_rank >= 0 && env_rank < c.routers ? "router" : "expert", c.log_level);
  RaiseDescriptorLimit();
  auto isa = ChooseIsa(c.isa);
  if (!isa.ok()) return FailWith(isa.status());
  LaunchFlags lf;
  lf.transport = c.transport;
  lf.ranks = c.ranks;
  lf.routers = c.routers;
  lf.placement = c.placement;
  lf.microbatch_tokens = c.microbatch_tokens;
  lf.deadline_ms = c.deadline_ms;
  lf.startup_timeout_s = c.startup_timeout_s;
  auto job = JobLaunch::Create(lf);
  if (!job.ok()) return FailWith(job.status());
  if ((*job)->size() < 2) {
    return FailWith(Status::InvalidArgument(
        "serve needs at least 2 ranks (a router and an expert rank): run it under mpirun -np N, "
        "or set \"transport: inproc\" with \"ranks: N\""));
  }
  JobOptions opts;
  (*job)->Fill(&opts);
  opts.source.model = c.model;
  opts.source.preset = c.preset;
  opts.source.seed = c.seed;
  opts.source.gate_skew = c.gate_skew;
  opts.source.experts = c.experts;
  auto dtype = ParseWeightDType(c.dtype);
  if (!dtype.ok()) return FailWith(dtype.status());
  opts.source.dtype = *dtype;
  opts.threads = c.threads;
  opts.isa = *isa;
  if (Status s = ValidateDeviceFlags(f.dev); !s.ok()) return FailWith(s);
  if (f.dev.device == "cuda") {  // before anything starts: no GPU is a clear error, exit 2
    if (auto probe = RequireCuda(); !probe.ok()) return FailWith(probe.status());
    opts.hooks.expert_device = [&f](int rank, const LoadedLayers& l) {
      return CudaExpertCompute(f.dev, rank, l);
    };
  }
  auto spec = SpecOf(opts.source);
  if (!spec.ok()) return FailWith(spec.status());
  auto layers = ResolveLayers(*spec, c.layers);
  if (!layers.ok()) return FailWith(layers.status());
  opts.layers = *layers;
  if (c.batching.max_batch_tokens < 1) c.batching.max_batch_tokens = 1;

  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);
  if (!f.pid_file.empty() && (*job)->rank() == 0) std::ofstream(f.pid_file) << ::getpid() << "\n";
  const auto started = std::chrono::steady_clock::now();

  // Each rank's services start before it loads (so /health/live answers during loading).
  Ranks ranks;
  opts.hooks.placement = [&](int rank, Transport* t, const Placement& placement,
                             const ModelSpec& model) -> Status {
    MOERUN_ASSIGN_OR_RETURN(
        auto rs, RankServices::Start(rank, placement, model, opts.layers, t, *metrics_listen,
                                     std::chrono::seconds(c.serving.load_window_s)));
    std::lock_guard<std::mutex> lock(ranks.mu);
    ranks.by_rank[rank] = std::move(rs);
    return Status::Ok();
  };
  opts.hooks.done = [&](int rank) {
    std::unique_ptr<RankServices> gone;
    std::lock_guard<std::mutex> lock(ranks.mu);
    gone = std::move(ranks.by_rank[rank]);
  };
  opts.hooks.ready = [&](int rank) {
    if (RankServices* rs = ranks.Get(rank)) rs->set_loaded();
    if (rank == 0) {
      spdlog::info(
          "every rank loaded its weights: ready {:.2f} s after start",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    }
  };
  opts.hooks.expert_host = [&](int rank, ExpertRank& host) {
    if (RankServices* rs = ranks.Get(rank)) rs->Attach(&host);
  };
  opts.hooks.health = PeerHealthOptions{std::chrono::milliseconds(sc.probe_interval_ms),
                                        std::chrono::milliseconds(sc.probe_deadline_ms)};
  std::mutex health_mu;
  std::map<int, PeerHealth*> health_of;
  std::map<int, RouterControl*> control_of;
  opts.hooks.router_health = [&](int rank, PeerHealth* h) {
    std::lock_guard<std::mutex> lock(health_mu);
    health_of[rank] = h;
  };
  opts.hooks.router_control = [&](int rank, RouterControl* rc) {
    std::lock_guard<std::mutex> lock(health_mu);
    control_of[rank] = rc;
  };

  const RouterWork work = [&](int rank, std::map<int, RouterLayer*>& eps) -> Status {
    RankServices* rs = ranks.Get(rank);
    PeerHealth* health = nullptr;
    RouterControl* rc = nullptr;
    {
      std::lock_guard<std::mutex> lock(health_mu);
      health = health_of[rank];
      rc = control_of[rank];
    }
    for (auto& [l, ep] : eps) rs->Attach(ep);
    if (rc != nullptr) {
      rc->set_on_switch(
          [rs](std::shared_ptr<const Placement> p) { rs->SetPlacement(std::move(p)); });
    }
    std::unique_ptr<PlacementControl> placement_control;
    // Updated between batches (RankServices outlives this router's RouterControl).
    Gauge* version_gauge = nullptr;
    Gauge* migration_running = nullptr;
    Gauge* migration_bytes = nullptr;
    if (rc != nullptr) {
      version_gauge = rs->metrics().AddGauge("moerun_placement_version",
                                             "Version of the placement this router uses");
      version_gauge->Set(static_cast<double>(rc->placement()->version()));
    }
    if (rank == 0 && rc != nullptr) {
      placement_control = std::make_unique<PlacementControl>(rs, rc, c.rebalance);
      migration_running =
          rs->metrics().AddGauge("moerun_migration_running", "1 while a migration runs");
      migration_bytes = rs->metrics().AddGauge("moerun_migration_bytes_loaded",
                                               "Bytes of expert weights the last migration loaded");
    }
    Status control_failed;
    Batcher batcher(c.batching, spec->hidden);

    ServingOptions so;
    so.framed.listen = WithPortOffset(*listen, rank);
    so.framed.name = "router " + std::to_string(rank) + " serving";
    so.framed.max_frame_bytes = static_cast<uint32_t>(sc.max_frame_bytes);
    so.framed.max_connections = sc.max_connections;
    so.framed.frame_timeout = std::chrono::milliseconds(sc.frame_timeout_ms);
    so.framed.max_buffered_bytes = sc.max_buffered_bytes;
    so.max_inflight_per_connection = sc.max_inflight_per_connection;
    so.default_deadline = std::chrono::milliseconds(sc.default_deadline_ms);
    ServedModel served;
    served.layers = opts.layers;
    served.hidden = spec->hidden;
    // A request larger than the batcher's queue could never be queued: refuse it as invalid.
    served.max_request_tokens = std::min(sc.max_request_tokens, c.batching.max_queue_tokens);
    MOERUN_ASSIGN_OR_RETURN(auto endpoint,
                            ServingEndpoint::Start(so, served, &batcher, &rs->metrics()));
    std::unique_ptr<ControlEndpoint> control;
    if (rank == 0) {
      if (token.empty()) {
        spdlog::warn("no control token file (serving.token_file or --token-file): moectl is off");
      } else {
        FramedServerOptions co;
        co.listen = *control_listen;
        co.name = "control";
        co.max_connections = 64;
        ControlProvider provider;
        provider.status = [rs, pc = placement_control.get()] {
          moerun::v1::StatusResponse s = rs->Status();
          if (pc != nullptr) *s.mutable_migration() = pc->Progress();
          return s;
        };
        provider.placement = [rs] { return rs->PlacementInfo(); };
        provider.stats = [rs] { return rs->Stats(); };
        provider.plan = [rs](const moerun::v1::PlanRequest& r) { return rs->Plan(r); };
        if (PlacementControl* pc = placement_control.get()) {
          provider.apply = [pc](const moerun::v1::ApplyRequest& r) { return pc->Apply(r); };
          provider.progress = [pc] { return pc->Progress(); };
          provider.expert_update = [pc](const moerun::v1::ExpertUpdateRequest& r) {
            return pc->Update(r);
          };
          provider.expert_action = [pc](const moerun::v1::ExpertActionRequest& r) {
            return pc->Action(r);
          };
        }
        MOERUN_ASSIGN_OR_RETURN(control,
                                ControlEndpoint::Start(co, token, provider, &rs->metrics()));
      }
      spdlog::info(
          "serving {} layer(s) of {} on {} ranks at {}; ready in {:.2f} s; stop with SIGTERM",
          eps.size(), FamilyName(spec->family), (*job)->size(),
          FormatHostPort(WithPortOffset(*listen, rank)),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      if (!f.ready_file.empty()) std::ofstream(f.ready_file) << "ready\n";
    }

    Counter* batches = rs->metrics().AddCounter("moerun_batches_total", "Batches run");
    Counter* batch_tokens =
        rs->metrics().AddCounter("moerun_batch_tokens_total", "Tokens of the batches run");
    std::chrono::steady_clock::time_point drain_until{};
    bool draining = false;
    auto refresh = [&] {
      if (health != nullptr) health->Poll();
      if (rc != nullptr && control_failed.ok()) {
        control_failed = rc->Poll();
        if (!control_failed.ok()) {
          spdlog::error("router {}: the control channel failed ({}): stopping", rank,
                        control_failed.ToString());
          g_stop.store(true);
        }
      }
      if (placement_control) {
        placement_control->Tick();
        const MigrationView mv = rc->Progress();
        migration_running->Set(mv.state == "running" ? 1.0 : 0.0);
        migration_bytes->Set(static_cast<double>(mv.bytes_loaded));
      }
      if (version_gauge != nullptr) {
        version_gauge->Set(static_cast<double>(rc->placement()->version()));
      }
      const BatcherStats st = batcher.stats();
      rs->Refresh(health, static_cast<int64_t>(st.queued_requests), st.queued_tokens);
    };
    batcher.Run(
        [&](int layer, const float* x, int64_t tokens, float* out,
            std::chrono::steady_clock::time_point deadline) -> Status {
          const auto it = eps.find(layer);
          if (it == eps.end()) {
            return Status::InvalidArgument("layer " + std::to_string(layer) + " is not served");
          }
          if (health != nullptr) health->Poll();
          Status s = it->second->Forward(x, tokens, out, deadline);
          batches->Inc();
          batch_tokens->Inc(static_cast<uint64_t>(tokens));
          if (s.ok()) rs->CountBatch();
          return s;
        },
        [&] {
          if (!g_stop.load()) return false;
          if (!draining) {
            draining = true;
            rs->set_draining();
            endpoint->BeginDrain();
            drain_until =
                std::chrono::steady_clock::now() + std::chrono::seconds(sc.drain_timeout_s);
          }
          if (endpoint->in_flight() == 0) return true;
          if (std::chrono::steady_clock::now() >= drain_until) {
            spdlog::warn("drain timeout: {} request(s) still in flight", endpoint->in_flight());
            return true;
          }
          return false;
        },
        refresh);
    endpoint->Stop();
    if (control) control->Stop();
    if (!control_failed.ok()) return control_failed;
    const BatcherStats st = batcher.stats();
    spdlog::info("router {} stopping: {} batches, {} requests, {} tokens served, {} expired", rank,
                 st.batches, st.requests, st.tokens, st.expired);
    return Status::Ok();
  };
  const Status s = (*job)->Run(opts, work);
  if (!s.ok()) (*job)->Abort(FailWith(s));
  if ((*job)->rank() == 0) spdlog::info("shut down cleanly");
  return 0;
}

}  // namespace

std::function<int()> AddServeCommand(CLI::App& app) {
  auto flags = std::make_shared<ServeFlags>();
  CLI::App* cmd = app.add_subcommand("serve", "Start the long-running runtime (all ranks)");
  cmd->add_option("--config", flags->config, "YAML config (see configs/ and the README)")
      ->required();
  cmd->add_option("--ready-file", flags->ready_file,
                  "Write this file once every rank has loaded its weights and router 0 listens");
  cmd->add_option("--pid-file", flags->pid_file, "Write rank 0's process id here");
  cmd->add_option("--transport", flags->transport,
                  "mpi, ucx or inproc (overrides the config's transport)");
  cmd->add_option("--listen", flags->listen,
                  "Serving endpoint HOST:PORT of router 0 (router i: PORT + i)");
  cmd->add_option("--control-listen", flags->control_listen, "moectl endpoint HOST:PORT");
  cmd->add_option("--metrics-listen", flags->metrics_listen,
                  "HTTP /metrics and /health HOST:PORT of rank 0 (rank r: PORT + r)");
  cmd->add_option("--token-file", flags->token_file, "Control token file (enables moectl)");
  AddDeviceFlags(cmd, &flags->dev,
                 "cpu or cuda (expert ranks run their experts on their local GPU)",
                 "--device cuda: tokens per microbatch the GPU buffers hold");
  return [flags, cmd]() -> int {
    if (!cmd->parsed()) return -1;
    return RunServe(*flags);
  };
}

}  // namespace moerun
