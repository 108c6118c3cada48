// Host-side planning of the CUDA layer, in plain C++ so that it is tested on machines without a
// GPU. The kernels use the same functions (MOERUN_HD), so the tests check the code the GPU runs:
//   - the device weight layout (gate/up rows interleaved in blocks of kColBlock hidden columns,
//     so one tile of the first GEMM yields both halves of its columns; inter padded to a block);
//   - the tile schedule of the grouped FFN (group g owns m-tiles [tile_off[g], tile_off[g+1]));
//   - the graph bucket of a token count;
//   - the arena: every per-batch buffer at a fixed, aligned offset of one allocation.
// Pure functions and plain data; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/host_device.h"

namespace moerun::cuda_plan {

constexpr int kColBlock = 64;

MOERUN_HD inline int64_t PaddedInter(int64_t inter) {
  return (inter + kColBlock - 1) / kColBlock * kColBlock;
}
// Rows of the device W13 [2 * PaddedInter][hidden] holding W_gate row j and W_up row j.
MOERUN_HD inline int64_t GateRow(int64_t j) {
  return (j / kColBlock) * 2 * kColBlock + j % kColBlock;
}
MOERUN_HD inline int64_t UpRow(int64_t j) { return GateRow(j) + kColBlock; }

// tile_off[g + 1] = tile_off[g] + ceil(rows_g / bm); row_off likewise with rows. n = groups.
MOERUN_HD inline void ScanGroups(const int32_t* rows, int n, int bm, int32_t* row_off,
                                 int32_t* tile_off) {
  row_off[0] = 0;
  tile_off[0] = 0;
  for (int g = 0; g < n; ++g) {
    row_off[g + 1] = row_off[g] + rows[g];
    tile_off[g + 1] = tile_off[g] + (rows[g] + bm - 1) / bm;
  }
}

// The group owning m-tile `tile` (< tile_off[n]): the last g with tile_off[g] <= tile.
MOERUN_HD inline int FindGroup(const int32_t* tile_off, int n, int32_t tile) {
  int lo = 0, hi = n;  // invariant: tile_off[lo] <= tile < tile_off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tile_off[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// An upper bound of the m-tiles of `rows` rows spread over at most `groups` non-empty groups.
inline int64_t MaxTiles(int64_t rows, int64_t groups, int bm) {
  return (rows + bm - 1) / bm + (groups < rows ? groups : rows);
}

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
