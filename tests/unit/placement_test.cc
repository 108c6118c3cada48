#include "router/placement.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

namespace moerun {
namespace {

using json = nlohmann::json;

std::vector<std::pair<int, int>> SlotPairs(const LayerPlacement& lp) {
  std::vector<std::pair<int, int>> v;
  for (const Slot& s : lp.slots) v.emplace_back(s.rank, s.expert);
  return v;
}

// The indexes of a layer agree with its slot list; every expert has a slot; routers host none.
void CheckConsistent(const Placement& p, const LayerPlacement& lp) {
  ASSERT_EQ(lp.replicas.size(), static_cast<size_t>(p.num_experts()));
  ASSERT_EQ(lp.rank_slots.size(), static_cast<size_t>(p.num_ranks()));
  for (int e = 0; e < p.num_experts(); ++e) {
    const auto& reps = lp.replicas[static_cast<size_t>(e)];
    EXPECT_FALSE(reps.empty()) << "expert " << e;
    for (size_t i = 0; i < reps.size(); ++i) {
      EXPECT_EQ(lp.slots[static_cast<size_t>(reps[i])].expert, e);
      if (i > 0) {
        EXPECT_LT(reps[i - 1], reps[i]) << "replicas in slot order";
      }
    }
  }
  size_t total = 0;
  for (int r = 0; r < p.num_ranks(); ++r) {
    const auto& rs = lp.rank_slots[static_cast<size_t>(r)];
    if (r < p.num_routers()) {
      EXPECT_TRUE(rs.empty()) << "router rank " << r << " hosts slots";
    }
    for (size_t i = 0; i < rs.size(); ++i) {
      EXPECT_EQ(lp.slots[static_cast<size_t>(rs[i])].rank, r);
      if (i > 0) {
        EXPECT_LT(rs[i - 1], rs[i]) << "rank slots in slot order";
      }
    }
    total += rs.size();
  }
  EXPECT_EQ(total, lp.slots.size());
}

// --- Linear and RoundRobin ------------------------------------------------------------------

TEST(PlacementTest, LinearGivesContiguousBalancedBlocks) {
  for (auto [experts, ranks, routers] : std::vector<std::tuple<int, int, int>>{{8, 3, 1},
                                                                               {16, 5, 1},
                                                                               {10, 4, 1},
                                                                               {3, 6, 2},
                                                                               {64, 9, 1},
                                                                               {7, 4, 3},
                                                                               {1, 2, 1},
                                                                               {128, 10, 2}}) {
    SCOPED_TRACE(std::to_string(experts) + " experts, " + std::to_string(ranks) + " ranks, " +
                 std::to_string(routers) + " routers");
    const Result<Placement> p = Placement::Linear(experts, ranks, routers);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->num_experts(), experts);
    EXPECT_EQ(p->num_ranks(), ranks);
    EXPECT_EQ(p->num_routers(), routers);
    const LayerPlacement* lp = p->Layer(0);
    ASSERT_NE(lp, nullptr);
    EXPECT_EQ(lp, p->Layer(Placement::kAnyLayer));
    EXPECT_EQ(lp, p->Layer(1234)) << "a generated placement applies to every layer";
    CheckConsistent(*p, *lp);
    ASSERT_EQ(lp->slots.size(), static_cast<size_t>(experts)) << "one slot per expert";
    const int hosts = ranks - routers;
    std::vector<int> count(static_cast<size_t>(ranks), 0);
    for (int e = 0; e < experts; ++e) {
      const Slot& s = lp->slots[static_cast<size_t>(e)];
      EXPECT_EQ(s.expert, e);
      EXPECT_GE(s.rank, routers);
      EXPECT_LT(s.rank, ranks);
      if (e > 0) {
        EXPECT_LE(lp->slots[static_cast<size_t>(e - 1)].rank, s.rank) << "contiguous";
      }
      ++count[static_cast<size_t>(s.rank)];
    }
    int lo = experts, hi = 0;
    for (int r = routers; r < ranks; ++r) {
      lo = std::min(lo, count[static_cast<size_t>(r)]);
      hi = std::max(hi, count[static_cast<size_t>(r)]);
    }
    EXPECT_LE(hi - lo, 1) << "blocks differ by at most one expert";
    EXPECT_EQ(hi, (experts + hosts - 1) / hosts);
    EXPECT_EQ(lp->MaxSlotsPerRank(), hi);
  }
}

TEST(PlacementTest, LinearExactLayouts) {
  {
    const Result<Placement> p = Placement::Linear(8, 3, 1);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(SlotPairs(*p->Layer(0)),
              (std::vector<std::pair<int, int>>{
                  {1, 0}, {1, 1}, {1, 2}, {1, 3}, {2, 4}, {2, 5}, {2, 6}, {2, 7}}));
  }
  {
    const Result<Placement> p = Placement::Linear(10, 4, 1);  // blocks of 4, 3, 3
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(SlotPairs(*p->Layer(0)),
              (std::vector<std::pair<int, int>>{
                  {1, 0}, {1, 1}, {1, 2}, {1, 3}, {2, 4}, {2, 5}, {2, 6}, {3, 7}, {3, 8}, {3, 9}}));
  }
  {
    const Result<Placement> p = Placement::Linear(3, 6, 2);  // more hosts than experts
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(SlotPairs(*p->Layer(0)), (std::vector<std::pair<int, int>>{{2, 0}, {3, 1}, {4, 2}}));
    EXPECT_TRUE(p->Layer(0)->rank_slots[5].empty());
  }
}

TEST(PlacementTest, RoundRobinDealsExpertsInTurn) {
  for (auto [experts, ranks, routers] : std::vector<std::tuple<int, int, int>>{
           {8, 3, 1}, {16, 5, 1}, {10, 4, 1}, {3, 6, 2}, {7, 4, 3}, {128, 10, 2}}) {
    SCOPED_TRACE(std::to_string(experts) + " experts, " + std::to_string(ranks) + " ranks, " +
                 std::to_string(routers) + " routers");
    const Result<Placement> p = Placement::RoundRobin(experts, ranks, routers);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const LayerPlacement* lp = p->Layer(5);
    ASSERT_NE(lp, nullptr);
    CheckConsistent(*p, *lp);
    ASSERT_EQ(lp->slots.size(), static_cast<size_t>(experts));
    const int hosts = ranks - routers;
    for (int e = 0; e < experts; ++e) {
      EXPECT_EQ(lp->slots[static_cast<size_t>(e)].expert, e);
      EXPECT_EQ(lp->slots[static_cast<size_t>(e)].rank, routers + e % hosts);
    }
  }
  const Result<Placement> p = Placement::RoundRobin(10, 4, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->Layer(0)->rank_slots[1], (std::vector<int>{0, 3, 6, 9}));
  EXPECT_EQ(p->Layer(0)->rank_slots[2], (std::vector<int>{1, 4, 7}));
  EXPECT_EQ(p->Layer(0)->rank_slots[3], (std::vector<int>{2, 5, 8}));
}

TEST(PlacementTest, GeneratedLayoutsRejectImpossibleJobs) {
  for (auto [experts, ranks, routers] : std::vector<std::tuple<int, int, int>>{
           {0, 4, 1}, {-3, 4, 1}, {8, 4, 0}, {8, 4, -1}, {8, 1, 1}, {8, 3, 3}, {8, 2, 5}}) {
    SCOPED_TRACE(std::to_string(experts) + " experts, " + std::to_string(ranks) + " ranks, " +
                 std::to_string(routers) + " routers");
    const Result<Placement> lin = Placement::Linear(experts, ranks, routers);
    EXPECT_FALSE(lin.ok());
    EXPECT_EQ(lin.status().code(), StatusCode::kInvalidArgument);
    const Result<Placement> rr = Placement::RoundRobin(experts, ranks, routers);
    EXPECT_FALSE(rr.ok());
    EXPECT_EQ(rr.status().code(), StatusCode::kInvalidArgument);
  }
  // More than kMaxSlotsPerRank slots on one rank.
  EXPECT_TRUE(Placement::Linear(Placement::kMaxSlotsPerRank, 2, 1).ok());
  const Result<Placement> big = Placement::Linear(Placement::kMaxSlotsPerRank + 1, 2, 1);
  EXPECT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("slots on one rank"), std::string::npos)
      << big.status().ToString();
}

