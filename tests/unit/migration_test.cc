// Online migration and expert updates inside one process (ranks as threads over the inproc
// transport, the real RouterControl and ExpertRank): the router keeps answering while experts
// move, every answer is bitwise the single-process layer's, the old copies are freed; a canary
// sends its exact share of the expert's rows to the new weights, and a rollback restores the old
// outputs bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/migration/router_control.h"
#include "runtime/model/checkpoint.h"
#include "runtime/ranks/rank_job.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using namespace moerun::testing;

std::vector<float> RandomInput(int64_t tokens, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  for (float& v : x) v = d(rng);
  return x;
}

std::vector<float> SingleProcess(const std::string& fixture, const std::vector<float>& x,
                                 int64_t tokens) {
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(2);
  MoeLayer layer(LoadFixture(fixture, k), k, &pool);
  std::vector<float> out(x.size());
  EXPECT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  return out;
}

// Runs `work` on router 0 of an inproc job with RouterControl; the other routers poll theirs
// until router 0 is done.
void RunJobOn(const WeightSource& source, const std::vector<int>& served, int ranks, int routers,
              const std::string& placement,
              const std::function<void(std::map<int, RouterLayer*>&, RouterControl*)>& work,
              const std::function<void(JobOptions*)>& tweak = nullptr) {
  JobOptions opts;
  opts.routers = routers;
  opts.source = source;
  opts.layers = served;
  opts.placement = placement;
  opts.ep.deadline = std::chrono::milliseconds(20000);
  opts.threads = 1;
  opts.isa = BestIsa();
  opts.router.control = true;
  if (tweak) tweak(&opts);
  std::atomic<bool> finished{false};
  const RouterWork rw = [&](RouterRank& router) -> Status {
    RouterControl* c = router.control();
    if (c == nullptr) return Status::Internal("no RouterControl");
    if (router.rank() == 0) {
      std::map<int, RouterLayer*> layers = router.layers();
      work(layers, c);
      finished = true;
      return Status::Ok();
    }
    while (!finished) {
      MOERUN_RETURN_IF_ERROR(router.Poll());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return Status::Ok();
  };
  const std::vector<Status> results = RunInprocJob(ranks, opts, rw);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)].ToString();
  }
}

void RunJob(const std::string& fixture, int ranks, int routers, const std::string& placement,
            const std::function<void(RouterLayer*, RouterControl*)>& work,
            const std::function<void(JobOptions*)>& tweak = nullptr) {
  WeightSource source;
  source.model = FixtureDir(fixture);
  RunJobOn(
      source, {0}, ranks, routers, placement,
      [&](std::map<int, RouterLayer*>& layers, RouterControl* c) { work(layers.at(0), c); }, tweak);
}

// Every expert moved to another rank, some replicated: linear over ranks [routers, ranks)
// shifted by one rank.
Placement Shifted(int experts, int ranks, int routers, uint64_t version) {
  const int hosts = ranks - routers;
  std::string slots;
  for (int e = 0; e < experts; ++e) {
    const int home = e * hosts / experts;
    const int r = routers + (home + 1) % hosts;
    slots += fmt::format("{}[{},{}]", slots.empty() ? "" : ",", r, e);
    if (e % 4 == 0 && hosts > 1) slots += fmt::format(",[{},{}]", routers + (home + 2) % hosts, e);
  }
  auto p = Placement::FromJson(
      fmt::format("{{\"format\": \"moerun-placement-v1\", \"version\": {}, \"num_experts\": {}, "
                  "\"num_ranks\": {}, \"num_routers\": {}, \"layers\": {{\"*\": [{}]}}}}",
                  version, experts, ranks, routers, slots),
      "test");
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return *p;
}

// Polls (and serves `x` between polls, checking every answer) until the migration ends.
MigrationView ServeThrough(RouterLayer* layer, RouterControl* c, const std::vector<float>& x,
                           int64_t tokens, const std::vector<float>& want, int* batches) {
  std::vector<float> out(x.size());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    EXPECT_TRUE(c->Poll().ok());
    EXPECT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0) << "batch " << *batches;
    ++*batches;
    const MigrationView v = c->Progress();
    if (v.state != "running") return v;
  }
  ADD_FAILURE() << "the migration did not end";
  return c->Progress();
}

