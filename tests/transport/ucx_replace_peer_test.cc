// A new process takes over a rank of a running ucx transport (moerun serve --join): UcxJoiner and
// Transport::ReplacePeer. In one process (two or three ucx transports polled by one thread), and
// under mpirun, where rank 1's process drops its transport for a joiner's and the other ranks
// take the joiner in. See ucx_transport.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/inproc.h"
#include "transport/registry.h"
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

// The sizes each exchange moves: eager ones and, unless the put threshold is out of reach, ones
// at and above it (the put path: RTR, put, FIN).
std::vector<size_t> Sizes(const UcxOptions& o) {
  std::vector<size_t> s = {1, 64, 4096};
  if (o.put_min <= (size_t{1} << 22)) {
    s.push_back(o.put_min);
    s.push_back(o.put_min + 5);
  }
  s.push_back((size_t{1} << 20) + 7);
  return s;
}

// A joiner, or the reason the test cannot run (a build without UCX).
std::unique_ptr<UcxJoiner> Joiner(const UcxOptions& o, std::string* skip) {
  Result<std::unique_ptr<UcxJoiner>> j = CreateUcxJoiner(o);
  if (!j.ok()) {
    if (j.status().code() == StatusCode::kUnsupported) {
      *skip = j.status().ToString();
    } else {
      ADD_FAILURE() << "CreateUcxJoiner: " << j.status().ToString();
    }
    return nullptr;
  }
  return std::move(j).value();
}

// Polls the requests of several transports of this thread until all are done (one thread drives
// both ends, so no single WaitAll can).
void WaitEach(std::initializer_list<std::pair<Transport*, std::vector<Request>*>> sets) {
  const Deadline deadline = Patient();
  for (;;) {
    size_t pending = 0;
    for (auto& [t, reqs] : sets) {
      for (Request& r : *reqs) {
        if (!r.valid()) continue;
        Result<bool> done = t->Test(r);
        ASSERT_TRUE(done.ok()) << t->name() << " rank " << t->rank() << ", request with rank "
                               << r.peer << ": " << done.status().ToString();
        if (*done) {
          r = Request{};
        } else {
          ++pending;
        }
      }
    }
    if (pending == 0) return;
    ASSERT_LT(SteadyClock::now(), deadline) << pending << " requests did not complete";
    std::this_thread::yield();
  }
}

// Destroys `gone` on another thread while this one keeps `stays` progressing: closing an
// endpoint waits for the peer's process (over TCP), and here that is this thread.
void DestroyWhileProgressing(std::unique_ptr<Transport>& gone, Transport& stays) {
  uint8_t none = 0;
  Result<Request> idle = stays.Irecv(stays.rank(), 99, &none, 1);  // to itself: never sent
  ASSERT_TRUE(idle.ok()) << idle.status().ToString();
  std::atomic<bool> done{false};
  std::thread th([&] {
    gone.reset();
    done.store(true);
  });
  while (!done.load()) {
    (void)stays.Test(*idle);
    std::this_thread::yield();
  }
  th.join();
  MOERUN_EXPECT_OK(stays.Cancel(*idle));
}

// Messages of every size both ways between `a` (rank ra) and `b` (rank rb), both in this thread,
// on `tag`; each checked byte for byte.
void ExchangeInProcess(Transport& a, Transport& b, int tag, const std::vector<size_t>& sizes,
                       uint32_t round) {
  const int ra = a.rank(), rb = b.rank();
  std::vector<std::vector<uint8_t>> out_a, out_b;
  std::vector<GuardedBuffer> in_a, in_b;
  in_a.reserve(sizes.size());
  in_b.reserve(sizes.size());
  std::vector<Request> reqs_a, reqs_b;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto index = static_cast<uint32_t>(round * 100 + i);
    out_a.emplace_back(sizes[i]);
    out_b.emplace_back(sizes[i]);
    FillPayload(out_a.back().data(), sizes[i], ra, rb, index);
    FillPayload(out_b.back().data(), sizes[i], rb, ra, index);
    in_a.emplace_back(sizes[i]);
    in_b.emplace_back(sizes[i]);
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r1, a.Irecv(rb, tag, in_a.back().data(), sizes[i]));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s1, a.Isend(rb, tag, out_a.back().data(), sizes[i]));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request s2, b.Isend(ra, tag, out_b.back().data(), sizes[i]));
    MOERUN_ASSERT_OK_AND_ASSIGN(Request r2, b.Irecv(ra, tag, in_b.back().data(), sizes[i]));
    reqs_a.insert(reqs_a.end(), {r1, s1});
    reqs_b.insert(reqs_b.end(), {s2, r2});
  }
  WaitEach({{&a, &reqs_a}, {&b, &reqs_b}});
  if (::testing::Test::HasFatalFailure()) return;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto index = static_cast<uint32_t>(round * 100 + i);
    EXPECT_TRUE(PayloadIs(in_a[i].data(), sizes[i], rb, ra, index)) << sizes[i] << " bytes";
    EXPECT_TRUE(PayloadIs(in_b[i].data(), sizes[i], ra, rb, index)) << sizes[i] << " bytes";
    EXPECT_TRUE(in_a[i].GuardIntact());
    EXPECT_TRUE(in_b[i].GuardIntact());
  }
}

