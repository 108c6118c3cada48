// The transports' counters say what each transfer did (transport.h, TransportCounters): rank 0
// sends rank 1 one message at a time and both read their counters around it; the sender then
// tells the receiver its deltas, which the receiver checks together with its own:
//   inproc: every message is copied once, from the sender's buffer into the receiver's: the
//           receiver's copied_bytes grow by the message's size, nothing else moves;
//   ucx:    a message goes either as a UCX tagged message (below put_min: eagerly, through
//           UCX's bounce buffers; the sender's eager_bytes) or by put (put_bytes), never both, as
//           its size and MOERUN_UCX_PUT_MIN / MOERUN_UCX_PROTOCOL decide; the transport copies
//           nothing itself (copied_bytes 0 on both sides); a put into a registered receive
//           buffer registers nothing, one into an unregistered buffer registers it for that
//           message (on demand);
//   mpi:    nothing is counted: messages go between the caller's buffers and MPI, whose own
//           copies are MPI's (mpi_transport.cc).
// (nccl counts its host staging copies: nccl_one_gpu_test.cc.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "transport/transport.h"
#include "transport/transport_harness.h"
#include "transport/ucx/ucx_transport.h"

namespace moerun {
namespace {

using testing::Backend;
using testing::FillPayload;
using testing::GuardedBuffer;
using testing::Patient;
using testing::PayloadIs;

class TransportCountersTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const std::string why = testing::SkipReason(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  void Run(const testing::RankBody& body) { testing::RunOnRanks(GetParam(), body); }
};

// One side's counter deltas over one transfer (sent as bytes from rank 0 to rank 1).
struct Delta {
  uint64_t put = 0, eager = 0, copied = 0, registrations = 0, on_demand = 0;
  static Delta Between(const TransportCounters& a, const TransportCounters& b) {
    return {b.put_bytes - a.put_bytes, b.eager_bytes - a.eager_bytes,
            b.copied_bytes - a.copied_bytes, b.registrations - a.registrations,
            b.on_demand_registrations - a.on_demand_registrations};
  }
};

// The ucx transport's put threshold as the environment sets it (ucx_transport.h), and whether
// puts are forced (MOERUN_UCX_PROTOCOL=put); under kTag or auto over TCP alone, messages at or
// above it may go eagerly too.
size_t UcxPutMin() {
  const char* v = std::getenv("MOERUN_UCX_PUT_MIN");
  return v != nullptr ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : UcxOptions{}.put_min;
}
bool UcxPutsForced() {
  const char* v = std::getenv("MOERUN_UCX_PROTOCOL");
  return v != nullptr && std::string(v) == "put";
}

struct Case {
  const char* what;
  size_t bytes;
  bool registered;  // the receive buffer (and the send buffer) given to RegisterMemory first
};

// What the receiver checks for one case, given both sides' deltas.
void CheckCase(const char* backend, const Case& c, const Delta& sender, const Delta& receiver) {
  SCOPED_TRACE(std::string(backend) + ": " + c.what + " (" + std::to_string(c.bytes) + " bytes)");
  const std::string name = backend;
  if (name == "inproc") {
    // The path that copies: each byte once, into the receiver's buffer.
    EXPECT_EQ(receiver.copied, c.bytes);
    EXPECT_EQ(sender.copied, 0u);
    EXPECT_EQ(sender.put + sender.eager + receiver.put + receiver.eager, 0u);
  } else if (name == "ucx") {
    EXPECT_EQ(sender.copied, 0u) << "the ucx transport copied a payload itself";
    EXPECT_EQ(receiver.copied, 0u) << "the ucx transport copied a payload itself";
    EXPECT_TRUE((sender.put == c.bytes && sender.eager == 0) ||
                (sender.eager == c.bytes && sender.put == 0))
        << "put " << sender.put << ", eager " << sender.eager << ": each byte goes one way";
    const bool put = sender.put == c.bytes;
    if (c.bytes < UcxPutMin()) {
      EXPECT_FALSE(put) << "a message below put_min (" << UcxPutMin() << ") went by put";
    } else if (UcxPutsForced()) {
      EXPECT_TRUE(put) << "MOERUN_UCX_PROTOCOL=put, yet " << c.bytes << " bytes went eagerly";
    }
    // A put into memory given to RegisterMemory registers nothing more: zero copy, zero
    // registrations on the hot path; an unregistered receive buffer is registered for it.
    EXPECT_EQ(receiver.on_demand, put && !c.registered ? 1u : 0u);
    EXPECT_EQ(receiver.registrations, put && !c.registered ? 1u : 0u);
    EXPECT_EQ(receiver.put + receiver.eager, 0u);
    std::printf("[ info ] ucx: %s (%zu bytes): %s, %llu bytes copied by the transport\n", c.what,
                c.bytes, put ? "by put" : "as a UCX tagged message (eager_bytes)",
                static_cast<unsigned long long>(sender.copied + receiver.copied));
  } else if (name == "mpi") {
    const Delta zero;
    EXPECT_EQ(std::memcmp(&sender, &zero, sizeof zero), 0) << "mpi counted something";
    EXPECT_EQ(std::memcmp(&receiver, &zero, sizeof zero), 0) << "mpi counted something";
  } else {
    ADD_FAILURE() << "no expectation for the counters of " << backend;
  }
}

TEST_P(TransportCountersTest, EachTransferCountsWhatItCopied) {
  Run([](Transport& t) {
    constexpr int kTag = 3100, kTagDelta = 3101;
    const int me = t.rank();
    if (me > 1) return;
    const Case cases[] = {
        {"a small message", 100, false},
        {"a small message into registered memory", 3000, true},
        {"a large message into registered memory", (size_t{1} << 20) + 8, true},
        {"a large message into an unregistered buffer", (size_t{1} << 20) + 8, false},
    };
    for (uint32_t i = 0; i < std::size(cases); ++i) {
      const Case& c = cases[i];
      if (me == 0) {
        std::vector<uint8_t> out(c.bytes);
        FillPayload(out.data(), out.size(), 0, 1, i);
        if (c.registered) MOERUN_ASSERT_OK(t.RegisterMemory(out.data(), out.size()));
        const TransportCounters before = t.counters();
        MOERUN_ASSERT_OK(t.Send(1, kTag, out.data(), out.size(), Patient()));
        const Delta d = Delta::Between(before, t.counters());
        if (c.registered) t.UnregisterMemory(out.data());
        MOERUN_ASSERT_OK(t.Send(1, kTagDelta, &d, sizeof d, Patient()));
      } else {
        GuardedBuffer in(c.bytes);
        if (c.registered) MOERUN_ASSERT_OK(t.RegisterMemory(in.data(), in.size()));
        const TransportCounters before = t.counters();
        MOERUN_ASSERT_OK(t.Recv(0, kTag, in.data(), in.size(), Patient()));
        const TransportCounters after = t.counters();
        if (c.registered) t.UnregisterMemory(in.data());
        ASSERT_TRUE(PayloadIs(in.data(), in.size(), 0, 1, i));
        ASSERT_TRUE(in.GuardIntact());
        Delta sender;
        MOERUN_ASSERT_OK(t.Recv(0, kTagDelta, &sender, sizeof sender, Patient()));
        // (RegisterMemory's own registration was counted before `before`.)
        const Delta receiver = Delta::Between(before, after);
        CheckCase(t.name(), c, sender, receiver);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(inproc, TransportCountersTest, ::testing::Values(Backend{"inproc", 2}),
                         testing::BackendTestName);
INSTANTIATE_TEST_SUITE_P(mpi, TransportCountersTest, ::testing::Values(Backend{"mpi", 0}),
                         testing::BackendTestName);
INSTANTIATE_TEST_SUITE_P(ucx, TransportCountersTest, ::testing::Values(Backend{"ucx", 0}),
                         testing::BackendTestName);

}  // namespace
}  // namespace moerun
