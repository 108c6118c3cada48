// The expert rank's host pinning hook (runtime/ranks/expert_rank.h HostPinning), which --device
// cuda uses to page-lock the rank's receive and send buffers once (cudaHostRegister) for
// asynchronous copies: every buffer a device compute reads rows from or writes y to is pinned at
// that moment, a buffer that grows is unpinned before it is freed and the new one pinned, and
// nothing stays pinned after the rank ends. Checked with a CPU compute behind the hook, on inproc
// ranks: the output stays bitwise the single-process layer's.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>

#include "runtime/layer/moe_layer.h"
#include "runtime/ranks/rank_job.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// What the hook saw, from every expert rank's thread.
struct PinLog {
  std::mutex mu;
  std::map<const char*, size_t> pinned;  // start -> bytes
  int pins = 0, unpins = 0, computes = 0;
  std::vector<std::string> errors;

  bool Covers(const void* p, size_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (const auto& [start, n] : pinned) {
      if (c >= start && c + bytes <= start + n) return true;
    }
    return false;
  }
};

// The grouped FFN of the rows on the CPU (what a device would compute).
Status CpuGroups(const MoeLayerWeights& w, const float* rows, const std::vector<int32_t>& experts,
                 const std::vector<int64_t>& counts, float* y) {
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(1);
  GroupedFfn ffn(k, &pool);
  std::vector<ExpertGroup> groups;
  int64_t first = 0;
  for (size_t g = 0; g < experts.size(); ++g) {
    groups.push_back(ExpertGroup{&w.experts[static_cast<size_t>(experts[g])],
                                 w.spec.RoutedAct(w.layer), first, counts[g]});
    first += counts[g];
  }
  std::vector<int32_t> row_token(static_cast<size_t>(first));
  for (int64_t r = 0; r < first; ++r) row_token[static_cast<size_t>(r)] = static_cast<int32_t>(r);
  const int64_t h = w.spec.hidden, ldy = ffn.PaddedHidden(h);
  std::vector<float> tmp(static_cast<size_t>(first * ldy));
  ffn.Run(groups, rows, h, row_token.data(), tmp.data(), ldy);
  for (int64_t r = 0; r < first; ++r) {
    std::memcpy(y + r * h, tmp.data() + r * ldy, static_cast<size_t>(h) * 4);
  }
  return Status::Ok();
}

TEST(ExpertPinningTest, ComputedBuffersArePinnedAndEveryPinIsReleased) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "input", &tokens);
  PinLog log;
  const ExpertSetup setup = [&](int, const LoadedLayers& layers) -> Result<ExpertCompute> {
    HostPinning pin;
    pin.pin = [&](void* p, size_t bytes) {
      std::lock_guard<std::mutex> lock(log.mu);
      if (!log.pinned.emplace(static_cast<const char*>(p), bytes).second) {
        log.errors.push_back("pinned twice");
      }
      ++log.pins;
      return Status::Ok();
    };
    pin.unpin = [&](void* p) {
      std::lock_guard<std::mutex> lock(log.mu);
      if (log.pinned.erase(static_cast<const char*>(p)) == 0) {
        log.errors.push_back("unpinned what was not pinned");
      }
      ++log.unpins;
    };
    return ExpertCompute(
        [&, layers](int layer, const float* rows, const std::vector<int32_t>& experts,
                    const std::vector<int64_t>& counts, float* y) {
          const MoeLayerWeights& w = *layers.at(layer);
          int64_t total = 0;
          for (int64_t c : counts) total += c;
          const size_t bytes = static_cast<size_t>(total * w.spec.hidden) * 4;
          {
            std::lock_guard<std::mutex> lock(log.mu);
            ++log.computes;
            if (!log.Covers(rows, bytes)) log.errors.push_back("rows not in a pinned buffer");
            if (!log.Covers(y, bytes)) log.errors.push_back("y not in a pinned buffer");
          }
          return CpuGroups(w, rows, experts, counts, y);
        },
        std::move(pin));
  };
  JobOptions opts;
  opts.source.model = FixtureDir("qwen3_moe");
  opts.layers = {0};
  opts.placement = "round_robin";
  opts.ep.microbatch_tokens = 3;  // several microbatches, buffers that grow
  opts.ep.deadline = std::chrono::milliseconds(20000);
  opts.threads = 1;
  opts.isa = BestIsa();
  std::vector<float> out(x.size());
  const RouterWork work = [&](RouterRank& router) {
    // Growing batches: 1 token, then all of them.
    MOERUN_RETURN_IF_ERROR(router.layer(0)->Forward(x.data(), 1, out.data()));
    return router.layer(0)->Forward(x.data(), tokens, out.data());
  };
  for (const Status& s : RunInprocJob(3, opts, work, setup)) EXPECT_TRUE(s.ok()) << s.ToString();

  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(2);
  MoeLayer layer(LoadFixture("qwen3_moe", k), k, &pool);
  std::vector<float> want(x.size());
  ASSERT_TRUE(layer.Forward(x.data(), tokens, want.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);

  for (const auto& e : log.errors) ADD_FAILURE() << e;
  EXPECT_GT(log.computes, 2);
  EXPECT_GE(log.pins, 4);              // each expert rank: a receive and a send buffer
  EXPECT_EQ(log.pins, log.unpins);     // every pin released ...
  EXPECT_TRUE(log.pinned.empty());     // ... by the time the ranks are gone
  EXPECT_LE(log.pins, 2 * 2 * 2 * 4);  // pinned when a buffer grows, not per microbatch
}

}  // namespace
}  // namespace moerun
