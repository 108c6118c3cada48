#include "router/dispatch_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "router/placement.h"

namespace moerun {
namespace {

Placement MustParse(const std::string& text) {
  Result<Placement> p = Placement::FromJson(text, "test.json");
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

// Expert 0 on ranks 1 and 2 (slots 0 and 1), expert 1 on rank 1, expert 2 on rank 3.
const char* kReplicated = R"({"format": "moerun-placement-v1", "version": 1, "num_experts": 3,
  "num_ranks": 4, "num_routers": 1, "layers": {"*": [[1, 0], [2, 0], [1, 1], [3, 2]]}})";
// The same, but expert 0's first slot is on rank 2: ties go to the first slot, not the lower rank.
const char* kReplicatedSwapped = R"({"format": "moerun-placement-v1", "version": 1,
  "num_experts": 3, "num_ranks": 4, "num_routers": 1,
  "layers": {"*": [[2, 0], [1, 0], [1, 1], [3, 2]]}})";

// The slot that carries each row, from the plan's layout (rank by rank, slot by slot).
std::vector<int> RowSlots(const DispatchPlan& plan, const LayerPlacement& lp) {
  std::vector<int> row_slot(static_cast<size_t>(plan.rank_offset.back()), -1);
  for (int d = 0; d < plan.num_ranks; ++d) {
    int64_t row = plan.rank_offset[static_cast<size_t>(d)];
    for (int s : lp.rank_slots[static_cast<size_t>(d)]) {
      for (int32_t j = 0; j < plan.slot_rows[static_cast<size_t>(s)]; ++j) {
        row_slot[static_cast<size_t>(row++)] = s;
      }
    }
    EXPECT_EQ(row, plan.rank_offset[static_cast<size_t>(d) + 1]) << "rank " << d;
  }
  return row_slot;
}

// Every documented property of a plan; returns the slot chosen for each (token, k).
std::vector<int> CheckPlan(const DispatchPlan& plan, const std::vector<int32_t>& ids,
                           int64_t tokens, int k, const LayerPlacement& lp) {
  const size_t n = static_cast<size_t>(tokens * k);
  const int ranks = static_cast<int>(lp.rank_slots.size());
  EXPECT_EQ(plan.num_ranks, ranks);
  EXPECT_EQ(plan.rank_offset.size(), static_cast<size_t>(ranks) + 1);
  EXPECT_EQ(plan.slot_rows.size(), lp.slots.size());
  EXPECT_EQ(plan.row_token.size(), n);
  EXPECT_EQ(plan.assignment_row.size(), n);
  if (::testing::Test::HasFailure()) return {};
  // Contiguous blocks, one per rank, covering every row.
  EXPECT_EQ(plan.rank_offset[0], 0);
  EXPECT_EQ(plan.rank_offset[static_cast<size_t>(ranks)], static_cast<int64_t>(n));
  for (int d = 0; d < ranks; ++d) {
    EXPECT_LE(plan.rank_offset[static_cast<size_t>(d)],
              plan.rank_offset[static_cast<size_t>(d) + 1]);
    int64_t rows = 0;
    for (int s : lp.rank_slots[static_cast<size_t>(d)])
      rows += plan.slot_rows[static_cast<size_t>(s)];
    EXPECT_EQ(plan.rows_to(d), rows) << "rank " << d << ": rows_to is the sum of its slots' rows";
  }
  const std::vector<int> row_slot = RowSlots(plan, lp);
  // Each assignment has one row; the row carries its token; the row's slot hosts its expert.
  std::vector<int> chosen(n, -1);
  std::vector<int> uses(n, 0);
  std::vector<int64_t> last_row_of_slot(lp.slots.size(), -1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = plan.assignment_row[i];
    if (r < 0 || r >= static_cast<int64_t>(n)) {
      ADD_FAILURE() << "assignment " << i << " points at row " << r << " of " << n;
      continue;
    }
    ++uses[static_cast<size_t>(r)];
    EXPECT_EQ(plan.row_token[static_cast<size_t>(r)],
              static_cast<int32_t>(i / static_cast<size_t>(k)))
        << "assignment " << i;
    const int s = row_slot[static_cast<size_t>(r)];
    if (s < 0) {
      ADD_FAILURE() << "row " << r << " lies in no slot's block";
      continue;
    }
    chosen[i] = s;
    EXPECT_EQ(lp.slots[static_cast<size_t>(s)].expert, ids[i]) << "assignment " << i;
    // Within a slot, rows follow (token, k) order.
    EXPECT_GT(r, last_row_of_slot[static_cast<size_t>(s)])
        << "assignment " << i << " in slot " << s;
    last_row_of_slot[static_cast<size_t>(s)] = r;
  }
  EXPECT_EQ(uses, std::vector<int>(n, 1)) << "assignment_row is a permutation of the rows";
  return chosen;
}

