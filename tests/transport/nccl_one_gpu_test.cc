// The nccl transport on the GPUs of one process, its ranks as threads over an inproc bootstrap
// (no mpirun): what a machine with a single GPU can check of it. One rank sends to itself over
// NCCL (the send and the receive it meets go in one group): the whole data path (staging copies,
// grouped ncclSend/ncclRecv, events, envelopes, unexpected messages, a size mismatch, a receive
// withdrawn before its message came). Two ranks on one GPU: NCCL refuses them, and both fail at
// creation with an error, not a hang. With two GPUs: two ranks exchange messages both ways.
// Every test skips, saying why, without NCCL in the build or without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/layer/cuda/cuda_device.h"
#include "transport/inproc.h"
#include "transport/registry.h"
#include "transport/transport_harness.h"

namespace moerun {
namespace {

using testing::FillPayload;
using testing::GuardedBuffer;
using testing::Patient;
using testing::PayloadIs;

constexpr int kTagBulk = 7, kTagOther = 8;

// The number of visible GPUs, or skips the test saying why there is none.
#define MOERUN_NCCL_GPUS_OR_SKIP(var)                                                      \
  if (!FindTransport("nccl")) GTEST_SKIP() << RequireTransport("nccl").status().message(); \
  const CudaProbe probe_ = ProbeCuda();                                                    \
  if (probe_.devices.empty()) GTEST_SKIP() << "no usable GPU: " << probe_.error;           \
  const int var = static_cast<int>(probe_.devices.size())

Result<std::unique_ptr<Transport>> NcclOver(
    std::unique_ptr<Transport> boot, int device,
    std::chrono::seconds deadline = std::chrono::seconds(60)) {
  TransportRequest r;
  r.bootstrap = std::move(boot);
  r.device = device;
  r.bulk_tags = {kTagBulk};
  r.deadline = DeadlineIn(deadline);
  return CreateTransport("nccl", std::move(r));
}

TEST(NcclTransportGpuTest, OneRankSendsToItselfOverNccl) {
  MOERUN_NCCL_GPUS_OR_SKIP(gpus);
  (void)gpus;
  auto fabric = InprocFabric::Create(1);
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> t, NcclOver(fabric->Endpoint(0), 0));
  EXPECT_STREQ(t->name(), "nccl");
  uint32_t index = 0;
  // Receive first, then send: each size, the largest twice (the staging slots are reused).
  for (size_t bytes : {size_t{1}, size_t{4096}, size_t{65537}, size_t{1} << 20, size_t{80} << 20,
                       size_t{80} << 20}) {
    SCOPED_TRACE(std::to_string(bytes) + " bytes");
    std::vector<uint8_t> out(bytes);
    FillPayload(out.data(), bytes, 0, 0, index);
    GuardedBuffer in(bytes);
    MOERUN_ASSERT_OK(t->RegisterMemory(in.data(), bytes));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r, t->Irecv(0, kTagBulk, in.data(), bytes));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s, t->Isend(0, kTagBulk, out.data(), bytes));
    Request both[] = {r, s};
    MOERUN_ASSERT_OK(t->WaitAll(both, Patient(), "self"));
    EXPECT_TRUE(PayloadIs(in.data(), bytes, 0, 0, index));
    EXPECT_TRUE(in.GuardIntact());
    t->UnregisterMemory(in.data());
    ++index;
  }
  // Send first and let it go (an unexpected message, staged), then receive it.
  {
    std::vector<uint8_t> out(3000);
    FillPayload(out.data(), out.size(), 0, 0, 50);
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s, t->Isend(0, kTagBulk, out.data(), out.size()));
    MOERUN_ASSERT_OK(t->Wait(s, Patient(), "send"));
    GuardedBuffer in(3000);
    MOERUN_ASSERT_OK(t->Recv(0, kTagBulk, in.data(), in.size(), Patient()));
    EXPECT_TRUE(PayloadIs(in.data(), in.size(), 0, 0, 50));
  }
  // A size mismatch fails the receive, not the send, and the next message is intact.
  {
    std::vector<uint8_t> out(100), next(64);
    FillPayload(out.data(), out.size(), 0, 0, 60);
    FillPayload(next.data(), next.size(), 0, 0, 61);
    GuardedBuffer in(60);
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r, t->Irecv(0, kTagBulk, in.data(), in.size()));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s, t->Isend(0, kTagBulk, out.data(), out.size()));
    const Status rs = t->Wait(r, Patient(), "receive");
    EXPECT_EQ(rs.code(), StatusCode::kInvalidArgument) << rs.ToString();
    EXPECT_NE(rs.message().find("100 bytes"), std::string::npos) << rs.ToString();
    MOERUN_EXPECT_OK(t->Wait(s, Patient(), "send"));
    EXPECT_TRUE(in.Untouched());
    GuardedBuffer in2(64);
    MOERUN_ASSERT_OK(t->Send(0, kTagBulk, next.data(), next.size(), Patient()));
    MOERUN_ASSERT_OK(t->Recv(0, kTagBulk, in2.data(), in2.size(), Patient()));
    EXPECT_TRUE(PayloadIs(in2.data(), in2.size(), 0, 0, 61));
  }
  // A receive whose message never came is withdrawn (no abort): the transport stays usable.
  {
    GuardedBuffer never(256);
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r, t->Irecv(0, kTagBulk, never.data(), never.size()));
    Request one[] = {r};
    const Status st = t->WaitAll(one, DeadlineIn(std::chrono::milliseconds(100)), "receive");
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
    EXPECT_FALSE(t->peer_failed(0));
    std::vector<uint8_t> out(256);
    FillPayload(out.data(), out.size(), 0, 0, 70);
    GuardedBuffer in(256);
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r2, t->Irecv(0, kTagBulk, in.data(), in.size()));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s2, t->Isend(0, kTagBulk, out.data(), out.size()));
    Request both[] = {r2, s2};
    MOERUN_ASSERT_OK(t->WaitAll(both, Patient(), "after a withdrawn receive"));
    EXPECT_TRUE(PayloadIs(in.data(), in.size(), 0, 0, 70));
    EXPECT_TRUE(never.Untouched());
  }
  // Zero bytes, and a tag that is not an NCCL tag (over the bootstrap).
  {
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r, t->Irecv(0, kTagBulk, nullptr, 0));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s, t->Isend(0, kTagBulk, nullptr, 0));
    uint64_t a = 42, b = 0;
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r2, t->Irecv(0, kTagOther, &b, sizeof b));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s2, t->Isend(0, kTagOther, &a, sizeof a));
    Request all[] = {r, s, r2, s2};
    MOERUN_ASSERT_OK(t->WaitAll(all, Patient(), "zero bytes and bootstrap"));
    EXPECT_EQ(b, 42u);
  }
  MOERUN_EXPECT_OK(t->Barrier(Patient()));
  const TransportCounters c = t->counters();
  EXPECT_GT(c.copied_bytes, uint64_t{160} << 20);
  std::printf("[ info ] nccl self: %.1f MiB copied through staging, %llu registrations\n",
              static_cast<double>(c.copied_bytes) / (1 << 20),
              static_cast<unsigned long long>(c.registrations));
}

