#include "runtime/ranks/rank_job.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "base/host_name.h"
#include "base/log.h"
#include "runtime/ep/protocol.h"
#include "runtime/model/expert_file.h"

namespace moerun {
namespace {

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

Result<std::unique_ptr<RankJob>> RankJob::Prepare(Transport* t, const JobOptions& opts) {
  std::unique_ptr<RankJob> job(new RankJob());
  job->t_ = t;
  job->opts_ = opts;
  std::string note;
  MOERUN_ASSIGN_OR_RETURN(job->spec_, SpecOf(opts.source, &note));
  if (!note.empty() && t->rank() == 0) spdlog::info("{}", note);
  const int launched = t->size() - opts.spare_ranks;
  if (opts.spare_ranks < 0 || launched <= opts.routers) {
    return Status::InvalidArgument(
        fmt::format("{} spare rank(s) of {}: the job needs a router and an expert rank launched",
                    opts.spare_ranks, t->size()));
  }
  MOERUN_ASSIGN_OR_RETURN(Placement made, Placement::Make(opts.placement, job->spec_.num_experts,
                                                          launched, opts.routers));
  if (opts.spare_ranks > 0) {
    // The same placement over every rank: the spare ones hold nothing.
    nlohmann::json j = nlohmann::json::parse(made.ToJson());
    j["num_ranks"] = t->size();
    MOERUN_ASSIGN_OR_RETURN(made, Placement::FromJson(j.dump(), "the placement with spare ranks"));
  }
  job->placement_ = std::make_shared<const Placement>(std::move(made));
  job->header_bytes_ = HeaderBytes(*job->placement_, opts.layers);
  for (const auto& [rank, n] : opts.rank_threads) {
    if (rank < 0 || rank >= t->size() || n < 1) {
      return Status::InvalidArgument(fmt::format(
          "rank_threads: rank {} with {} thread(s): the job has ranks 0..{}, each with 1 or more",
          rank, n, t->size() - 1));
    }
  }
  for (const auto& [rank, isa] : opts.rank_isa) {
    if (rank < 0 || rank >= t->size()) {
      return Status::InvalidArgument(fmt::format("rank_isa: rank {} ({}): the job has ranks 0..{}",
                                                 rank, IsaName(isa), t->size() - 1));
    }
  }
  const auto own = opts.rank_threads.find(t->rank());
  job->threads_ = own != opts.rank_threads.end() ? own->second
                  : opts.threads > 0             ? opts.threads
                                     : DefaultThreads(t->rank(), t->size(), opts.routers);
  const auto own_isa = opts.rank_isa.find(t->rank());
  job->kernels_ = &KernelsFor(own_isa != opts.rank_isa.end() ? own_isa->second : opts.isa);
  if (opts.cache.budget_bytes > 0) {
    for (int e : opts.cache_pinned) {
      if (e < 0 || e >= job->spec_.num_experts) {
        return Status::InvalidArgument("expert cache: pinned expert " + std::to_string(e) +
                                       " is not an expert of the model (0.." +
                                       std::to_string(job->spec_.num_experts - 1) + ")");
      }
    }
  }
  return job;
}

Status RankJob::Load() {
  pool_ = std::make_unique<ThreadPool>(threads_);
  const int me = rank();
  const auto started = std::chrono::steady_clock::now();
  size_t experts_here = 0;
  const bool cached = opts_.cache.budget_bytes > 0 && !is_router() && !opts_.joined;
  if (cached) return LoadCached();
  std::map<int, std::vector<bool>> masks;
  for (int layer : opts_.layers) {
    masks[layer] = is_router() || opts_.joined
                       ? std::vector<bool>(static_cast<size_t>(spec_.num_experts), false)
                       : placement_->ExpertsOf(me, layer);
  }
  MOERUN_ASSIGN_OR_RETURN(experts_here, LoadMasks(masks));
  size_t bytes = 0;
  for (const auto& [l, w] : weights_) bytes += w->ExpertBytes();
  spdlog::info(
      "{} rank {}: {} layer(s), {} expert slot(s), {:.1f} MiB of weights, loaded in {:.2f} s",
      role(), me, opts_.layers.size(), experts_here, static_cast<double>(bytes) / (1 << 20),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return Status::Ok();
}

Result<size_t> RankJob::LoadMasks(const std::map<int, std::vector<bool>>& masks) {
  size_t experts = 0;
  for (const auto& [layer, mask] : masks) {
    for (bool b : mask) experts += b;
    MOERUN_ASSIGN_OR_RETURN(
        weights_[layer],
        LoadWeights(opts_.source, spec_, layer, mask, *kernels_, threads_,
                    "rank " + std::to_string(rank()) + " layer " + std::to_string(layer)));
  }
  return experts;
}

Status RankJob::LoadCached() {
  const int me = rank();
  const auto started = std::chrono::steady_clock::now();
  MOERUN_ASSIGN_OR_RETURN(reader_, ExpertReader::Open(opts_.source, spec_, *kernels_));
  // The order experts fill the budget in: the pinned ones, then by number (every layer).
  std::vector<std::pair<int, int>> order;
  size_t hosted_count = 0;
  for (int layer : opts_.layers) {
    hosted_[layer] = placement_->ExpertsOf(me, layer);
    pinned_[layer].assign(static_cast<size_t>(spec_.num_experts), false);
    for (int e : opts_.cache_pinned) {
      if (hosted_[layer][static_cast<size_t>(e)]) pinned_[layer][static_cast<size_t>(e)] = true;
    }
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (int layer : opts_.layers) {
      for (int e = 0; e < spec_.num_experts; ++e) {
        const size_t i = static_cast<size_t>(e);
        if (!hosted_[layer][i] || pinned_[layer][i] != (pass == 0)) continue;
        order.push_back({layer, e});
        ++hosted_count;
      }
    }
  }
  // One expert first: its size says how many fit.
  size_t one = 0;
  if (!order.empty()) {
    MOERUN_ASSIGN_OR_RETURN(ExpertWeights w, reader_->Load(order[0].first, order[0].second));
    one = w.bytes();
    if (one > opts_.cache.budget_bytes) {
      return Status::InvalidArgument(fmt::format(
          "expert cache of {:.2f} MiB is smaller than one expert of this model ({:.2f} MiB as "
          "held): give expert_cache_mib at least {}",
          static_cast<double>(opts_.cache.budget_bytes) / (1 << 20),
          static_cast<double>(one) / (1 << 20), (one + (1 << 20) - 1) >> 20));
    }
  }
  const size_t fit = one > 0 ? opts_.cache.budget_bytes / one : 0;
  size_t pinned_count = 0;
  for (const auto& [layer, mask] : pinned_) {
    for (bool b : mask) pinned_count += b;
  }
  if (pinned_count > fit) {
    return Status::InvalidArgument(fmt::format(
        "expert cache: {} pinned experts on rank {} need {:.1f} MiB, more than the budget of "
        "{:.1f} MiB",
        pinned_count, me, static_cast<double>(pinned_count * one) / (1 << 20),
        static_cast<double>(opts_.cache.budget_bytes) / (1 << 20)));
  }
  std::map<int, std::vector<bool>> initial;
  for (int layer : opts_.layers) {
    initial[layer].assign(static_cast<size_t>(spec_.num_experts), false);
  }
  for (size_t i = 0; i < order.size() && i < fit; ++i) {
    initial[order[i].first][static_cast<size_t>(order[i].second)] = true;
  }
  MOERUN_ASSIGN_OR_RETURN(const size_t resident, LoadMasks(initial));
  size_t bytes = 0;
  for (const auto& [l, w] : weights_) bytes += w->ExpertBytes();
  spdlog::info(
      "expert rank {}: {} layer(s), {} expert slot(s) hosted, {} resident in the expert cache "
      "({:.1f} of {:.1f} MiB, {}), loaded in {:.2f} s",
      me, opts_.layers.size(), hosted_count, resident, static_cast<double>(bytes) / (1 << 20),
      static_cast<double>(opts_.cache.budget_bytes) / (1 << 20),
      EvictionPolicyName(opts_.cache.policy),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  return Status::Ok();
}

Status RankJob::LearnNodes() {
  const int n = t_->size();
  for (const auto& [rank, name] : opts_.nodes) {
    if (rank >= n) {
      return Status::InvalidArgument(
          fmt::format("nodes: rank {} (node {}) is not in this job of {} ranks", rank, name, n));
    }
  }
  node_names_.assign(static_cast<size_t>(n), std::string());
  const int launched = n - opts_.spare_ranks;
  if (!opts_.nodes.empty()) {
    for (int r = 0; r < launched; ++r) {
      if (!opts_.nodes.count(r)) {
        return Status::InvalidArgument(
            fmt::format("nodes: rank {} is on no node (list every launched rank)", r));
      }
    }
    for (const auto& [rank, name] : opts_.nodes) node_names_[static_cast<size_t>(rank)] = name;
  } else if (!opts_.joined) {
    std::string mine = HostName();
    if (mine.empty()) mine = "?";
    if (mine.size() > 255) mine.resize(255);
    MOERUN_ASSIGN_OR_RETURN(
        auto all,
        AllGatherBytes(*t_, std::vector<uint8_t>(mine.begin(), mine.end()), kReservedTagBase + 64,
                       255, SteadyClock::now() + opts_.startup_timeout, "host names", launched));
    for (int r = 0; r < launched; ++r) {
      const auto& b = all[static_cast<size_t>(r)];
      node_names_[static_cast<size_t>(r)].assign(b.begin(), b.end());
    }
  }
  // Ids in order of first appearance; a rank whose node is unknown is alone on its own.
  std::map<std::string, int> ids;
  opts_.ep.rank_node.assign(static_cast<size_t>(n), 0);
  int next = 0;
  for (int r = 0; r < n; ++r) {
    const std::string& name = node_names_[static_cast<size_t>(r)];
    if (name.empty()) {
      opts_.ep.rank_node[static_cast<size_t>(r)] = next++;
      continue;
    }
    const auto [it, fresh] = ids.emplace(name, next);
    if (fresh) ++next;
    opts_.ep.rank_node[static_cast<size_t>(r)] = it->second;
  }
  if (rank() == 0 && !opts_.joined) {
    std::map<std::string, std::vector<int>> on;
    for (int r = 0; r < n; ++r) {
      if (!node_names_[static_cast<size_t>(r)].empty()) {
        on[node_names_[static_cast<size_t>(r)]].push_back(r);
      }
    }
    std::string list;
    for (const auto& [name, ranks] : on) {
      list +=
          fmt::format("{}{}: rank(s) {}", list.empty() ? "" : "; ", name, fmt::join(ranks, ","));
    }
    spdlog::info(
        "{} node(s) ({}): {}{}", on.size(), opts_.nodes.empty() ? "host names" : "nodes:", list,
        opts_.ep.node_spill >= 0
            ? fmt::format("; routers prefer their node's copies (spill {})", opts_.ep.node_spill)
            : std::string());
  }
  return Status::Ok();
}

Status RankJob::WaitReady() {
  if (opts_.joined) return LearnNodes();  // the others are serving already
  MOERUN_RETURN_IF_ERROR(
      t_->Barrier(SteadyClock::now() + opts_.startup_timeout, t_->size() - opts_.spare_ranks));
  MOERUN_RETURN_IF_ERROR(LearnNodes());
  if (rank() == 0) {
    spdlog::info("all {} ranks ready ({} router(s), {} expert ranks, placement {} v{}){}",
                 t_->size() - opts_.spare_ranks, opts_.routers,
                 t_->size() - opts_.spare_ranks - opts_.routers, opts_.placement,
                 placement_->version(),
                 opts_.spare_ranks > 0
                     ? fmt::format(", {} spare expert rank(s) for joiners", opts_.spare_ranks)
                     : std::string());
  }
  return Status::Ok();
}

LoadedLayers RankJob::loaded() const { return LoadedLayers(weights_.begin(), weights_.end()); }

Result<std::unique_ptr<RouterRank>> RankJob::MakeRouter() {
  if (!is_router()) return Status::Internal("rank " + std::to_string(rank()) + " is no router");
  return std::make_unique<RouterRank>(t_, placement_, weights_, *kernels_, pool_.get(),
                                      header_bytes_, opts_.ep, opts_.router);
}

Result<std::unique_ptr<ExpertRank>> RankJob::MakeExpert(ExpertCompute compute) {
  if (is_router()) return Status::Internal("rank " + std::to_string(rank()) + " is a router");
  ExpertRankOptions o;
  o.deadline = opts_.ep.deadline;
  const auto own_memory = opts_.rank_expert_memory_bytes.find(rank());
  o.memory_budget_bytes = own_memory != opts_.rank_expert_memory_bytes.end()
                              ? own_memory->second
                              : opts_.expert_memory_bytes;
  auto host = std::make_unique<ExpertRank>(t_, *placement_, weights_, *kernels_, pool_.get(), o);
  if (compute && reader_) {
    return Status::Unsupported(
        "the expert cache is not available with --device cuda yet: the device holds a copy of "
        "every hosted expert made at start (leave expert_cache_mib at 0)");
  }
  if (compute) host->set_compute(std::move(compute));
  // Loads while serving run on one background thread (the pool computes); the job outlives the
  // rank, so the loaders may refer to it.
  const int me = rank();
  host->set_loaders(
      [this, me](int layer, const std::vector<bool>& mask, const std::map<int, std::string>& files,
                 const LoadThrottle& throttle) -> Result<std::shared_ptr<MoeLayerWeights>> {
        MOERUN_ASSIGN_OR_RETURN(auto w, LoadWeights(opts_.source, spec_, layer, mask, *kernels_, 1,
                                                    "rank " + std::to_string(me) + " layer " +
                                                        std::to_string(layer) + " (migration)",
                                                    throttle));
        for (const auto& [e, file] : files) {  // promoted updates replace the source's weights
          if (e < 0 || e >= static_cast<int>(mask.size()) || !mask[static_cast<size_t>(e)]) {
            continue;
          }
          MOERUN_ASSIGN_OR_RETURN(w->experts[static_cast<size_t>(e)],
                                  LoadExpertFile(file, spec_, layer, e, w->dtype, *kernels_));
        }
        return w;
      },
      [this](int layer, int expert, const std::string& file) -> Result<ExpertWeights> {
        return LoadExpertFile(file, spec_, layer, expert, weights_.at(layer)->dtype, *kernels_);
      });
  if (reader_) {
    std::unique_ptr<SpillFile> spill;
    if (!opts_.cache_spill_dir.empty()) {
      MOERUN_ASSIGN_OR_RETURN(spill, SpillFile::Create(opts_.cache_spill_dir));
    }
    const ExpertReader* reader = reader_.get();
    host->control().EnableCache(
        opts_.cache,
        [this, reader](int layer, int expert, const std::string& file) -> Result<ExpertWeights> {
          if (!file.empty()) {
            return LoadExpertFile(file, spec_, layer, expert, weights_.at(layer)->dtype, *kernels_);
          }
          return reader->Load(layer, expert);
        },
        hosted_, pinned_, std::move(spill));
  }
  return host;
}

Status RunRank(Transport* t, const JobOptions& options, const RouterWork& work,
               const ExpertSetup& expert_setup) {
  MOERUN_ASSIGN_OR_RETURN(auto job, RankJob::Prepare(t, options));
  MOERUN_RETURN_IF_ERROR(job->Load());
  MOERUN_RETURN_IF_ERROR(job->WaitReady());
  if (!job->is_router()) {
    ExpertCompute compute;
    if (expert_setup) {
      MOERUN_ASSIGN_OR_RETURN(compute, expert_setup(job->rank(), job->loaded()));
    }
    MOERUN_ASSIGN_OR_RETURN(auto host, job->MakeExpert(std::move(compute)));
    MOERUN_RETURN_IF_ERROR(host->Serve());
    spdlog::debug("expert rank {} served {} microbatches", host->rank(),
                  host->microbatches_served());
    LogTransportCounters(*t);
    return Status::Ok();
  }
  MOERUN_ASSIGN_OR_RETURN(auto router, job->MakeRouter());
  // The expert ranks are told to stop even if the work failed (they would wait for it).
  const Status worked = work ? work(*router) : Status::Ok();
  const Status finished = router->Finish();
  return worked.ok() ? finished : worked;
}

}  // namespace moerun
