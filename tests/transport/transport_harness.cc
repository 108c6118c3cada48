#include "transport/transport_harness.h"

#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>

#include "launch/local_device.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "transport/launcher_env.h"
#include "transport/registry.h"

namespace moerun::testing {
namespace {

// This process's MPI endpoint, when it was started by an MPI launcher.
struct MpiState {
  bool launched = false;
  std::unique_ptr<Transport> transport;
  Status error;  // why there is no transport
  // The ucx endpoint (bootstrapped over its own MPI endpoint), made by the first ucx test.
  bool ucx_tried = false;
  std::unique_ptr<Transport> ucx;
  Status ucx_error;
  // The nccl endpoint (over its own MPI endpoint, one GPU per rank), made by the first nccl test;
  // or why this machine cannot run it (decided alike on every rank of a host).
  bool nccl_tried = false;
  std::string nccl_skip;
  std::unique_ptr<Transport> nccl;
  Status nccl_error;
};

MpiState& Mpi() {
  static MpiState state;
  return state;
}

// On ranks other than 0: only failures, each line naming the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[mpi rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "unknown", r.line_number(), r.message());
    std::fflush(stderr);
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::fprintf(stderr, "[mpi rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(),
                 info.name());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

// Rank 0 learns which ranks failed the test that just ran and fails it too, so that its summary
// (the only one printed) lists it. The exchange also keeps the ranks in step between tests.
void ExchangeFailures(Transport& t) {
  const int n = t.size(), me = t.rank();
  const uint8_t mine = ::testing::Test::HasFailure() ? 1 : 0;
  std::vector<uint8_t> theirs(static_cast<size_t>(n), 0);
  std::vector<Request> reqs;
  Status st;
  for (int p = 0; p < n && st.ok(); ++p) {
    if (p == me) continue;
    Result<Request> r = t.Irecv(p, kHarnessTag, &theirs[static_cast<size_t>(p)], 1);
    if (!r.ok()) {
      st = r.status();
      break;
    }
    reqs.push_back(*r);
    Result<Request> s = t.Isend(p, kHarnessTag, &mine, 1);
    if (!s.ok()) {
      st = s.status();
      break;
    }
    reqs.push_back(*s);
  }
  if (!st.ok()) {
    for (Request& r : reqs) (void)t.Cancel(r);
    ADD_FAILURE() << "harness: posting the end-of-test exchange failed: " << st.ToString();
    return;
  }
  st = t.WaitAll(reqs, Patient(), "end-of-test exchange");
  if (!st.ok()) {
    ADD_FAILURE() << "harness: the end-of-test exchange failed: " << st.ToString();
    return;
  }
  if (me != 0) return;  // rank 0 reports for all; a failing rank exits non-zero by itself
  for (int p = 1; p < n; ++p) {
    if (theirs[static_cast<size_t>(p)] != 0) {
      ADD_FAILURE() << "mpi rank " << p << " failed this test (see its \"[mpi rank " << p
                    << "]\" lines)";
    }
  }
}

}  // namespace

void PrintTo(const Backend& b, std::ostream* os) {
  *os << b.name;
  if (b.ranks > 0) *os << "(" << b.ranks << " ranks)";
}

std::string BackendTestName(const ::testing::TestParamInfo<Backend>& info) {
  return info.param.ranks > 0 ? std::to_string(info.param.ranks) + "ranks" : "world";
}

// The ucx endpoint, created collectively by the first ucx test (every rank runs the same tests).
Transport* Ucx() {
  MpiState& m = Mpi();
  if (!m.ucx_tried && m.transport) {
    m.ucx_tried = true;
    Result<std::unique_ptr<Transport>> boot = CreateTransport("mpi");
    if (!boot.ok()) {
      m.ucx_error = boot.status();
    } else {
      TransportRequest r;
      r.bootstrap = std::move(boot).value();
      Result<std::unique_ptr<Transport>> t = CreateTransport("ucx", std::move(r));
      if (t.ok()) {
        m.ucx = std::move(t).value();
      } else {
        m.ucx_error = t.status();
      }
    }
  }
  return m.ucx.get();
}

// Why the nccl backend cannot run on this machine: no NCCL in the build, no GPU, fewer visible GPUs
// than ranks on this host. Empty when it can.
std::string NcclSkipReason() {
  if (FindTransport("nccl") == nullptr) return RequireTransport("nccl").status().message();
  const CudaProbe probe = ProbeCuda();
  if (probe.devices.empty()) {
    return "no usable GPU (" + (probe.built ? probe.error : std::string("no CUDA in this build")) +
           "): the nccl transport needs one GPU per rank";
  }
  const Status one_each = CheckOneGpuPerRank(
      ChooseLocalDevice(ProcessEnvironment(), static_cast<int>(probe.devices.size())));
  return one_each.ok() ? "" : one_each.message();
}

// The tags the suite's cases use go over NCCL; the harness's own and the collectives' do not.
std::vector<int> NcclSuiteTags() {
  return {100, 200, 300,  400,  401,  402, kReservedTagBase - 1, 500, 550, 600,
          601, 700, 1000, 1001, 1100, 1200};
}

// The nccl endpoint, created collectively by the first nccl test that runs (every rank runs the
// same tests and takes the same skip decision).
Transport* Nccl() {
  MpiState& m = Mpi();
  if (!m.nccl_tried && m.transport) {
    m.nccl_tried = true;
    const CudaProbe probe = ProbeCuda();
    const LocalDeviceChoice gpu =
        ChooseLocalDevice(ProcessEnvironment(), static_cast<int>(probe.devices.size()));
    Result<std::unique_ptr<Transport>> boot = CreateTransport("mpi");
    if (!boot.ok()) {
      m.nccl_error = boot.status();
    } else {
      TransportRequest r;
      r.bootstrap = std::move(boot).value();
      r.device = gpu.device;
      r.bulk_tags = NcclSuiteTags();
      r.deadline = DeadlineIn(std::chrono::seconds(120));
      Result<std::unique_ptr<Transport>> t = CreateTransport("nccl", std::move(r));
      if (t.ok()) {
        m.nccl = std::move(t).value();
      } else {
        m.nccl_error = t.status();
      }
    }
  }
  return m.nccl.get();
}

std::string SkipReason(const Backend& backend) {
  if (backend.name == "inproc") return "";
  if (backend.name != "mpi" && backend.name != "ucx" && backend.name != "nccl") {
    return "unknown backend " + backend.name;
  }
  const MpiState& m = Mpi();
  if (!m.launched) return "not started by an MPI launcher (run it under mpirun -np N, N >= 2)";
  if (!m.transport) {
    // A build without MPI cannot run these; a build with MPI that fails to start them fails.
    return FindTransport("mpi") == nullptr ? m.error.ToString() : "";
  }
  if (m.transport->size() < 2) return "the MPI world has a single rank (use mpirun -np N, N >= 2)";
  if (backend.name == "ucx" && FindTransport("ucx") == nullptr) {
    return RequireTransport("ucx").status().ToString();
  }
  if (backend.name == "nccl") {
    if (!Mpi().nccl_tried && Mpi().nccl_skip.empty()) Mpi().nccl_skip = NcclSkipReason();
    return Mpi().nccl_skip;
  }
  return "";
}

void RunInproc(const std::shared_ptr<InprocFabric>& fabric, const RankBody& body) {
  const int n = fabric->size();
  std::vector<std::unique_ptr<Transport>> endpoints;
  for (int r = 0; r < n; ++r) endpoints.push_back(fabric->Endpoint(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      SCOPED_TRACE("inproc rank " + std::to_string(r) + " of " + std::to_string(n));
      body(*endpoints[static_cast<size_t>(r)]);
    });
  }
  for (std::thread& th : threads) th.join();
}

