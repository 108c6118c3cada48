#include "launch/moebench/floor.h"

#include <algorithm>
#include <cstdio>
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

bool IsFloorFault(double x_floor) { return !(x_floor >= kFloorFaultBelow); }

std::string FloorFaultReason(double x_floor, bool memory_bound, double our_rate,
                             double floor_rate) {
  char line[256];
  if (memory_bound) {
    std::snprintf(line, sizeof line,
                  "x_floor %.2f < %.2f: the layer read its weights at %.1f GB/s, faster than the "
                  "floor's measured memory read bandwidth %.1f GB/s: the floor under-reads this "
                  "machine",
                  x_floor, kFloorFaultBelow, our_rate, floor_rate);
  } else {
    std::snprintf(line, sizeof line,
                  "x_floor %.2f < %.2f: the layer ran at %.1f GFLOP/s, faster than the floor's "
                  "measured compute rate %.1f GFLOP/s: the floor under-rates this machine",
                  x_floor, kFloorFaultBelow, our_rate, floor_rate);
  }
  return line;
}

int64_t CountActiveExperts(const std::vector<int32_t>& ids) {
  std::set<int32_t> distinct;
  for (int32_t id : ids) {
    if (id >= 0) distinct.insert(id);
  }
  return static_cast<int64_t>(distinct.size());
}

}  // namespace moerun::bench
