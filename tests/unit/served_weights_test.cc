// ExpertControl hands its rank a fresh ServedWeights on every change of what it serves: after a
// release, a background load, an update in canary and its rollback, the handle the rank last got
// names the new hosted set and canary state, checked against the weights ExpertControl holds.
// Ranks as endpoints of the inproc transport: rank 0 plays the router, rank 1 the expert rank.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "runtime/ep/served_weights.h"
#include "runtime/migration/expert_control.h"
#include "runtime/model/preset.h"
#include "tests/unit/layer_fixtures.h"
#include "transport/inproc.h"

namespace moerun {
namespace {

using nlohmann::json;
using namespace moerun::testing;

constexpr int kServedExperts = 12;  // SmallSpec's

std::vector<bool> ExpertMask(std::initializer_list<int> experts) {
  std::vector<bool> m(kServedExperts, false);
  for (int e : experts) m[static_cast<size_t>(e)] = true;
  return m;
}

Result<std::shared_ptr<MoeLayerWeights>> BuildServedLayer(const std::vector<bool>& mask,
                                                          uint64_t seed) {
  PresetOptions o;
  o.seed = seed;
  o.load_expert = mask;
  MOERUN_ASSIGN_OR_RETURN(auto w,
                          BuildPresetLayer(SmallSpec(Family::kQwen3Moe), KernelsFor(BestIsa()), o));
  return std::make_shared<MoeLayerWeights>(std::move(w));
}

class ExpertServedWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fabric_ = InprocFabric::Create(2);
    router_ = fabric_->Endpoint(0);
    rank_ = fabric_->Endpoint(1);
    auto w = BuildServedLayer(ExpertMask({0, 1, 2, 3, 4, 5}), 7);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    std::map<int, std::shared_ptr<MoeLayerWeights>> layers;
    layers[0] = *w;
    control_ = std::make_unique<ExpertControl>(rank_.get(), 1, std::move(layers),
                                               std::chrono::milliseconds(5000));
    control_->set_loaders([](int, const std::vector<bool>& mask, const std::map<int, std::string>&,
                             const LoadThrottle&) { return BuildServedLayer(mask, 7); },
                          [](int, int expert, const std::string&) -> Result<ExpertWeights> {
                            MOERUN_ASSIGN_OR_RETURN(auto update,
                                                    BuildServedLayer(ExpertMask({expert}), 9));
                            return std::move(update->experts[static_cast<size_t>(expert)]);
                          });
    control_->set_on_change([this](const ServedWeights& s) {
      got_ = s;
      ++changes_;
    });
  }
  void TearDown() override { control_.reset(); }

  // Sends a control message as router 0 and returns its final reply (polling meanwhile).
  json Ask(uint32_t id, const json& body) {
    const std::string b = body.dump();
    auto send = router_->Isend(1, kTagRows, b.data(), b.size());
    EXPECT_TRUE(send.ok());
    EpHeaderFixed h;
    h.kind = static_cast<uint32_t>(EpKind::kControl);
    h.layer = body.value("layer", 0);
    h.seq = id;
    h.rows = static_cast<int64_t>(b.size());
    EXPECT_TRUE(control_->OnMessage(0, h).ok());
    EXPECT_TRUE(router_->Wait(*send, DeadlineIn(std::chrono::seconds(5))).ok());
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      EpControlHeader ch;
      auto hr = router_->Irecv(1, kTagControl, &ch, sizeof ch);
      EXPECT_TRUE(hr.ok());
      bool done = false;
      while (!done && std::chrono::steady_clock::now() < until) {
        EXPECT_TRUE(control_->Poll().ok());
        auto t = router_->Test(*hr);
        EXPECT_TRUE(t.ok());
        done = t.ok() && *t;
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!done) {
        (void)router_->Cancel(*hr);
        break;
      }
      std::string reply(ch.bytes, '\0');
      EXPECT_TRUE(router_
                      ->Recv(1, kTagControlBody, reply.data(), reply.size(),
                             DeadlineIn(std::chrono::seconds(5)))
                      .ok());
      json j = json::parse(reply);
      if (j.value("final", false)) return j;
    }
    ADD_FAILURE() << "no final reply to " << b;
    return json{};
  }

  // The handle the rank holds says what ExpertControl holds (no cache: the experts with weights).
  void ExpectHandleMatches() {
    const MoeLayerWeights* w = control_->layer(0);
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(got_.layer(0), w);
    EXPECT_EQ(got_.layer(1), nullptr);
    EXPECT_EQ(got_.layer(-1), nullptr);
    EXPECT_EQ(got_.cache, nullptr);
    EXPECT_EQ(got_.has_updates, control_->has_updates());
    for (int e = 0; e < kServedExperts; ++e) {
      EXPECT_EQ(got_.hosts(0, e), !w->experts[static_cast<size_t>(e)].w13.empty()) << e;
    }
    EXPECT_FALSE(got_.hosts(0, kServedExperts));
    EXPECT_FALSE(got_.hosts(1, 0));
  }

  std::vector<int> Hosted() const {
    std::vector<int> out;
    for (int e = 0; e < kServedExperts; ++e) {
      if (got_.hosts(0, e)) out.push_back(e);
    }
    return out;
  }

  std::shared_ptr<InprocFabric> fabric_;
  std::unique_ptr<Transport> router_, rank_;
  std::unique_ptr<ExpertControl> control_;
  ServedWeights got_;
  int changes_ = 0;
};

