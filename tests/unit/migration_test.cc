// Online migration and expert updates inside one process (ranks as threads over the inproc
// transport, the real RouterControl and ExpertRank): the router keeps answering while experts
// move, every answer is bitwise the single-process layer's, the old copies are freed. Expert
// updates are checked against the truth, a single-process layer: under a canary every answer is,
// row by row, bitwise that of the layer with the new weights where the canary rule gives the row
// to them and of the old layer elsewhere; promoted, the new layer's; rolled back, the old one's.
// A negative control shows the check fails on an update with one weight slightly off.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "router/gating.h"
#include "runtime/migration/router_control.h"
#include "runtime/model/checkpoint.h"
#include "runtime/model/expert_file.h"
#include "runtime/ranks/rank_job.h"
#include "tests/unit/inproc_job.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using namespace moerun::testing;

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
  const auto x = NormalRows(tokens, spec->hidden, 7);
  const auto want = ForwardOneProcess(fixture, x, tokens);
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
  const auto x = NormalRows(tokens, spec->hidden, 11);
  const auto want = ForwardOneProcess(fixture, x, tokens);
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
  const auto x = NormalRows(tokens, spec.hidden, 5);
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

// A file holding expert `from`'s tensors of the fixture under expert `to`'s names; with
// `ulps_off` > 0, the first element of down_proj is that many F32 ulps larger in magnitude (its
// bits
// + ulps_off).
void WriteExpertAs(const std::string& fixture, int from, int to, const std::string& path,
                   uint32_t ulps_off = 0) {
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
    const size_t at = data.size();
    data.append(reinterpret_cast<const char*>(t->data), n);
    if (ulps_off > 0 && std::string(part) == "down_proj") {
      ASSERT_EQ(t->info->dtype, DType::kF32) << "the fixture's experts are F32";
      uint32_t bits;
      std::memcpy(&bits, data.data() + at, 4);
      bits += ulps_off;
      std::memcpy(data.data() + at, &bits, 4);
    }
  }
  WriteFile(path, MakeSafetensors(header.dump(), data));
}

// The fixture's layer, mutable (LoadFixture's is shared and const).
MoeLayerWeights LoadFixtureLayer(const std::string& fixture, const CpuKernels& k) {
  const std::string dir = FixtureDir(fixture);
  auto spec = LoadModelSpec(dir);
  auto ck = Checkpoint::Open(dir);
  if (!spec.ok() || !ck.ok()) throw std::runtime_error("cannot open fixture " + fixture);
  auto w = LoadLayer(**ck, *spec, k, LoadOptions{});
  if (!w.ok()) throw std::runtime_error(w.status().ToString());
  return std::move(w).value();
}

// The fixture's layer with expert `to` holding expert `from`'s weights: the truth for the update
// file WriteExpertAs(fixture, from, to) writes, built from the checkpoint, not from that file.
MoeLayerWeights FixtureWithExpertAs(const std::string& fixture, int from, int to,
                                    const CpuKernels& k) {
  MoeLayerWeights w = LoadFixtureLayer(fixture, k);
  MoeLayerWeights donor = LoadFixtureLayer(fixture, k);
  w.experts[static_cast<size_t>(to)] = std::move(donor.experts[static_cast<size_t>(from)]);
  return w;
}

std::vector<float> ForwardOf(MoeLayerWeights w, const std::vector<float>& x, int64_t tokens) {
  const CpuKernels& k = KernelsFor(BestIsa());
  ThreadPool pool(2);
  MoeLayer layer(std::make_shared<const MoeLayerWeights>(std::move(w)), k, &pool);
  std::vector<float> out(x.size());
  EXPECT_TRUE(layer.Forward(x.data(), tokens, out.data()).ok());
  return out;
}

// The tokens of `x` whose top-k holds `expert`, in token order: the order of the expert's rows in
// the batch's (one) microbatch, grouped by (expert, token, slot).
std::vector<int64_t> TokensOfExpert(const MoeLayerWeights& w, const std::vector<float>& x,
                                    int64_t tokens, int expert) {
  ThreadPool pool(1);
  Gating gating(w.Gate(), KernelsFor(BestIsa()), &pool);
  gating.Run(x.data(), tokens);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int s = 0; s < w.spec.top_k; ++s) {
      if (gating.ids()[static_cast<size_t>(t * w.spec.top_k + s)] == expert) out.push_back(t);
    }
  }
  return out;
}

