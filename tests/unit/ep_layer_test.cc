// Expert parallelism inside one process (ranks as threads over the inproc transport): for every
// golden fixture, rank count, placement and microbatch size, the output is bitwise the
// single-process layer's.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include "runtime/ranks/rank_job.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using namespace moerun::testing;

// Writes a placement with every expert on one rank and every third expert also on another.
std::string ReplicaPlacement(const TempDir& tmp, int experts, int ranks) {
  std::string slots;
  for (int e = 0; e < experts; ++e) {
    const int r = 1 + e % (ranks - 1);
    slots += fmt::format("{}[{},{}]", slots.empty() ? "" : ",", r, e);
    if (e % 3 == 0 && ranks > 2) slots += fmt::format(",[{},{}]", 1 + (e + 1) % (ranks - 1), e);
  }
  const std::string path = tmp.File("placement.json");
  WriteFile(path, fmt::format("{{\"format\": \"moerun-placement-v1\", \"version\": 2, "
                              "\"num_experts\": {}, \"num_ranks\": {}, \"num_routers\": 1, "
                              "\"layers\": {{\"*\": [{}]}}}}",
                              experts, ranks, slots));
  return path;
}

// Runs the fixture's layer on `ranks` inproc ranks; returns router 0's output.
std::vector<float> Distributed(const std::string& fixture, const std::vector<float>& x,
                               int64_t tokens, int ranks, const std::string& placement,
                               int64_t microbatch, EpStats* stats = nullptr, int routers = 1,
                               const ExpertSetup& expert_setup = nullptr) {
  JobOptions opts;
  opts.routers = routers;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = placement;
  opts.ep.microbatch_tokens = microbatch;
  opts.ep.deadline = std::chrono::milliseconds(20000);
  opts.threads = 1;
  opts.isa = BestIsa();
  std::vector<float> out(x.size());
  const RouterWork work = [&](RouterRank& router) {
    if (router.rank() != 0) return Status::Ok();
    const Status s = router.layer(0)->Forward(x.data(), tokens, out.data());
    if (stats) *stats = router.layer(0)->stats();
    return s;
  };
  const std::vector<Status> results = RunInprocJob(ranks, opts, work, expert_setup);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
  return out;
}

class EpLayerTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EpLayerTest, BitwiseEqualToOneProcess) {
  const std::string fixture = GetParam();
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir(fixture) + "/golden.safetensors", "input", &tokens);
  const auto want = ForwardOneProcess(fixture, x, tokens);
  const int experts = LoadModelSpec(FixtureDir(fixture))->num_experts;
  TempDir tmp;
  for (int ranks : {2, 3, 4}) {
    const std::string replicas = ReplicaPlacement(tmp, experts, ranks);
    for (const std::string& placement :
         {std::string("linear"), std::string("round_robin"), replicas}) {
      for (int64_t mb : {0, 7}) {
        SCOPED_TRACE(fmt::format("{} ranks {} {} mb {}", fixture, ranks, placement, mb));
        const auto got = Distributed(fixture, x, tokens, ranks, placement, mb);
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, EpLayerTest, ::testing::ValuesIn(FixtureNames()),
                         [](const auto& tp) { return tp.param; });

// A stream that hands the layer its batch in pieces (as requests arriving while it runs): the
// first `start` tokens at the call, then `step` more at each Extend; records what Done reported.
class PiecewiseStream : public BatchStream {
 public:
  PiecewiseStream(int64_t start, int64_t step, int64_t total)
      : tokens_(start), step_(step), total_(total) {}
  int64_t Extend(int64_t tokens, Deadline*) override {
    EXPECT_EQ(tokens, tokens_);
    tokens_ = std::min(total_, tokens_ + step_);
    return tokens_;
  }
  void Done(int64_t done, const BatchTiming&) override {
    EXPECT_GE(done, done_.empty() ? 0 : done_.back()) << "done only grows";
    done_.push_back(done);
  }
  int64_t tokens() const override { return tokens_; }
  const std::vector<int64_t>& done() const { return done_; }

 private:
  int64_t tokens_, step_, total_;
  std::vector<int64_t> done_;
};

// A batch that grows while it runs computes bitwise what one process computes for all of it,
// whatever the pieces and microbatch size, and reports its final tokens as it goes.
TEST(EpLayerTest, ABatchThatGrowsWhileItRunsIsBitwiseTheWholeBatch) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "input", &tokens);
  const auto want = ForwardOneProcess("qwen3_moe", x, tokens);
  for (const int64_t mb : {int64_t{0}, int64_t{5}}) {
    for (const int64_t step : {int64_t{1}, int64_t{7}}) {
      SCOPED_TRACE(fmt::format("microbatch {} step {}", mb, step));
      JobOptions opts = FixtureJob("qwen3_moe", mb);
      std::vector<float> out(x.size(), -1.0f);
      PiecewiseStream stream(3, step, tokens);
      const RouterWork work = [&](RouterRank& router) {
        if (router.rank() != 0) return Status::Ok();
        return router.Forward(0, x.data(), 3, out.data(), Deadline::max(), &stream);
      };
      const std::vector<Status> results = RunInprocJob(3, opts, work);
      for (const Status& r : results) ASSERT_TRUE(r.ok()) << r.ToString();
      EXPECT_EQ(stream.tokens(), tokens);
      ASSERT_FALSE(stream.done().empty());
      EXPECT_EQ(stream.done().back(), tokens);
      EXPECT_GT(stream.done().size(), 1u) << "tokens are reported final before the end";
      EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    }
  }
}