// --- FromJson: valid ------------------------------------------------------------------------

// 4 experts on ranks 1..3 (rank 0 routes). Layer 3 has its own table with expert 0 replicated on
// ranks 1 and 2; "*" covers every other layer; layer 7 replicates everything.
const char* kValid = R"({
  "format": "moerun-placement-v1", "version": 7, "num_experts": 4, "num_ranks": 4,
  "num_routers": 1,
  "layers": {
    "3": [[2, 0], [1, 1], [1, 0], [3, 2], [3, 3]],
    "*": [[1, 0], [1, 1], [2, 2], [3, 3]],
    "7": [[1, 0], [2, 0], [3, 0], [1, 1], [2, 1], [3, 1], [2, 2], [3, 2], [1, 3], [3, 3]]
  }
})";

TEST(PlacementTest, FromJsonReadsLayersReplicasAndFallback) {
  const Result<Placement> p = Placement::FromJson(kValid, "valid.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->version(), 7u);
  EXPECT_EQ(p->num_experts(), 4);
  EXPECT_EQ(p->num_ranks(), 4);
  EXPECT_EQ(p->num_routers(), 1);

  const LayerPlacement* l3 = p->Layer(3);
  ASSERT_NE(l3, nullptr);
  CheckConsistent(*p, *l3);
  EXPECT_EQ(SlotPairs(*l3),
            (std::vector<std::pair<int, int>>{{2, 0}, {1, 1}, {1, 0}, {3, 2}, {3, 3}}));
  EXPECT_EQ(l3->replicas[0], (std::vector<int>{0, 2}));  // in slot order, not rank order
  EXPECT_EQ(l3->replicas[1], (std::vector<int>{1}));
  EXPECT_EQ(l3->rank_slots[0], (std::vector<int>{}));
  EXPECT_EQ(l3->rank_slots[1], (std::vector<int>{1, 2}));
  EXPECT_EQ(l3->rank_slots[2], (std::vector<int>{0}));
  EXPECT_EQ(l3->rank_slots[3], (std::vector<int>{3, 4}));
  EXPECT_EQ(l3->MaxSlotsPerRank(), 2);

  const LayerPlacement* any = p->Layer(Placement::kAnyLayer);
  ASSERT_NE(any, nullptr);
  CheckConsistent(*p, *any);
  EXPECT_EQ(p->Layer(0), any);
  EXPECT_EQ(p->Layer(4), any);
  EXPECT_EQ(p->Layer(100000), any);
  EXPECT_NE(p->Layer(3), any);

  const LayerPlacement* l7 = p->Layer(7);
  ASSERT_NE(l7, nullptr);
  CheckConsistent(*p, *l7);
  EXPECT_EQ(l7->replicas[0], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(l7->MaxSlotsPerRank(), 4);
}

TEST(PlacementTest, FromJsonWithoutStarHasNoFallback) {
  const char* text = R"({"format": "moerun-placement-v1", "version": 0, "num_experts": 2,
    "num_ranks": 3, "num_routers": 1, "layers": {"0": [[1, 0], [2, 1]], "999999": [[2, 0], [1, 1]]}})";
  const Result<Placement> p = Placement::FromJson(text, "numbered.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->version(), 0u);
  ASSERT_NE(p->Layer(0), nullptr);
  ASSERT_NE(p->Layer(999999), nullptr);
  EXPECT_EQ(p->Layer(999999)->slots[0].rank, 2);
  EXPECT_EQ(p->Layer(1), nullptr);
  EXPECT_EQ(p->Layer(Placement::kAnyLayer), nullptr);
  EXPECT_EQ(p->ExpertsOf(1, 1), (std::vector<bool>{false, false})) << "no layer: empty mask";
}

// --- FromJson: invalid ----------------------------------------------------------------------

// A valid document with one member replaced.
std::string With(const std::string& key, const json& value) {
  json doc = json::parse(kValid);
  if (value.is_discarded()) {
    doc.erase(key);
  } else {
    doc[key] = value;
  }
  return doc.dump();
}

std::string WithLayers(const json& layers) { return With("layers", layers); }

void ExpectRejected(const std::string& text, const std::string& what, StatusCode code,
                    const std::string& needle) {
  SCOPED_TRACE(what + ": " + text);
  Result<Placement> p = Status::Internal("not run");
  EXPECT_NO_THROW(p = Placement::FromJson(text, "bad.json")) << "FromJson must not throw";
  ASSERT_FALSE(p.ok()) << "accepted";
  EXPECT_EQ(p.status().code(), code) << p.status().ToString();
  EXPECT_NE(p.status().message().find("bad.json"), std::string::npos)
      << "the error names the source: " << p.status().ToString();
  EXPECT_NE(p.status().message().find(needle), std::string::npos)
      << "the error should mention \"" << needle << "\": " << p.status().ToString();
}

const json kDrop = json::value_t::discarded;

TEST(PlacementTest, FromJsonRejectsMalformedDocuments) {
  ExpectRejected("", "empty text", StatusCode::kCorrupt, "not a JSON object");
  ExpectRejected("{\"format\": ", "truncated", StatusCode::kCorrupt, "not a JSON object");
  ExpectRejected("[1, 2]", "an array", StatusCode::kCorrupt, "not a JSON object");
  ExpectRejected("42", "a number", StatusCode::kCorrupt, "not a JSON object");
}

TEST(PlacementTest, FromJsonRejectsAWrongFormatTag) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(With("format", "moerun-placement-v2"), "another version", bad, "format");
  ExpectRejected(With("format", "MOERUN-PLACEMENT-V1"), "another case", bad, "format");
  ExpectRejected(With("format", ""), "empty", bad, "format");
  ExpectRejected(With("format", kDrop), "missing", bad, "format");
}

