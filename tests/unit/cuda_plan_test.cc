// The CUDA layer's host-side planning (runtime/layer/cuda/device_plan.h): the code its kernels run
// for the weight layout and the tile schedule, the graph buckets and the arena. Runs without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_plan.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace cuda_plan;

TEST(CudaPlanTest, GraphBuckets) {
  EXPECT_EQ(GraphBucket(1, 256), 1);
  EXPECT_EQ(GraphBucket(2, 256), 2);
  EXPECT_EQ(GraphBucket(3, 256), 4);
  EXPECT_EQ(GraphBucket(17, 256), 32);
  EXPECT_EQ(GraphBucket(256, 256), 256);
  EXPECT_EQ(GraphBucket(257, 256), 0);    // too large: no graph
  EXPECT_EQ(GraphBucket(150, 200), 200);  // capped at the largest graph
  EXPECT_EQ(GraphBucket(5, 0), 0);        // graphs off
  EXPECT_EQ(GraphBucket(0, 256), 0);
  // Every batch fits its bucket, and a bucket serves at least half of its size.
  for (int64_t t = 1; t <= 1000; ++t) {
    const int64_t b = GraphBucket(t, 512);
    if (t > 512) {
      EXPECT_EQ(b, 0);
      continue;
    }
    EXPECT_GE(b, t);
    EXPECT_LT(b, 2 * t);
  }
}

TEST(CudaPlanTest, WeightLayoutInterleavesGateAndUpBlocks) {
  EXPECT_EQ(PaddedInter(1), 64);
  EXPECT_EQ(PaddedInter(768), 768);
  EXPECT_EQ(PaddedInter(40), 64);
  EXPECT_EQ(PaddedInter(14336), 14336);
  for (int64_t inter : {40, 64, 100, 768}) {
    const int64_t ip = PaddedInter(inter);
    std::set<int64_t> rows;
    for (int64_t j = 0; j < ip; ++j) {
      EXPECT_TRUE(rows.insert(GateRow(j)).second);
      EXPECT_TRUE(rows.insert(UpRow(j)).second);
      // One GEMM1 tile of kColBlock columns reads 64 gate rows, then the 64 up rows.
      EXPECT_EQ(GateRow(j) / (2 * kColBlock), j / kColBlock);
      EXPECT_EQ(UpRow(j) - GateRow(j), kColBlock);
    }
    EXPECT_EQ(static_cast<int64_t>(rows.size()), 2 * ip);
    EXPECT_EQ(*rows.rbegin(), 2 * ip - 1);
  }
}

TEST(CudaPlanTest, TileScheduleCoversEveryRowOnce) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int groups = 1 + static_cast<int>(rng() % 300);
    const int bm = trial % 2 ? 32 : 64;
    std::vector<int32_t> rows(static_cast<size_t>(groups));
    int64_t total = 0, nonempty = 0;
    for (auto& r : rows) {
      r = rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 300);
      total += r;
      nonempty += r > 0;
    }
    std::vector<int32_t> row_off(static_cast<size_t>(groups + 1)), tile_off(row_off);
    ScanGroups(rows.data(), groups, bm, row_off.data(), tile_off.data());
    ASSERT_EQ(row_off.back(), total);
    ASSERT_LE(tile_off.back(), MaxTiles(total, groups, bm));
    ASSERT_LE(tile_off.back(), MaxTiles(total, nonempty, bm));
    std::vector<int> seen(static_cast<size_t>(total), 0);
    for (int32_t tile = 0; tile < tile_off.back(); ++tile) {
      const int g = FindGroup(tile_off.data(), groups, tile);
      ASSERT_GT(rows[static_cast<size_t>(g)], 0) << "an empty group owns no tile";
      const int32_t m0 =
          row_off[static_cast<size_t>(g)] + (tile - tile_off[static_cast<size_t>(g)]) * bm;
      const int32_t end = row_off[static_cast<size_t>(g) + 1];
      ASSERT_LT(m0, end);
      for (int32_t r = m0; r < std::min(end, m0 + bm); ++r) ++seen[static_cast<size_t>(r)];
    }
    for (int v : seen) ASSERT_EQ(v, 1);
  }
}

TEST(CudaPlanTest, ArenaRegionsAreAlignedAndDisjoint) {
  LayerShape s;
  s.max_tokens = 8192;
  s.hidden = 7168;
  s.experts = 256;
  s.top_k = 8;
  s.gate_rows = 256;
  s.shared = true;
  s.max_inter_padded = 2048;
  s.act_bytes = 2;
  const ArenaPlan p = PlanLayerArena(s);
  size_t end = 0;
  std::set<std::string> names;
  for (const auto& r : p.regions) {
    EXPECT_EQ(r.offset % 256, 0u) << r.name;
    EXPECT_GE(r.offset, end) << r.name;
    end = r.offset + r.bytes;
    EXPECT_TRUE(names.insert(r.name).second);
  }
  EXPECT_EQ(p.total, end);
  EXPECT_EQ(FfnRows(s, 8192), 8192 * 9);
  // The gathered rows: 73,728 rows x 7168 x 2 bytes.
  for (const auto& r : p.regions) {
    if (r.name == "rows") {
      EXPECT_EQ(r.bytes, size_t{73728} * 7168 * 2);
    } else if (r.name == "y") {
      EXPECT_EQ(r.bytes, size_t{73728} * 7168 * 4);
    }
  }
  EXPECT_NE(p.Describe().find("hidden_act"), std::string::npos);
}

TEST(CudaPlanTest, DeviceCudaWithoutAGpuIsAClearError) {
  const CudaProbe probe = ProbeCuda();
  if (!probe.devices.empty()) GTEST_SKIP() << "this machine has a GPU";
  const auto w = testing::BuildSmall(Family::kMixtral, KernelsFor(Isa::kScalar));
  auto layer = CudaMoeLayer::Upload(*w, CudaLayerOptions{});
  ASSERT_FALSE(layer.ok());
  EXPECT_NE(layer.status().message().find("cuda"), std::string::npos) << layer.status().ToString();
}

}  // namespace
}  // namespace moerun
