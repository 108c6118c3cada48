// The cache replay's pure half (router/replay/cache_sim.h): the steps a rank sees from a
// token-level trace built by hand, the placements, and Belady's optimum against hand cases and an
// exhaustive search of every eviction choice on small random sequences.
#include "router/replay/cache_sim.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <map>
#include <random>

namespace moerun {
namespace {

// A token-level trace: streams[s][l][t] = the top-k experts of token t in layer l.
RoutingTrace HandTrace(int num_experts, int top_k,
                       const std::vector<std::vector<std::vector<std::vector<int32_t>>>>& streams) {
  RoutingTrace t;
  t.source = "hand";
  t.num_experts = num_experts;
  t.top_k = top_k;
  const size_t L = streams.at(0).size();
  t.counts.assign(L, std::vector<double>(static_cast<size_t>(num_experts), 0.0));
  for (size_t l = 0; l < L; ++l) t.layers.push_back(static_cast<int>(l));
  for (size_t s = 0; s < streams.size(); ++s) {
    RoutingTrace::Stream st;
    st.name = "s" + std::to_string(s);
    st.tokens = static_cast<int64_t>(streams[s][0].size());
    st.ids.resize(L);
    for (size_t l = 0; l < L; ++l) {
      for (const auto& tok : streams[s][l]) {
        for (int32_t e : tok) {
          st.ids[l].push_back(e);
          if (e >= 0) t.counts[l][static_cast<size_t>(e)] += 1;
        }
      }
    }
    t.streams.push_back(std::move(st));
  }
  return t;
}

std::vector<CacheStep> Steps(const std::vector<std::pair<int, std::vector<int>>>& s) {
  std::vector<CacheStep> out;
  for (const auto& [layer, experts] : s) out.push_back(CacheStep{layer, experts});
  return out;
}

TEST(CacheSim, LinearHostedSplitsEachLayer) {
  auto h = LinearHosted(2, 8, 3, 1);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  // Rank 1 of 3 over 8 experts: [8/3, 16/3) = [2, 5).
  for (const auto& layer : *h) {
    EXPECT_EQ(layer, (std::vector<char>{0, 0, 1, 1, 1, 0, 0, 0}));
  }
  EXPECT_FALSE(LinearHosted(2, 8, 9, 0).ok());
  EXPECT_FALSE(LinearHosted(2, 8, 2, 2).ok());
  EXPECT_EQ(LinearHosted(2, 8, 2, -1).status().code(), StatusCode::kInvalidArgument);
}

TEST(CacheSim, HostedFromMapsTakesTheRanksSlots) {
  LayerMaps m;
  m.phy2log = {3, 0, 1, 3, 2, 0};  // 6 slots over 2 ranks: rank 0 slots 0-2, rank 1 slots 3-5
  auto h = HostedFromMaps({m}, 4, 2, 1);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ((*h)[0], (std::vector<char>{1, 0, 1, 1}));
  EXPECT_FALSE(HostedFromMaps({m}, 4, 4, 0).ok());  // 6 slots, not a multiple of 4
  m.phy2log[4] = 9;
  EXPECT_FALSE(HostedFromMaps({m}, 4, 2, 1).ok());
}

TEST(CacheSim, StepsAreBatchByBatchLayerByLayerOfTheRanksExperts) {
  // 2 layers, 4 experts, top-2; stream 0 has 3 tokens, stream 1 has 1.
  const RoutingTrace t = HandTrace(
      4, 2, {{{{0, 1}, {1, 2}, {3, 0}}, {{2, 3}, {2, 3}, {-1, -1}}}, {{{2, 3}}, {{0, 3}}}});
  auto all = LinearHosted(2, 4, 1, 0);
  ASSERT_TRUE(all.ok());
  auto steps = RankCacheSteps(t, *all, 2);
  ASSERT_TRUE(steps.ok()) << steps.status().ToString();
  // Stream 0: batch {t0, t1}, then {t2} (its layer 1 record missing); stream 1: its one token.
  const std::vector<CacheStep> want =
      Steps({{0, {0, 1, 2}}, {1, {2, 3}}, {0, {0, 3}}, {0, {2, 3}}, {1, {0, 3}}});
  ASSERT_EQ(steps->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*steps)[i].layer, want[i].layer) << i;
    EXPECT_EQ((*steps)[i].experts, want[i].experts) << i;
  }
  // Rank 1 of 2 hosts experts 2 and 3: layer-0 steps without them are no steps.
  auto half = LinearHosted(2, 4, 2, 1);
  ASSERT_TRUE(half.ok());
  steps = RankCacheSteps(t, *half, 2);
  ASSERT_TRUE(steps.ok());
  const std::vector<CacheStep> want1 =
      Steps({{0, {2}}, {1, {2, 3}}, {0, {3}}, {0, {2, 3}}, {1, {3}}});
  ASSERT_EQ(steps->size(), want1.size());
  for (size_t i = 0; i < want1.size(); ++i) EXPECT_EQ((*steps)[i].experts, want1[i].experts) << i;
  // One batch of everything: a batch never spans two streams.
  steps = RankCacheSteps(t, *all, 1000);
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(steps->size(), 4u);

  EXPECT_EQ(RankCacheSteps(t, *all, 0).status().code(), StatusCode::kInvalidArgument);
  auto wrong = LinearHosted(3, 4, 1, 0);
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(RankCacheSteps(t, *wrong, 2).ok());
  RoutingTrace counts_only;
  counts_only.source = "window.json";
  counts_only.num_experts = 4;
  counts_only.counts.assign(2, std::vector<double>(4, 1.0));
  const auto bad = RankCacheSteps(counts_only, *all, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("window.json"), std::string::npos);
}

