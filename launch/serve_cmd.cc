#include "launch/serve_cmd.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "base/exit_code.h"
#include "base/log.h"
#include "launch/cuda_setup.h"
#include "launch/death_survival.h"
#include "launch/job_launch.h"
#include "launch/layer_flags.h"
#include "launch/rank_services.h"
#include "launch/serve_join.h"
#include "launch/serve_router.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/model/layer_loader.h"
#include "runtime/model/weight_source.h"
#include "runtime/ranks/rank_job.h"
#include "runtime/serving/control_endpoint.h"
#include "runtime/serving/host_port.h"
#include "runtime/serving/tracing_options.h"
#include "transport/launcher_env.h"
#include "transport/registry.h"

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
  std::string serving_key_file;             // --serving-key-file: overrides serving.key_file
  std::string tls_cert_file, tls_key_file;  // --tls-cert-file/--tls-key-file: serving.tls
  std::string join;  // router 0's control endpoint: take over a dead expert rank of that job
  int64_t expert_cache_mib = -1;   // -1: the config's
  int64_t expert_memory_mib = -1;  // -1: the config's
  std::string expert_cache_policy;
  std::string trace_endpoint;  // --trace-endpoint etc.: tracing.*
  double trace_sample = -1;
  int64_t trace_slow_ms = -1;
  std::string expert_cache_spill_dir;
  double expert_cache_load_mib_s = -1;  // -1: the config's
  DeviceFlags dev;                      // --device cuda: expert ranks compute on their local GPU
  int ranks = 0;                        // > 0: overrides ranks: (and the job --plan-memory plans)
  bool plan_memory = false;             // print each rank's device memory plan and exit
  bool json = false;                    // --plan-memory as JSON
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

// A warning for each endpoint that listens on every interface (the defaults are loopback). Rank
// 0's process (router 0: serving, control and HTTP endpoints) logs them for the job, since every
// rank binds the same hosts (at port + rank); a joined rank logs its HTTP endpoint's.
void WarnAllInterfaces(const ServeConfig& c, bool router, bool control) {
  const ServingConfig& sc = c.serving;
  std::vector<std::string> lines;
  if (router) {
    lines.push_back(
        AllInterfacesWarning("the serving endpoint", sc.listen, "serving.listen", "--listen"));
  }
  if (control && !sc.token_file.empty()) {
    lines.push_back(AllInterfacesWarning("the control endpoint (moectl)", sc.control_listen,
                                         "serving.control_listen", "--control-listen"));
  }
  lines.push_back(AllInterfacesWarning("the HTTP endpoint (/metrics, /health)", sc.metrics_listen,
                                       "serving.metrics_listen", "--metrics-listen"));
  for (const std::string& l : lines) {
    if (!l.empty()) spdlog::warn("{}", l);
  }
}

