#include "runtime/ranks/expert_rank.h"

#include <utility>

namespace moerun {

ExpertRank::ExpertRank(Transport* transport, const Placement& placement,
                       std::map<int, std::shared_ptr<MoeLayerWeights>> layers,
                       const CpuKernels& kernels, ThreadPool* pool, ExpertRankOptions options)
    : control_(transport, placement.num_routers(), std::move(layers), options.deadline),
      server_(transport, placement, control_.layer_ids(), kernels, pool, options, &control_) {
  // The server gets what the rank serves now, and again after every change of it.
  control_.set_on_change([this](const ServedWeights& s) { server_.set_served(s); });
}

void ExpertRank::set_compute(ExpertCompute f) {
  control_.set_device_copy(static_cast<bool>(f));
  server_.set_compute(std::move(f));
}

}  // namespace moerun