void RunOnRanks(const Backend& backend, const RankBody& body) {
  if (backend.name == "inproc") {
    RunInproc(InprocFabric::Create(backend.ranks), body);
    return;
  }
  MpiState& m = Mpi();
  if (!m.transport) {
    ADD_FAILURE() << "the MPI transport could not be created: " << m.error.ToString();
    return;
  }
  Transport* chosen = m.transport.get();
  if (backend.name == "ucx") {
    chosen = Ucx();
    if (chosen == nullptr) {
      ADD_FAILURE() << "the ucx transport could not be created: " << m.ucx_error.ToString();
      return;
    }
  }
  if (backend.name == "nccl") {
    chosen = Nccl();
    if (chosen == nullptr) {
      ADD_FAILURE() << "the nccl transport could not be created: " << m.nccl_error.ToString();
      return;
    }
  }
  Transport& t = *chosen;
  SCOPED_TRACE(backend.name + " rank " + std::to_string(t.rank()) + " of " +
               std::to_string(t.size()));
  // Start together, so that timing-sensitive bodies (deadlines) see their peers at work.
  const Status st = t.Barrier(Patient());
  if (!st.ok()) {
    ADD_FAILURE() << "harness: the start-of-test barrier failed: " << st.ToString();
    return;
  }
  body(t);
  ExchangeFailures(t);
}

