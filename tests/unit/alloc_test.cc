// Steady state allocates nothing: after warm-up, many batches through the single-process layer
// and through an expert-parallel job (router and expert ranks as threads) make no heap
// allocation on any thread. This binary replaces operator new to count them.
// The replacements below pair malloc/aligned_alloc with free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>

#include "ranks/rank_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  const size_t align = static_cast<size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

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
    g_allocations = 0;
    g_counting = true;
    for (int64_t t : sizes) {
      if (!layer.Forward(x.data(), t, out.data()).ok()) break;
    }
    g_counting = false;
    EXPECT_EQ(g_allocations.load(), 0u);
  }
}

TEST(AllocationTest, ExpertParallelRouterAndExpertRanks) {
  int64_t tokens = 0;
  const std::string fixture = "deepseek_v3";
  const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
  JobOptions opts;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = "round_robin";
  opts.ep.microbatch_tokens = 16;
  opts.threads = 1;
  opts.isa = BestIsa();
  std::vector<float> out(x.size());
  uint64_t counted = 0;
  Status run;
  const RouterWork work = [&](int rank, std::map<int, RouterLayer*>& layers) -> Status {
    if (rank != 0) return Status::Ok();
    RouterLayer& ep = *layers.at(0);
    for (int i = 0; i < 3; ++i) MOERUN_RETURN_IF_ERROR(ep.Forward(x.data(), tokens, out.data()));
    const std::vector<int64_t> sizes = Sizes(tokens);
    g_allocations = 0;
    g_counting = true;  // counts on every thread: the router's and the expert ranks'
    for (int64_t t : sizes) run = ep.Forward(x.data(), t, out.data());
    g_counting = false;
    counted = g_allocations.load();
    return run;
  };
  const int ranks = 4;
  auto fabric = InprocFabric::Create(ranks);
  std::vector<Status> results(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto t = fabric->Endpoint(r);
      results[static_cast<size_t>(r)] = RunRank(t.get(), opts, work);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(run.ok()) << run.ToString();
  EXPECT_EQ(counted, 0u);
}

}  // namespace
}  // namespace moerun