// A second router rank (idle here) takes no experts and still shuts the job down cleanly.
TEST(EpLayerTest, TwoRouters) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("deepseek_v3") + "/golden.safetensors", "input", &tokens);
  const auto got = Distributed("deepseek_v3", x, tokens, 4, "round_robin", 5, nullptr, 2);
  const auto want = ForwardOneProcess("deepseek_v3", x, tokens);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
}

// The device hook (--device cuda wires the GPU in there) gets every non-empty group with its
// logical expert and row count, in slot order; here it computes them on the CPU, so the output
// must stay bitwise the single-process layer's.
TEST(EpLayerTest, ExpertDeviceHookGetsTheGroups) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("gpt_oss") + "/golden.safetensors", "input", &tokens);
  std::atomic<int64_t> rows_seen{0}, calls{0};
  const ExpertSetup hook = [&](int, const LoadedLayers& layers) -> Result<ExpertCompute> {
    return ExpertCompute([&, layers](int layer, const float* rows,
                                     const std::vector<int32_t>& group_expert,
                                     const std::vector<int64_t>& group_rows, float* y) {
      const MoeLayerWeights& w = *layers.at(layer);
      const CpuKernels& k = KernelsFor(BestIsa());
      ThreadPool pool(1);
      GroupedFfn ffn(k, &pool);
      std::vector<ExpertGroup> groups;
      int64_t first = 0;
      for (size_t g = 0; g < group_expert.size(); ++g) {
        EXPECT_GT(group_rows[g], 0);
        EXPECT_FALSE(w.experts[static_cast<size_t>(group_expert[g])].w13.empty());
        groups.push_back(ExpertGroup{&w.experts[static_cast<size_t>(group_expert[g])],
                                     w.spec.RoutedAct(w.layer), first, group_rows[g]});
        first += group_rows[g];
      }
      std::vector<int32_t> row_token(static_cast<size_t>(first));
      for (int64_t r = 0; r < first; ++r)
        row_token[static_cast<size_t>(r)] = static_cast<int32_t>(r);
      const int64_t h = w.spec.hidden, ldy = ffn.PaddedHidden(h);
      std::vector<float> tmp(static_cast<size_t>(first * ldy));
      ffn.Run(groups, rows, h, row_token.data(), tmp.data(), ldy);
      for (int64_t r = 0; r < first; ++r) {
        std::memcpy(y + r * h, tmp.data() + r * ldy, static_cast<size_t>(h) * 4);
      }
      rows_seen += first;
      ++calls;
      return Status::Ok();
    });
  };
  const auto got = Distributed("gpt_oss", x, tokens, 3, "round_robin", 5, nullptr, 1, hook);
  const auto want = ForwardOneProcess("gpt_oss", x, tokens);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
  const int k = LoadModelSpec(FixtureDir("gpt_oss"))->top_k;
  EXPECT_EQ(rows_seen.load(), tokens * k);  // every assignment computed once, by the hook
  EXPECT_GE(calls.load(), 2);
}