// The config with the flags' overrides, checked; the job's options (everything but the layers).
Result<ServeSetup> Configure(const ServeFlags& f) {
  ServeSetup s;
  MOERUN_ASSIGN_OR_RETURN(s.config, LoadServeConfig(f.config));
  ServeConfig& c = s.config;
  if (!f.transport.empty()) {
    if (f.transport != "mpi" && f.transport != "ucx" && f.transport != "nccl" &&
        f.transport != "inproc") {
      return Status::InvalidArgument("--transport must be mpi, ucx, nccl or inproc, not '" +
                                     f.transport + "'");
    }
    c.transport = f.transport;
  }
  // A job that names no transport: launch/job_launch.h's DefaultTransport (ucx under mpirun or
  // srun where the build has it); a joiner, which no launcher starts, joins such a job.
  if (c.transport.empty() && LaunchedByMpiLauncher()) {
    MOERUN_ASSIGN_OR_RETURN(c.transport, DefaultTransport());
  } else if (c.transport.empty() && !f.join.empty() && RequireTransport("ucx").ok()) {
    c.transport = "ucx";
  }
  if (!f.listen.empty()) c.serving.listen = f.listen;
  if (!f.control_listen.empty()) c.serving.control_listen = f.control_listen;
  if (!f.metrics_listen.empty()) c.serving.metrics_listen = f.metrics_listen;
  if (!f.token_file.empty()) c.serving.token_file = f.token_file;
  if (!f.serving_key_file.empty()) c.serving.key_file = f.serving_key_file;
  if (!f.tls_cert_file.empty()) c.serving.tls.cert_file = f.tls_cert_file;
  if (!f.tls_key_file.empty()) c.serving.tls.key_file = f.tls_key_file;
  if (f.expert_cache_mib >= 0) c.expert_cache_mib = f.expert_cache_mib;
  if (f.expert_memory_mib >= 0) {  // this process's: over the config's, its own rank's entry too
    c.expert_memory_mib = f.expert_memory_mib;
    c.rank_expert_memory_mib.clear();
  }
  if (!f.expert_cache_policy.empty()) c.expert_cache_policy = f.expert_cache_policy;
  if (!f.trace_endpoint.empty()) {
    MOERUN_RETURN_IF_ERROR(
        ParseOtlpEndpoint(f.trace_endpoint).status().WithContext("--trace-endpoint"));
    c.tracing.endpoint = f.trace_endpoint;
  }
  if (f.trace_sample >= 0) c.tracing.sample = f.trace_sample;
  if (f.trace_slow_ms >= 0) c.tracing.slow_ms = f.trace_slow_ms;
  if (!f.expert_cache_spill_dir.empty()) c.expert_cache_spill_dir = f.expert_cache_spill_dir;
  if (f.expert_cache_load_mib_s >= 0) c.expert_cache_load_mib_s = f.expert_cache_load_mib_s;
  if (f.ranks > 0) c.ranks = f.ranks;
  if (c.batching.max_batch_tokens < 1) c.batching.max_batch_tokens = 1;
  const ServingConfig& sc = c.serving;
  MOERUN_ASSIGN_OR_RETURN(s.listen, ParseHostPort(sc.listen).WithContext("serving listen address"));
  MOERUN_ASSIGN_OR_RETURN(s.control_listen,
                          ParseHostPort(sc.control_listen).WithContext("control listen address"));
  MOERUN_ASSIGN_OR_RETURN(s.metrics_listen,
                          ParseHostPort(sc.metrics_listen).WithContext("metrics listen address"));
  if (!sc.token_file.empty()) {
    MOERUN_ASSIGN_OR_RETURN(s.token, ReadTokenFile(sc.token_file));
  }
  if (!sc.key_file.empty()) {  // the same rules as the token file (mode 600, first line)
    MOERUN_ASSIGN_OR_RETURN(s.serving_key,
                            ReadTokenFile(sc.key_file).WithContext("serving key file"));
  }
  if (sc.tls.enabled()) {
    MOERUN_ASSIGN_OR_RETURN(s.tls, TlsServerContext::Load(sc.tls));
  }
  s.ready_file = f.ready_file;
  return s;
}

// The launch of the config's job (mpirun's ranks or inproc threads).
LaunchFlags LaunchFlagsFor(const ServeConfig& c) {
  LaunchFlags lf;
  lf.transport = c.transport;
  lf.ranks = c.ranks;
  lf.routers = c.routers;
  lf.placement = c.placement;
  lf.microbatch_tokens = c.microbatch_tokens;
  lf.deadline_ms = c.deadline_ms;
  lf.startup_timeout_s = c.startup_timeout_s;
  return lf;
}

