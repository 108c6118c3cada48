#include "launch/moebench/floor.h"

#include <algorithm>
#include <set>

namespace moerun::bench {

double LayerFlops(const FloorInput& in) {
  const double t = static_cast<double>(in.tokens);
  const double h = static_cast<double>(in.hidden);
  double f = 2.0 * t * h * static_cast<double>(in.num_experts);
  f += 2.0 * t * static_cast<double>(in.top_k) * 3.0 * h * static_cast<double>(in.expert_inter);
  f += 2.0 * t * 3.0 * h * static_cast<double>(in.shared_inter);
  return f;
}

double LayerWeightBytes(const FloorInput& in) {
  const double h = static_cast<double>(in.hidden);
  const double per_expert = 3.0 * h * static_cast<double>(in.expert_inter);
  double elements = per_expert * static_cast<double>(std::max<int64_t>(in.active_experts, 0));
  elements += 3.0 * h * static_cast<double>(in.shared_inter);
  return elements * in.weight_bytes_per_element +
         h * static_cast<double>(in.num_experts) * in.gate_bytes_per_element;
}

Floor ComputeFloor(const FloorInput& in, const FloorRates& rates) {
  Floor f;
  f.bytes = LayerWeightBytes(in);
  f.flops = LayerFlops(in);
  f.memory_ms = rates.bytes_per_s > 0 ? f.bytes / rates.bytes_per_s * 1e3 : 0;
  f.compute_ms = rates.flops_per_s > 0 ? f.flops / rates.flops_per_s * 1e3 : 0;
  f.ms = std::max(f.memory_ms, f.compute_ms);
  return f;
}

int64_t CountActiveExperts(const std::vector<int32_t>& ids) {
  std::set<int32_t> distinct;
  for (int32_t id : ids) {
    if (id >= 0) distinct.insert(id);
  }
  return static_cast<int64_t>(distinct.size());
}

}  // namespace moerun::bench
