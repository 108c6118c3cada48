#include "ranks/rank_job.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "base/log.h"
#include "ep/protocol.h"
#include "migration/router_control.h"
#include "model/checkpoint.h"
#include "model/expert_file.h"
#include "model/layer_loader.h"
#include "model/preset.h"
#include "ranks/expert_rank.h"

namespace moerun {
namespace {

// Logs progress every 2 s; with a throttle, also reports the bytes done and sleeps so that the
// load stays under its bandwidth (the loads it throttles run on one thread).
std::function<void(int, int, size_t)> Progress(const std::string& what,
                                               const LoadThrottle& throttle = {}) {
  auto start = std::chrono::steady_clock::now();
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  return [=](int done, int total, size_t bytes) {
    if (throttle.bytes_done != nullptr) throttle.bytes_done->store(bytes);
    if (throttle.bytes_per_s > 0) {
      const auto due =
          start +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
              std::chrono::duration<double>(static_cast<double>(bytes) / throttle.bytes_per_s));
      while (std::chrono::steady_clock::now() < due &&
             (throttle.cancel == nullptr || !throttle.cancel->load())) {
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            due - std::chrono::steady_clock::now(), std::chrono::milliseconds(20)));
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - *last < std::chrono::seconds(2)) return;
    *last = now;
    spdlog::info("{}: {}/{} experts, {:.1f} MiB, {:.1f} s", what, done, total,
                 static_cast<double>(bytes) / (1 << 20),
                 std::chrono::duration<double>(now - start).count());
  };
}

Result<std::shared_ptr<MoeLayerWeights>> LoadFor(const WeightSource& src, const ModelSpec& spec,
                                                 int layer, std::vector<bool> mask,
                                                 const CpuKernels& kernels, int threads,
                                                 const std::string& what,
                                                 const LoadThrottle& throttle = {}) {
  if (!src.model.empty()) {
    MOERUN_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(src.model));
    LoadOptions o;
    o.layer = layer;
    o.load_expert = std::move(mask);
    o.threads = threads;
    o.progress = Progress(what, throttle);
    MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, LoadLayer(*ckpt, spec, kernels, o));
    return std::make_shared<MoeLayerWeights>(std::move(w));
  }
  PresetOptions o;
  o.seed = src.seed;
  o.gate_skew = src.gate_skew;
  o.dtype = src.dtype;
  o.layer = layer;
  o.load_expert = std::move(mask);
  o.threads = threads;
  o.progress = Progress(what, throttle);
  MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w, BuildPresetLayer(spec, kernels, o));
  return std::make_shared<MoeLayerWeights>(std::move(w));
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

// Compute threads of a rank when not given: the host's cores shared among the ranks on it that
// compute. A router mostly waits while the expert ranks work, so expert ranks share the cores
// among themselves; routers get an equal share of all ranks on the host.
int DefaultThreads(int rank, int ranks, int routers) {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  int local = ranks;    // ranks on this host (inproc: all of them)
  int local_first = 0;  // the global rank of this host's first rank
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(v));
  if (const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
    local_first = rank - std::atoi(lr);
  }
  if (rank < routers) return std::max(1, cores / local);
  const int local_routers = std::clamp(routers - local_first, 0, local);
  return std::max(1, cores / std::max(1, local - local_routers));
}

}  // namespace

Result<ModelSpec> SpecOf(const WeightSource& source, std::string* note) {
  if (!source.model.empty()) return LoadModelSpec(source.model);
  if (source.spec) return *source.spec;
  PresetOptions o;
  o.seed = source.seed;
  o.experts = source.experts;
  o.dtype = source.dtype;
  return PresetSpec(source.preset, o, note);
}

// What the transport moved and how (RDMA backends): the zero-copy evidence of a run.
static void LogTransportCounters(const Transport& t) {
  const TransportCounters c = t.counters();
  if (c.put_bytes == 0 && c.eager_bytes == 0) return;
  spdlog::info(
      "{} transport: {:.2f} MiB written by put, {:.2f} MiB in eager messages, {} bytes "
      "copied by the transport, {} registrations ({} on demand)",
      t.name(), static_cast<double>(c.put_bytes) / (1 << 20),
      static_cast<double>(c.eager_bytes) / (1 << 20), c.copied_bytes, c.registrations,
      c.on_demand_registrations);
}

