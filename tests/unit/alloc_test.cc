// Steady state allocates nothing: after warm-up, many batches through the single-process layer
// and through an expert-parallel job (router and expert ranks as threads) make no heap
// allocation on any thread, operator new or the C allocator. Buffers grow to the largest size
// they have seen (an expert rank's message buffers, each pool worker's scratch), so the warm-up
// runs the very batches that are then counted: the same workload again allocates nothing. Which
// pool worker runs which task is up to the scheduler, so on a loaded machine a worker may meet
// its largest task only in a counted pass (GroupedFfn's per-worker scratch grows then, once): a
// pass that allocates is repeated, at most 3 times in all, and the last must allocate nothing;
// an allocation per batch (what this guards against) allocates in every pass and fails
// (tests/unit/alloc_counter.h counts them; the serving path has its own binary,
// tests/serving/serving_alloc_test.cc).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
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

// The counter counts: the zero-allocation checks below can fail. Each kind of allocation is made
// through a volatile function pointer (or a library call), which the compiler cannot elide.
void* (*volatile g_new)(std::size_t) = static_cast<void* (*)(std::size_t)>(::operator new);

TEST(AllocationTest, TheCounterCountsNew) {
  StartCountingAllocations();
  EXPECT_EQ(StopCountingAllocations(), 0u);  // nothing between start and stop
  StartCountingAllocations();
  auto v = std::make_unique<std::vector<int>>(100);  // two operator new
  EXPECT_EQ(StopCountingAllocations(), 2u);
  StartCountingAllocations();
  ::operator delete(g_new(64));
  EXPECT_EQ(StopCountingAllocations(), 1u);
}

// (Not in a sanitizer build, where the C allocator is the sanitizer's: alloc_counter.h.)
#if MOERUN_ALLOC_COUNTS_MALLOC
void* (*volatile g_malloc)(size_t) = std::malloc;
void* (*volatile g_calloc)(size_t, size_t) = std::calloc;
void* (*volatile g_realloc)(void*, size_t) = std::realloc;
void* (*volatile g_aligned_alloc)(size_t, size_t) = std::aligned_alloc;

TEST(AllocationTest, TheCounterCountsTheCAllocator) {
  StartCountingAllocations();
  void* p = g_malloc(64);
  EXPECT_EQ(StopCountingAllocations(), 1u);
  StartCountingAllocations();
  p = g_realloc(p, 1 << 20);
  EXPECT_EQ(StopCountingAllocations(), 1u);
  std::free(p);
  StartCountingAllocations();
  p = g_calloc(16, 16);
  EXPECT_EQ(StopCountingAllocations(), 1u);
  std::free(p);
  StartCountingAllocations();
  p = g_aligned_alloc(64, 256);
  EXPECT_EQ(StopCountingAllocations(), 1u);
  std::free(p);
  StartCountingAllocations();
  char* s = strdup("made by libc, which calls malloc");  // an allocation inside another library
  EXPECT_GE(StopCountingAllocations(), 1u);
  std::free(s);
  // Another thread's allocations count too; one marked not counted does not.
  StartCountingAllocations();
  std::thread([] { std::free(g_malloc(8)); }).join();
  const uint64_t with_thread = StopCountingAllocations();
  EXPECT_GE(with_thread, 2u);  // the thread's own state, and its malloc
  std::thread t([] {
    SetThreadNotCounted(true);
    std::free(g_malloc(8));
    delete new int(1);
  });
  StartCountingAllocations();
  t.join();
  EXPECT_EQ(StopCountingAllocations(), 0u);
}
#endif  // MOERUN_ALLOC_COUNTS_MALLOC

// Runs `pass` counted until one allocates nothing, at most 3 times; the counts.
std::vector<uint64_t> CountedPasses(const std::function<bool()>& pass) {
  std::vector<uint64_t> counts;
  counts.reserve(3);
  do {
    StartCountingAllocations();
    const bool ok = pass();
    counts.push_back(StopCountingAllocations());
    if (!ok) break;
  } while (counts.back() != 0 && counts.size() < 3);
  return counts;
}

std::string Joined(const std::vector<uint64_t>& v) {
  std::string s;
  for (uint64_t n : v) s += (s.empty() ? "" : ", ") + std::to_string(n);
  return s;
}

// The repeated passes cannot hide an allocation that every pass makes.
TEST(AllocationTest, ARepeatedPassDoesNotHideAnAllocationPerPass) {
  const std::vector<uint64_t> counts = CountedPasses([] {
    ::operator delete(g_new(8));
    return true;
  });
  EXPECT_EQ(counts, (std::vector<uint64_t>{1, 1, 1}));
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
    for (int i = 0; i < 2; ++i) {
      for (int64_t t : sizes) ASSERT_TRUE(layer.Forward(x.data(), t, out.data()).ok());
    }
    const std::vector<uint64_t> counts = CountedPasses([&] {
      for (int64_t t : sizes) {
        if (!layer.Forward(x.data(), t, out.data()).ok()) return false;
      }
      return true;
    });
    EXPECT_EQ(counts.back(), 0u) << "allocations in the counted passes: " << Joined(counts);
  }
}

TEST(AllocationTest, ExpertParallelRouterAndExpertRanks) {
  int64_t tokens = 0;
  const std::string fixture = "deepseek_v3";
  const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
  const JobOptions opts = FixtureJob(fixture, 16);
  std::vector<float> out(x.size());
  std::vector<uint64_t> counts;
  Status run;
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    RouterLayer& ep = *router.layer(0);
    for (int i = 0; i < 3; ++i) MOERUN_RETURN_IF_ERROR(ep.Forward(x.data(), tokens, out.data()));
    const std::vector<int64_t> sizes = Sizes(tokens);
    for (int i = 0; i < 2; ++i) {
      for (int64_t t : sizes) MOERUN_RETURN_IF_ERROR(ep.Forward(x.data(), t, out.data()));
    }
    // Counts on every thread: the router's and the expert ranks'.
    counts = CountedPasses([&] {
      for (int64_t t : sizes) {
        run = ep.Forward(x.data(), t, out.data());
        if (!run.ok()) return false;
      }
      return true;
    });
    return run;
  };
  for (const Status& s : RunInprocJob(4, opts, work)) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(run.ok()) << run.ToString();
  ASSERT_FALSE(counts.empty());
  EXPECT_EQ(counts.back(), 0u) << "allocations in the counted passes: " << Joined(counts);
}

}  // namespace
}  // namespace moerun
