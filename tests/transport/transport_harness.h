// The harness of the transport conformance suite (as UCX's gtest: one suite, every transport).
//
// A test body is a function `void Body(Transport& t)` that every rank executes. Over "inproc"
// the harness builds an InprocFabric of N ranks and runs the body on N threads; over "mpi" the
// body runs once in this process, as its MPI rank, and only when the binary was started by an MPI
// launcher with at least two ranks (otherwise the test is skipped). "ucx" and "nccl" run as "mpi",
// each over an endpoint of its own bootstrapped over MPI; "nccl" needs one GPU per rank and skips,
// saying why, without NCCL in the build, without a GPU, or with fewer GPUs than ranks on a host
// (NCCL refuses two ranks on one GPU). Its NCCL tags are the suite's (NcclSuiteTags in the .cc);
// the harness's own exchange and the barrier's reserved tags go over its MPI bootstrap.
//
// Under mpirun: the MPI transport is created once per process (before the tests, so that the
// rank is known) and destroyed after the last test and gtest's summary (its destruction
// finalises MPI). Ranks other than 0 print only their failures ("[mpi rank r] ..."); after each
// test the ranks tell rank 0 whether they failed, so that rank 0's summary lists a test that
// failed on any rank. A rank with a failure exits non-zero, and so does mpirun.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "transport/inproc.h"
#include "transport/transport.h"

namespace moerun::testing {

// One backend of the suite: "inproc" with `ranks` threads, or "mpi" (ucx, nccl) over the launched
// world.
struct Backend {
  std::string name;
  int ranks = 0;  // inproc: the fabric's size; mpi, ucx, nccl: 0 (the world's size)
};
void PrintTo(const Backend& b, std::ostream* os);
// gtest parameter names: "2ranks", "3ranks", ... for inproc; "world" for mpi.
std::string BackendTestName(const ::testing::TestParamInfo<Backend>& info);

using RankBody = std::function<void(Transport&)>;

// Why `backend` cannot run here (empty when it can): mpi outside mpirun, a world under 2 ranks,
// (nccl) no NCCL, no GPU, fewer GPUs than ranks on this host.
std::string SkipReason(const Backend& backend);
// Runs `body` on every rank of `backend` (see above). The caller has checked SkipReason.
void RunOnRanks(const Backend& backend, const RankBody& body);
// Runs `body` on one thread per rank of `fabric`, each with its own endpoint; joins them all.
void RunInproc(const std::shared_ptr<InprocFabric>& fabric, const RankBody& body);

// A tag the harness reserves for its own exchange after each mpi test; tests use other tags.
inline constexpr int kHarnessTag = 999'999;

// Messages whose bytes name where they come from (as DeepEP's tests do): word w of message
// `index` from `src` to `dst` is (src << 56 | dst << 48 | (index & 0xffff) << 32 | w) and a
// trailing partial word is that word's low bytes. A message delivered to the wrong place, in the
// wrong order or cut short does not compare equal.
void FillPayload(void* p, size_t bytes, int src, int dst, uint32_t index);
::testing::AssertionResult PayloadIs(const void* p, size_t bytes, int src, int dst, uint32_t index);

// A receive buffer followed by guard bytes that must stay untouched.
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kFill = 0xA5;
  explicit GuardedBuffer(size_t bytes) : bytes_(bytes), mem_(bytes + kGuard, kFill) {}
  uint8_t* data() { return mem_.data(); }
  const uint8_t* data() const { return mem_.data(); }
  size_t size() const { return bytes_; }
  ::testing::AssertionResult GuardIntact() const;
  ::testing::AssertionResult Untouched() const;  // every byte still kFill (never written)

 private:
  size_t bytes_;
  std::vector<uint8_t> mem_;
};

// A deadline long enough that only a hang reaches it.
inline Deadline Patient() { return DeadlineIn(std::chrono::milliseconds(60'000)); }

}  // namespace moerun::testing

#define MOERUN_EXPECT_OK(expr)                                                \
  do {                                                                        \
    const ::moerun::Status moerun_st_ = (expr);                               \
    EXPECT_TRUE(moerun_st_.ok()) << #expr << " -> " << moerun_st_.ToString(); \
  } while (0)

#define MOERUN_ASSERT_OK(expr)                                                \
  do {                                                                        \
    const ::moerun::Status moerun_st_ = (expr);                               \
    ASSERT_TRUE(moerun_st_.ok()) << #expr << " -> " << moerun_st_.ToString(); \
  } while (0)

#define MOERUN_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)              \
  auto tmp = (expr);                                                   \
  ASSERT_TRUE(tmp.ok()) << #expr << " -> " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()

#define MOERUN_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  MOERUN_ASSERT_OK_AND_ASSIGN_IMPL_(MOERUN_CONCAT_(moerun_tres_, __LINE__), lhs, expr)