TEST(EpLayerTest, ReplicasSpreadTheLoad) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "input", &tokens);
  TempDir tmp;
  // Every expert on both expert ranks: the plan splits the rows about evenly.
  std::string slots;
  for (int e = 0; e < 16; ++e) {
    slots += fmt::format("{}[1,{}],[2,{}]", slots.empty() ? "" : ",", e, e);
  }
  const std::string path = tmp.File("both.json");
  WriteFile(path, fmt::format("{{\"format\": \"moerun-placement-v1\", \"version\": 1, "
                              "\"num_experts\": 16, \"num_ranks\": 3, \"num_routers\": 1, "
                              "\"layers\": {{\"*\": [{}]}}}}",
                              slots));
  EpStats stats;
  const auto got = Distributed("qwen3_moe", x, tokens, 3, path, 0, &stats);
  const auto want = ForwardOneProcess("qwen3_moe", x, tokens);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
  const double a = static_cast<double>(stats.rows_per_rank[1]);
  const double b = static_cast<double>(stats.rows_per_rank[2]);
  EXPECT_EQ(a + b, static_cast<double>(tokens * 4));
  EXPECT_LE(std::abs(a - b), 1.0) << a << " vs " << b;
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

JobOptions FrozenJob(const std::string& fixture, const std::string& placement) {
  JobOptions opts;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = placement;
  opts.ep.microbatch_tokens = 3;
  opts.ep.deadline = std::chrono::milliseconds(1500);  // slow sanitizer builds stay within it
  opts.threads = 1;
  opts.isa = BestIsa();
  opts.router.health =
      PeerHealthOptions{std::chrono::milliseconds(20), std::chrono::milliseconds(100)};
  opts.router.control = true;
  return opts;
}

// Every expert on both expert ranks (1 and 2) of a 3-rank job.
std::string BothRanksPlacement(const TempDir& tmp, int experts) {
  std::string slots;
  for (int e = 0; e < experts; ++e) {
    slots += fmt::format("{}[1,{}],[2,{}]", slots.empty() ? "" : ",", e, e);
  }
  const std::string path = tmp.File("both.json");
  WriteFile(path, fmt::format("{{\"format\": \"moerun-placement-v1\", \"version\": 1, "
                              "\"num_experts\": {}, \"num_ranks\": 3, \"num_routers\": 1, "
                              "\"layers\": {{\"*\": [{}]}}}}",
                              experts, slots));
  return path;
}

// An expert rank that stops answering: a call that outlives the expert-parallel deadline marks it
// dead and is answered by the replicas, bitwise as before; the rank, once thawed, drains its late
// transfers (their answers are dropped) and gets no more work.
TEST(EpLayerTest, FrozenRankIsDeadAfterTheDeadlineAndReplicasAnswer) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("deepseek_v3") + "/golden.safetensors", "input", &tokens);
  const auto want = ForwardOneProcess("deepseek_v3", x, tokens);
  TempDir tmp;
  const int experts = LoadModelSpec(FixtureDir("deepseek_v3"))->num_experts;
  JobOptions opts = FrozenJob("deepseek_v3", BothRanksPlacement(tmp, experts));
  auto fabric = InprocFabric::Create(3);
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    PeerHealth* health = router.health();
    RouterLayer* l = router.layer(0);
    std::vector<float> out(x.size());
    EXPECT_TRUE(l->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);

    fabric->Freeze(2);
    std::fill(out.begin(), out.end(), 0.0f);
    const auto t0 = SteadyClock::now();
    Status s = l->Forward(x.data(), tokens, out.data());
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_LT(SteadyClock::now() - t0, std::chrono::seconds(5));
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    EXPECT_TRUE(health->dead(2));
    EXPECT_EQ(health->dead_count(), 1);
    EXPECT_GE(l->stats().retried_calls, 1u);
    EXPECT_GE(l->stats().retried_microbatches, 1u);
    health->Poll();  // rank 1's late transfers of the first call have completed
    EXPECT_TRUE(health->all_answering());  // the live ranks answer: the job is ready
    const auto peers = health->Snapshot();
    EXPECT_EQ(peers.size(), 2u);
    EXPECT_TRUE(peers[1].dead);

    fabric->Thaw(2);
    const uint64_t to_two = l->stats().rows_per_rank[2];
    for (int i = 0; i < 3; ++i) {
      std::fill(out.begin(), out.end(), 0.0f);
      EXPECT_TRUE(router.Poll().ok());
      s = l->Forward(x.data(), tokens, out.data());
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    }
    EXPECT_EQ(l->stats().rows_per_rank[2], to_two);  // dead is final: nothing more for rank 2
    EXPECT_TRUE(health->dead(2));
    return Status::Ok();
  };
  const std::vector<Status> results = RunInprocJob(3, opts, work, nullptr, fabric);
  // The dead rank itself may end with an error (the router withdrew what it had posted for it).
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

