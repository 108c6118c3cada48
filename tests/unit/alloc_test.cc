// Steady state allocates nothing: after warm-up, many batches through the single-process layer,
// through an expert-parallel job (router and expert ranks as threads), and many requests through
// the whole serving path of `moerun serve` (frames over TCP, the endpoint, the batcher, the router
// rank, the expert ranks, the answers) make no heap allocation on any thread. This binary
// replaces operator new to count them (a test's own client threads are not counted).
// The replacements below pair malloc/aligned_alloc with free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <gtest/gtest.h>

#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "launch/serve_router.h"
#include "ranks/rank_job.h"
#include "serving/serve_client.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};
thread_local bool t_not_counted = false;  // a test's client threads
// MOERUN_ALLOC_TRACE=N prints the call stacks of the first N counted allocations (to find them).
const int g_trace =
    std::getenv("MOERUN_ALLOC_TRACE") ? std::atoi(std::getenv("MOERUN_ALLOC_TRACE")) : 0;
std::atomic<int> g_traced{0};
void Trace() {
  static thread_local bool in_trace = false;
  if (in_trace || g_traced.fetch_add(1) >= g_trace) return;
  in_trace = true;
  void* frames[24];
  const int n = backtrace(frames, 24);
  std::fprintf(stderr, "--- counted allocation %d\n", g_traced.load());
  backtrace_symbols_fd(frames, n, 2);
  in_trace = false;
}
bool Counted() { return g_counting.load(std::memory_order_relaxed) && !t_not_counted; }
void Count() {
  g_allocations.fetch_add(1);
  if (g_trace > 0) Trace();
}
}  // namespace

void* operator new(std::size_t n) {
  if (Counted()) Count();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (Counted()) Count();
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

// A job on a fixture's layer 0, one thread per rank, experts round robin.
JobOptions FixtureJob(const std::string& fixture, int64_t microbatch_tokens) {
  JobOptions opts;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = "round_robin";
  opts.ep.microbatch_tokens = microbatch_tokens;
  opts.threads = 1;
  opts.isa = BestIsa();
  return opts;
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
    g_allocations = 0;
    g_counting = true;  // counts on every thread: the router's and the expert ranks'
    for (int64_t t : sizes) run = ep.Forward(x.data(), t, out.data());
    g_counting = false;
    counted = g_allocations.load();
    return run;
  };
  for (const Status& s : RunInprocJob(4, opts, work)) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(run.ok()) << run.ToString();
  EXPECT_EQ(counted, 0u);
}

// A port nothing listens on now (the kernel's choice for port 0).
uint16_t FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// The serving path of `moerun serve` as it runs (ServeRouter on a router rank of an inproc job
// with peer health and RouterControl, two expert ranks), fed by clients over TCP: after warm-up,
// requests of 1..16 tokens in F32 and BF16 on two connections allocate nothing, on any thread.
TEST(AllocationTest, ServingPathPerRequest) {
  t_not_counted = true;  // this thread only starts and joins the clients
  const std::string fixture = "deepseek_v3";
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
  ServeSetup setup;
  setup.config.serving.probe_interval_ms = 50;  // probes run often while counting
  setup.config.batching.max_wait_us = 200;
  const uint16_t port = FreePort();
  ASSERT_NE(port, 0);
  setup.listen = HostPort{"127.0.0.1", port};
  setup.metrics_listen = HostPort{"127.0.0.1", 0};
  setup.family = "deepseek_v3";
  setup.ranks = 3;
  JobOptions opts = FixtureJob(fixture, 8);
  opts.router.health = PeerHealthOptions{std::chrono::milliseconds(50), std::chrono::seconds(2)};
  opts.router.control = true;
  setup.layers = opts.layers;

  std::atomic<bool> stop{false};
  std::atomic<bool> serving{false};
  uint64_t counted = 0, requests = 0, answered_ok = 0;
  auto fabric = InprocFabric::Create(3);
  std::vector<Status> results(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      auto t = fabric->Endpoint(r);
      results[static_cast<size_t>(r)] = [&]() -> Status {
        MOERUN_ASSIGN_OR_RETURN(auto job, RankJob::Prepare(t.get(), opts));
        MOERUN_ASSIGN_OR_RETURN(auto services,
                                RankServices::Start(r, job->placement(), job->spec(), opts.layers,
                                                    t.get(), setup.metrics_listen));
        MOERUN_RETURN_IF_ERROR(job->Load());
        MOERUN_RETURN_IF_ERROR(job->WaitReady());
        if (!job->is_router()) {
          MOERUN_ASSIGN_OR_RETURN(auto expert, job->MakeExpert());
          services->Attach(expert.get());
          return expert->Serve();
        }
        setup.hidden = job->spec().hidden;
        MOERUN_ASSIGN_OR_RETURN(auto router, job->MakeRouter());
        serving = true;
        MOERUN_RETURN_IF_ERROR(ServeRouter(*router, *services, setup, stop));
        return router->Finish();
      }();
    });
  }
  // The clients: two connections (made before counting), each sending its requests one after the
  // other.
  while (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::unique_ptr<ServeConnection> conns[2];
  for (int attempt = 0; attempt < 100 && !conns[1]; ++attempt) {
    for (auto& c : conns) {
      if (c) continue;
      auto made = ServeConnection::Connect("127.0.0.1:" + std::to_string(port));
      if (made.ok()) c = std::move(made).value();
    }
    if (!conns[1]) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(conns[0] && conns[1]) << "the serving endpoint does not listen on " << port;
  const int64_t hidden = 64;
  auto client = [&](int c, int n, uint64_t* ok) {
    t_not_counted = true;
    v1::InferResponse resp;
    for (int i = 0; i < n; ++i) {
      const int64_t rows = 1 + (i * 7 + c) % 16;
      v1::InferRequest req;
      req.set_id(static_cast<uint64_t>(i + 1));
      req.set_dtype(i % 3 == 0 ? v1::BF16 : v1::F32);
      SetRequestData(&req, x.data(), rows, hidden, req.dtype());
      ASSERT_TRUE(conns[c]->Call(req, &resp, DeadlineIn(std::chrono::seconds(20))).ok());
      ASSERT_EQ(resp.code(), v1::OK) << resp.message();
      ++*ok;
    }
  };
  uint64_t warm[2] = {0, 0}, ok[2] = {0, 0};
  {
    std::thread a(client, 0, 300, &warm[0]), b(client, 1, 300, &warm[1]);
    a.join();
    b.join();
  }
  g_allocations = 0;
  g_counting = true;
  {
    std::thread a(client, 0, 400, &ok[0]), b(client, 1, 400, &ok[1]);
    a.join();
    b.join();
  }
  g_counting = false;
  counted = g_allocations.load();
  requests = 800;
  answered_ok = ok[0] + ok[1];
  conns[0].reset();
  conns[1].reset();
  stop = true;
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(results[static_cast<size_t>(r)].ok()) << r;
  EXPECT_EQ(answered_ok, requests);
  EXPECT_EQ(counted, 0u) << counted << " allocations over " << requests << " requests";
  t_not_counted = false;
}

}  // namespace
}  // namespace moerun