// --- backends that cannot ---------------------------------------------------------------------

TEST(UcxReplacePeer, InprocCannotReplaceAPeer) {
  auto fabric = InprocFabric::Create(2);
  std::unique_ptr<Transport> t = fabric->Endpoint(0);
  const uint8_t addr[] = {1, 2, 3};
  const Status st = t->ReplacePeer(1, addr);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
  EXPECT_NE(st.message().find("inproc"), std::string::npos) << st.ToString();
  EXPECT_TRUE(t->peer_address(0).empty());
  EXPECT_TRUE(t->peer_address(1).empty());
}

// --- one process --------------------------------------------------------------------------------

// A joiner given no address for some ranks: they are failed from the start; bad arguments to
// Connect and ReplacePeer are clear errors.
TEST(UcxReplacePeer, JoinerWithoutAddressesAndBadArguments) {
  std::string skip;
  std::unique_ptr<UcxJoiner> j = Joiner(UcxOptions{}, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(j, nullptr);
  const std::vector<uint8_t> mine = j->address();
  ASSERT_FALSE(mine.empty());
  {
    std::unique_ptr<UcxJoiner> k = Joiner(UcxOptions{}, &skip);
    ASSERT_NE(k, nullptr);
    const Result<std::unique_ptr<Transport>> bad = k->Connect(3, {{}, {}, {}});
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().ToString();
  }
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> t, j->Connect(0, {{}, {}, {}}));
  EXPECT_FALSE(j->Connect(0, {{}, {}, {}}).ok()) << "a joiner connects once";
  EXPECT_STREQ(t->name(), "ucx");
  EXPECT_EQ(t->rank(), 0);
  EXPECT_EQ(t->size(), 3);
  EXPECT_EQ(t->peer_address(0), mine);
  EXPECT_TRUE(t->peer_address(1).empty());
  EXPECT_TRUE(t->peer_address(7).empty());
  EXPECT_FALSE(t->peer_failed(0));
  uint8_t buf[64] = {};
  for (int peer : {1, 2}) {
    SCOPED_TRACE("peer " + std::to_string(peer));
    EXPECT_TRUE(t->peer_failed(peer));
    const Result<Request> s = t->Isend(peer, 5, buf, sizeof buf);
    EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
    const Result<Request> r = t->Irecv(peer, 5, buf, sizeof buf);
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  }
  const Status self = t->ReplacePeer(0, mine);
  EXPECT_EQ(self.code(), StatusCode::kInvalidArgument) << self.ToString();
  EXPECT_NE(self.message().find("itself"), std::string::npos) << self.ToString();
  for (int peer : {-1, 3, 1 << 30}) {
    const Status st = t->ReplacePeer(peer, mine);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("no such rank"), std::string::npos) << st.ToString();
  }
  const Status empty = t->ReplacePeer(1, {});
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument) << empty.ToString();
  EXPECT_TRUE(t->peer_failed(1)) << "a refused ReplacePeer changes nothing";
}