// The documented replica choice, written out plainly: least loaded rank, ties to the first slot.
std::vector<int> ReferenceChoice(const std::vector<int32_t>& ids, const LayerPlacement& lp,
                                 std::vector<double> load) {
  std::vector<int> chosen;
  for (int32_t e : ids) {
    int best = -1;
    for (int s : lp.replicas[static_cast<size_t>(e)]) {
      const int r = lp.slots[static_cast<size_t>(s)].rank;
      if (best < 0 || load[static_cast<size_t>(r)] <
                          load[static_cast<size_t>(lp.slots[static_cast<size_t>(best)].rank)]) {
        best = s;
      }
    }
    chosen.push_back(best);
    load[static_cast<size_t>(lp.slots[static_cast<size_t>(best)].rank)] += 1.0;
  }
  return chosen;
}

TEST(DispatchPlanTest, ExactRowsPerRankAndSlot) {
  const Result<Placement> p = Placement::Linear(8, 3, 1);  // rank 1: experts 0-3, rank 2: 4-7
  ASSERT_TRUE(p.ok());
  const LayerPlacement& lp = *p->Layer(0);
  const std::vector<int32_t> ids = {0, 5, 3, 0, 7, 4, 0, 1};  // 4 tokens, k = 2
  std::vector<double> load(3, 0.0);
  DispatchPlan plan;
  plan.Build(ids.data(), 4, 2, lp, load);
  EXPECT_EQ(plan.slot_rows, (std::vector<int32_t>{3, 1, 0, 1, 1, 1, 0, 1}));
  EXPECT_EQ(plan.rank_offset, (std::vector<int64_t>{0, 0, 5, 8}));
  EXPECT_EQ(plan.rows_to(0), 0);
  EXPECT_EQ(plan.rows_to(1), 5);
  EXPECT_EQ(plan.rows_to(2), 3);
  // Rank 1: slot 0 (tokens 0, 1, 3), slot 1 (token 3), slot 3 (token 1); rank 2: slot 4 (token
  // 2), slot 5 (token 0), slot 7 (token 2).
  EXPECT_EQ(plan.row_token, (std::vector<int32_t>{0, 1, 3, 3, 1, 2, 0, 2}));
  EXPECT_EQ(plan.assignment_row, (std::vector<int64_t>{0, 6, 4, 1, 7, 5, 2, 3}));
  EXPECT_EQ(load, (std::vector<double>{0, 5, 3}));
  CheckPlan(plan, ids, 4, 2, lp);
}

