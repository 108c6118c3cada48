// One rank of an expert-parallel job, from start to end, in the order it happens:
//   RankJob::Prepare   the model spec, the placement and this rank's role (nothing loaded yet:
//                      a serving rank starts its health endpoint here, so that it answers while
//                      the weights load);
//   Load               the weights this rank needs (routers: the router's tensors; expert ranks:
//                      the experts the placement gives them), with progress in the log;
//   WaitReady          every rank has loaded (a barrier with the job's startup timeout);
//   MakeRouter / MakeExpert   the rank as an object: a RouterRank, handed batches by its caller,
//                      or an ExpertRank, whose Serve runs until every router has stopped.
// Ranks [0, routers) are routers, the others expert ranks. RunRank does all of it for callers
// that only need the router's layers (`moerun forward`, benchmarks, tests).
//
// An error from any wait names the rank that did not answer; the caller ends the job
// (Transport::Abort) so that no rank is left waiting. Threads: one RankJob per rank, used by the
// rank's thread. The job owns the rank's thread pool and weights: it outlives the rank objects
// it makes.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/thread_pool.h"
#include "experts/cpu/isa.h"
#include "experts/cpu/kernels.h"
#include "router/placement.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/ep/router_layer.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/model_spec.h"
#include "runtime/model/weight_source.h"
#include "runtime/ranks/expert_rank.h"
#include "runtime/ranks/router_rank.h"
#include "transport/transport.h"

namespace moerun {

struct JobOptions {
  WeightSource source;
  std::vector<int> layers;  // MoE layers to serve (resolved, non-empty)
  int routers = 1;
  std::string placement = "linear";  // linear | round_robin | JSON file
  EpOptions ep;
  std::chrono::milliseconds startup_timeout{600000};
  int threads = 0;  // per rank; 0: cores / ranks on this host
  // Ranks with a thread count of their own (rank -> threads), over `threads`: ranks of different
  // speed in one job (the planner balances their time with moectl --speed-measured).
  std::map<int, int> rank_threads;
  Isa isa = Isa::kScalar;
  // Ranks with kernels of their own (rank -> ISA), over `isa` (the variants agree bitwise): a
  // rank as slow as an older host's, in one job.
  std::map<int, Isa> rank_isa;
  // Expert ranks: the most expert weights each may hold (expert_memory_mib; 0: no limit), and
  // ranks with a budget of their own (rank_expert_memory_mib). Router 0's planner gives a rank no
  // more slots per layer than budget ÷ one expert's bytes ÷ the layers served.
  uint64_t expert_memory_bytes = 0;
  std::map<int, uint64_t> rank_expert_memory_bytes;
  RouterRankOptions router;  // what a router rank has besides its layers
  // An expert rank that joined a running job (moerun serve --join) in place of a dead one: it
  // loads no experts (the placement in use holds none on it; a rebalance brings them) and waits
  // for no other rank.
  bool joined = false;
  // Expert rank slots after the launched ranks (the transport's last ranks, no process yet;
  // moerun serve's spare_expert_ranks): the placement is made over the launched ranks and holds
  // nothing on them, and the start barrier waits for the launched ranks only.
  int spare_ranks = 0;
  // Expert ranks: an expert cache of this many bytes (0: every hosted expert resident). At start
  // the pinned experts (every layer) and then the others in expert order are loaded up to the
  // budget; the rest load when a microbatch needs them (runtime/cache/expert_cache.h).
  ExpertCacheOptions cache;
  std::vector<int> cache_pinned;
  // A folder for the cache's spill file (loaded experts written once, later misses read back);
  // empty: misses load from the source each time.
  std::string cache_spill_dir;
  // Which ranks share a node (rank -> node name, the config's `nodes:`); empty: each rank's host
  // name. Learnt by every launched rank at the start barrier (WaitReady); the routers' dispatch
  // (ep.rank_node) and moectl's status and planner use it.
  std::map<int, std::string> nodes;
};

// The weights an expert rank loaded, by layer number (what a device copy is made from).
using LoadedLayers = std::map<int, std::shared_ptr<const MoeLayerWeights>>;

class RankJob {
 public:
  static Result<std::unique_ptr<RankJob>> Prepare(Transport* transport, const JobOptions& options);

  Transport* transport() const { return t_; }
  int rank() const { return t_->rank(); }
  bool is_router() const { return rank() < opts_.routers; }
  const char* role() const { return is_router() ? "router" : "expert"; }
  const ModelSpec& spec() const { return spec_; }
  const Placement& placement() const { return *placement_; }
  const JobOptions& options() const { return opts_; }

  Status Load();
  Status WaitReady();
  // Once ready: each rank's node name ("" where unknown: a spare rank without a `nodes:` entry).
  const std::vector<std::string>& node_names() const { return node_names_; }
  // Once loaded: the weights by layer number.
  LoadedLayers loaded() const;

  // Routers, once ready.
  Result<std::unique_ptr<RouterRank>> MakeRouter();
  // Expert ranks, once ready; `compute` (optional) runs the grouped FFN on a device instead.
  Result<std::unique_ptr<ExpertRank>> MakeExpert(ExpertCompute compute = nullptr);

 private:
  RankJob() = default;
  Status LearnNodes();  // node_names_ and opts_.ep.rank_node, at the start barrier
  Status LoadCached();  // Load for an expert rank with an expert cache
  // Loads each layer's experts of its mask (and the router's tensors); the experts loaded.
  Result<size_t> LoadMasks(const std::map<int, std::vector<bool>>& masks);

  Transport* t_ = nullptr;
  JobOptions opts_;
  ModelSpec spec_;
  std::shared_ptr<const Placement> placement_;
  size_t header_bytes_ = 0;
  int threads_ = 1;
  std::unique_ptr<ThreadPool> pool_;
  const CpuKernels* kernels_ = nullptr;
  std::map<int, std::shared_ptr<MoeLayerWeights>> weights_;
  // With an expert cache: what the placement gives this rank, and the source of its misses.
  std::map<int, std::vector<bool>> hosted_, pinned_;
  std::unique_ptr<ExpertReader> reader_;
  std::vector<std::string> node_names_;  // per rank ("" where unknown: a spare rank)
};

// What each router rank does once the job is ready.
using RouterWork = std::function<Status(RouterRank& router)>;
// What an expert rank computes on, given what it loaded (null: its CPU).
using ExpertSetup = std::function<Result<ExpertCompute>(int rank, const LoadedLayers& layers)>;

// Runs this rank's part of the job to the end: routers run `work` and then Finish; expert ranks
// serve until every router has finished.
Status RunRank(Transport* transport, const JobOptions& options, const RouterWork& work,
               const ExpertSetup& expert_setup = nullptr);

}  // namespace moerun
