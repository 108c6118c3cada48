// Host-side planning of the CUDA layer, in plain C++ so that it is tested on machines without a
// GPU (the weight layout and tile schedule it builds on: experts/cuda/tile_layout.h):
//   - the graph bucket of a token count;
//   - the arena: every per-batch buffer at a fixed, aligned offset of one allocation;
//   - a rank's device memory by role (PlanRankMemory): what `--plan-memory` prints and what the
//     rank's CUDA context allocates (the one source of both).
// Pure functions and plain data; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "experts/cuda/tile_layout.h"
#include "runtime/layer/cuda/device_weights.h"

namespace moerun::cuda_plan {

// The CUDA-graph bucket of a batch: the smallest power of two >= tokens, capped at graph_max;
// 0 when the batch is too large for graphs (or graphs are off: graph_max <= 0).
int64_t GraphBucket(int64_t tokens, int64_t graph_max);

// Named, 256-byte aligned regions of one device allocation. A region may alias an earlier one
// (the same offset, at most its bytes): the caller guarantees that their uses never overlap in
// time (stream order); every other pair of regions is disjoint.
struct ArenaPlan {
  struct Region {
    std::string name;
    size_t offset = 0, bytes = 0;
    std::string alias_of;  // empty: its own bytes
  };
  std::vector<Region> regions;
  size_t total = 0;
  size_t Add(const std::string& name, size_t bytes);  // returns the offset
  // `name` reuses `of`'s memory (bytes <= of's; an unknown `of` or a larger region: -1).
  int64_t AddAlias(const std::string& name, const std::string& of, size_t bytes);
  const Region* Find(const std::string& name) const;  // null if absent
  std::string Describe() const;                       // "arena 1.2 GB: x 64 MB, ..."
};

struct LayerShape {
  int64_t max_tokens = 0, hidden = 0;
  int experts = 0, top_k = 0, gate_rows = 0;  // gate_rows: experts (+1: Qwen2's shared gate)
  bool shared = false;
  int64_t max_inter_padded = 0;  // over routed and shared experts
  int act_bytes = 4;             // 4: exact math (f32 rows); 2: tensor cores (bf16/f16 rows)
};
// The arena of one layer: x, out, logits, ids, weights, shared scale, counts, offsets, tiles,
// row_token, slot_row, gathered rows, hidden activations, expert outputs, flags.
ArenaPlan PlanLayerArena(const LayerShape& s);
// Rows of the grouped FFN for `tokens` tokens: tokens * k (+ tokens for a shared expert).
inline int64_t FfnRows(const LayerShape& s, int64_t tokens) {
  return tokens * s.top_k + (s.shared ? tokens : 0);
}

// --- A rank's device memory ----------------------------------------------------------------------

// What a rank does with its GPU (launch/cuda_setup.h decides it from the job):
enum class DeviceRole {
  kCpuRouter,   // a router of an expert-parallel job: it gates and routes on its CPU, no device
  kExpertRank,  // an expert rank: the grouped FFN over the rows the routers send it
  kWholeLayer,  // one process (`moerun forward --device cuda`): gate, route, FFN and combine
};
const char* DeviceRoleName(DeviceRole r);  // "cpu router", "expert", "whole layer"

// Device bytes of one group descriptor (cuda_kernels::DevGroup; cuda_layer_impl.h checks it fits).
constexpr size_t kGroupDescriptorBytes = 128;

// One MoE layer a rank hosts: its number and the expert slots it holds in it (the placement's).
struct HostedLayer {
  int layer = 0;
  int slots = 0;    // slots (a dispatch header names each; replicas count once per slot)
  int experts = 0;  // distinct experts whose weights it holds (replicas on one rank share them)
};

struct RankMemoryInput {
  DeviceRole role = DeviceRole::kExpertRank;
  // The model's shape.
  int64_t hidden = 0, expert_inter = 0;
  int64_t shared_inter = 0;  // 0: no shared expert (it runs on the router in expert parallelism)
  int top_k = 0, experts = 0;
  int gate_rows = 0;  // experts (+1: Qwen2's shared-expert gate)
  bool expert_bias = false;
  bool gate_bias = false, selection_bias = false;  // whole layer: the router's bias vectors
  std::vector<HostedLayer> layers;
  WeightFormat format = WeightFormat::kF32;  // as the device holds the experts
  bool tensor_cores = false;                 // false: exact math (f32 rows)
  int64_t max_tokens = 0;                    // tokens per forward / microbatch the buffers hold
  size_t expert_cache_bytes = 0;             // > 0: an expert cache of this budget holds weights
  int64_t graph_max_tokens = 0;              // whole layer: CUDA graphs up to this many tokens
  int routers = 1;                           // expert rank: routers that send it microbatches
  size_t result_trailer_bytes = 0;           // expert rank: bytes after the rows of an answer
};

// A separately allocated part of the weights (not in the arena).
struct WeightPart {
  std::string name;
  size_t bytes = 0;
};

struct RankMemoryPlan {
  DeviceRole role = DeviceRole::kCpuRouter;
  int64_t hidden = 0;
  WeightFormat format = WeightFormat::kF32;
  bool tensor_cores = false;
  std::vector<WeightPart> weights;  // expert values/codes, scales, biases, the gate
  ArenaPlan arena;                  // every per-batch buffer (aliases included, counted once)
  int64_t max_rows = 0;             // rows of the largest batch the arena holds
  int max_groups = 0;               // groups of one grouped FFN call
  int64_t act_stride = 0;           // padded intermediate size (the hidden activations' stride)
  int act_bytes = 4;                // bytes of a row element fed to the FFN (4 exact, 2 mma)
  int graph_buckets = 0;            // CUDA graphs the rank may capture (driver memory, not here)
  size_t io_buffer_bytes = 0;       // expert rank: one receive buffer (a send buffer: + trailer)
  size_t pinned_tables = 0;         // page-locked staging of the flags and the group tables
  size_t pinned_host = 0;           // page-locked host bytes: the tables + the rank's io buffers
  size_t weight_bytes() const;
  size_t non_weight_bytes() const { return arena.total; }
  size_t device_total() const { return weight_bytes() + arena.total; }
  size_t Weight(const std::string& name) const;  // a part's bytes (0 if absent)
};

// The device memory of a rank in its role; InvalidArgument for shapes that make no sense.
//   cpu router   nothing on the device (0 bytes).
//   expert rank  its experts' weights over every layer it hosts (or the cache budget), and ONE
//                arena for all of them sized for the largest microbatch a router may send it:
//                per token at most min(top_k, its slots in that layer) rows, so
//                max_rows = max_tokens * max over layers of min(top_k, slots). Exact math: the
//                f32 rows are GEMM1's input and y reuses them (GEMM2 runs after GEMM1 has read
//                them); tensor cores: the f32 rows are converted into 16-bit rows, then y reuses
//                the f32 region. Nothing of the router's (gate, logits, ids, x, out).
//   whole layer  PlanLayerArena's regions plus the group tables, the gate and every expert.
Result<RankMemoryPlan> PlanRankMemory(const RankMemoryInput& in);

// "region | bytes" lines of one rank (a table for --plan-memory).
std::string DescribeRankMemory(const RankMemoryPlan& p);

}  // namespace moerun::cuda_plan