TEST(DispatchPlanTest, RankWithoutChosenExpertsGetsNoRows) {
  const Result<Placement> p = Placement::Linear(8, 5, 1);  // ranks 1..4, two experts each
  ASSERT_TRUE(p.ok());
  const LayerPlacement& lp = *p->Layer(0);
  const std::vector<int32_t> ids = {0, 7, 1, 6, 7, 0};  // only ranks 1 and 4
  std::vector<double> load(5, 0.0);
  DispatchPlan plan;
  plan.Build(ids.data(), 3, 2, lp, load);
  CheckPlan(plan, ids, 3, 2, lp);
  EXPECT_EQ(plan.rows_to(0), 0) << "the router";
  EXPECT_EQ(plan.rows_to(1), 3);
  EXPECT_EQ(plan.rows_to(2), 0);
  EXPECT_EQ(plan.rows_to(3), 0);
  EXPECT_EQ(plan.rows_to(4), 3);
  EXPECT_EQ(plan.rank_offset, (std::vector<int64_t>{0, 0, 3, 3, 3, 6}));
  // No tokens at all: every rank gets nothing.
  plan.Build(ids.data(), 0, 2, lp, load);
  EXPECT_EQ(plan.rank_offset, std::vector<int64_t>(6, 0));
  EXPECT_EQ(plan.slot_rows, std::vector<int32_t>(8, 0));
  EXPECT_TRUE(plan.row_token.empty());
  EXPECT_TRUE(plan.assignment_row.empty());
}

TEST(DispatchPlanTest, ReplicaChoiceAvoidsTheLoadedRank) {
  const Placement p = MustParse(kReplicated);
  const LayerPlacement& lp = *p.Layer(0);
  // Rank 1 already carries 5 rows: expert 0's next tokens go to its replica on rank 2, until
  // rank 2 has caught up (a tie goes to the first slot, on rank 1).
  std::vector<double> load = {0, 5, 0, 0};
  const std::vector<int32_t> ids(7, 0);
  DispatchPlan plan;
  plan.Build(ids.data(), 7, 1, lp, load);
  const std::vector<int> chosen = CheckPlan(plan, ids, 7, 1, lp);
  EXPECT_EQ(chosen, (std::vector<int>{1, 1, 1, 1, 1, 0, 1}));
  EXPECT_EQ(plan.slot_rows, (std::vector<int32_t>{1, 6, 0, 0}));
  EXPECT_EQ(plan.rows_to(1), 1);
  EXPECT_EQ(plan.rows_to(2), 6);
  EXPECT_EQ(load, (std::vector<double>{0, 6, 6, 0})) << "the planned rows are added to the load";

  // Only four new tokens: all of them avoid rank 1.
  std::vector<double> load2 = {0, 5, 0, 0};
  plan.Build(ids.data(), 4, 1, lp, load2);
  EXPECT_EQ(plan.rows_to(1), 0);
  EXPECT_EQ(plan.rows_to(2), 4);
  EXPECT_EQ(plan.row_token, (std::vector<int32_t>{0, 1, 2, 3}));

  // Fractional loads compare as given.
  std::vector<double> load3 = {0, 0.5, 0.25, 0};
  plan.Build(ids.data(), 1, 1, lp, load3);
  EXPECT_EQ(plan.rows_to(2), 1);
}