class MigrationTest : public ::testing::TestWithParam<int> {};

TEST_P(MigrationTest, ServesBitwiseThroughTheMigration) {
  const int routers = GetParam();
  const std::string fixture = "deepseek_v3";
  const int ranks = routers + 3;
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  const int64_t tokens = 64;
  const auto x = RandomInput(tokens, spec->hidden, 7);
  const auto want = SingleProcess(fixture, x, tokens);
  RunJob(fixture, ranks, routers, "linear", [&](RouterLayer* layer, RouterControl* c) {
    int batches = 0;
    const Placement target = Shifted(spec->num_experts, ranks, routers, 9);
    MigrationOptions o;
    o.expert_bytes = 1;
    auto started = c->Apply(target, o);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    EXPECT_EQ(started->state, "running");
    EXPECT_EQ(started->from_version, 1u);
    EXPECT_EQ(started->to_version, 2u);
    // A second one is refused while the first runs.
    EXPECT_FALSE(c->Apply(target, o).ok());
    const MigrationView v = ServeThrough(layer, c, x, tokens, want, &batches);
    ASSERT_EQ(v.state, "done") << v.error;
    ASSERT_EQ(v.layers.size(), 1u);
    EXPECT_EQ(v.layers[0].state, "done");
    // Every expert moved: each is loaded once more (plus its replica) and each old copy freed.
    EXPECT_EQ(v.layers[0].experts_to_load, spec->num_experts + (spec->num_experts + 3) / 4);
    EXPECT_GT(v.bytes_loaded, 0);
    EXPECT_GT(v.layers[0].bytes_freed, 0);
    EXPECT_GE(batches, 1);
    EXPECT_EQ(layer->placement().version(), 2u);
    EXPECT_TRUE(Placement::SameSlots(*layer->placement().Layer(0), *target.Layer(0)));
    // Served on the new table, still bitwise.
    std::vector<float> out(x.size());
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(c->Poll().ok());
      ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
      EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
    }
    // Back again: the same placement twice is a no-op the second time.
    auto back = c->Apply(*Placement::Linear(spec->num_experts, ranks, routers), o);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(ServeThrough(layer, c, x, tokens, want, &batches).state, "done");
    auto again = c->Apply(*Placement::Linear(spec->num_experts, ranks, routers), o);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->state, "done");
    EXPECT_FALSE(again->note.empty());
  });
}

INSTANTIATE_TEST_SUITE_P(Routers, MigrationTest, ::testing::Values(1, 2),
                         [](const auto& tp) { return fmt::format("routers{}", tp.param); });

// Two layers move one after the other; each switch makes a version, and both keep answering
// exactly as before.
// Expert ranks with an expert cache of 2 experts each (of ~5 hosted): the migration hosts the
// new experts, warms the cache where there is room, evicts the released ones; every answer
// before, during and after is bitwise the single-process layer's.
TEST(MigrationTest, ServesBitwiseThroughTheMigrationWithAnExpertCache) {
  const std::string fixture = "deepseek_v3";
  const int ranks = 4, routers = 1;
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  const int64_t tokens = 16;
  const auto x = RandomInput(tokens, spec->hidden, 11);
  const auto want = SingleProcess(fixture, x, tokens);
  const size_t one = LoadFixture(fixture, KernelsFor(BestIsa()))->experts[0].bytes();
  RunJob(
      fixture, ranks, routers, "linear",
      [&](RouterLayer* layer, RouterControl* c) {
        int batches = 0;
        std::vector<float> out(x.size());
        ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
        EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
        MigrationOptions o;
        o.expert_bytes = 1;
        auto started = c->Apply(Shifted(spec->num_experts, ranks, routers, 9), o);
        ASSERT_TRUE(started.ok()) << started.status().ToString();
        const MigrationView v = ServeThrough(layer, c, x, tokens, want, &batches);
        ASSERT_EQ(v.state, "done") << v.error;
        for (int i = 0; i < 3; ++i) {
          ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
          EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0);
        }
      },
      [&](JobOptions* o) { o->cache.budget_bytes = 2 * one; });
}