// The canary rule, written from its contract (runtime/migration/expert_control.h): after any
// number n of the expert's rows, floor(n * share) of them went to the new weights; so row j of the
// expert's stream (0-based, counted from the update's start) is a canary row exactly when
// floor((j + 1) * share) > floor(j * share).
bool IsCanaryRow(uint64_t j, double share) {
  return std::floor(static_cast<double>(j + 1) * share) >
         std::floor(static_cast<double>(j) * share);
}

// Which rows of one batch the canary takes: the batch is the `batch`-th (0-based) since the update
// started, every batch the same input, so the expert's rows of earlier batches are batch * m.
std::vector<bool> CanaryTokensOfBatch(const std::vector<int64_t>& expert_tokens, int64_t tokens,
                                      uint64_t batch, double share) {
  std::vector<bool> take(static_cast<size_t>(tokens), false);
  const uint64_t m = expert_tokens.size();
  for (uint64_t i = 0; i < m; ++i) {
    take[static_cast<size_t>(expert_tokens[i])] = IsCanaryRow(batch * m + i, share);
  }
  return take;
}

// The check against the truth: "" when row t of `got` is bitwise row t of `with_new` where
// new_rows[t] and of `with_old` elsewhere; else the first row and element that differ, with the
// values and their bits.
std::string CompareWithTruth(const std::vector<float>& got, const std::vector<float>& with_old,
                             const std::vector<float>& with_new, const std::vector<bool>& new_rows,
                             int64_t hidden) {
  if (got.size() != with_old.size() || got.size() != with_new.size() ||
      got.size() != new_rows.size() * static_cast<size_t>(hidden)) {
    return fmt::format("sizes differ: got {}, old {}, new {}, {} rows of {}", got.size(),
                       with_old.size(), with_new.size(), new_rows.size(), hidden);
  }
  for (size_t t = 0; t < new_rows.size(); ++t) {
    const std::vector<float>& want = new_rows[t] ? with_new : with_old;
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t i = t * static_cast<size_t>(hidden) + static_cast<size_t>(h);
      uint32_t a, b;
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &want[i], 4);
      if (a != b) {
        return fmt::format(
            "row {} ({} weights) element {}: got {:.9g} (0x{:08x}), want {:.9g} "
            "(0x{:08x})",
            t, new_rows[t] ? "new" : "old", h, got[i], a, want[i], b);
      }
    }
  }
  return "";
}

std::vector<bool> AllRows(int64_t tokens, bool value) {
  return std::vector<bool>(static_cast<size_t>(tokens), value);
}

// The check itself on made-up rows: equal passes, one bit off in either half fails, and a row
// taken from the wrong layer fails.
TEST(ExpertUpdateTest, TruthCheckFailsOnOneBit) {
  const int64_t tokens = 3, hidden = 4;
  std::vector<float> old_out = RandomRows(tokens, hidden, 1);
  std::vector<float> new_out = RandomRows(tokens, hidden, 2);
  const std::vector<bool> take = {false, true, false};
  std::vector<float> got = old_out;
  std::copy(new_out.begin() + hidden, new_out.begin() + 2 * hidden, got.begin() + hidden);
  EXPECT_EQ(CompareWithTruth(got, old_out, new_out, take, hidden), "");
  for (size_t i : {size_t{2}, size_t{5}}) {
    std::vector<float> bad = got;
    uint32_t bits;
    std::memcpy(&bits, &bad[i], 4);
    bits ^= 1u;
    std::memcpy(&bad[i], &bits, 4);
    const std::string why = CompareWithTruth(bad, old_out, new_out, take, hidden);
    EXPECT_NE(why.find(fmt::format("element {}", i % hidden)), std::string::npos) << why;
  }
  EXPECT_NE(CompareWithTruth(got, old_out, new_out, AllRows(tokens, false), hidden), "");
  EXPECT_NE(CompareWithTruth(old_out, old_out, new_out, take, hidden), "");
}