// Rank 0 (a) takes rank 1 in at b's address, then at c's: messages flow on the same tags after
// each replacement; b's stale RTR and eager message are not matched by c; a request in flight
// blocks the replacement, a cancelled put receive (a zombie) does not.
TEST(UcxReplacePeer, TwoReplacementsInOneProcess) {
  constexpr int kTag = 40, kTagStale = 41, kTagStaleEager = 42, kTagMarker = 43;
  UcxOptions opts;
  opts.protocol = UcxProtocol::kPut;  // the RTR path whatever UCX_TLS offers
  const std::vector<size_t> sizes = Sizes(opts);
  const size_t put_bytes = opts.put_min + 5;
  std::string skip;
  std::unique_ptr<UcxJoiner> ja = Joiner(opts, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  std::unique_ptr<UcxJoiner> jb = Joiner(opts, &skip);
  ASSERT_TRUE(ja && jb);
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> a, ja->Connect(0, {{}, {}}));
  EXPECT_TRUE(a->peer_failed(1));
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> b,
                              jb->Connect(1, {a->peer_address(0), {}}));
  MOERUN_ASSERT_OK(a->ReplacePeer(1, b->peer_address(1)));
  EXPECT_FALSE(a->peer_failed(1));
  EXPECT_EQ(a->peer_address(1), b->peer_address(1));
  ExchangeInProcess(*a, *b, kTag, sizes, 1);
  ASSERT_FALSE(HasFatalFailure());

  // b leaves behind, at a: an RTR (a put receive a never sent to), a REVOKE (a cancelled put
  // receive) and an unmatched eager message; the marker after them makes sure they have landed.
  std::vector<uint8_t> stale_in(put_bytes);
  MOERUN_ASSERT_OK_AND_ASSIGN(Request stale_recv,
                              b->Irecv(0, kTagStale, stale_in.data(), put_bytes));
  (void)stale_recv;  // never completes: b goes first
  std::vector<uint8_t> revoked_in(put_bytes);
  MOERUN_ASSERT_OK_AND_ASSIGN(Request revoked,
                              b->Irecv(0, kTagStale + 10, revoked_in.data(), put_bytes));
  MOERUN_EXPECT_OK(b->Cancel(revoked));
  std::vector<uint8_t> stale_eager(64);
  FillPayload(stale_eager.data(), 64, 1, 0, 90);
  uint64_t marker = 7;
  std::vector<Request> rb, ra;
  MOERUN_ASSERT_OK_AND_ASSIGN(Request se, b->Isend(0, kTagStaleEager, stale_eager.data(), 64));
  MOERUN_ASSERT_OK_AND_ASSIGN(Request sm, b->Isend(0, kTagMarker, &marker, sizeof marker));
  uint64_t got_marker = 0;
  MOERUN_ASSERT_OK_AND_ASSIGN(Request rm, a->Irecv(1, kTagMarker, &got_marker, sizeof got_marker));
  rb = {se, sm};
  ra = {rm};
  WaitEach({{a.get(), &ra}, {b.get(), &rb}});
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(got_marker, marker);

  // A receive of a's from rank 1 in flight: ReplacePeer refuses, naming it.
  std::unique_ptr<UcxJoiner> jc = Joiner(opts, &skip);
  ASSERT_NE(jc, nullptr);
  uint8_t pending_buf[32];
  MOERUN_ASSERT_OK_AND_ASSIGN(Request pending, a->Irecv(1, kTag + 100, pending_buf, 32));
  const Status busy = a->ReplacePeer(1, jc->address());
  EXPECT_EQ(busy.code(), StatusCode::kInvalidArgument) << busy.ToString();
  EXPECT_NE(busy.message().find("in flight"), std::string::npos) << busy.ToString();
  MOERUN_EXPECT_OK(a->Cancel(pending));
  // A cancelled put receive waits for the sender's answer (a zombie): reaped by ReplacePeer.
  std::vector<uint8_t> zombie_in(put_bytes);
  MOERUN_ASSERT_OK_AND_ASSIGN(Request zombie, a->Irecv(1, kTag + 101, zombie_in.data(), put_bytes));
  MOERUN_EXPECT_OK(a->Cancel(zombie));

  // b goes; a takes rank 1 in at c's address.
  DestroyWhileProgressing(b, *a);
  MOERUN_ASSERT_OK(a->ReplacePeer(1, jc->address()));
  EXPECT_FALSE(a->peer_failed(1));
  EXPECT_EQ(a->peer_address(1), jc->address());
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> c,
                              jc->Connect(1, {a->peer_address(0), {}}));
  EXPECT_EQ(c->peer_address(1), jc->address());

  // a's send on b's stale channel goes to c's receive (posted after it), and a's eager receive
  // gets c's message, not b's.
  std::vector<uint8_t> out(put_bytes), out_revoked(put_bytes);
  FillPayload(out.data(), put_bytes, 0, 1, 91);
  FillPayload(out_revoked.data(), put_bytes, 0, 1, 92);
  GuardedBuffer in_eager(64), in_c(put_bytes), in_c_revoked(put_bytes);
  MOERUN_ASSERT_OK_AND_ASSIGN(Request r0, a->Irecv(1, kTagStaleEager, in_eager.data(), 64));
  MOERUN_ASSERT_OK_AND_ASSIGN(Request s0, a->Isend(1, kTagStale, out.data(), put_bytes));
  MOERUN_ASSERT_OK_AND_ASSIGN(Request s1,
                              a->Isend(1, kTagStale + 10, out_revoked.data(), put_bytes));
  for (int i = 0; i < 100; ++i) {  // a stale RTR would be taken now
    const Result<bool> early = a->Test(s0);
    ASSERT_TRUE(early.ok()) << early.status().ToString();
    if (*early) {  // sent eagerly by UCX (tag protocol)
      s0 = Request{};
      break;
    }
  }
  std::vector<uint8_t> fresh_eager(64);
  FillPayload(fresh_eager.data(), 64, 1, 0, 93);
  MOERUN_ASSERT_OK_AND_ASSIGN(Request rc, c->Irecv(0, kTagStale, in_c.data(), put_bytes));
  MOERUN_ASSERT_OK_AND_ASSIGN(Request rc2,
                              c->Irecv(0, kTagStale + 10, in_c_revoked.data(), put_bytes));
  MOERUN_ASSERT_OK_AND_ASSIGN(Request sc, c->Isend(0, kTagStaleEager, fresh_eager.data(), 64));
  ra = {r0, s0, s1};
  std::vector<Request> rcs = {rc, rc2, sc};
  WaitEach({{a.get(), &ra}, {c.get(), &rcs}});
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_TRUE(PayloadIs(in_eager.data(), 64, 1, 0, 93)) << "the old process's message was taken";
  EXPECT_TRUE(PayloadIs(in_c.data(), put_bytes, 0, 1, 91));
  EXPECT_TRUE(PayloadIs(in_c_revoked.data(), put_bytes, 0, 1, 92));
  EXPECT_TRUE(in_c.GuardIntact());
  ExchangeInProcess(*a, *c, kTag, sizes, 2);
  EXPECT_FALSE(a->peer_failed(1));
  EXPECT_FALSE(c->peer_failed(0));
  DestroyWhileProgressing(c, *a);
}

