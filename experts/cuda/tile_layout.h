// The device layout of expert weights and the tile schedule of the grouped FFN, in plain C++
// (MOERUN_HD) so that the kernels and the host-side tests run the same code:
//   - W13 holds gate/up rows interleaved in blocks of kColBlock columns, so one tile of the first
//     GEMM yields both halves of its columns; inter is padded to a block;
//   - group g owns m-tiles [tile_off[g], tile_off[g+1]) of the FFN's rows.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "base/host_device.h"

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

}  // namespace moerun::cuda_plan