TEST(MigrationTest, OneLayerAtATime) {
  ModelSpec spec;
  spec.family = Family::kQwen3Moe;
  spec.hidden = 64, spec.num_layers = 2, spec.num_experts = 8, spec.top_k = 2;
  spec.expert_inter = 32;
  spec.gate.kind = GateKind::kSoftmaxTopK;
  spec.gate.num_experts = spec.num_experts;
  spec.gate.top_k = spec.top_k;
  spec.moe_layers = {0, 1};
  WeightSource source;
  source.spec = spec;
  source.seed = 3;
  const int64_t tokens = 32;
  const auto x = RandomInput(tokens, spec.hidden, 5);
  RunJobOn(source, {0, 1}, 4, 1, "linear",
           [&](std::map<int, RouterLayer*>& layers, RouterControl* c) {
             std::map<int, std::vector<float>> want;
             for (auto& [l, layer] : layers) {
               want[l].resize(x.size());
               ASSERT_TRUE(layer->Forward(x.data(), tokens, want[l].data()).ok());
             }
             MigrationOptions o;
             ASSERT_TRUE(c->Apply(Shifted(spec.num_experts, 4, 1, 2), o).ok());
             std::vector<float> out(x.size());
             std::set<std::string> seen;  // (layer 0 state, layer 1 state) while it runs
             for (int i = 0; i < 100000 && c->Progress().state == "running"; ++i) {
               ASSERT_TRUE(c->Poll().ok());
               const MigrationView v = c->Progress();
               if (v.layers.size() == 2) seen.insert(v.layers[0].state + "/" + v.layers[1].state);
               for (auto& [l, layer] : layers) {
                 ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
                 ASSERT_EQ(std::memcmp(out.data(), want[l].data(), out.size() * 4), 0);
               }
             }
             const MigrationView v = c->Progress();
             ASSERT_EQ(v.state, "done") << v.error;
             EXPECT_EQ(v.to_version, 3u);
             EXPECT_EQ(c->placement()->version(), 3u);
             // Layer 1 never loaded while layer 0 was still loading or switching.
             EXPECT_EQ(seen.count("loading/loading"), 0u);
             EXPECT_EQ(seen.count("switching/loading"), 0u);
             EXPECT_EQ(seen.count("loading/switching"), 0u);
             EXPECT_TRUE(seen.count("done/loading") + seen.count("done/switching") > 0)
                 << "layer 1 was not seen moving after layer 0";
           });
}

TEST(MigrationTest, RefusesPlacementsOfAnotherJob) {
  const std::string fixture = "qwen3_moe";
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  RunJob(fixture, 3, 1, "linear", [&](RouterLayer*, RouterControl* c) {
    MigrationOptions o;
    auto other = c->Apply(*Placement::Linear(spec->num_experts, 4, 1), o);
    EXPECT_FALSE(other.ok());
    EXPECT_NE(other.status().message().find("this job has"), std::string::npos);
    EXPECT_EQ(c->Progress().state, "none");
  });
}

// A file holding expert `from`'s tensors of the fixture under expert `to`'s names.
void WriteExpertAs(const std::string& fixture, int from, int to, const std::string& path) {
  auto ck = Checkpoint::Open(FixtureDir(fixture));
  ASSERT_TRUE(ck.ok());
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const char* part : {"gate_proj", "up_proj", "down_proj"}) {
    auto t = (*ck)->Get(fmt::format("model.layers.0.mlp.experts.{}.{}.weight", from, part));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const size_t n = t->info->end - t->info->begin;
    header[fmt::format("model.layers.0.mlp.experts.{}.{}.weight", to, part)] = {
        {"dtype", DTypeName(t->info->dtype)},
        {"shape", t->info->shape},
        {"data_offsets", {data.size(), data.size() + n}}};
    data.append(reinterpret_cast<const char*>(t->data), n);
  }
  WriteFile(path, MakeSafetensors(header.dump(), data));
}

