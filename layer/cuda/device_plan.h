// Host-side planning of the CUDA layer, in plain C++ so that it is tested on machines without a
// GPU (the weight layout and tile schedule it builds on: experts/cuda/tile_layout.h):
//   - the graph bucket of a token count;
//   - the arena: every per-batch buffer at a fixed, aligned offset of one allocation.
// Pure functions and plain data; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "experts/cuda/tile_layout.h"

namespace moerun::cuda_plan {

// The CUDA-graph bucket of a batch: the smallest power of two >= tokens, capped at graph_max;
// 0 when the batch is too large for graphs (or graphs are off: graph_max <= 0).
int64_t GraphBucket(int64_t tokens, int64_t graph_max);

// Named, 256-byte aligned regions of one device allocation.
struct ArenaPlan {
  struct Region {
    std::string name;
    size_t offset = 0, bytes = 0;
  };
  std::vector<Region> regions;
  size_t total = 0;
  size_t Add(const std::string& name, size_t bytes);  // returns the offset
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

}  // namespace moerun::cuda_plan
