// Steady state allocates nothing: after warm-up, many batches through the single-process layer
// and through an expert-parallel job (router and expert ranks as threads) make no heap
// allocation on any thread (tests/unit/alloc_counter.h counts them; the serving path has its own
// binary, tests/serving/serving_alloc_test.cc).
#include <gtest/gtest.h>

#include <thread>

#include "runtime/ranks/rank_job.h"
#include "tests/unit/alloc_counter.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// Batches of varying sizes up to `max_tokens`, all drawn from one input.
std::vector<int64_t> Sizes(int64_t max_tokens) {
  std::vector<int64_t> s;
  for (int i = 0; i < 40; ++i) s.push_back(1 + (i * 37) % max_tokens);
  return s;
}

TEST(AllocationTest, SingleProcessLayer) {
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(2);
  for (const std::string fixture : {"qwen2_moe", "deepseek_v3", "gpt_oss", "step3p5"}) {
    SCOPED_TRACE(fixture);
    MoeLayer layer(LoadFixture(fixture, k), k, &pool);
    int64_t tokens = 0;
    const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
    std::vector<float> out(x.size());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
    const auto sizes = Sizes(tokens);
    StartCountingAllocations();
    for (int64_t t : sizes) {
      if (!layer.Forward(x.data(), t, out.data()).ok()) break;
    }
    EXPECT_EQ(StopCountingAllocations(), 0u);
  }
}

TEST(AllocationTest, ExpertParallelRouterAndExpertRanks) {
  int64_t tokens = 0;
  const std::string fixture = "deepseek_v3";
  const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
  const JobOptions opts = FixtureJob(fixture, 16);
  std::vector<float> out(x.size());
  uint64_t counted = 0;
  Status run;
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    RouterLayer& ep = *router.layer(0);
    for (int i = 0; i < 3; ++i) MOERUN_RETURN_IF_ERROR(ep.Forward(x.data(), tokens, out.data()));
    const std::vector<int64_t> sizes = Sizes(tokens);
    StartCountingAllocations();  // counts on every thread: the router's and the expert ranks'
    for (int64_t t : sizes) run = ep.Forward(x.data(), t, out.data());
    counted = StopCountingAllocations();
    return run;
  };
  for (const Status& s : RunInprocJob(4, opts, work)) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(run.ok()) << run.ToString();
  EXPECT_EQ(counted, 0u);
}

}  // namespace
}  // namespace moerun