Result<JobOptions> JobOptionsFor(const ServeConfig& c) {
  JobOptions o;
  FillJobOptions(LaunchFlagsFor(c), &o);
  o.source.model = c.model;
  o.source.preset = c.preset;
  o.source.seed = c.seed;
  o.source.gate_skew = c.gate_skew;
  o.source.experts = c.experts;
  o.source.intermediate = c.intermediate;
  MOERUN_ASSIGN_OR_RETURN(o.source.dtype, ParseWeightDType(c.dtype));
  o.threads = c.threads;
  o.rank_threads = c.rank_threads;
  o.expert_memory_bytes = static_cast<uint64_t>(c.expert_memory_mib) << 20;
  for (const auto& [rank, mib] : c.rank_expert_memory_mib) {
    o.rank_expert_memory_bytes[rank] = static_cast<uint64_t>(mib) << 20;
  }
  MOERUN_ASSIGN_OR_RETURN(o.isa, ChooseIsa(c.isa));
  for (const auto& [rank, name] : c.rank_isa) {
    MOERUN_ASSIGN_OR_RETURN(o.rank_isa[rank], ChooseIsa(name));
  }
  // A rank silent for the expert-parallel deadline is dead (as one that misses it with a
  // microbatch): the job serves on without it.
  o.router.health = PeerHealthOptions{std::chrono::milliseconds(c.serving.probe_interval_ms),
                                      std::chrono::milliseconds(c.serving.probe_deadline_ms),
                                      std::chrono::milliseconds(c.deadline_ms)};
  o.router.control = true;
  o.cache.budget_bytes = static_cast<size_t>(c.expert_cache_mib) << 20;
  MOERUN_ASSIGN_OR_RETURN(o.cache.policy, ParseEvictionPolicy(c.expert_cache_policy));
  o.cache.loaders = c.expert_cache_loaders;
  o.cache.load_bytes_per_s = c.expert_cache_load_mib_s * (1 << 20);
  o.cache_pinned = c.expert_cache_pinned;
  o.cache_spill_dir = c.expert_cache_spill_dir;
  o.spare_ranks = c.spare_expert_ranks;
  o.nodes = c.nodes;
  o.ep.node_spill = c.dispatch.prefer_node ? c.dispatch.spill : -1;
  return o;
}

// The model's spec, and the layers it serves into o->layers.
Result<ModelSpec> ResolveModel(const ServeConfig& c, JobOptions* o) {
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecOf(o->source));
  MOERUN_ASSIGN_OR_RETURN(o->layers, ResolveLayers(spec, c.layers));
  return spec;
}

Result<std::unique_ptr<JobLaunch>> Launch(const ServeConfig& c) {
  MOERUN_ASSIGN_OR_RETURN(auto job, JobLaunch::Create(LaunchFlagsFor(c)));
  if (job->size() < 2) {
    return Status::InvalidArgument(
        "serve needs at least 2 ranks (a router and an expert rank): run it under mpirun -np N, "
        "or set \"transport: inproc\" with \"ranks: N\"");
  }
  return job;
}

// An expert rank serves until every router has stopped; its experts run on its GPU with
// --device cuda.
Status ServeExpert(RankJob& job, RankServices& services, const DeviceFlags& dev) {
  ExpertCompute compute;
  if (dev.device == "cuda") {
    MOERUN_ASSIGN_OR_RETURN(compute,
                            CudaExpertCompute(dev, job.rank(), job.loaded(), job.placement()));
  }
  MOERUN_ASSIGN_OR_RETURN(auto expert, job.MakeExpert(std::move(compute)));
  services.Attach(expert.get());
  MOERUN_RETURN_IF_ERROR(expert->Serve());
  LogTransportCounters(*job.transport());
  return Status::Ok();
}

// One rank of the serve job, start to end. Its services (HTTP metrics and health) start before
// the weights load, so that /health/live answers while they do.
Status ServeRank(Transport* t, const ServeSetup& setup, const JobOptions& options,
                 const DeviceFlags& dev) {
  MOERUN_ASSIGN_OR_RETURN(auto job, RankJob::Prepare(t, options));
  const ServingConfig& sc = setup.config.serving;
  HttpServerOptions http;
  http.idle_timeout = std::chrono::milliseconds(sc.http_idle_timeout_ms);
  http.max_connections = sc.http_max_connections;
  MOERUN_ASSIGN_OR_RETURN(
      auto services,
      RankServices::Start(job->rank(), job->placement(), job->spec(), options.layers, t,
                          setup.metrics_listen, std::chrono::seconds(sc.load_window_s), http));
  MOERUN_RETURN_IF_ERROR(job->Load());
  MOERUN_RETURN_IF_ERROR(job->WaitReady());
  services->set_nodes(job->node_names());
  services->set_loaded();
  if (job->rank() == 0) {
    spdlog::info(
        "every rank loaded its weights: ready {:.2f} s after start",
        std::chrono::duration<double>(std::chrono::steady_clock::now() - setup.started).count());
  }
  if (!job->is_router()) return ServeExpert(*job, *services, dev);
  MOERUN_ASSIGN_OR_RETURN(auto router, job->MakeRouter());
  MOERUN_RETURN_IF_ERROR(ServeRouter(*router, *services, setup, g_stop));
  return router->Finish();
}