// Two ranks as threads of `fabric` (2 ranks; it must outlive the transports); rank r on GPU
// devices[r]. Creation is collective: both threads create.
std::vector<Result<std::unique_ptr<Transport>>> CreatePair(
    const std::shared_ptr<InprocFabric>& fabric, const std::vector<int>& devices,
    std::chrono::seconds deadline = std::chrono::seconds(60)) {
  std::vector<Result<std::unique_ptr<Transport>>> out;
  out.emplace_back(Status::Internal("not run"));
  out.emplace_back(Status::Internal("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      out[static_cast<size_t>(r)] =
          NcclOver(fabric->Endpoint(r), devices[static_cast<size_t>(r)], deadline);
    });
  }
  for (std::thread& th : threads) th.join();
  return out;
}

// NCCL does not support two ranks of one communicator on one GPU (it reports "Duplicate GPU
// detected", or, its documentation warns, may hang): both ranks' creations end alike by their
// 20 s deadline, with an error (the watchdog aborts a hung initialisation), or, should a later
// NCCL accept it, both created. Never one rank created and the other not, never past the
// deadline. (The launcher refuses such a job before it starts; this checks the transport's own
// error path.)
TEST(NcclTransportGpuTest, TwoRanksOnOneGpuFailAtCreationNotHang) {
  MOERUN_NCCL_GPUS_OR_SKIP(gpus);
  (void)gpus;
  const auto t0 = std::chrono::steady_clock::now();
  auto fabric = InprocFabric::Create(2);
  auto pair = CreatePair(fabric, {0, 0}, std::chrono::seconds(20));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(pair[0].ok(), pair[1].ok()) << "one rank created its transport, the other not";
  for (int r = 0; r < 2; ++r) {
    const auto& p = pair[static_cast<size_t>(r)];
    std::printf("[ info ] two ranks on GPU 0, rank %d: %s\n", r,
                p.ok() ? "created (this NCCL accepts it)" : p.status().ToString().c_str());
  }
  EXPECT_LT(s, 30.0) << "creation should end by its 20 s deadline";
  if (pair[0].ok() && pair[1].ok()) {  // ended together: finalising waits for the peer
    std::vector<std::thread> enders;
    for (int r = 0; r < 2; ++r) {
      enders.emplace_back([&, r] { pair[static_cast<size_t>(r)] = Status::Internal("ended"); });
    }
    for (std::thread& th : enders) th.join();
  }
}