// A "format" that is not a string at all (a number, null, a list) is also a wrong format tag.
TEST(PlacementTest, FromJsonRejectsANonStringFormatTag) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(With("format", 1), "a number", bad, "format");
  ExpectRejected(With("format", nullptr), "null", bad, "format");
  ExpectRejected(With("format", json::array({"moerun-placement-v1"})), "a list", bad, "format");
}

TEST(PlacementTest, FromJsonRejectsBadHeaderIntegers) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(With("version", kDrop), "no version", bad, "\"version\"");
  ExpectRejected(With("version", "7"), "string version", bad, "\"version\"");
  ExpectRejected(With("version", 7.5), "fractional version", bad, "\"version\"");
  ExpectRejected(With("version", -1), "negative version", bad, "\"version\"");
  ExpectRejected(With("num_experts", 0), "no experts", bad, "\"num_experts\"");
  ExpectRejected(With("num_experts", 4.0), "float experts", bad, "\"num_experts\"");
  ExpectRejected(With("num_experts", true), "bool experts", bad, "\"num_experts\"");
  ExpectRejected(With("num_ranks", 1), "one rank", bad, "\"num_ranks\"");
  ExpectRejected(With("num_ranks", nullptr), "null ranks", bad, "\"num_ranks\"");
  ExpectRejected(With("num_routers", 0), "no router", bad, "\"num_routers\"");
  ExpectRejected(With("num_routers", 4), "routers == ranks", bad, "\"num_routers\"");
  ExpectRejected(With("num_routers", kDrop), "no routers", bad, "\"num_routers\"");
  ExpectRejected(With("layers", kDrop), "no layers", bad, "\"layers\"");
  ExpectRejected(With("layers", json::object()), "empty layers", bad, "\"layers\"");
  ExpectRejected(With("layers", json::array()), "layers as a list", bad, "\"layers\"");
}

