// A throttled load (LoadThrottle: what ExpertControl's background loads of a migration or an
// update are given) takes at least its bytes / the bandwidth: a lower bound, which is physics (a
// loaded machine only makes a load slower), not an upper bound a busy machine could trip. The
// bytes it reports are the bytes it loaded.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "runtime/model/weight_source.h"
#include "tests/unit/layer_fixtures.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// Loads every routed expert of `src`'s first MoE layer under `throttle`; the seconds it took, and
// the bytes of the routed experts it holds.
double TimedLoad(const WeightSource& src, const LoadThrottle& throttle, size_t* expert_bytes) {
  const Result<ModelSpec> spec = SpecOf(src);
  EXPECT_TRUE(spec.ok()) << spec.status().ToString();
  if (!spec.ok()) return 0;
  const auto start = std::chrono::steady_clock::now();
  auto w = LoadWeights(src, *spec, spec->moe_layers.front(),
                       std::vector<bool>(static_cast<size_t>(spec->num_experts), true),
                       KernelsFor(BestIsa()), 1, "throttle test", throttle);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  if (w.ok()) {
    *expert_bytes = 0;  // the routed experts' (the shared expert is not an expert a rank moves)
    for (const ExpertWeights& e : (*w)->experts) *expert_bytes += e.bytes();
  }
  return s;
}

void ExpectThrottled(const WeightSource& src) {
  std::atomic<uint64_t> done{0};
  LoadThrottle unlimited;
  unlimited.bytes_done = &done;
  size_t bytes = 0;
  TimedLoad(src, unlimited, &bytes);
  ASSERT_GT(bytes, 0u);
  EXPECT_EQ(done.load(), bytes);  // the bytes reported are the experts' bytes
  // A bandwidth at which these bytes take 0.4 s.
  const double want_s = 0.4;
  LoadThrottle slow;
  slow.bytes_per_s = static_cast<double>(bytes) / want_s;
  std::atomic<uint64_t> slow_done{0};
  slow.bytes_done = &slow_done;
  size_t slow_bytes = 0;
  const double took = TimedLoad(src, slow, &slow_bytes);
  EXPECT_EQ(slow_bytes, bytes);
  EXPECT_EQ(slow_done.load(), bytes);
  EXPECT_GE(took, want_s) << bytes << " bytes at " << slow.bytes_per_s << " B/s";
}

TEST(LoadThrottleTest, ACheckpointLoadTakesAtLeastBytesOverBandwidth) {
  WeightSource src;
  src.model = FixtureDir("deepseek_v3");
  ExpectThrottled(src);
}

TEST(LoadThrottleTest, APresetLoadTakesAtLeastBytesOverBandwidth) {
  WeightSource src;
  src.spec = SmallSpec(Family::kQwen3Moe);
  src.seed = 5;
  ExpectThrottled(src);
}

}  // namespace
}  // namespace moerun