// Spare ranks (moerun serve's spare_expert_ranks): a transport made over a one-rank bootstrap with
// two spare ranks has three; the spare ones are failed from the start (no process), the barrier
// over the launched ranks passes, and a joiner takes spare rank 2: ReplacePeer makes its first
// endpoint and messages of every size flow, while spare rank 1 stays failed. The option's
// environment variable is parsed with a clear error.
TEST(UcxReplacePeer, SpareRanksBeyondTheBootstrap) {
  UcxOptions opts;
  opts.protocol = UcxProtocol::kPut;
  opts.spare_ranks = 2;
  std::string skip;
  std::unique_ptr<UcxJoiner> jb = Joiner(opts, &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_NE(jb, nullptr);
  auto fabric = InprocFabric::Create(1);
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> a,
                              CreateUcxTransport(fabric->Endpoint(0), opts));
  EXPECT_EQ(a->size(), 3);
  EXPECT_FALSE(a->peer_failed(0));
  EXPECT_TRUE(a->peer_failed(1));
  EXPECT_TRUE(a->peer_failed(2));
  uint8_t byte = 1;
  const Result<Request> none = a->Isend(1, 40, &byte, 1);
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable) << none.status().ToString();
  MOERUN_EXPECT_OK(a->Barrier(Patient(), /*among=*/1));

  MOERUN_ASSERT_OK(a->ReplacePeer(2, jb->address()));
  EXPECT_FALSE(a->peer_failed(2));
  EXPECT_TRUE(a->peer_failed(1));
  MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> b,
                              jb->Connect(2, {a->peer_address(0), {}, {}}));
  EXPECT_EQ(b->size(), 3);
  ExchangeInProcess(*a, *b, 40, Sizes(opts), 1);
  ASSERT_FALSE(HasFatalFailure());
  DestroyWhileProgressing(b, *a);

  ::setenv("MOERUN_UCX_SPARE_RANKS", "3", 1);
  Result<UcxOptions> env = UcxOptionsFromEnvironment();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->spare_ranks, 3);
  ::setenv("MOERUN_UCX_SPARE_RANKS", "-1", 1);
  env = UcxOptionsFromEnvironment();
  EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(env.status().message().find("MOERUN_UCX_SPARE_RANKS"), std::string::npos);
  ::unsetenv("MOERUN_UCX_SPARE_RANKS");
}

