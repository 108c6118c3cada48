// One rank of an expert-parallel job: its role, the weights it needs, and its work.
//
// Ranks [0, routers) are routers: they load the router's tensors (gate, biases, shared expert)
// and run RouterLayer; the others load only the experts the placement gives them and run
// ExpertRank. Every rank loads, then all meet at a barrier (the job is ready), then every router
// runs `work`; when it returns, that router tells the expert ranks it is done (they stop once
// every router has).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "ep/peer_health.h"
#include "ep/router_layer.h"
#include "experts/cpu/kernels.h"
#include "model/model_spec.h"
#include "ranks/expert_rank.h"
#include "router/placement.h"
#include "transport/transport.h"

namespace moerun {

// Where a layer's weights come from.
struct WeightSource {
  std::string model;              // checkpoint folder, or
  std::string preset;             // preset name, or
  std::optional<ModelSpec> spec;  // any shape, with seeded weights as presets make them
  uint64_t seed = 1;
  int experts = 0;
  double gate_skew = 0.0;  // presets: Zipf exponent of the routing (model/preset.h)
  DType dtype = DType::kF32;
};

class ExpertRank;
class RouterControl;
using LoadedLayers = std::map<int, std::shared_ptr<const MoeLayerWeights>>;

// What a long-running job (serve) hooks into a rank's life; all optional.
struct JobHooks {
  // Every rank (its number first), once the placement is made, before loading; an error ends
  // the rank's part of the job.
  std::function<Status(int, Transport*, const Placement&, const ModelSpec&)> placement;
  // Every rank whose placement hook ran, when its part ends (the transport is still valid).
  std::function<void(int)> done;
  // Every rank, once every rank has loaded its weights.
  std::function<void(int)> ready;
  // Expert ranks, before serving.
  std::function<void(int, ExpertRank&)> expert_host;
  // Expert ranks, once loaded: where their experts run when not on the CPU (--device cuda);
  // an error ends the rank's part of the job.
  std::function<Result<ExpertCompute>(int rank, const LoadedLayers&)> expert_device;
  // Routers: with health options, a PeerHealth probes the expert ranks and takes over the
  // transfers of missed deadlines (see ep/peer_health.h); it is handed over before work.
  std::optional<PeerHealthOptions> health;
  std::function<void(int, PeerHealth*)> router_health;
  // Routers: their RouterControl (migrations, expert updates) once made, before work; null when
  // work has returned.
  std::function<void(int, RouterControl*)> router_control;
};

struct JobOptions {
  WeightSource source;
  std::vector<int> layers;  // MoE layers to serve (resolved, non-empty)
  int routers = 1;
  std::string placement = "linear";  // linear | round_robin | JSON file
  EpOptions ep;
  std::chrono::milliseconds startup_timeout{600000};
  int threads = 0;  // per rank; 0: cores / ranks on this host
  Isa isa = Isa::kScalar;
  JobHooks hooks;
};

// The model spec a source describes (experts scaled as the preset says).
Result<ModelSpec> SpecOf(const WeightSource& source, std::string* note = nullptr);

// What each router rank does once the job is ready; it gets its rank and the layers by number.
using RouterWork = std::function<Status(int rank, std::map<int, RouterLayer*>& layers)>;

// Runs this rank's part of the job to the end. An error from any wait names the rank that did not
// answer; the caller ends the job (Transport::Abort) so that no rank is left waiting.
Status RunRank(Transport* transport, const JobOptions& options, const RouterWork& work);

}  // namespace moerun
