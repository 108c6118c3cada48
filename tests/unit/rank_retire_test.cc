// moectl retire inside one process (ranks as threads over the inproc transport, the real
// RouterControl, PeerHealth and expert ranks): a retired expert rank's experts move to the others
// first (a migration), every answer before, during and after is bitwise the single-process
// layer's, then the rank is sent its shutdown and its thread ends; it is "retired", not dead.
// The refusals (a router, an unknown rank, a retired one, the last live one, a second retire
// while one runs) are checked with their messages.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "runtime/migration/router_control.h"
#include "runtime/ranks/rank_job.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"

namespace moerun {
namespace {

using moerun::testing::FixtureDir;
using moerun::testing::ForwardOneProcess;
using moerun::testing::LoadFixture;
using moerun::testing::NormalRows;
using moerun::testing::RunInprocJob;

bool HoldsAny(const Placement& p, int rank) {
  std::vector<bool> only(static_cast<size_t>(p.num_ranks()), false);
  only[static_cast<size_t>(rank)] = true;
  return p.UsesAny(only, {0});  // the layer served
}

// Serves `x` between polls (every answer checked) until the retire of `rank` is complete: its
// migration done and the rank retired here.
void ServeUntilRetired(RouterLayer* layer, RouterControl* c, int rank, const std::vector<float>& x,
                       int64_t tokens, const std::vector<float>& want) {
  std::vector<float> out(x.size());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int batches = 0;
  while (std::chrono::steady_clock::now() < until) {
    ASSERT_TRUE(c->Poll().ok());
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    ASSERT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0) << "batch " << batches;
    ++batches;
    const std::vector<int> retired = c->retired_ranks();
    if (std::find(retired.begin(), retired.end(), rank) != retired.end()) return;
  }
  FAIL() << "rank " << rank << " was not retired";
}

class RankRetireTest : public ::testing::TestWithParam<int> {};

TEST_P(RankRetireTest, RetiresWithoutAWrongAnswerAndRefusesWhatItCannot) {
  const std::string fixture = "deepseek_v3";
  const int routers = GetParam();
  const int ranks = routers + 3;  // expert ranks a, b, c
  const int a = routers, b = routers + 1, c3 = routers + 2;
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  const int64_t tokens = 64;
  const auto x = NormalRows(tokens, spec->hidden, 11);
  const auto want = ForwardOneProcess(fixture, x, tokens);

  JobOptions opts;
  opts.routers = routers;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = "linear";
  opts.ep.deadline = std::chrono::milliseconds(20000);
  opts.threads = 1;
  opts.isa = BestIsa();
  opts.router.control = true;
  opts.router.health = PeerHealthOptions{};
  std::atomic<bool> finished{false};
  const RouterWork rw = [&](RouterRank& router) -> Status {
    RouterControl* c = router.control();
    if (c == nullptr) return Status::Internal("no RouterControl");
    if (router.rank() != 0) {
      // Router 0 tells the others: they mark the ranks retired too (and send their shutdowns).
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!finished || (c->retired_ranks() != std::vector<int>{a, b} &&
                           std::chrono::steady_clock::now() < until)) {
        MOERUN_RETURN_IF_ERROR(router.Poll());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(c->retired_ranks(), (std::vector<int>{a, b})) << "router " << router.rank();
      return Status::Ok();
    }
    // Router 0's part; the others stop polling once it ends, however it ends.
    struct Done {
      std::atomic<bool>* flag;
      ~Done() { *flag = true; }
    } done{&finished};
    RouterLayer* layer = router.layers().at(0);
    MigrationOptions o;
    o.expert_bytes = 1;
    auto refused = [&](int rank, StatusCode code, const std::string& words) {
      auto r = c->Retire(rank, o);
      EXPECT_FALSE(r.ok()) << "retire " << rank;
      if (r.ok()) return;
      EXPECT_EQ(r.status().code(), code) << r.status().ToString();
      EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().ToString();
    };
    const std::string n = std::to_string(routers - 1);
    refused(routers - 1, StatusCode::kInvalidArgument, "rank " + n + " is a router");
    refused(9, StatusCode::kInvalidArgument, "no rank 9 in this job");
    refused(-1, StatusCode::kInvalidArgument, "no rank -1");

    // Rank b holds experts (linear): they move first, then it leaves.
    const std::string sb = std::to_string(b), sc = std::to_string(c3);
    EXPECT_TRUE(HoldsAny(*c->placement(), b));
    auto started = c->Retire(b, o);
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (!started.ok()) return started.status();
    EXPECT_EQ(started->trigger, "retire");
    EXPECT_EQ(started->state, "running");
    refused(c3, StatusCode::kUnavailable, "rank " + sb + " is being retired");
    ServeUntilRetired(layer, c, b, x, tokens, want);
    const MigrationView v = c->Progress();
    EXPECT_EQ(v.state, "done") << v.error;
    EXPECT_EQ(v.trigger, "retire");
    EXPECT_FALSE(HoldsAny(*c->placement(), b));
    EXPECT_TRUE(c->dead_ranks().empty());  // retired is no failure
    refused(b, StatusCode::kInvalidArgument, "rank " + sb + " is already retired");
    // A placement that gives it experts again is refused.
    EXPECT_FALSE(c->Apply(*Placement::Linear(spec->num_experts, ranks, routers), o).ok());

    // Then rank a: rank c alone serves everything, still bitwise.
    EXPECT_TRUE(c->Retire(a, o).ok());
    ServeUntilRetired(layer, c, a, x, tokens, want);
    EXPECT_EQ(c->retired_ranks(), (std::vector<int>{a, b}));
    refused(c3, StatusCode::kInvalidArgument, "rank " + sc + " is the last live expert rank");
    std::vector<float> out(x.size());
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(c->Poll().ok());
      EXPECT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
      EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    }
    return Status::Ok();
  };
  // The retired ranks' threads end (their Serve returns once the router's shutdown came) with
  // Ok, as every other rank's.
  const std::vector<Status> results = RunInprocJob(ranks, opts, rw);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(Routers, RankRetireTest, ::testing::Values(1, 2),
                         [](const auto& tp) { return "routers" + std::to_string(tp.param); });

}  // namespace
}  // namespace moerun