TEST(DispatchPlanTest, ReplicasAlternateAsLoadAccumulates) {
  const Placement p = MustParse(kReplicated);
  const LayerPlacement& lp = *p.Layer(0);
  std::vector<double> load(4, 0.0);
  const std::vector<int32_t> ids(6, 0);
  DispatchPlan plan;
  plan.Build(ids.data(), 6, 1, lp, load);
  const std::vector<int> chosen = CheckPlan(plan, ids, 6, 1, lp);
  EXPECT_EQ(chosen, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(plan.rank_offset, (std::vector<int64_t>{0, 0, 3, 6, 6}));
  EXPECT_EQ(plan.row_token, (std::vector<int32_t>{0, 2, 4, 1, 3, 5}));
  EXPECT_EQ(plan.assignment_row, (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));

  // Another expert's rows count as load too: expert 1 lives on rank 1 only.
  std::vector<double> load2(4, 0.0);
  const std::vector<int32_t> mixed = {0, 1, 0, 1, 0, 1, 0, 1};  // 4 tokens, k = 2
  plan.Build(mixed.data(), 4, 2, lp, load2);
  const std::vector<int> chosen2 = CheckPlan(plan, mixed, 4, 2, lp);
  EXPECT_EQ(chosen2, (std::vector<int>{0, 2, 1, 2, 1, 2, 1, 2}));
  EXPECT_EQ(load2, (std::vector<double>{0, 5, 3, 0}));
}

TEST(DispatchPlanTest, TiesGoToTheFirstSlot) {
  for (const char* text : {kReplicated, kReplicatedSwapped}) {
    const Placement p = MustParse(text);
    const LayerPlacement& lp = *p.Layer(0);
    const int first_rank = lp.slots[static_cast<size_t>(lp.replicas[0][0])].rank;
    for (const std::vector<double>& start :
         {std::vector<double>{0, 0, 0, 0}, std::vector<double>{9, 3, 3, 1}}) {
      std::vector<double> load = start;
      const int32_t id = 0;
      DispatchPlan plan;
      plan.Build(&id, 1, 1, lp, load);
      EXPECT_EQ(plan.rows_to(first_rank), 1) << "expert 0's first slot is on rank " << first_rank;
      EXPECT_EQ(plan.slot_rows[static_cast<size_t>(lp.replicas[0][0])], 1);
    }
  }
}

// Random placements with replicas, random loads and ids: every property, and the choice of the
// plainly written reference.
TEST(DispatchPlanTest, RandomPlansKeepEveryProperty) {
  std::mt19937 rng(20240611);
  for (int trial = 0; trial < 200; ++trial) {
    const int ranks = 2 + static_cast<int>(rng() % 7);
    const int routers = 1 + static_cast<int>(rng() % static_cast<unsigned>(ranks - 1));
    const int experts = 1 + static_cast<int>(rng() % 24);
    const int hosts = ranks - routers;
    std::string slots;
    for (int e = 0; e < experts; ++e) {
      std::vector<int> rs(static_cast<size_t>(hosts));
      std::iota(rs.begin(), rs.end(), routers);
      std::shuffle(rs.begin(), rs.end(), rng);
      const int copies = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(hosts, 3)));
      for (int c = 0; c < copies; ++c) {
        slots += (slots.empty() ? "" : ", ") + std::string("[") +
                 std::to_string(rs[static_cast<size_t>(c)]) + ", " + std::to_string(e) + "]";
      }
    }
    const std::string text = R"({"format": "moerun-placement-v1", "version": 1, "num_experts": )" +
                             std::to_string(experts) + ", \"num_ranks\": " + std::to_string(ranks) +
                             ", \"num_routers\": " + std::to_string(routers) +
                             ", \"layers\": {\"*\": [" + slots + "]}}";
    const Placement p = MustParse(text);
    if (::testing::Test::HasFailure()) return;
    const LayerPlacement& lp = *p.Layer(0);
    const int64_t tokens = static_cast<int64_t>(rng() % 40);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(experts, 4)));
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(experts));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      ids.insert(ids.end(), all.begin(), all.begin() + k);  // distinct experts per token
    }
    std::vector<double> load(static_cast<size_t>(ranks));
    for (double& l : load) l = static_cast<double>(rng() % 5);
    const std::vector<int> want = ReferenceChoice(ids, lp, load);
    DispatchPlan plan;
    plan.Build(ids.data(), tokens, k, lp, load);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + text);
    const std::vector<int> chosen = CheckPlan(plan, ids, tokens, k, lp);
    ASSERT_EQ(chosen, want);
  }
}