// moerun serve --join: this process takes over a dead expert rank of the running job whose
// router 0 listens at f.join, and serves as it until the job ends.
int RunJoined(ServeSetup& setup, const ServeFlags& f) {
  const ServeConfig& c = setup.config;
  InitLogging(-1, "expert", c.log_level);
  if (setup.token.empty()) {
    return FailWith(Status::InvalidArgument(
        "--join needs the job's control token: --token-file FILE (or serving.token_file)"));
  }
  if (c.transport != "ucx") {
    return FailWith(Status::InvalidArgument(
        "--join needs a job on the ucx transport (only ucx takes a new process in), not '" +
        c.transport + "': set transport: ucx, or --transport ucx"));
  }
  if (f.dev.device == "cuda") {
    return FailWith(Status::InvalidArgument(
        "--join with --device cuda is not supported: a GPU expert rank holds only the experts it "
        "loads at start, and a joining rank gets its experts while serving"));
  }
  auto options = JobOptionsFor(c);
  if (!options.ok()) return FailWith(options.status());
  auto spec = ResolveModel(c, &*options);
  if (!spec.ok()) return FailWith(spec.status());
  options->joined = true;
  RaiseDescriptorLimit();
  JoinTarget target;
  target.control = f.join;
  target.token = setup.token;
  if (setup.tls) {
    // The job's TLS: the router is checked with serving.tls.ca_file (else the system's CAs);
    // where it asks for client certificates, the joiner shows the job's own.
    target.tls.enabled = true;
    target.tls.ca_file = c.serving.tls_ca_file;
    if (!c.serving.tls.client_ca_file.empty()) {
      target.tls.cert_file = c.serving.tls.cert_file;
      target.tls.key_file = c.serving.tls.key_file;
    }
  }
  target.num_experts = spec->num_experts;
  target.layers = options->layers;
  target.placement = c.placement;
  target.routers = c.routers;
  target.timeout = std::chrono::milliseconds(c.startup_timeout_s * 1000);
  spdlog::info("join: asking router 0 at {} for a dead expert rank to take over", f.join);
  auto joined = JoinJob(target);
  if (!joined.ok()) return FailWith(joined.status());
  Transport* t = joined->transport.get();
  InitLogging(t->rank(), "expert", c.log_level);
  WarnAllInterfaces(c, false, false);
  spdlog::info(
      "joined the job as expert rank {} of {} (placement v{} in use: no experts here until a "
      "rebalance)",
      t->rank(), t->size(), joined->placement_version);
  const Status s = ServeRank(t, setup, *options, f.dev);
  if (!s.ok()) return FailWith(s);
  spdlog::info("rank {} (joined) shut down cleanly", t->rank());
  return 0;
}

// The GPU memory of --device cuda, before anything is allocated.
Status CheckCudaCache(const DeviceFlags& dev, const ServeConfig& c) {
  if (dev.device == "cuda" && c.expert_cache_mib > 0) {
    return Status::InvalidArgument(
        "the expert cache (expert_cache_mib) is not available with --device cuda yet: the device "
        "holds a copy of every hosted expert made at start");
  }
  return Status::Ok();
}