// --- under mpirun -------------------------------------------------------------------------------

Status SendBytes(Transport& t, int peer, int tag, const std::vector<uint8_t>& bytes) {
  const uint64_t n = bytes.size();
  MOERUN_RETURN_IF_ERROR(t.Send(peer, tag, &n, sizeof n, Patient()));
  return t.Send(peer, tag, bytes.data(), bytes.size(), Patient());
}

Result<std::vector<uint8_t>> RecvBytes(Transport& t, int peer, int tag) {
  uint64_t n = 0;
  MOERUN_RETURN_IF_ERROR(t.Recv(peer, tag, &n, sizeof n, Patient()));
  if (n > (uint64_t{1} << 20)) return Status::Corrupt("an address of " + std::to_string(n) + " B");
  std::vector<uint8_t> bytes(n);
  MOERUN_RETURN_IF_ERROR(t.Recv(peer, tag, bytes.data(), bytes.size(), Patient()));
  return bytes;
}

// Rank 1 and each other rank: every size, both ways, on `tag`, checked.
void ExchangeWithRankOne(Transport& t, int tag, const std::vector<size_t>& sizes, uint32_t round) {
  const int n = t.size(), me = t.rank();
  for (int other = 0; other < n; ++other) {
    if (other == 1 || (me != 1 && me != other)) continue;
    const int peer = me == 1 ? other : 1;
    std::vector<std::vector<uint8_t>> out;
    std::vector<GuardedBuffer> in;
    in.reserve(sizes.size());
    std::vector<Request> reqs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto index = static_cast<uint32_t>(round * 100 + i);
      out.emplace_back(sizes[i]);
      FillPayload(out.back().data(), sizes[i], me, peer, index);
      in.emplace_back(sizes[i]);
      MOERUN_ASSERT_OK_AND_ASSIGN(Request r, t.Irecv(peer, tag, in.back().data(), sizes[i]));
      MOERUN_ASSERT_OK_AND_ASSIGN(Request s, t.Isend(peer, tag, out.back().data(), sizes[i]));
      reqs.insert(reqs.end(), {r, s});
    }
    MOERUN_ASSERT_OK(t.WaitAll(reqs, Patient(), "exchange with rank 1"));
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto index = static_cast<uint32_t>(round * 100 + i);
      EXPECT_TRUE(PayloadIs(in[i].data(), sizes[i], peer, me, index))
          << "round " << round << ", " << sizes[i] << " bytes";
      EXPECT_TRUE(in[i].GuardIntact());
    }
  }
}

class UcxReplacePeerMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::SkipReason(Backend{"mpi", 0});
    if (!why.empty()) GTEST_SKIP() << why;
    std::string skip;
    if (Joiner(UcxOptions{}, &skip) == nullptr && !skip.empty()) GTEST_SKIP() << skip;
  }
};

TEST_F(UcxReplacePeerMpi, MpiCannotReplaceAPeer) {
  testing::RunOnRanks(Backend{"mpi", 0}, [](Transport& t) {
    const uint8_t addr[] = {1, 2, 3};
    const Status st = t.ReplacePeer((t.rank() + 1) % t.size(), addr);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
    EXPECT_NE(st.message().find("mpi"), std::string::npos) << st.ToString();
    EXPECT_TRUE(t.peer_address(t.rank()).empty());
  });
}