TEST(NcclTransportGpuTest, TwoGpusExchangeBothWays) {
  MOERUN_NCCL_GPUS_OR_SKIP(gpus);
  if (gpus < 2) GTEST_SKIP() << gpus << " GPU visible: two ranks need two GPUs";
  auto fabric = InprocFabric::Create(2);
  auto pair = CreatePair(fabric, {0, 1});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(pair[static_cast<size_t>(r)].ok())
        << pair[static_cast<size_t>(r)].status().ToString();
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Transport& t = **pair[static_cast<size_t>(r)];
      const int peer = 1 - r;
      // Rows one way and results the other, several in flight, receives posted late on rank 1.
      constexpr int kMessages = 8;
      std::vector<std::vector<uint8_t>> out(kMessages), in(kMessages);
      std::vector<Request> reqs;
      for (int k = 0; k < kMessages; ++k) {
        const size_t bytes = (size_t{1} << (10 + k)) + static_cast<size_t>(k);
        out[static_cast<size_t>(k)].resize(bytes);
        in[static_cast<size_t>(k)].resize(bytes);
        FillPayload(out[static_cast<size_t>(k)].data(), bytes, r, peer, static_cast<uint32_t>(k));
        if (r == 0) {
          auto q = t.Irecv(peer, kTagBulk, in[static_cast<size_t>(k)].data(), bytes);
          ASSERT_TRUE(q.ok()) << q.status().ToString();
          reqs.push_back(*q);
        }
        auto s = t.Isend(peer, kTagBulk, out[static_cast<size_t>(k)].data(), bytes);
        ASSERT_TRUE(s.ok()) << s.status().ToString();
        reqs.push_back(*s);
      }
      if (r == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (int k = 0; k < kMessages; ++k) {
          auto q = t.Irecv(peer, kTagBulk, in[static_cast<size_t>(k)].data(),
                           in[static_cast<size_t>(k)].size());
          ASSERT_TRUE(q.ok()) << q.status().ToString();
          reqs.push_back(*q);
        }
      }
      MOERUN_ASSERT_OK(t.WaitAll(reqs, Patient(), "two GPUs"));
      for (int k = 0; k < kMessages; ++k) {
        EXPECT_TRUE(PayloadIs(in[static_cast<size_t>(k)].data(), in[static_cast<size_t>(k)].size(),
                              peer, r, static_cast<uint32_t>(k)));
      }
      MOERUN_EXPECT_OK(t.Barrier(Patient()));
    });
  }
  for (std::thread& th : threads) th.join();
  // Ended together: finalising a communicator waits for its peer's.
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { pair[static_cast<size_t>(r)] = Status::Internal("ended"); });
  }
  for (std::thread& th : threads) th.join();
}

}  // namespace
}  // namespace moerun