TEST(CacheSim, BeladyHandCases) {
  // C = 2: a b c a b. At c, a (next at 3) stays and b (next at 4) goes; a hits, b misses.
  auto c = BeladyCounts(Steps({{0, {0}}, {0, {1}}, {0, {2}}, {0, {0}}, {0, {1}}}), 2);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->needs, 5);
  EXPECT_EQ(c->hits, 1);
  EXPECT_EQ(c->misses, 4);
  EXPECT_EQ(c->compulsory, 3);
  // The furthest next use goes: {a b}, then c evicts b (next at 3), keeping a (next at 2).
  c = BeladyCounts(Steps({{0, {0, 1}}, {1, {2}}, {0, {0}}, {0, {1}}}), 2);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits, 1);
  EXPECT_EQ(c->misses, 4);
  // A step larger than the cache holds all of it, then keeps the soonest used.
  c = BeladyCounts(Steps({{0, {0, 1, 2}}, {0, {2}}, {0, {1}}}), 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits, 1);  // 2 is kept (next at 1), then 1 misses
  EXPECT_EQ(c->misses, 4);
  EXPECT_EQ(c->compulsory, 3);
  // Layers are separate keys.
  c = BeladyCounts(Steps({{0, {1}}, {1, {1}}, {0, {1}}}), 4);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits, 1);
  EXPECT_EQ(c->compulsory, 2);
  EXPECT_FALSE(BeladyCounts({}, 0).ok());
  EXPECT_EQ(DistinctExperts(Steps({{0, {1, 2}}, {1, {1}}, {0, {2}}})), 3);
}

TEST(CacheSim, StaticBestKeepsTheMostNeeded) {
  // Needs: (0,0) x3, (0,1) x1, (1,2) x2. Room for 2: (0,0) and (1,2) stay, 2 + 1 hits.
  const auto steps = Steps({{0, {0, 1}}, {1, {2}}, {0, {0}}, {1, {2}}, {0, {0}}});
  auto c = StaticBestCounts(steps, 2);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->needs, 6);
  EXPECT_EQ(c->hits, 3);
  EXPECT_EQ(c->misses, 3);
  EXPECT_EQ(c->compulsory, 3);
  c = StaticBestCounts(steps, 10);  // room for all: only first uses miss
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->misses, 3);
  // The set ignores that a step's experts are resident together: a step of two experts in a
  // cache of one keeps the fixed expert resident beside the other.
  c = StaticBestCounts(Steps({{0, {0, 1}}, {0, {0, 1}}}), 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits, 1);
  EXPECT_FALSE(StaticBestCounts(steps, 0).ok());
}

// The fewest misses over every choice: between steps any resident set of at most C; during a
// step the step's experts plus kept ones, at most max(C, |step|); after it any subset of those.
int64_t ExhaustiveMinMisses(const std::vector<CacheStep>& steps, int stride, int capacity) {
  std::map<unsigned, int64_t> best{{0u, 0}};
  for (const CacheStep& s : steps) {
    unsigned need = 0;
    for (int e : s.experts) need |= 1u << (s.layer * stride + e);
    const int room = std::max(capacity, std::popcount(need));
    std::map<unsigned, int64_t> next;
    for (const auto& [state, cost] : best) {
      const int64_t c = cost + std::popcount(need & ~state);
      // Every kept subset of the resident set (submask enumeration, the empty one included).
      for (unsigned kept = state;; kept = (kept - 1) & state) {
        const unsigned during = kept | need;
        if (std::popcount(during) <= room) {
          for (unsigned after = during;; after = (after - 1) & during) {
            if (std::popcount(after) <= capacity) {
              auto it = next.find(after);
              if (it == next.end() || c < it->second) next[after] = c;
            }
            if (after == 0) break;
          }
        }
        if (kept == 0) break;
      }
    }
    best.swap(next);
  }
  int64_t m = std::numeric_limits<int64_t>::max();
  for (const auto& [state, cost] : best) m = std::min(m, cost);
  return m;
}

TEST(CacheSim, BeladyEqualsTheExhaustiveOptimum) {
  std::mt19937 rng(39);
  int cases = 0, with_hits = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int layers = 1 + static_cast<int>(rng() % 2);
    const int experts = 2 + static_cast<int>(rng() % 3);  // 2..4 a layer, at most 8 keys
    const int capacity = 1 + static_cast<int>(rng() % 4);
    const int n = 1 + static_cast<int>(rng() % 9);
    std::vector<CacheStep> steps;
    for (int i = 0; i < n; ++i) {
      CacheStep s;
      s.layer = static_cast<int>(rng() % static_cast<unsigned>(layers));
      for (int e = 0; e < experts; ++e) {
        if (rng() % 3 == 0) s.experts.push_back(e);
      }
      if (s.experts.empty()) s.experts.push_back(static_cast<int>(rng() % experts));
      steps.push_back(std::move(s));
    }
    // Keys as the search numbers them need a fixed stride: pad the highest expert's column.
    int stride = 0;
    for (const CacheStep& s : steps) stride = std::max(stride, s.experts.back() + 1);
    const auto c = BeladyCounts(steps, capacity);
    ASSERT_TRUE(c.ok());
    const int64_t want = ExhaustiveMinMisses(steps, stride, capacity);
    ASSERT_EQ(c->misses, want) << "trial " << trial;
    EXPECT_EQ(c->hits + c->misses, c->needs);
    EXPECT_LE(c->compulsory, c->misses);
    ++cases;
    with_hits += c->hits > 0;
  }
  EXPECT_EQ(cases, 400);
  EXPECT_GT(with_hits, 100);  // the cases are not all trivial
}

}  // namespace
}  // namespace moerun