TEST(DispatchPlanTest, BuildAgainReusesItsStorage) {
  const Result<Placement> p = Placement::RoundRobin(64, 5, 1);
  ASSERT_TRUE(p.ok());
  const LayerPlacement& lp = *p->Layer(0);
  constexpr int64_t kTokens = 256;
  constexpr int kK = 4;
  std::mt19937 rng(7);
  auto random_ids = [&](int64_t tokens) {
    std::vector<int32_t> ids(static_cast<size_t>(tokens * kK));
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 64);
    return ids;
  };
  DispatchPlan plan;
  std::vector<double> load(5, 0.0);
  const std::vector<int32_t> first = random_ids(kTokens);
  plan.Build(first.data(), kTokens, kK, lp, load);
  const auto* offsets = plan.rank_offset.data();
  const auto* slot_rows = plan.slot_rows.data();
  const auto* row_token = plan.row_token.data();
  const auto* assignment_row = plan.assignment_row.data();
  for (int round = 0; round < 5; ++round) {
    // The same size, then smaller: no vector moves; and the plan is that of a fresh Build.
    const int64_t tokens = round % 2 == 0 ? kTokens : kTokens / 2;
    const std::vector<int32_t> ids = random_ids(tokens);
    std::vector<double> l1(5, 0.0), l2(5, 0.0);
    plan.Build(ids.data(), tokens, kK, lp, l1);
    EXPECT_EQ(plan.rank_offset.data(), offsets) << "round " << round;
    EXPECT_EQ(plan.slot_rows.data(), slot_rows) << "round " << round;
    EXPECT_EQ(plan.row_token.data(), row_token) << "round " << round;
    EXPECT_EQ(plan.assignment_row.data(), assignment_row) << "round " << round;
    DispatchPlan fresh;
    fresh.Build(ids.data(), tokens, kK, lp, l2);
    EXPECT_EQ(plan.rank_offset, fresh.rank_offset);
    EXPECT_EQ(plan.slot_rows, fresh.slot_rows);
    EXPECT_EQ(plan.row_token, fresh.row_token);
    EXPECT_EQ(plan.assignment_row, fresh.assignment_row);
    CheckPlan(plan, ids, tokens, kK, lp);
  }
}

}  // namespace
}  // namespace moerun

namespace moerun {
namespace {

// Ranks 1, 2 on node 0 (with router 0), ranks 3, 4 on node 1. Expert 0 on ranks 1 and 3, expert 1
// on rank 2 and 4, expert 2 on rank 4 only.
const char* kTwoNodes = R"({"format": "moerun-placement-v1", "version": 1, "num_experts": 3,
  "num_ranks": 5, "num_routers": 1,
  "layers": {"*": [[1, 0], [3, 0], [2, 1], [4, 1], [4, 2]]}})";