// A caller's deadline (a client's) never makes a rank late: a call whose deadline has passed
// dispatches nothing; a call with a 1 ms deadline to a rank that answers 300 ms later waits for it
// by the expert-parallel deadline and is answered bitwise, nothing stranded, every rank answering.
TEST(EpLayerTest, ACallersShortDeadlineNeverMakesARankLate) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("deepseek_v3") + "/golden.safetensors", "input", &tokens);
  const auto want = ForwardOneProcess("deepseek_v3", x, tokens);
  TempDir tmp;
  const int experts = LoadModelSpec(FixtureDir("deepseek_v3"))->num_experts;
  JobOptions opts = FrozenJob("deepseek_v3", BothRanksPlacement(tmp, experts));
  auto fabric = InprocFabric::Create(3);
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    PeerHealth* health = router.health();
    RouterLayer* l = router.layer(0);
    std::vector<float> out(x.size());
    const uint64_t sent = l->stats().microbatches;
    Status s = l->Forward(x.data(), tokens, out.data(), SteadyClock::now());
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
    EXPECT_EQ(l->stats().microbatches, sent);  // nothing dispatched past the deadline

    fabric->Freeze(2);
    std::thread thaw([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      fabric->Thaw(2);
    });
    std::fill(out.begin(), out.end(), 0.0f);
    s = l->Forward(x.data(), tokens, out.data(), DeadlineIn(std::chrono::milliseconds(1)));
    thaw.join();
    // Its first microbatch went out before the 1 ms passed; the rest were not dispatched.
    EXPECT_TRUE(s.ok() || s.code() == StatusCode::kDeadlineExceeded) << s.ToString();
    EXPECT_EQ(s.message().find("rank 2"), std::string::npos) << s.ToString();
    EXPECT_EQ(l->stats().retried_calls, 0u);
    health->Poll();
    EXPECT_FALSE(health->dead(2));
    for (const PeerView& v : health->Snapshot()) {
      EXPECT_FALSE(v.stranded) << "rank " << v.rank;
      EXPECT_FALSE(v.dead) << "rank " << v.rank;
    }
    std::fill(out.begin(), out.end(), 0.0f);
    s = l->Forward(x.data(), tokens, out.data(), DeadlineIn(std::chrono::seconds(30)));
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    return Status::Ok();
  };
  const std::vector<Status> results = RunInprocJob(3, opts, work, nullptr, fabric);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