Status RunRank(Transport* t, const JobOptions& opts, const RouterWork& work) {
  const int rank = t->rank();
  const int ranks = t->size();
  const bool router = rank < opts.routers;
  const std::string role = router ? "router" : "expert";
  std::string note;
  MOERUN_ASSIGN_OR_RETURN(ModelSpec spec, SpecOf(opts.source, &note));
  if (!note.empty() && rank == 0) spdlog::info("{}", note);
  MOERUN_ASSIGN_OR_RETURN(Placement made,
                          Placement::Make(opts.placement, spec.num_experts, ranks, opts.routers));
  const auto shared_placement = std::make_shared<const Placement>(std::move(made));
  const Placement& placement = *shared_placement;
  const size_t header_bytes = HeaderBytes(placement, opts.layers);
  if (opts.hooks.placement) {
    MOERUN_RETURN_IF_ERROR(opts.hooks.placement(rank, t, placement, spec));
  }
  struct Done {
    const JobHooks& hooks;
    int rank;
    ~Done() {
      if (hooks.done) hooks.done(rank);
    }
  } done_hook{opts.hooks, rank};

  const int threads = opts.threads > 0 ? opts.threads : DefaultThreads(rank, ranks, opts.routers);
  ThreadPool pool(threads);
  const CpuKernels& kernels = KernelsFor(opts.isa);

  // Load what this rank needs.
  const auto t_load = std::chrono::steady_clock::now();
  std::map<int, std::shared_ptr<MoeLayerWeights>> weights;
  size_t experts_here = 0;
  for (int layer : opts.layers) {
    std::vector<bool> mask = router
                                 ? std::vector<bool>(static_cast<size_t>(spec.num_experts), false)
                                 : placement.ExpertsOf(rank, layer);
    for (bool b : mask) experts_here += b;
    MOERUN_ASSIGN_OR_RETURN(
        weights[layer],
        LoadFor(opts.source, spec, layer, std::move(mask), kernels, threads,
                "rank " + std::to_string(rank) + " layer " + std::to_string(layer)));
  }
  size_t bytes = 0;
  for (const auto& [l, w] : weights) bytes += w->ExpertBytes();
  spdlog::info(
      "{} rank {}: {} layer(s), {} expert slot(s), {:.1f} MiB of weights, loaded in {:.2f} s", role,
      rank, opts.layers.size(), experts_here, static_cast<double>(bytes) / (1 << 20),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());

  MOERUN_RETURN_IF_ERROR(t->Barrier(SteadyClock::now() + opts.startup_timeout));
  if (rank == 0) {
    spdlog::info("all {} ranks ready ({} router(s), {} expert ranks, placement {} v{})", ranks,
                 opts.routers, ranks - opts.routers, opts.placement, placement.version());
  }
  if (opts.hooks.ready) opts.hooks.ready(rank);

  if (!router) {
    ExpertRankOptions ho;
    ho.deadline = opts.ep.deadline;
    ExpertRank host(t, placement, weights, kernels, &pool, ho);
    if (opts.hooks.expert_device) {
      const LoadedLayers loaded(weights.begin(), weights.end());
      MOERUN_ASSIGN_OR_RETURN(ExpertCompute compute, opts.hooks.expert_device(rank, loaded));
      host.set_compute(std::move(compute));
    }
    // Loads while serving run on one background thread (the pool computes).
    host.set_loaders(
        [&opts, &spec, &kernels, rank](
            int layer, const std::vector<bool>& mask, const std::map<int, std::string>& files,
            const LoadThrottle& throttle) -> Result<std::shared_ptr<MoeLayerWeights>> {
          MOERUN_ASSIGN_OR_RETURN(auto w, LoadFor(opts.source, spec, layer, mask, kernels, 1,
                                                  "rank " + std::to_string(rank) + " layer " +
                                                      std::to_string(layer) + " (migration)",
                                                  throttle));
          for (const auto& [e, file] : files) {  // promoted updates replace the source's weights
            if (e < 0 || e >= static_cast<int>(mask.size()) || !mask[static_cast<size_t>(e)]) {
              continue;
            }
            MOERUN_ASSIGN_OR_RETURN(w->experts[static_cast<size_t>(e)],
                                    LoadExpertFile(file, spec, layer, e, w->dtype, kernels));
          }
          return w;
        },
        [&spec, &kernels, &weights](int layer, int expert,
                                    const std::string& file) -> Result<ExpertWeights> {
          return LoadExpertFile(file, spec, layer, expert, weights.at(layer)->dtype, kernels);
        });
    if (opts.hooks.expert_host) opts.hooks.expert_host(rank, host);
    MOERUN_RETURN_IF_ERROR(host.Serve());
    spdlog::debug("expert rank {} served {} microbatches", rank, host.microbatches_served());
    LogTransportCounters(*t);
    return Status::Ok();
  }

  std::vector<std::unique_ptr<RouterLayer>> layers;
  std::map<int, RouterLayer*> by_number;
  for (const auto& [l, w] : weights) {
    layers.push_back(std::make_unique<RouterLayer>(t, shared_placement, w, kernels, &pool,
                                                   header_bytes, opts.ep));
    by_number[l] = layers.back().get();
  }
  std::unique_ptr<PeerHealth> health;
  if (opts.hooks.health) {
    health = std::make_unique<PeerHealth>(t, placement, header_bytes, *opts.hooks.health);
    for (auto& l : layers) l->set_health(health.get());
    if (opts.hooks.router_health) opts.hooks.router_health(rank, health.get());
  }
  std::unique_ptr<RouterControl> control;
  if (opts.hooks.router_control) {
    control = std::make_unique<RouterControl>(t, shared_placement, by_number, header_bytes,
                                              opts.ep.deadline);
    opts.hooks.router_control(rank, control.get());
  }
  Status s = work ? work(rank, by_number) : Status::Ok();
  if (control) {
    opts.hooks.router_control(rank, nullptr);
    control.reset();
  }
  if (!s.ok()) return s;
  layers.clear();
  if (health) {
    // Late transfers and probes finish before the shutdown message queues behind them.
    health->StopProbing();
    const Deadline until = DeadlineIn(opts.ep.deadline);
    while (!health->idle() && SteadyClock::now() < until) {
      health->Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (opts.hooks.router_health) opts.hooks.router_health(rank, nullptr);
    health.reset();
  }
  MOERUN_RETURN_IF_ERROR(SendShutdown(t, placement, header_bytes, opts.ep.deadline));
  LogTransportCounters(*t);
  return Status::Ok();
}

}  // namespace moerun