// serve --plan-memory: every rank's device memory by region, from the shapes alone (no GPU, no
// weights, no transport started); prints to stdout and exits 0.
int PlanMemory(const ServeConfig& c, const ServeFlags& f) {
  if (f.dev.device != "cuda") {
    return FailWith(Status::InvalidArgument(
        "--plan-memory plans the GPU memory of --device cuda: add --device cuda"));
  }
  if (Status s = ValidateDeviceFlags(f.dev); !s.ok()) return FailWith(s);
  if (Status s = CheckCudaCache(f.dev, c); !s.ok()) return FailWith(s);
  auto options = JobOptionsFor(c);
  if (!options.ok()) return FailWith(options.status());
  auto spec = ResolveModel(c, &*options);
  if (!spec.ok()) return FailWith(spec.status());
  auto dtype = SourceWeightType(options->source, *spec);
  if (!dtype.ok()) return FailWith(dtype.status());
  MemoryPlanJob job;
  job.model = c.model.empty() ? "preset " + c.preset : c.model;
  job.spec = *spec;
  job.layers = options->layers;
  job.dtype = *dtype;
  job.ranks = PlanRanks(f.ranks, c.ranks);
  job.routers = c.routers;
  job.placement = c.placement;
  if (job.ranks < 2) {
    return FailWith(Status::InvalidArgument(fmt::format(
        "--plan-memory: serve needs at least 2 ranks (a router and an expert rank), the job has "
        "{}: pass --ranks N (or set ranks: in the config)",
        job.ranks)));
  }
  auto text = FormatJobMemory(f.dev, job, f.json);
  if (!text.ok()) return FailWith(text.status());
  std::fputs(text->c_str(), stdout);
  std::fflush(stdout);
  return 0;
}