// Every rank makes the ucx transport over MPI; then rank 1's process drops it for a joiner's (as
// a new process taking over a dead rank 1 would), and the others take the joiner in with
// ReplacePeer. Messages flow on the same tags as before; what the old rank 1 left at rank 0 (an
// RTR of a put receive rank 0 never sent to, a REVOKE, an unmatched eager message) is not matched
// by the new one's requests.
TEST_F(UcxReplacePeerMpi, JoinerTakesOverRankOne) {
  testing::RunOnRanks(Backend{"mpi", 0}, [](Transport& mpi) {
    constexpr int kTag = 60, kTagStale = 61, kTagRevoked = 62, kTagStaleEager = 63, kTagMarker = 64,
                  kTagAddress = 65, kTagGo = 66;
    const int n = mpi.size(), me = mpi.rank();
    MOERUN_ASSERT_OK_AND_ASSIGN(const UcxOptions opts, UcxOptionsFromEnvironment());
    const std::vector<size_t> sizes = Sizes(opts);
    const size_t put_bytes = std::max(opts.put_min, size_t{64}) + 5;
    MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> boot, CreateTransport("mpi"));
    MOERUN_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Transport> ucx,
                                CreateUcxTransport(std::move(boot), opts));
    for (int p = 0; p < n; ++p) EXPECT_FALSE(ucx->peer_address(p).empty()) << "rank " << p;
    ExchangeWithRankOne(*ucx, kTag, sizes, 1);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());

    // The old rank 1 leaves things behind at rank 0; the marker after them makes sure they
    // have landed there.
    std::vector<uint8_t> stale_in(put_bytes), revoked_in(put_bytes);
    if (me == 1) {
      MOERUN_ASSERT_OK_AND_ASSIGN(Request stale,
                                  ucx->Irecv(0, kTagStale, stale_in.data(), put_bytes));
      (void)stale;  // never completes: the transport goes first
      MOERUN_ASSERT_OK_AND_ASSIGN(Request revoked,
                                  ucx->Irecv(0, kTagRevoked, revoked_in.data(), put_bytes));
      MOERUN_EXPECT_OK(ucx->Cancel(revoked));
      std::vector<uint8_t> stale_eager(64);
      FillPayload(stale_eager.data(), 64, 1, 0, 90);
      MOERUN_ASSERT_OK(ucx->Send(0, kTagStaleEager, stale_eager.data(), 64, Patient()));
      const uint64_t marker = 7;
      MOERUN_ASSERT_OK(ucx->Send(0, kTagMarker, &marker, sizeof marker, Patient()));
    } else if (me == 0) {
      uint64_t marker = 0;
      MOERUN_ASSERT_OK(ucx->Recv(1, kTagMarker, &marker, sizeof marker, Patient()));
      EXPECT_EQ(marker, 7u);
    }

    // Rank 1's process: a joiner's worker, the old transport gone, the address to every rank,
    // theirs back, and Connect. The others: ReplacePeer, and their own address to rank 1.
    if (me == 1) {
      std::string skip;
      std::unique_ptr<UcxJoiner> joiner = Joiner(opts, &skip);
      ASSERT_NE(joiner, nullptr) << skip;
      ucx.reset();
      std::vector<std::vector<uint8_t>> addrs(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p) {
        if (p != 1) MOERUN_ASSERT_OK(SendBytes(mpi, p, kTagAddress, joiner->address()));
      }
      for (int p = 0; p < n; ++p) {
        if (p == 1) continue;
        MOERUN_ASSERT_OK_AND_ASSIGN(addrs[static_cast<size_t>(p)], RecvBytes(mpi, p, kTagAddress));
      }
      MOERUN_ASSERT_OK_AND_ASSIGN(ucx, joiner->Connect(1, addrs));
      EXPECT_EQ(ucx->rank(), 1);
      EXPECT_EQ(ucx->size(), n);
      EXPECT_EQ(ucx->peer_address(1), joiner->address());
      for (int p = 0; p < n; ++p) {
        if (p == 1) continue;
        EXPECT_EQ(ucx->peer_address(p), addrs[static_cast<size_t>(p)]);
        EXPECT_FALSE(ucx->peer_failed(p)) << "rank " << p;
      }
    } else {
      MOERUN_ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> addr, RecvBytes(mpi, 1, kTagAddress));
      if (me == 0) {
        std::printf("[ info ] rank 0: old rank 1 %s before ReplacePeer\n",
                    ucx->peer_failed(1) ? "failed" : "not failed");
      }
      MOERUN_ASSERT_OK(ucx->ReplacePeer(1, addr));
      EXPECT_FALSE(ucx->peer_failed(1));
      EXPECT_EQ(ucx->peer_address(1), addr);
      MOERUN_ASSERT_OK(SendBytes(mpi, 1, kTagAddress, ucx->peer_address(me)));
    }

    // Rank 0's sends on the old rank 1's channels are posted first (a stale RTR would be taken
    // at once), its eager receive too (a stale message would match it); the new rank 1 posts
    // its requests only then.
    if (me == 0) {
      std::vector<uint8_t> out(put_bytes), out_revoked(put_bytes);
      FillPayload(out.data(), put_bytes, 0, 1, 91);
      FillPayload(out_revoked.data(), put_bytes, 0, 1, 92);
      GuardedBuffer in_eager(64);
      std::vector<Request> reqs;
      MOERUN_ASSERT_OK_AND_ASSIGN(Request r, ucx->Irecv(1, kTagStaleEager, in_eager.data(), 64));
      MOERUN_ASSERT_OK_AND_ASSIGN(Request s, ucx->Isend(1, kTagStale, out.data(), put_bytes));
      MOERUN_ASSERT_OK_AND_ASSIGN(Request s2,
                                  ucx->Isend(1, kTagRevoked, out_revoked.data(), put_bytes));
      for (int i = 0; i < 100; ++i) {  // a stale RTR would be taken now
        const Result<bool> early = ucx->Test(s);
        ASSERT_TRUE(early.ok()) << early.status().ToString();
        if (*early) {  // sent eagerly by UCX (tag protocol)
          s = Request{};
          break;
        }
      }
      const uint8_t go = 1;
      MOERUN_ASSERT_OK(mpi.Send(1, kTagGo, &go, 1, Patient()));
      reqs = {r, s, s2};
      MOERUN_ASSERT_OK(ucx->WaitAll(reqs, Patient(), "rank 0 after the replacement"));
      EXPECT_TRUE(PayloadIs(in_eager.data(), 64, 1, 0, 93))
          << "a receive of the new rank 1's took the old one's message";
    } else if (me == 1) {
      uint8_t go = 0;
      MOERUN_ASSERT_OK(mpi.Recv(0, kTagGo, &go, 1, Patient()));
      GuardedBuffer in(put_bytes), in_revoked(put_bytes);
      std::vector<uint8_t> fresh_eager(64);
      FillPayload(fresh_eager.data(), 64, 1, 0, 93);
      std::vector<Request> reqs;
      MOERUN_ASSERT_OK_AND_ASSIGN(Request r, ucx->Irecv(0, kTagStale, in.data(), put_bytes));
      MOERUN_ASSERT_OK_AND_ASSIGN(Request r2,
                                  ucx->Irecv(0, kTagRevoked, in_revoked.data(), put_bytes));
      MOERUN_ASSERT_OK_AND_ASSIGN(Request s, ucx->Isend(0, kTagStaleEager, fresh_eager.data(), 64));
      reqs = {r, r2, s};
      MOERUN_ASSERT_OK(ucx->WaitAll(reqs, Patient(), "the new rank 1"));
      EXPECT_TRUE(PayloadIs(in.data(), put_bytes, 0, 1, 91));
      EXPECT_TRUE(PayloadIs(in_revoked.data(), put_bytes, 0, 1, 92));
      EXPECT_TRUE(in.GuardIntact());
    }
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    ExchangeWithRankOne(*ucx, kTag, sizes, 2);
    for (int p = 0; p < n; ++p) {
      if (p != me) {
        EXPECT_FALSE(ucx->peer_failed(p)) << "rank " << p;
      }
    }
    // Everyone is done with the ucx transports before they go.
    MOERUN_EXPECT_OK(mpi.Barrier(Patient()));
    ucx.reset();
  });
}

}  // namespace
}  // namespace moerun