TEST(DispatchPlanTest, LocalityPrefersTheRoutersNodeWithinTheBound) {
  const Placement p = MustParse(kTwoNodes);
  const LayerPlacement& lp = *p.Layer(0);
  const std::vector<int> node = {0, 0, 0, 1, 1};
  // Router on node 1: expert 0 goes to rank 3, expert 1 to rank 4 (both local), whatever the
  // plain choice (ties to the first slot: ranks 1 and 2) would say.
  DispatchLocality loc{node, 1, 1.0};
  std::vector<double> load(5, 0.0);
  const std::vector<int32_t> ids = {0, 1};
  DispatchPlan plan;
  plan.Build(ids.data(), 1, 2, lp, load, &loc);
  std::vector<int> chosen = CheckPlan(plan, ids, 1, 2, lp);
  EXPECT_EQ(chosen, (std::vector<int>{1, 3}));
  EXPECT_EQ(plan.off_node_rows, 0);
  EXPECT_EQ(plan.off_node_token_nodes, 0);

  // Without locality the plain choice, and the counts are 0.
  std::fill(load.begin(), load.end(), 0.0);
  plan.Build(ids.data(), 1, 2, lp, load);
  EXPECT_EQ(CheckPlan(plan, ids, 1, 2, lp), (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.off_node_rows, 0);

  // With spill < 0: the plain choice, but counted (router on node 1: both rows leave it, to one
  // node).
  DispatchLocality count_only{node, 1, -1};
  std::fill(load.begin(), load.end(), 0.0);
  plan.Build(ids.data(), 1, 2, lp, load, &count_only);
  EXPECT_EQ(CheckPlan(plan, ids, 1, 2, lp), (std::vector<int>{0, 2}));
  EXPECT_EQ(plan.off_node_rows, 2);
  EXPECT_EQ(plan.off_node_token_nodes, 1);

  // Past the bound the least loaded copy: rank 3 carries 10 rows, its node-mate rank 4 none; the
  // bound is their mean 5 + 0.5 × max(1, (10 + 1 row) ÷ 2 ranks) = 7.75 < 10.
  DispatchLocality tight{node, 1, 0.5};
  std::vector<double> busy = {0, 0, 0, 10, 0};
  const std::vector<int32_t> one = {0};
  plan.Build(one.data(), 1, 1, lp, busy, &tight);
  EXPECT_EQ(CheckPlan(plan, one, 1, 1, lp), (std::vector<int>{0}));
  EXPECT_EQ(plan.off_node_rows, 1);
  // A wide bound keeps it local.
  DispatchLocality wide{node, 1, 20.0};
  busy = {0, 0, 0, 10, 0};
  plan.Build(one.data(), 1, 1, lp, busy, &wide);
  EXPECT_EQ(CheckPlan(plan, one, 1, 1, lp), (std::vector<int>{1}));
  EXPECT_EQ(plan.off_node_rows, 0);
}

TEST(DispatchPlanTest, LocalityPrefersANodeTheTokenAlreadyGoesTo) {
  const Placement p = MustParse(kTwoNodes);
  const LayerPlacement& lp = *p.Layer(0);
  // A third node (rank 0, the router's, holds no expert): expert 2 is only on rank 4 (node 1),
  // so expert 1 then goes to rank 4 too (node 1 again) rather than to rank 2 (its first slot).
  const std::vector<int> node = {2, 0, 0, 1, 1};
  DispatchLocality loc{node, 2, 1.0};
  std::vector<double> load(5, 0.0);
  const std::vector<int32_t> ids = {2, 1};
  DispatchPlan plan;
  plan.Build(ids.data(), 1, 2, lp, load, &loc);
  EXPECT_EQ(CheckPlan(plan, ids, 1, 2, lp), (std::vector<int>{4, 3}));
  EXPECT_EQ(plan.off_node_rows, 2);
  EXPECT_EQ(plan.off_node_token_nodes, 1);
}

TEST(DispatchPlanTest, LocalityKeepsEveryPropertyOnRandomPlans) {
  std::mt19937 rng(7);
  const Placement p = MustParse(kTwoNodes);
  const LayerPlacement& lp = *p.Layer(0);
  const std::vector<int> node = {0, 0, 0, 1, 1};
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t tokens = 1 + static_cast<int64_t>(rng() % 40);
    const int k = 1 + static_cast<int>(rng() % 3);
    std::vector<int32_t> ids(static_cast<size_t>(tokens * k));
    for (auto& e : ids) e = static_cast<int32_t>(rng() % 3);
    DispatchLocality loc{node, static_cast<int>(rng() % 2), (rng() % 4) * 0.5};
    std::vector<double> load(5, 0.0);
    DispatchPlan plan;
    plan.Build(ids.data(), tokens, k, lp, load, &loc);
    const std::vector<int> chosen = CheckPlan(plan, ids, tokens, k, lp);
    ASSERT_EQ(chosen.size(), ids.size());
    int64_t off = 0;
    for (int s : chosen) off += node[static_cast<size_t>(lp.slots[size_t(s)].rank)] != loc.node;
    EXPECT_EQ(plan.off_node_rows, off);
    EXPECT_LE(plan.off_node_token_nodes, plan.off_node_rows);
  }
}

}  // namespace
}  // namespace moerun