TEST_F(ExpertServedWeightsTest, TheExpertRanksHandleFollowsEveryChange) {
  // Handed at once when the callback is set.
  EXPECT_EQ(changes_, 1);
  ExpectHandleMatches();
  EXPECT_EQ(Hosted(), (std::vector<int>{0, 1, 2, 3, 4, 5}));

  // A release frees the expert: the handle no longer names it.
  json r = Ask(1, {{"op", "release"}, {"layer", 0}, {"experts", {1, 4}}});
  EXPECT_TRUE(r.value("ok", false)) << r.dump();
  ExpectHandleMatches();
  EXPECT_EQ(Hosted(), (std::vector<int>{0, 2, 3, 5}));

  // A background load: the handle names the new experts once they are in.
  r = Ask(2, {{"op", "load"}, {"layer", 0}, {"experts", {1, 7, 9}}});
  EXPECT_TRUE(r.value("ok", false)) << r.dump();
  ExpectHandleMatches();
  EXPECT_EQ(Hosted(), (std::vector<int>{0, 1, 2, 3, 5, 7, 9}));

  // An update in canary, then its rollback.
  EXPECT_FALSE(got_.has_updates);
  r = Ask(3, {{"op", "update"}, {"layer", 0}, {"expert", 7}, {"file", "x"}, {"canary", 0.5}});
  EXPECT_TRUE(r.value("ok", false)) << r.dump();
  EXPECT_TRUE(got_.has_updates);
  ExpectHandleMatches();
  r = Ask(4, {{"op", "rollback"}, {"layer", 0}, {"expert", 7}});
  EXPECT_TRUE(r.value("ok", false)) << r.dump();
  EXPECT_FALSE(got_.has_updates);
  ExpectHandleMatches();
  EXPECT_EQ(Hosted(), (std::vector<int>{0, 1, 2, 3, 5, 7, 9}));
}

TEST_F(ExpertServedWeightsTest, AFailedLoadLeavesTheHandleAsItWas) {
  control_->set_loaders(
      [](int, const std::vector<bool>&, const std::map<int, std::string>&, const LoadThrottle&)
          -> Result<std::shared_ptr<MoeLayerWeights>> { return Status::NotFound("no weights"); },
      nullptr);
  const json r = Ask(1, {{"op", "load"}, {"layer", 0}, {"experts", {8}}});
  EXPECT_FALSE(r.value("ok", true)) << r.dump();
  ExpectHandleMatches();
  EXPECT_EQ(Hosted(), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_FALSE(control_->hosts(0, 8));  // nobody uses what could not be loaded
}

}  // namespace
}  // namespace moerun
