// The serving path of `moerun serve` allocates nothing per request at steady state: frames over
// TCP, the serving endpoint, the batcher, the router rank (peer health, RouterControl), the
// expert ranks and the answers, on every thread but the test's own clients
// (tests/unit/alloc_counter.h counts).
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>

#include "base/log.h"
#include "launch/serve_router.h"
#include "runtime/ranks/rank_job.h"
#include "runtime/serving/serve_client.h"
#include "tests/unit/alloc_counter.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// The counter counts in this binary too (operator new and the C allocator), so the zero below
// can fail; tests/unit/alloc_test.cc checks every kind of allocation.
TEST(ServingAllocationTest, TheCounterCountsNewAndMalloc) {
  StartCountingAllocations();
  auto p = std::make_unique<int>(1);
  EXPECT_EQ(StopCountingAllocations(), 1u);
#if MOERUN_ALLOC_COUNTS_MALLOC  // (not under a sanitizer: alloc_counter.h)
  static void* (*volatile g_malloc)(size_t) = std::malloc;
  StartCountingAllocations();
  void* q = g_malloc(32);
  EXPECT_EQ(StopCountingAllocations(), 1u);
  std::free(q);
#endif
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
// requests of 1..16 tokens in F32 and BF16 on two connections, each with the serving key the
// endpoint requires, allocate nothing, on any thread; half of them ask where their time went
// (InferRequest.timing), and their answers say it consistently.
TEST(AllocationTest, ServingPathPerRequest) {
  SetThreadNotCounted(true);                // this thread only starts and joins the clients
  spdlog::info("serving allocation test");  // the logger exists before the ranks' threads log
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
  // A serving key, so that its check (in constant time, in place) is on the path counted.
  setup.serving_key = "a-serving-key-longer-than-any-small-string-buffer";
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
  // (Both: the first may be refused while the endpoint starts and the second, a moment later,
  // taken.)
  const auto both = [&] { return conns[0] && conns[1]; };
  for (int attempt = 0; attempt < 100 && !both(); ++attempt) {
    for (auto& c : conns) {
      if (c) continue;
      ClientOptions co;
      co.key = setup.serving_key;
      auto made = ServeConnection::Connect("127.0.0.1:" + std::to_string(port), co);
      if (made.ok()) c = std::move(made).value();
    }
    if (!both()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!both()) {
    // Stop and join the ranks before failing (a joinable thread left behind would terminate).
    stop = true;
    for (auto& t : ranks) t.join();
    SetThreadNotCounted(false);
    FAIL() << "the serving endpoint does not listen on " << port;
  }
  const int64_t hidden = 64;
  auto client = [&](int c, int n, uint64_t* ok) {
    SetThreadNotCounted(true);
    v1::InferResponse resp;
    for (int i = 0; i < n; ++i) {
      const int64_t rows = 1 + (i * 7 + c) % 16;
      v1::InferRequest req;
      req.set_id(static_cast<uint64_t>(i + 1));
      req.set_dtype(i % 3 == 0 ? v1::BF16 : v1::F32);
      req.set_timing(i % 2 == 0);
      SetRequestData(&req, x.data(), rows, hidden, req.dtype());
      ASSERT_TRUE(conns[c]->Call(req, &resp, DeadlineIn(std::chrono::seconds(20))).ok());
      ASSERT_EQ(resp.code(), v1::OK) << resp.message();
      ASSERT_EQ(resp.has_timing(), req.timing());
      if (req.timing()) {
        // Top-4 over the two expert ranks: every row of the batch's microbatches so far went
        // to one of them, this request's among them; each rank's own time is inside its round
        // trip; the whole is inside the server's time.
        const v1::Timing& t = resp.timing();
        uint64_t assigned = 0;
        for (const v1::RankTiming& r : t.ranks()) {
          ASSERT_TRUE(r.rank() == 1 || r.rank() == 2) << r.rank();
          ASSERT_LE(r.compute_us(), r.round_trip_us());
          assigned += r.rows();
        }
        ASSERT_EQ(assigned % 4, 0u);
        ASSERT_GE(assigned, 4u * static_cast<uint64_t>(rows));
        ASSERT_LE(assigned, 4u * t.batch_tokens());
        ASSERT_LE(t.reply_us(), t.server_us());
        ASSERT_LE(t.queue_us(), t.server_us());
      }
      ++*ok;
    }
  };
  uint64_t warm[2] = {0, 0}, ok[2] = {0, 0};
  {
    std::thread a(client, 0, 300, &warm[0]), b(client, 1, 300, &warm[1]);
    a.join();
    b.join();
  }
  StartCountingAllocations();
  {
    std::thread a(client, 0, 400, &ok[0]), b(client, 1, 400, &ok[1]);
    a.join();
    b.join();
  }
  counted = StopCountingAllocations();
  requests = 800;
  answered_ok = ok[0] + ok[1];
  {
    // The key is required (ServeSetup::serving_key reached the endpoint): a request without it
    // is refused.
    v1::InferRequest req;
    req.set_id(7);
    SetRequestData(&req, x.data(), 1, hidden, v1::F32);
    req.set_key("");
    // (No ASSERT here: the ranks' threads are joined below.)
    auto keyless = ServeConnection::Connect("127.0.0.1:" + std::to_string(port));
    EXPECT_TRUE(keyless.ok()) << keyless.status().ToString();
    v1::InferResponse resp;
    if (keyless.ok()) {
      EXPECT_TRUE((*keyless)->Call(req, &resp, DeadlineIn(std::chrono::seconds(20))).ok());
    }
    EXPECT_EQ(resp.code(), v1::UNAUTHENTICATED) << resp.message();
    EXPECT_EQ(resp.id(), 7u);
  }
  conns[0].reset();
  conns[1].reset();
  stop = true;
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(results[static_cast<size_t>(r)].ok()) << r;
  EXPECT_EQ(answered_ok, requests);
  EXPECT_EQ(counted, 0u) << counted << " allocations over " << requests << " requests";
  SetThreadNotCounted(false);
}

}  // namespace
}  // namespace moerun