TEST(PlacementTest, FromJsonRejectsASlotOnARouterOrMissingRank) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(WithLayers({{"*", {{0, 0}, {1, 1}, {2, 2}, {3, 3}}}}), "slot on router rank 0",
                 bad, "not an expert rank");
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {4, 3}}}}), "rank 4 of 4", bad,
                 "not an expert rank");
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {-1, 3}}}}), "negative rank", bad,
                 "slot");
}

TEST(PlacementTest, FromJsonRejectsAnExpertOutOfRange) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {3, 3}, {3, 4}}}}), "expert 4 of 4",
                 bad, "names expert 4");
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {3, 3}, {2, -1}}}}), "expert -1", bad,
                 "slot");
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {3, 3}, {2, 1 << 21}}}}), "huge expert",
                 bad, "slot");
}

TEST(PlacementTest, FromJsonRejectsAnExpertWithoutASlot) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {3, 3}}}}), "expert 2 missing", bad,
                 "expert 2 has no slot");
  ExpectRejected(WithLayers({{"*", json::array()}}), "no slots at all", bad, "has no slot");
  // Missing in one numbered layer while "*" is complete.
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {3, 3}}}, {"5", {{1, 0}, {2, 2}}}}),
                 "layer 5 lacks experts", bad, "layer 5");
}