// Polls `c` until update 0 reaches `state` (30 s at most).
ExpertUpdateView PollUntil(RouterControl* c, const std::string& state) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < until) {
    EXPECT_TRUE(c->Poll().ok());
    const auto u = c->Updates();
    if (!u.empty() && u[0].state == state) return u[0];
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ADD_FAILURE() << "the update did not reach " << state;
  return c->Updates().at(0);
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
  const auto x = NormalRows(tokens, spec->hidden, 11);
  // The truth: one process with the old weights, one with expert 1's weights as expert 0.
  const CpuKernels& k = KernelsFor(BestIsa());
  const auto want = ForwardOneProcess(fixture, x, tokens);
  const auto want_new = ForwardOf(FixtureWithExpertAs(fixture, 1, expert, k), x, tokens);
  const std::vector<int64_t> mine = TokensOfExpert(*LoadFixture(fixture, k), x, tokens, expert);
  ASSERT_FALSE(mine.empty());
  // The new weights change every row of the expert (else the check could not tell them apart)
  // and no other row.
  {
    std::vector<bool> changes = AllRows(tokens, false);
    for (int64_t t : mine) changes[static_cast<size_t>(t)] = true;
    for (int64_t t = 0; t < tokens; ++t) {
      const size_t at = static_cast<size_t>(t * spec->hidden);
      EXPECT_EQ(std::memcmp(want.data() + at, want_new.data() + at, spec->hidden * 4) != 0,
                changes[static_cast<size_t>(t)])
          << "token " << t;
    }
  }
  RunJob(fixture, 4, 1, "linear", [&](RouterLayer* layer, RouterControl* c) {
    std::vector<float> out(x.size());
    // Bad requests are refused with a reason.
    EXPECT_FALSE(c->Update(0, spec->num_experts, file, 0.1).ok());
    EXPECT_FALSE(c->Update(7, expert, file, 0.1).ok());
    EXPECT_FALSE(c->Update(0, expert, file, 1.5).ok());
    EXPECT_FALSE(c->Act("promote", 0, expert).ok());  // no update yet
    // A file that does not exist fails the update on the ranks, nothing changes.
    ASSERT_TRUE(c->Update(0, expert, tmp.File("missing.safetensors"), 0.1).ok());
    const ExpertUpdateView failed = PollUntil(c, "failed");
    EXPECT_NE(failed.error.find("missing.safetensors"), std::string::npos) << failed.error;
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(CompareWithTruth(out, want, want_new, AllRows(tokens, false), spec->hidden), "");

    const double share = 0.25;
    auto u = c->Update(0, expert, file, share);
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    EXPECT_EQ(u->state, "loading");
    EXPECT_FALSE(c->Apply(*Placement::RoundRobin(spec->num_experts, 4, 1), {}).ok());
    PollUntil(c, "canary");
    // Every answer under the canary, row by row: the new layer's on the canary's rows, the old
    // layer's on the others. The expert lives on one rank (linear, no replica), so its rows form
    // one stream counted from the update's start.
    uint64_t batches = 0, canary_rows = 0;
    for (int i = 0; i < 400 && batches * mine.size() < 10000; ++i) {
      ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
      const std::vector<bool> take = CanaryTokensOfBatch(mine, tokens, batches, share);
      for (bool b : take) canary_rows += b ? 1 : 0;
      ASSERT_EQ(CompareWithTruth(out, want, want_new, take, spec->hidden), "")
          << "canary batch " << batches;
      ++batches;
      ASSERT_TRUE(c->Poll().ok());
      if (i % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    }
    EXPECT_GT(canary_rows, 0u) << "the canary took no row: nothing was checked against new weights";
    auto r = c->Act("rollback", 0, expert);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const ExpertUpdateView done = PollUntil(c, "rolled back");
    // The rank's counts (in its reply to the rollback, after every batch) are the truth's.
    EXPECT_EQ(done.rows, batches * mine.size());
    EXPECT_EQ(done.canary_rows, canary_rows);
    EXPECT_EQ(done.canary_rows,
              static_cast<uint64_t>(std::floor(static_cast<double>(done.rows) * share)));
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(CompareWithTruth(out, want, want_new, AllRows(tokens, false), spec->hidden), "")
        << "rollback is not exact";

    // Promoted weights answer every row, and follow the expert when it moves (a replica of
    // expert 0 included: Shifted replicates every fourth expert).
    ASSERT_TRUE(c->Update(0, expert, file, 0.0).ok());
    PollUntil(c, "canary");
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(CompareWithTruth(out, want, want_new, AllRows(tokens, false), spec->hidden), "")
        << "a 0% canary changed answers";
    ASSERT_TRUE(c->Act("promote", 0, expert).ok());
    PollUntil(c, "promoted");
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(CompareWithTruth(out, want, want_new, AllRows(tokens, true), spec->hidden), "")
        << "promoted answers are not the new layer's";
    MigrationOptions o;
    ASSERT_TRUE(c->Apply(Shifted(spec->num_experts, 4, 1, 5), o).ok());
    int moved = 0;
    const MigrationView v = ServeThrough(layer, c, x, tokens, want_new, &moved);
    EXPECT_EQ(v.state, "done") << v.error;
  });
}

// The negative control: in the update file one weight of the new expert is off by 2^-12 of its
// value (2048 F32 ulps; a single ulp of this weight is lost in the outputs' rounding: measured,
// not one output bit of these 256 tokens moved), the truth is the layer with the right weights.
// The same check must report a mismatch, in every canary batch and once promoted; the answers
// are bitwise those of the weights the file holds (so nothing else differs).
TEST(ExpertUpdateTest, TruthCheckCatchesAnUpdateOneWeightOff) {
  const std::string fixture = "qwen3_moe";
  const auto spec = LoadModelSpec(FixtureDir(fixture));
  ASSERT_TRUE(spec.ok());
  TempDir tmp;
  const std::string file = tmp.File("expert_off.safetensors");
  const int expert = 0;
  WriteExpertAs(fixture, 1, expert, file, /*ulps_off=*/2048);
  const int64_t tokens = 256;
  const auto x = NormalRows(tokens, spec->hidden, 11);
  const CpuKernels& k = KernelsFor(BestIsa());
  const auto want = ForwardOneProcess(fixture, x, tokens);
  const auto want_new = ForwardOf(FixtureWithExpertAs(fixture, 1, expert, k), x, tokens);
  // What the ranks actually hold: the file's (one weight off) expert, loaded as they load it.
  MoeLayerWeights off = LoadFixtureLayer(fixture, k);
  auto off_expert = LoadExpertFile(file, off.spec, off.layer, expert, off.dtype, k);
  ASSERT_TRUE(off_expert.ok()) << off_expert.status().ToString();
  off.experts[static_cast<size_t>(expert)] = std::move(off_expert).value();
  const auto want_off = ForwardOf(std::move(off), x, tokens);
  const std::vector<int64_t> mine = TokensOfExpert(*LoadFixture(fixture, k), x, tokens, expert);
  ASSERT_FALSE(mine.empty());
  const double share = 0.5;
  RunJob(fixture, 4, 1, "linear", [&](RouterLayer* layer, RouterControl* c) {
    std::vector<float> out(x.size());
    ASSERT_TRUE(c->Update(0, expert, file, share).ok());
    PollUntil(c, "canary");
    int caught = 0;
    for (uint64_t b = 0; b < 4; ++b) {
      ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
      const std::vector<bool> take = CanaryTokensOfBatch(mine, tokens, b, share);
      EXPECT_EQ(CompareWithTruth(out, want, want_off, take, spec->hidden), "");
      const std::string why = CompareWithTruth(out, want, want_new, take, spec->hidden);
      if (!why.empty()) {
        ++caught;
        std::printf("negative control (canary batch %d): %s\n", static_cast<int>(b), why.c_str());
      }
    }
    EXPECT_EQ(caught, 4) << "the check passed an update with one weight off";
    ASSERT_TRUE(c->Act("promote", 0, expert).ok());
    PollUntil(c, "promoted");
    ASSERT_TRUE(layer->Forward(x.data(), tokens, out.data()).ok());
    EXPECT_EQ(CompareWithTruth(out, want, want_off, AllRows(tokens, true), spec->hidden), "");
    const std::string why =
        CompareWithTruth(out, want, want_new, AllRows(tokens, true), spec->hidden);
    EXPECT_NE(why, "") << "the check passed promoted weights with one weight off";
    std::printf("negative control (promoted): %s\n", why.c_str());
  });
}

// A transport for one router rank's RouterControl alone: sends complete at once and are kept
// (tag, peer, bytes), receives never complete, and the ranks in `failed` are gone.
class TakeoverTransport : public Transport {
 public:
  TakeoverTransport(int rank, int size) : rank_(rank), size_(size) {}
  const char* name() const override { return "takeover-test"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override {
    sent.push_back({peer, tag, std::string(static_cast<const char*>(buf), bytes)});
    return Request{next_++, peer};
  }
  Result<Request> Irecv(int peer, int, void*, size_t) override {
    recvs_.insert(next_);
    return Request{next_++, peer};
  }
  Result<bool> Test(Request r) override { return recvs_.count(r.id) == 0; }
  Status Cancel(Request) override { return Status::Ok(); }
  bool peer_failed(int peer) const override { return failed.count(peer) != 0; }
  [[noreturn]] void Abort(int code) override { std::exit(code); }

  struct Sent {
    int peer, tag;
    std::string bytes;
  };
  std::vector<Sent> sent;
  std::set<int> failed;

  // The JSON bodies sent to `peer` (control bodies to routers, kTagRows bodies to expert ranks).
  std::vector<nlohmann::json> Bodies(int peer) const {
    std::vector<nlohmann::json> out;
    for (const Sent& s : sent) {
      if (s.peer == peer && (s.tag == kTagControlBody || s.tag == kTagRows)) {
        out.push_back(nlohmann::json::parse(s.bytes));
      }
    }
    return out;
  }

 private:
  int rank_, size_;
  std::set<uint64_t> recvs_;
  uint64_t next_ = 1;
};

// Router 0 dies: router 1, the lowest live router, coordinates from its next Poll. With no
// other live router it has every live expert rank release, for all routers, each copy its
// placement does not hold there; with router 2 alive, router 2 is told to switch to router 1's
// placement first and the releases wait for its answer.
TEST(RouterControlTakeoverTest, LowestLiveRouterTakesOverAndReleasesWhatItsPlacementDoesNotUse) {
  for (const int routers : {2, 3}) {
    SCOPED_TRACE("routers " + std::to_string(routers));
    const int ranks = routers + 2;  // expert ranks a, b
    const int a = routers, b = routers + 1;
    TakeoverTransport t(1, ranks);
    auto placement = std::make_shared<const Placement>(*Placement::Linear(8, ranks, routers));
    RouterControl c(&t, placement, {{0, nullptr}}, sizeof(EpHeaderFixed) + 64,
                    std::chrono::milliseconds(60000));
    ASSERT_TRUE(c.Poll().ok());
    EXPECT_EQ(c.coordinator(), 0);
    EXPECT_TRUE(t.Bodies(a).empty() && t.Bodies(b).empty());  // router 0 coordinates

    t.failed.insert(0);
    EXPECT_EQ(c.coordinator(), 1);
    ASSERT_TRUE(c.Poll().ok());
    ASSERT_TRUE(c.Poll().ok());  // once only
    if (routers == 3) {
      const auto to2 = t.Bodies(2);
      ASSERT_EQ(to2.size(), 1u);
      EXPECT_EQ(to2[0]["op"], "switch");
      EXPECT_EQ(to2[0]["layer"], 0);
      EXPECT_EQ(to2[0]["placement"], placement->ToJson());
      // Router 2 has not answered: nothing is released yet.
      EXPECT_TRUE(t.Bodies(a).empty() && t.Bodies(b).empty());
      continue;
    }
    // Linear: experts 0-3 on rank a, 4-7 on rank b; each releases the others, for all routers.
    for (const auto& [rank, unused] :
         {std::pair<int, std::vector<int>>{a, {4, 5, 6, 7}}, {b, {0, 1, 2, 3}}}) {
      const auto bodies = t.Bodies(rank);
      ASSERT_EQ(bodies.size(), 1u) << "rank " << rank;
      EXPECT_EQ(bodies[0]["op"], "release");
      EXPECT_EQ(bodies[0]["layer"], 0);
      EXPECT_EQ(bodies[0]["all_routers"], true);
      EXPECT_EQ(bodies[0]["experts"].get<std::vector<int>>(), unused) << "rank " << rank;
    }
  }
}

}  // namespace
}  // namespace moerun
