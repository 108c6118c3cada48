#include "launch/serve_cmd.h"

#include <atomic>
#include <csignal>
#include <fstream>

#include "launch/job_launch.h"
#include "launch/layer_source.h"
#include "runtime/batcher.h"
#include "runtime/layer_loader.h"
#include "runtime/log.h"
#include "runtime/serve_config.h"

namespace moerun {
namespace {

std::atomic<bool> g_stop{false};

extern "C" void OnStopSignal(int) { g_stop.store(true); }

struct ServeFlags {
  std::string config;
  std::string ready_file;
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

int RunServe(const ServeFlags& f) {
  auto config = LoadServeConfig(f.config);
  if (!config.ok()) return FailWith(config.status());
  const ServeConfig& c = *config;
  InitLogging(RankFromEnvironment(), "main", c.log_level);
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
  opts.source.experts = c.experts;
  auto dtype = ParseWeightDType(c.dtype);
  if (!dtype.ok()) return FailWith(dtype.status());
  opts.source.dtype = *dtype;
  opts.threads = c.threads;
  opts.isa = *isa;
  auto spec = SpecOf(opts.source);
  if (!spec.ok()) return FailWith(spec.status());
  auto layers = ResolveLayers(*spec, c.layers);
  if (!layers.ok()) return FailWith(layers.status());
  opts.layers = *layers;

  std::signal(SIGTERM, OnStopSignal);
  std::signal(SIGINT, OnStopSignal);
  const auto started = std::chrono::steady_clock::now();
  const RouterWork work = [&](int rank, std::map<int, ExpertParallelLayer*>& eps) -> Status {
    Batcher batcher(c.batching, spec->hidden);
    if (rank == 0) {
      spdlog::info(
          "serving {} layer(s) of {} on {} ranks; ready in {:.2f} s; stop with SIGTERM", eps.size(),
          FamilyName(spec->family), (*job)->size(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      if (!f.ready_file.empty()) std::ofstream(f.ready_file) << "ready\n";
    }
    Status failed;
    batcher.Run(
        [&](int layer, const float* x, int64_t tokens, float* out) -> Status {
          const auto it = eps.find(layer);
          if (it == eps.end()) {
            return Status::InvalidArgument("layer " + std::to_string(layer) + " is not served");
          }
          Status s = it->second->Forward(x, tokens, out);
          if (s.code() == StatusCode::kDeadlineExceeded || s.code() == StatusCode::kUnavailable) {
            failed = s;  // an expert rank is gone: stop serving
            g_stop.store(true);
          }
          return s;
        },
        [] { return g_stop.load(); });
    const BatcherStats st = batcher.stats();
    spdlog::info("router {} stopping: {} batches, {} requests, {} tokens served", rank, st.batches,
                 st.requests, st.tokens);
    return failed;
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
                  "Write this file once every rank has loaded its weights");
  return [flags, cmd]() -> int {
    if (!cmd->parsed()) return -1;
    return RunServe(*flags);
  };
}

}  // namespace moerun