TEST(PlacementTest, FromJsonRejectsADuplicateRankExpert) {
  ExpectRejected(WithLayers({{"*", {{1, 0}, {1, 1}, {2, 2}, {3, 3}, {1, 0}}}}),
                 "expert 0 twice on rank 1", StatusCode::kInvalidArgument,
                 "expert 0 appears twice on rank 1");
}

TEST(PlacementTest, FromJsonRejectsNonIntegerSlots) {
  const StatusCode bad = StatusCode::kInvalidArgument;
  const json good = {{1, 0}, {1, 1}, {2, 2}};
  for (const json& odd : {json{1, 3.5}, json{1.0, 3}, json{"1", 3}, json{1, true}, json{nullptr, 3},
                          json{1}, json{1, 3, 0}, json::array(), json{{"rank", 1}, {"expert", 3}},
                          json(13), json("1,3"), json{json{1}, 3}}) {
    json slots = good;
    slots.push_back(odd);
    ExpectRejected(WithLayers({{"*", slots}}), "slot " + odd.dump(), bad, "[rank, expert]");
  }
  ExpectRejected(WithLayers({{"*", "1,0 1,1"}}), "layer as a string", bad, "list of slots");
  ExpectRejected(WithLayers({{"*", {{"0", {1, 0}}}}}), "layer as an object", bad, "list of slots");
}

TEST(PlacementTest, FromJsonRejectsBadLayerKeys) {
  const json slots = {{1, 0}, {1, 1}, {2, 2}, {3, 3}};
  for (const char* key :
       {"x", "-1", "1.5", "", "1234567", " 3", "3 ", "3a", "+3", "**", "0x3", "1e3"}) {
    ExpectRejected(WithLayers({{key, slots}}), std::string("layer key \"") + key + "\"",
                   StatusCode::kInvalidArgument, "is not a layer number");
  }
}

// --- CheckFits, ToJson, ExpertsOf, Make -----------------------------------------------------

TEST(PlacementTest, CheckFitsComparesTheJob) {
  const Result<Placement> p = Placement::FromJson(kValid, "valid.json");
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->CheckFits(4, 1, 4).ok());
  for (auto [ranks, routers, experts] : std::vector<std::tuple<int, int, int>>{
           {5, 1, 4}, {3, 1, 4}, {4, 2, 4}, {4, 1, 8}, {4, 1, 3}, {8, 2, 4}}) {
    const Status st = p->CheckFits(ranks, routers, experts);
    EXPECT_FALSE(st.ok()) << ranks << " ranks, " << routers << " routers, " << experts
                          << " experts";
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("the placement is for"), std::string::npos) << st.ToString();
  }
}

void ExpectSamePlacement(const Placement& a, const Placement& b, const std::vector<int>& layers) {
  EXPECT_EQ(a.version(), b.version());
  EXPECT_EQ(a.num_experts(), b.num_experts());
  EXPECT_EQ(a.num_ranks(), b.num_ranks());
  EXPECT_EQ(a.num_routers(), b.num_routers());
  for (int layer : layers) {
    const LayerPlacement* la = a.Layer(layer);
    const LayerPlacement* lb = b.Layer(layer);
    ASSERT_EQ(la == nullptr, lb == nullptr) << "layer " << layer;
    if (la == nullptr) continue;
    EXPECT_EQ(SlotPairs(*la), SlotPairs(*lb)) << "layer " << layer;
    EXPECT_EQ(la->replicas, lb->replicas) << "layer " << layer;
    EXPECT_EQ(la->rank_slots, lb->rank_slots) << "layer " << layer;
  }
}