void FillPayload(void* p, size_t bytes, int src, int dst, uint32_t index) {
  auto* out = static_cast<uint8_t*>(p);
  const uint64_t hi = (static_cast<uint64_t>(src & 0xff) << 56) |
                      (static_cast<uint64_t>(dst & 0xff) << 48) |
                      (static_cast<uint64_t>(index & 0xffff) << 32);
  const size_t words = bytes / 8;
  for (size_t w = 0; w < words; ++w) {
    const uint64_t v = hi | static_cast<uint32_t>(w);
    std::memcpy(out + w * 8, &v, 8);
  }
  if (bytes % 8 != 0) {
    const uint64_t v = hi | static_cast<uint32_t>(words);
    std::memcpy(out + words * 8, &v, bytes % 8);
  }
}

::testing::AssertionResult PayloadIs(const void* p, size_t bytes, int src, int dst,
                                     uint32_t index) {
  const auto* in = static_cast<const uint8_t*>(p);
  const uint64_t hi = (static_cast<uint64_t>(src & 0xff) << 56) |
                      (static_cast<uint64_t>(dst & 0xff) << 48) |
                      (static_cast<uint64_t>(index & 0xffff) << 32);
  const size_t words = (bytes + 7) / 8;
  for (size_t w = 0; w < words; ++w) {
    const size_t len = std::min<size_t>(8, bytes - w * 8);
    const uint64_t want = hi | static_cast<uint32_t>(w);
    uint64_t got = 0;
    std::memcpy(&got, in + w * 8, len);
    if (std::memcmp(&got, &want, len) != 0) {
      std::ostringstream os;
      os << "message " << index << " from rank " << src << " to rank " << dst << " (" << bytes
         << " bytes) differs at byte offset " << w * 8 << ": want 0x" << std::hex << want
         << ", got 0x" << got << std::dec << " (that word reads as src " << (got >> 56) << ", dst "
         << ((got >> 48) & 0xff) << ", index " << ((got >> 32) & 0xffff) << ", word "
         << (got & 0xffffffffu) << ")";
      return ::testing::AssertionFailure() << os.str();
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult GuardedBuffer::GuardIntact() const {
  for (size_t i = bytes_; i < mem_.size(); ++i) {
    if (mem_[i] != kFill) {
      return ::testing::AssertionFailure() << "a guard byte past the " << bytes_
                                           << "-byte buffer was overwritten (offset " << i << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult GuardedBuffer::Untouched() const {
  for (size_t i = 0; i < mem_.size(); ++i) {
    if (mem_[i] != kFill) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of a buffer that should never be written was written";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace moerun::testing

namespace {

// Cases that cannot apply to this run are left out by the filter, not skipped, so that a skip
// always means something this machine lacks (the suite's summary fails on those that are not
// listed in tests/allowed_skips.txt):
//   - without an MPI launcher, the mpi, ucx and nccl instantiations and the cases that replace a
//     rank (they run in the ctest tests transport_conformance_* and transport_ucx_replace_peer_*,
//     under mpirun);
//   - messages over 1 GiB over inproc (mpi cuts them into 1 GiB pieces, inproc moves any size
//     with one memcpy: the case would only need 2 GiB of memory);
//   - a withdrawn send over the backends that cannot withdraw one (can_withdraw_sends is false;
//     transport.h).
void LeaveOutWhatCannotApply(bool launched) {
  std::string out =
      "inproc/TransportConformance.OverOneGiBMessagesKeepTheirBoundaries/*:"
      "mpi/TransportConformance.CancelledSendIsWithdrawn/*:"
      "ucx/TransportConformance.CancelledSendIsWithdrawn/*:"
      "nccl/TransportConformance.CancelledSendIsWithdrawn/*";
  if (!launched) out += ":mpi/*:ucx/*:nccl/*:UcxReplacePeerMpi.*";
  std::string filter = GTEST_FLAG_GET(filter);
  filter += filter.find('-') == std::string::npos ? "-" : ":";
  GTEST_FLAG_SET(filter, filter + out);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using moerun::testing::Mpi;
  Mpi().launched = moerun::LaunchedByMpiLauncher();
  LeaveOutWhatCannotApply(Mpi().launched);
  if (Mpi().launched) {
    moerun::Result<std::unique_ptr<moerun::Transport>> t = moerun::CreateTransport("mpi");
    if (t.ok()) {
      Mpi().transport = std::move(t).value();
    } else {
      Mpi().error = t.status();
    }
    if (Mpi().transport && Mpi().transport->rank() != 0) {
      ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new moerun::testing::FailurePrinter(Mpi().transport->rank()));
    }
  }
  const int rc = RUN_ALL_TESTS();
  // Destroying the last endpoint finalises MPI. Not in an Environment's TearDown: gtest prints its
  // summary after the tear-down, and MPI_Finalize's fence is what keeps a failing rank's early
  // exit from making mpirun kill rank 0 before that summary is out. Also when no test ran
  // (--gtest_list_tests).
  std::fflush(stdout);
  Mpi().nccl.reset();
  Mpi().ucx.reset();
  Mpi().transport.reset();
  return rc;
}