int RunServe(const ServeFlags& f) {
  auto setup = Configure(f);
  if (!setup.ok()) return FailWith(setup.status());
  if (f.plan_memory) return PlanMemory(setup->config, f);
  if (f.json) return FailWith(Status::InvalidArgument("--json goes with --plan-memory"));
  if (!f.join.empty()) return RunJoined(*setup, f);
  const ServeConfig& c = setup->config;
  const int env_rank = RankFromEnvironment();
  InitLogging(env_rank, env_rank >= 0 && env_rank < c.routers ? "router" : "expert", c.log_level);
  if (env_rank <= 0) WarnAllInterfaces(c, true, true);  // once a job (inproc: -1, one process)
  RaiseDescriptorLimit();
  if (c.spare_expert_ranks > 0 && c.transport != "ucx") {
    return FailWith(Status::InvalidArgument(
        "spare_expert_ranks needs the ucx transport (only ucx takes a new process in), not '" +
        (c.transport.empty() ? std::string("inproc") : c.transport) + "'"));
  }
  if (c.transport == "ucx") {
    // The ucx transport's size: the launched ranks plus the spare ones (MOERUN_UCX_SPARE_RANKS
    // is the config's, whatever the environment said).
    ::setenv("MOERUN_UCX_SPARE_RANKS", std::to_string(c.spare_expert_ranks).c_str(), 1);
  }
  auto job = Launch(c);
  if (!job.ok()) return FailWith(job.status());
  if ((*job)->rank() == 0) {  // once a job: what a dead expert rank will do to it
    const DeathSurvival d = JudgeDeathSurvival(
        (*job)->transport(), std::chrono::milliseconds(c.deadline_ms), ProcessEnvironment());
    if (d.verdict == DeathSurvival::Verdict::kSurvives) {
      spdlog::info("{}", d.line);
    } else {
      spdlog::warn("{}", d.line);
    }
  }
  auto options = JobOptionsFor(c);
  if (!options.ok()) return FailWith(options.status());
  if (Status s = ValidateDeviceFlags(f.dev); !s.ok()) return FailWith(s);
  if (Status s = CheckCudaCache(f.dev, c); !s.ok()) return FailWith(s);
  if (f.dev.device == "cuda") {  // before anything starts: no GPU is a clear error, exit 2
    if (auto probe = RequireCuda(); !probe.ok()) return FailWith(probe.status());
  }
  auto spec = ResolveModel(c, &*options);
  if (!spec.ok()) return FailWith(spec.status());
  setup->layers = options->layers;
  setup->hidden = spec->hidden;
  setup->family = FamilyName(spec->family);
  setup->ranks = (*job)->size();

  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);
  if (!f.pid_file.empty() && (*job)->rank() == 0) std::ofstream(f.pid_file) << ::getpid() << "\n";
  const Status s = (*job)->Run([&](Transport* t) { return ServeRank(t, *setup, *options, f.dev); });
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
                  "mpi, ucx, nccl or inproc (overrides the config's transport)");
  cmd->add_option("--listen", flags->listen,
                  "Serving endpoint HOST:PORT of router 0 (router i: PORT + i; default "
                  "127.0.0.1:5700, loopback only: name an interface's address, or 0.0.0.0 for "
                  "all, to serve other hosts)");
  cmd->add_option("--control-listen", flags->control_listen,
                  "moectl endpoint HOST:PORT (default 127.0.0.1:5800)");
  cmd->add_option("--metrics-listen", flags->metrics_listen,
                  "HTTP /metrics and /health HOST:PORT of rank 0 (rank r: PORT + r; default "
                  "127.0.0.1:9700: probes and Prometheus from other hosts need an interface's "
                  "address or 0.0.0.0)");
  cmd->add_option("--token-file", flags->token_file, "Control token file (enables moectl)");
  cmd->add_option("--serving-key-file", flags->serving_key_file,
                  "Serving key file (chmod 600): every request must carry its key (overrides "
                  "serving.key_file)");
  cmd->add_option("--tls-cert-file", flags->tls_cert_file,
                  "TLS certificate chain (PEM) of the serving and control endpoints (overrides "
                  "serving.tls.cert_file; needs --tls-key-file or serving.tls.key_file)");
  cmd->add_option("--tls-key-file", flags->tls_key_file,
                  "TLS private key (PEM, chmod 600) (overrides serving.tls.key_file)");
  cmd->add_option("--expert-cache-mib", flags->expert_cache_mib,
                  "Expert cache of each expert rank in MiB (0: every hosted expert resident; "
                  "overrides expert_cache_mib)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--expert-memory-mib", flags->expert_memory_mib,
                  "The most expert weights this process's expert rank(s) may hold, in MiB (0: no "
                  "limit; a joiner on a smaller host): the planner gives them no more slots than "
                  "fit (overrides expert_memory_mib and rank_expert_memory_mib)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--expert-cache-policy", flags->expert_cache_policy,
                  "Expert cache eviction: adaptive (as whichever of cycle, lru and lfu its "
                  "shadow caches show hitting most lately), cycle (the next use expected "
                  "furthest away, layer by layer), lfu (decayed frequency) or lru")
      ->check(CLI::IsMember({"adaptive", "cycle", "lfu", "lru"}));
  cmd->add_option("--trace-endpoint", flags->trace_endpoint,
                  "OpenTelemetry traces of the requests to this OTLP/HTTP collector, "
                  "http://HOST:PORT[/PATH] (overrides tracing.endpoint)");
  cmd->add_option("--trace-sample", flags->trace_sample,
                  "Share of the requests traced, besides those whose traceparent says sampled, "
                  "the failed and the slow ones (overrides tracing.sample; default 0.01)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--trace-slow-ms", flags->trace_slow_ms,
                  "Also trace every request slower than this, frame in to answer out (0: off; "
                  "overrides tracing.slow_ms)")
      ->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  cmd->add_option("--expert-cache-spill-dir", flags->expert_cache_spill_dir,
                  "Folder for the expert cache's spill file: experts loaded once are written "
                  "there packed, later misses read them back (overrides expert_cache_spill_dir)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--expert-cache-load-mib-s", flags->expert_cache_load_mib_s,
                  "Bandwidth of each expert rank's cache loads in MiB/s, all loaders together "
                  "(0: unlimited; overrides expert_cache_load_mib_s)")
      ->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--join", flags->join,
                  "Start outside the job's mpirun and take over a dead expert rank of the running "
                  "job whose router 0's control endpoint is HOST:PORT (needs the job's config, "
                  "--token-file and the ucx transport)");
  AddDeviceFlags(cmd, &flags->dev,
                 "cpu or cuda (expert ranks run their experts on their local GPU)",
                 "--device cuda: tokens per microbatch the GPU buffers hold");
  cmd->add_option("--ranks", flags->ranks,
                  "Total ranks: the inproc job's threads (overrides ranks:) and the job "
                  "--plan-memory plans (default there: the MPI launcher's size, else ranks:)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_flag("--plan-memory", flags->plan_memory,
                "With --device cuda: print each rank's device memory by region (from the model's "
                "shapes; no GPU or weights needed) and exit");
  cmd->add_flag("--json", flags->json, "With --plan-memory: print the plan as JSON");
  return [flags, cmd]() -> int {
    if (!cmd->parsed()) return -1;
    return RunServe(*flags);
  };
}

}  // namespace moerun