TEST(PlacementTest, ToJsonRoundTrips) {
  const std::vector<int> layers = {Placement::kAnyLayer, 0, 3, 4, 7, 100};
  const Result<Placement> p = Placement::FromJson(kValid, "valid.json");
  ASSERT_TRUE(p.ok());
  const std::string text = p->ToJson();
  const json doc = json::parse(text);
  EXPECT_EQ(doc["format"], "moerun-placement-v1");
  EXPECT_EQ(doc["version"], 7);
  EXPECT_EQ(doc["layers"]["3"], json::parse(R"([[2, 0], [1, 1], [1, 0], [3, 2], [3, 3]])"));
  EXPECT_TRUE(doc["layers"].contains("*"));
  const Result<Placement> back = Placement::FromJson(text, "round-trip.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << text;
  ExpectSamePlacement(*p, *back, layers);
  EXPECT_EQ(back->ToJson(), text) << "ToJson is stable";

  for (const auto& gen : {Placement::Linear(10, 4, 1), Placement::RoundRobin(13, 6, 2)}) {
    ASSERT_TRUE(gen.ok());
    const Result<Placement> again = Placement::FromJson(gen->ToJson(), "generated.json");
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    ExpectSamePlacement(*gen, *again, layers);
  }
}

TEST(PlacementTest, ExpertsOfMasks) {
  const Result<Placement> p = Placement::FromJson(kValid, "valid.json");
  ASSERT_TRUE(p.ok());
  using M = std::vector<bool>;
  // Layer 3: rank 1 hosts 1 and 0, rank 2 hosts 0, rank 3 hosts 2 and 3.
  EXPECT_EQ(p->ExpertsOf(0, 3), (M{false, false, false, false}));
  EXPECT_EQ(p->ExpertsOf(1, 3), (M{true, true, false, false}));
  EXPECT_EQ(p->ExpertsOf(2, 3), (M{true, false, false, false}));
  EXPECT_EQ(p->ExpertsOf(3, 3), (M{false, false, true, true}));
  // Any other layer: "*".
  EXPECT_EQ(p->ExpertsOf(1, 0), (M{true, true, false, false}));
  EXPECT_EQ(p->ExpertsOf(2, 0), (M{false, false, true, false}));
  EXPECT_EQ(p->ExpertsOf(3, 42), (M{false, false, false, true}));
  // Layer 7: everything on two ranks or more.
  EXPECT_EQ(p->ExpertsOf(1, 7), (M{true, true, false, true}));
  EXPECT_EQ(p->ExpertsOf(2, 7), (M{true, true, true, false}));
  // Ranks outside the job: empty masks, not a crash.
  EXPECT_EQ(p->ExpertsOf(-1, 3), (M{false, false, false, false}));
  EXPECT_EQ(p->ExpertsOf(4, 3), (M{false, false, false, false}));
  // Over a generated placement the masks partition the experts.
  const Result<Placement> rr = Placement::RoundRobin(10, 4, 1);
  ASSERT_TRUE(rr.ok());
  std::vector<int> owners(10, 0);
  for (int r = 0; r < 4; ++r) {
    const M m = rr->ExpertsOf(r, 0);
    ASSERT_EQ(m.size(), 10u);
    for (int e = 0; e < 10; ++e) {
      if (m[static_cast<size_t>(e)]) {
        ++owners[static_cast<size_t>(e)];
        EXPECT_EQ(r, 1 + e % 3);
      }
    }
  }
  EXPECT_EQ(owners, std::vector<int>(10, 1));
}

TEST(PlacementTest, MakeBySpecAndFromFile) {
  const Result<Placement> lin = Placement::Make("linear", 8, 3, 1);
  ASSERT_TRUE(lin.ok());
  EXPECT_EQ(lin->Layer(0)->slots[4].rank, 2);
  const Result<Placement> def = Placement::Make("", 8, 3, 1);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(SlotPairs(*def->Layer(0)), SlotPairs(*lin->Layer(0)));
  const Result<Placement> rr = Placement::Make("round_robin", 8, 3, 1);
  ASSERT_TRUE(rr.ok());
  EXPECT_EQ(rr->Layer(0)->slots[1].rank, 2);

  const std::string path = (std::filesystem::temp_directory_path() /
                            ("moerun_placement_test_" + std::to_string(::getpid()) + ".json"))
                               .string();
  {
    std::ofstream out(path);
    out << kValid;
  }
  const Result<Placement> file = Placement::Make(path, 4, 4, 1);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->version(), 7u);
  const Result<Placement> misfit = Placement::Make(path, 8, 4, 1);
  EXPECT_FALSE(misfit.ok()) << "a file for 4 experts used for 8";
  std::filesystem::remove(path);
  const Result<Placement> missing = Placement::Make(path, 4, 4, 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

// With capacities, an orphan goes to the survivor with the fewest slots among those with room;
// where none has room, to the fewest among all (an expert keeps a copy).
TEST(PlacementTest, WithoutRanksKeepsToTheSurvivorsMemory) {
  // Expert ranks 1..3; 6 experts (1: 0,3  2: 1  3: 2,4,5).
  const std::string doc = R"({"format": "moerun-placement-v1", "version": 1, "num_experts": 6,
    "num_ranks": 4, "num_routers": 1,
    "layers": {"*": [[1,0],[2,1],[3,2],[1,3],[3,4],[3,5]]}})";
  const Result<Placement> p = Placement::FromJson(doc, "test");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<bool> dead = {false, false, false, true};
  // Without capacities: 2, 4, 5 to ranks 2, 1, 2 (the fewest first).
  const Result<Placement> plain = p->WithoutRanks(dead, 2);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->Layer(0)->rank_slots[2].size(), 3u);
  // Rank 2's memory holds 1 slot (it has it): all three orphans go to rank 1.
  int replaced = 0;
  const Result<Placement> capped = p->WithoutRanks(dead, 2, &replaced, {-1, -1, 1, -1});
  ASSERT_TRUE(capped.ok()) << capped.status().ToString();
  EXPECT_EQ(replaced, 3);
  EXPECT_EQ(capped->Layer(0)->rank_slots[1].size(), 5u);
  EXPECT_EQ(capped->Layer(0)->rank_slots[2].size(), 1u);
  // Neither has room: still placed (on the fewest), no expert lost.
  const Result<Placement> full = p->WithoutRanks(dead, 2, nullptr, {-1, 2, 1, -1});
  ASSERT_TRUE(full.ok());
  for (int e = 0; e < 6; ++e)
    EXPECT_FALSE(full->Layer(0)->replicas[static_cast<size_t>(e)].empty());
}