// Without a PeerHealth, a rank that misses the expert-parallel deadline is not dead: its late
// answers land in the layer's own stranded buffers, so the next calls (of another size: a stale
// answer would not fit) are answered bitwise right instead of taking the late ones. The CI once
// failed here with "message of 384 bytes where the receiver expected 640" when the transfers were
// cancelled.
TEST(EpLayerTest, WithoutHealthALateRankStaysInStepForTheNextCalls) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("deepseek_v3") + "/golden.safetensors", "input", &tokens);
  ASSERT_GE(tokens, 4);
  const auto want = ForwardOneProcess("deepseek_v3", x, tokens);
  TempDir tmp;
  const int experts = LoadModelSpec(FixtureDir("deepseek_v3"))->num_experts;
  JobOptions opts = FrozenJob("deepseek_v3", BothRanksPlacement(tmp, experts));
  opts.router.health.reset();
  opts.router.control = false;
  const int64_t hidden = static_cast<int64_t>(x.size()) / tokens;
  auto fabric = InprocFabric::Create(3);
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    EXPECT_EQ(router.health(), nullptr);
    RouterLayer* l = router.layer(0);
    std::vector<float> out(x.size());
    fabric->Freeze(2);
    Status s = l->Forward(x.data(), tokens, out.data());  // past the 1.5 s expert-parallel deadline
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
    fabric->Thaw(2);
    for (int64_t n : {tokens, int64_t{1}, tokens - 1, int64_t{2}}) {
      std::fill(out.begin(), out.end(), 0.0f);
      s = l->Forward(x.data(), n, out.data());
      EXPECT_TRUE(s.ok()) << n << " tokens: " << s.ToString();
      // A token's output does not depend on its batch mates: the first n rows are the golden's.
      EXPECT_EQ(std::memcmp(out.data(), want.data(), static_cast<size_t>(n * hidden) * 4), 0)
          << n << " tokens";
    }
    return Status::Ok();
  };
  const std::vector<Status> results = RunInprocJob(3, opts, work, nullptr, fabric);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

// No replicas: the dead rank's experts have no copy; calls that need them wait (kUnavailable,
// waiting_for_copies) while router 0's recovery loads them on the survivors from the checkpoint;
// then the answers are bitwise the single process's again, from placement v2.
TEST(EpLayerTest, OrphanedExpertsAreReplacedOnTheSurvivors) {
  int64_t tokens = 0;
  const auto x = ReadF32(FixtureDir("qwen3_moe") + "/golden.safetensors", "input", &tokens);
  const auto want = ForwardOneProcess("qwen3_moe", x, tokens);
  JobOptions opts = FrozenJob("qwen3_moe", "round_robin");
  auto fabric = InprocFabric::Create(4);
  const RouterWork work = [&](RouterRank& router) -> Status {
    if (router.rank() != 0) return Status::Ok();
    PeerHealth* health = router.health();
    RouterLayer* l = router.layer(0);
    std::vector<float> out(x.size());
    EXPECT_TRUE(l->Forward(x.data(), tokens, out.data()).ok());
    fabric->Freeze(3);
    Status s = l->Forward(x.data(), tokens, out.data());
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_TRUE(l->waiting_for_copies());
    EXPECT_TRUE(health->dead(3));
    EXPECT_GT(l->orphans(), 0);
    const auto until = SteadyClock::now() + std::chrono::seconds(20);
    while ((l->orphans() > 0 || router.control()->Progress().state != "done") &&
           SteadyClock::now() < until) {
      EXPECT_TRUE(router.Poll().ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(l->orphans(), 0);
    const MigrationView mv = router.control()->Progress();
    EXPECT_EQ(mv.trigger, "recovery");
    EXPECT_EQ(router.control()->placement()->version(), 2u);
    EXPECT_GT(router.control()->experts_replaced(), 0u);
    EXPECT_TRUE(router.control()->placement()->Layer(0)->rank_slots[3].empty());
    std::fill(out.begin(), out.end(), 0.0f);
    s = l->Forward(x.data(), tokens, out.data());
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_FALSE(l->waiting_for_copies());
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    // A placement that uses the dead rank is refused.
    Result<Placement> rr =
        Placement::RoundRobin(router.control()->placement()->num_experts(), 4, 1);
    EXPECT_TRUE(rr.ok());
    EXPECT_EQ(router.control()->Apply(*rr, MigrationOptions{}).status().code(),
              StatusCode::kInvalidArgument);
    fabric->Thaw(3);
    return Status::Ok();
  };
  const std::vector<Status> results = RunInprocJob(4, opts, work, nullptr, fabric);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

}  // namespace
}  // namespace moerun
