// The physical floor of one MoE layer forward on a device: the larger of (a) reading the weights
// the batch needs once, at the device's copy bandwidth, and (b) its FLOPs at the device's dense
// matmul rate. `moebench layer --device cuda` reports x_floor = our time ÷ this floor.
// Pure functions of their arguments (no device, no I/O); thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moerun::bench {

// NVIDIA H200 (bf16), as measured for /work/shared/ANCHORS.md: copy bandwidth and dense bf16
// matmul rate.
inline constexpr double kH200BytesPerSecond = 4.24e12;
inline constexpr double kH200FlopsPerSecond = 806e12;

struct FloorRates {
  double bytes_per_s = kH200BytesPerSecond;
  double flops_per_s = kH200FlopsPerSecond;
};

// One layer forward of `tokens` tokens.
struct FloorInput {
  int64_t tokens = 0;
  int64_t hidden = 0;        // H
  int64_t expert_inter = 0;  // I of one routed expert
  int64_t num_experts = 0;   // E (the gate's outputs)
  int64_t top_k = 0;         // k
  int64_t shared_inter = 0;  // 0: no shared expert (always read and computed when present)
  // Distinct routed experts the batch's routing chose (at most min(E, tokens * k)).
  int64_t active_experts = 0;
  double weight_bytes_per_element = 2;  // the experts' weights: 2 for bf16/f16, 4 for f32
  // The gate's weights [E][H]; 0 leaves them out of the bytes (as ANCHORS.md's table does).
  double gate_bytes_per_element = 0;
};

struct Floor {
  double bytes = 0;       // weights read: active experts (+ shared expert, + gate)
  double flops = 0;       // gate + k routed experts per token (+ shared expert)
  double memory_ms = 0;   // bytes / bandwidth
  double compute_ms = 0;  // flops / matmul rate
  double ms = 0;          // max of the two
  bool memory_bound() const { return memory_ms >= compute_ms; }
};

// FLOPs of one forward: 2*T*H*E (gate) + 2*T*k*3*H*I (routed SwiGLU experts: gate, up, down)
// + 2*T*3*H*Is (shared expert).
double LayerFlops(const FloorInput& in);
// Bytes of the weights the batch reads: 3*H*I per active expert (+ 3*H*Is, + H*E for the gate),
// times their element sizes.
double LayerWeightBytes(const FloorInput& in);
Floor ComputeFloor(const FloorInput& in, const FloorRates& rates = {});

// A floor is what the machine cannot beat, so x_floor (our time / floor) below this is a floor
// fault: the floor under-reads the machine (a bandwidth or rate measured too low) and the ratio
// flatters us. 0.95, not 1, leaves room for timing noise between the two measurements.
inline constexpr double kFloorFaultBelow = 0.95;

// Whether `x_floor` is a floor fault: below kFloorFaultBelow, or NaN (no comparison is no
// success).
bool IsFloorFault(double x_floor);

// One line saying why a floor fault is one: the ratio, and our rate against the floor's measured
// rate (memory-bound: GB/s of weights read; else GFLOP/s).
std::string FloorFaultReason(double x_floor, bool memory_bound, double our_rate, double floor_rate);

// Distinct expert ids in a routing ([tokens * k] ids; negative ids, if any, are not counted).
int64_t CountActiveExperts(const std::vector<int32_t>& ids);

}  // namespace moerun::bench