// The placement without dead ranks: their slots go; an expert with a surviving replica keeps
// only it; an orphan goes to the survivor with the fewest slots (lowest rank among equals).
TEST(PlacementTest, WithoutRanksReplacesOrphansOnTheLeastLoaded) {
  // 1 router, expert ranks 1..3; 6 experts round robin (1: 0,3  2: 1,4  3: 2,5) plus a replica
  // of expert 2 on rank 1.
  const std::string doc = R"({"format": "moerun-placement-v1", "version": 4, "num_experts": 6,
    "num_ranks": 4, "num_routers": 1,
    "layers": {"*": [[1,0],[2,1],[3,2],[1,3],[2,4],[3,5],[1,2]]}})";
  const Result<Placement> p = Placement::FromJson(doc, "test");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<bool> dead = {false, false, false, true};
  EXPECT_TRUE(p->UsesAny(dead));
  int replaced = -1;
  const Result<Placement> q = p->WithoutRanks(dead, 5, &replaced);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->version(), 5u);
  EXPECT_FALSE(q->UsesAny(dead));
  EXPECT_EQ(replaced, 1);  // expert 5 (expert 2 keeps its copy on rank 1)
  const LayerPlacement* lp = q->Layer(7);
  ASSERT_NE(lp, nullptr);
  EXPECT_TRUE(lp->rank_slots[3].empty());
  for (int e = 0; e < 6; ++e) EXPECT_FALSE(lp->replicas[static_cast<size_t>(e)].empty()) << e;
  // Rank 1 holds 3 slots, rank 2 holds 2: the orphan goes to rank 2.
  EXPECT_EQ(lp->slots[static_cast<size_t>(lp->replicas[5][0])].rank, 2);

  // LiveLayer keeps the slot numbers and leaves the dead ranks' slots out.
  int orphans = -1;
  const LayerPlacement live = LiveLayer(*p->Layer(0), dead, &orphans);
  EXPECT_EQ(orphans, 1);
  EXPECT_EQ(live.slots.size(), p->Layer(0)->slots.size());
  EXPECT_TRUE(live.replicas[5].empty());
  EXPECT_EQ(live.replicas[2], std::vector<int>{6});
  EXPECT_TRUE(live.rank_slots[3].empty());

  // No survivor: a clear error.
  const Result<Placement> none = p->WithoutRanks({false, true, true, true}, 6);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace moerun