TEST(ExpertUpdateTest, CanaryShareRollbackAndPromote) {
  const std::string fixture = "qwen3_moe";
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  TempDir tmp;
  const std::string file = tmp.File("expert.safetensors");
  const int expert = 0;
  WriteExpertAs(fixture, 1, expert, file);
  const int64_t tokens = 256;
  const auto x = RandomInput(tokens, spec->hidden, 11);
  const auto want = SingleProcess(fixture, x, tokens);
  RunJob(fixture, 4, 1, "linear", [&](RouterLayer* layer, RouterControl* c) {
    std::vector<float> out(x.size());
    auto poll_until = [&](const std::string& state) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (std::chrono::steady_clock::now() < until) {
        EXPECT_TRUE(c->Poll().ok());
        const auto u = c->Updates();
        if (!u.empty() && u[0].state == state) return u[0];
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ADD_FAILURE() << "the update did not reach " << state;
      return c->Updates().at(0);
    };
    // Bad requests are refused with a reason.
    EXPECT_FALSE(c->Update(0, spec->num_experts, file, 0.1).ok());
    EXPECT_FALSE(c->Update(7, expert, file, 0.1).ok());
    EXPECT_FALSE(c->Update(0, expert, file, 1.5).ok());
    EXPECT_FALSE(c->Act("promote", 0, expert).ok());  // no update yet
    // A file that does not exist fails the update on the ranks, nothing changes.
    ASSERT_TRUE(c->Update(0, expert, tmp.File("missing.safetensors"), 0.1).ok());
    const ExpertUpdateView failed = poll_until("failed");
    EXPECT_NE(failed.error.find("missing.safetensors"), std::string::npos) << failed.error;

    const double share = 0.25;
    auto u = c->Update(0, expert, file, share);
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    EXPECT_EQ(u->state, "loading");
    EXPECT_FALSE(c->Apply(*Placement::RoundRobin(spec->num_experts, 4, 1), {}).ok());
    poll_until("canary");
    bool changed = false;
    uint64_t rows = 0;
    for (int i = 0; i < 400 && rows < 10000; ++i) {
      ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
      changed |= std::memcmp(out.data(), want.data(), want.size() * 4) != 0;
      ASSERT_TRUE(c->Poll().ok());
      rows = c->Updates().at(0).rows;
      if (i % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    }
    EXPECT_TRUE(changed) << "the canary changed no output";
    auto r = c->Act("rollback", 0, expert);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const ExpertUpdateView done = poll_until("rolled back");
    ASSERT_GE(done.rows, 10000u);
    const double measured = static_cast<double>(done.canary_rows) / static_cast<double>(done.rows);
    EXPECT_NEAR(measured, share, 0.01) << done.canary_rows << " of " << done.rows;
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), want.data(), want.size() * 4), 0) << "rollback is not exact";

    // Promoted weights answer every row, and follow the expert when it moves.
    ASSERT_TRUE(c->Update(0, expert, file, 0.0).ok());
    poll_until("canary");
    ASSERT_TRUE(c->Act("promote", 0, expert).ok());
    poll_until("promoted");
    std::vector<float> promoted(x.size());
    ASSERT_TRUE(layer->Forward(x.data(), tokens, promoted.data()).ok());
    EXPECT_NE(std::memcmp(promoted.data(), want.data(), want.size() * 4), 0);
    MigrationOptions o;
    ASSERT_TRUE(c->Apply(Shifted(spec->num_experts, 4, 1, 5), o).ok());
    int batches = 0;
    const MigrationView v = ServeThrough(layer, c, x, tokens, promoted, &batches);
    EXPECT_EQ(v.state, "done") << v.error;
  });
}

}  // namespace
}  // namespace moerun
