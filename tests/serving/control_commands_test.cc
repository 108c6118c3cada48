// moectl's commands that change a job (placement apply / import / progress, rebalance, expert
// update / status / promote / rollback) against a real ControlEndpoint whose provider is a small
// in-test state machine: what reaches the provider, --wait, --json and the exit codes (0 ok, 1
// refused or failed, 2 bad usage). And placement plan offline (--loads) with --cache-experts.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "launch/serve_router.h"
#include "router/placement.h"
#include "runtime/serving/control_endpoint.h"
#include "runtime/serving/host_port.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using namespace moerun::testing;
namespace fs = std::filesystem;

// apply: "running", then done (or failed) after `polls` progress calls; expert updates: "loading",
// then canary (or failed, for a file whose name holds "bad") after `polls` status calls.
class FakeRouter {
 public:
  int polls = 2;
  bool fail = false;  // the next migrations end "failed"
  bool busy = false;  // apply is refused: a migration is already running

  ControlProvider Provider() {
    ControlProvider p;
    p.status = [] { return v1::StatusResponse(); };
    p.placement = [] { return v1::PlacementResponse(); };
    p.stats = [] { return v1::StatsResponse(); };
    p.apply = [this](const v1::ApplyRequest& r) -> Result<v1::MigrationStatus> {
      std::lock_guard lock(mu_);
      applies.push_back(r);
      if (busy) return Status::Unavailable("a migration is already running");
      if (!r.from_plan() && !nlohmann::json::accept(r.placement_json())) {
        return Status::InvalidArgument("placement: not JSON");
      }
      m_ = v1::MigrationStatus();
      m_.set_id(++ids_);
      m_.set_from_version(7);
      m_.set_to_version(8);
      m_.set_throttle_mib_s(r.throttle_mib_s());
      m_.set_trigger("moectl");
      m_.set_bytes_to_move(4 << 20);
      for (int l = 0; l < 2; ++l) {
        v1::MigrationLayer* ml = m_.add_layers();
        ml->set_layer(l);
        ml->set_state("pending");
        ml->set_experts_to_load(2);
        ml->set_experts_to_free(2);
        ml->set_bytes_to_move(2 << 20);
      }
      if (r.from_plan()) {
        v1::PlanResponse* plan = m_.mutable_plan();
        plan->set_policy(r.plan().policy());
        v1::LayerPlan* lp = plan->add_layers();
        lp->set_balancedness_before(0.5);
        lp->set_balancedness_after(0.9);
        if (r.min_gain() > 0.4) {
          m_.set_state("skipped");
          m_.set_note("predicted gain 0.400 is below --min-gain");
          m_.clear_layers();
          return m_;
        }
      }
      m_.set_state("running");
      polls_left_ = polls;
      return m_;
    };
    p.progress = [this] {
      std::lock_guard lock(mu_);
      ++progress_calls;
      if (m_.state() == "running") {
        m_.set_bytes_loaded(m_.bytes_loaded() + (1 << 20));
        m_.mutable_layers(0)->set_state("loading");
        if (--polls_left_ <= 0) {
          m_.set_state(fail ? "failed" : "done");
          if (fail) m_.set_error("expert rank 2 does not answer");
          for (auto& l : *m_.mutable_layers()) l.set_state(fail ? "failed" : "done");
          m_.set_bytes_loaded(fail ? 1 << 20 : m_.bytes_to_move());
        }
      }
      return m_;
    };
    p.expert_update = [this](const v1::ExpertUpdateRequest& r) -> Result<v1::ExpertResponse> {
      std::lock_guard lock(mu_);
      updates.push_back(r);
      v1::ExpertVariant v;
      v.set_layer(r.layer());
      v.set_expert(r.expert());
      v.set_file(r.file());
      v.set_canary_percent(r.canary_percent());
      v.set_state("loading");
      v.add_ranks(1);
      v.add_ranks(2);
      variants_.push_back(v);
      expert_polls_left_ = polls;
      v1::ExpertResponse out;
      *out.add_variants() = v;
      return out;
    };
    p.expert_action = [this](const v1::ExpertActionRequest& r) -> Result<v1::ExpertResponse> {
      std::lock_guard lock(mu_);
      actions.push_back(r);
      if (r.action() != "status" && r.action() != "promote" && r.action() != "rollback") {
        return Status::InvalidArgument("unknown action " + r.action());
      }
      v1::ExpertResponse out;
      for (auto& v : variants_) {
        if (r.layer() >= 0 && (v.layer() != r.layer() || v.expert() != r.expert())) continue;
        if (v.state() == "loading" && r.action() == "status" && --expert_polls_left_ <= 0) {
          const bool bad = fs::path(v.file()).filename().string().starts_with("bad");
          v.set_state(bad ? "failed" : "canary");
          if (bad) v.set_error("tensor ffn.w1 has the wrong shape");
          v.set_rows(1000);
          v.set_canary_rows(bad ? 0 : 48);
        }
        if (r.action() == "promote") v.set_state("promoted");
        if (r.action() == "rollback") v.set_state("rolled back");
        *out.add_variants() = v;
      }
      if (r.action() != "status" && out.variants_size() == 0) {
        return Status::NotFound("no update of that expert");
      }
      return out;
    };
    return p;
  }

  // The recorded requests, read after moectl exited.
  std::mutex mu_;
  std::vector<v1::ApplyRequest> applies;
  std::vector<v1::ExpertUpdateRequest> updates;
  std::vector<v1::ExpertActionRequest> actions;
  int progress_calls = 0;

 private:
  v1::MigrationStatus m_;  // "none" until an apply
  uint64_t ids_ = 0;
  int polls_left_ = 0;
  std::vector<v1::ExpertVariant> variants_;
  int expert_polls_left_ = 0;
};

class ControlCommandsTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(router_.Provider()); }

  void Start(ControlProvider provider) {
    if (endpoint_) endpoint_->Stop();
    token_file_ = dir_.File("token");
    WriteFile(token_file_, "s3cret\n");
    ::chmod(token_file_.c_str(), 0600);
    FramedServerOptions o;
    o.listen = ParseHostPort("127.0.0.1:0").value();
    o.name = "control";
    auto ep = ControlEndpoint::Start(o, "s3cret", std::move(provider), &metrics_);
    ASSERT_TRUE(ep.ok()) << ep.status().ToString();
    endpoint_ = std::move(ep).value();
  }
  void TearDown() override {
    if (endpoint_) endpoint_->Stop();
  }

  ProcessResult Moectl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {MOECTL_BIN, "--target",
                                     "127.0.0.1:" + std::to_string(endpoint_->port()),
                                     "--token-file", token_file_};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv, 60);
  }

  std::string PlacementFile() {
    const std::string path = dir_.File("placement.json");
    WriteFile(path, Placement::Linear(8, 3, 1).value().ToJson());
    return path;
  }

  TempDir dir_;
  MetricsRegistry metrics_;
  FakeRouter router_;
  std::string token_file_;
  std::unique_ptr<ControlEndpoint> endpoint_;
};

TEST_F(ControlCommandsTest, ApplyFileWaitsUntilDone) {
  const std::string path = PlacementFile();
  ProcessResult r = Moectl({"placement", "apply", path, "--throttle-mib-s", "64", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("migration 1 (moectl): done, v7 -> v8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("throttle 64.0 MiB/s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("migration 1 running: 0/2 layers switched"), std::string::npos)
      << r.output;  // a progress line
  ASSERT_EQ(router_.applies.size(), 1u);
  EXPECT_EQ(router_.applies[0].placement_json(), ReadFile(path));
  EXPECT_FALSE(router_.applies[0].from_plan());
  EXPECT_DOUBLE_EQ(router_.applies[0].throttle_mib_s(), 64);
  EXPECT_EQ(router_.progress_calls, 2);  // polled until done, not after
}

TEST_F(ControlCommandsTest, ApplyWithoutWaitReturnsAtOnce) {
  ProcessResult r = Moectl({"placement", "apply", PlacementFile(), "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["state"], "running");
  EXPECT_EQ(j["layers"].size(), 2u);
  EXPECT_EQ(router_.progress_calls, 0);
  EXPECT_DOUBLE_EQ(router_.applies.at(0).throttle_mib_s(), 0);  // the job's own
}

TEST_F(ControlCommandsTest, ApplyPlanSendsThePlanOptions) {
  ProcessResult r =
      Moectl({"placement", "apply", "--plan", "--redundant", "2", "--policy", "eplb-global",
              "--groups", "4", "--nodes", "2", "--min-gain", "0.05", "--wait", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(router_.applies.size(), 1u);
  const v1::ApplyRequest& a = router_.applies[0];
  EXPECT_TRUE(a.from_plan());
  EXPECT_TRUE(a.placement_json().empty());
  EXPECT_EQ(a.plan().redundant(), 2);
  EXPECT_EQ(a.plan().policy(), "eplb-global");
  EXPECT_EQ(a.plan().groups(), 4);
  EXPECT_EQ(a.plan().nodes(), 2);
  EXPECT_EQ(a.plan().max_bytes(), 0);
  EXPECT_DOUBLE_EQ(a.min_gain(), 0.05);
  // --json --wait: the progress lines go to stderr (here mixed in), the final answer is the
  // last JSON document.
  const std::string out = r.output.substr(r.output.find("{\n"));
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["state"], "done");
  EXPECT_EQ(j["plan"]["policy"], "eplb-global");
}

TEST_F(ControlCommandsTest, RebalanceIsApplyPlan) {
  ProcessResult r = Moectl({"rebalance", "--redundant", "1", "--throttle-mib-s", "8", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("layer 0 balancedness 0.500 -> 0.900 predicted"), std::string::npos)
      << r.output;
  ASSERT_EQ(router_.applies.size(), 1u);
  EXPECT_TRUE(router_.applies[0].from_plan());
  EXPECT_EQ(router_.applies[0].plan().redundant(), 1);
  EXPECT_EQ(router_.applies[0].plan().policy(), "default");
  EXPECT_DOUBLE_EQ(router_.applies[0].throttle_mib_s(), 8);
}

TEST_F(ControlCommandsTest, SkippedBelowMinGainIsSuccess) {
  ProcessResult r = Moectl({"rebalance", "--min-gain", "0.5", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(": skipped,"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("below --min-gain"), std::string::npos) << r.output;
  EXPECT_EQ(router_.progress_calls, 0);
}

TEST_F(ControlCommandsTest, FailedMigrationExits1) {
  router_.fail = true;
  ProcessResult r = Moectl({"placement", "apply", PlacementFile(), "--wait"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: expert rank 2 does not answer"), std::string::npos) << r.output;
  // Without --wait: running, exit 0; progress then reports the failure (exit 1).
  r = Moectl({"placement", "apply", PlacementFile()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = Moectl({"placement", "progress", "--wait"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("migration 2 (moectl): failed"), std::string::npos) << r.output;
}

TEST_F(ControlCommandsTest, RefusedApplyExits1WithTheRoutersReason) {
  const std::string bad = dir_.File("bad.json");
  WriteFile(bad, "{not json");
  ProcessResult r = Moectl({"placement", "apply", bad});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("refused: invalid_argument: placement: not JSON"), std::string::npos)
      << r.output;
  EXPECT_EQ(router_.applies.at(0).placement_json(), "{not json");
  router_.busy = true;
  r = Moectl({"rebalance", "--wait"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("refused: unavailable: a migration is already running"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(router_.progress_calls, 0);
}

TEST_F(ControlCommandsTest, BadUsageExits2AndSendsNothing) {
  const std::string path = PlacementFile();
  const std::vector<std::vector<std::string>> cases = {
      {"placement", "apply"},                            // neither FILE nor --plan
      {"placement", "apply", path, "--plan"},            // both
      {"placement", "apply", path, "--redundant", "1"},  // a plan option without --plan
      {"placement", "apply", path, "--throttle-mib-s", "-1"},
      {"placement", "import"},
      {"rebalance", "--redundant", "many"},
      {"expert", "update", "--expert", "1", "--from", path},  // no --layer
      {"expert", "update", "--layer", "0", "--expert", "1", "--from", path, "--canary", "150"},
      {"expert", "promote", "--layer", "0"},
      {"expert"},
  };
  for (const auto& args : cases) {
    ProcessResult r = Moectl(args);
    EXPECT_EQ(r.exit_code, 2) << args[1] << " " << (args.size() > 2 ? args[2] : "") << ": "
                              << r.output;
  }
  EXPECT_TRUE(router_.applies.empty());
  EXPECT_TRUE(router_.updates.empty());
  EXPECT_TRUE(router_.actions.empty());
}

TEST_F(ControlCommandsTest, MissingFilesExit1WithAMessage) {
  const std::string missing = dir_.File("nowhere.json");
  for (const char* cmd : {"apply", "import"}) {
    ProcessResult r = Moectl({"placement", cmd, missing});
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("placement " + missing + ": no such file"), std::string::npos)
        << r.output;
  }
  ProcessResult r = Moectl({"placement", "apply", dir_.path()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("is a folder"), std::string::npos) << r.output;
  r = Moectl({"expert", "update", "--layer", "0", "--expert", "3", "--from", missing});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("expert weights " + missing + ": no such file"), std::string::npos)
      << r.output;
  EXPECT_TRUE(router_.applies.empty());
  EXPECT_TRUE(router_.updates.empty());
}

TEST_F(ControlCommandsTest, ImportChecksThePlacementFirst) {
  const std::string path = PlacementFile();
  ProcessResult r = Moectl({"placement", "import", path, "--throttle-mib-s", "16"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("placement " + path + ": v1, 8 experts, 3 ranks (1 router)"),
            std::string::npos)
      << r.output;
  ASSERT_EQ(router_.applies.size(), 1u);
  EXPECT_EQ(router_.applies[0].placement_json(), ReadFile(path));
  EXPECT_DOUBLE_EQ(router_.applies[0].throttle_mib_s(), 16);
  // JSON, but not a placement: refused here, nothing sent.
  const std::string bad = dir_.File("not_a_placement.json");
  WriteFile(bad, R"({"format": "something-else"})");
  r = Moectl({"placement", "import", bad});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("placement import: "), std::string::npos) << r.output;
  EXPECT_EQ(router_.applies.size(), 1u);
}

TEST_F(ControlCommandsTest, ProgressWithoutAMigration) {
  ProcessResult r = Moectl({"placement", "progress", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no migration has run"), std::string::npos) << r.output;
}

TEST_F(ControlCommandsTest, ExpertUpdateSendsAnAbsolutePathAndWaitsForTheCanary) {
  const std::string weights = dir_.File("expert3.safetensors");
  WriteFile(weights, "not read by moectl");
  const std::string relative = fs::relative(weights, fs::current_path()).string();
  ASSERT_NE(relative.front(), '/');
  ProcessResult r = Moectl({"expert", "update", "--layer", "1", "--expert", "3", "--from", relative,
                            "--canary", "12.5", "--wait"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(router_.updates.size(), 1u);
  const v1::ExpertUpdateRequest& u = router_.updates[0];
  EXPECT_EQ(u.layer(), 1);
  EXPECT_EQ(u.expert(), 3);
  EXPECT_DOUBLE_EQ(u.canary_percent(), 12.5);
  EXPECT_EQ(fs::path(u.file()), fs::absolute(weights).lexically_normal());
  EXPECT_NE(r.output.find("layer 1 expert 3: canary"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" 4.8 "), std::string::npos) << r.output;  // measured: 48 of 1000 rows
  ASSERT_EQ(router_.actions.size(), 2u);                             // polled until not loading
  EXPECT_EQ(router_.actions[0].action(), "status");
  EXPECT_EQ(router_.actions[0].layer(), 1);
  EXPECT_EQ(router_.actions[0].expert(), 3);
}

TEST_F(ControlCommandsTest, ExpertUpdateDefaultsAndNoWait) {
  const std::string weights = dir_.File("e.safetensors");
  WriteFile(weights, "x");
  ProcessResult r =
      Moectl({"expert", "update", "--layer", "0", "--expert", "2", "--from", weights, "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["variants"][0]["state"], "loading");
  EXPECT_DOUBLE_EQ(router_.updates.at(0).canary_percent(), 5);
  EXPECT_TRUE(router_.actions.empty());
}

TEST_F(ControlCommandsTest, FailedExpertUpdateExits1) {
  const std::string weights = dir_.File("bad_expert.safetensors");
  WriteFile(weights, "x");
  ProcessResult r =
      Moectl({"expert", "update", "--layer", "0", "--expert", "1", "--from", weights, "--wait"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("tensor ffn.w1 has the wrong shape"), std::string::npos) << r.output;
  // status reports the failed update without failing itself.
  r = Moectl({"expert", "status"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("failed"), std::string::npos) << r.output;
}

TEST_F(ControlCommandsTest, ExpertStatusPromoteRollback) {
  const std::string weights = dir_.File("e.safetensors");
  WriteFile(weights, "x");
  ASSERT_EQ(
      Moectl({"expert", "update", "--layer", "2", "--expert", "5", "--from", weights, "--wait"})
          .exit_code,
      0);
  router_.actions.clear();
  ProcessResult r = Moectl({"expert", "status", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["variants"][0]["state"], "canary");
  r = Moectl({"expert", "promote", "--layer", "2", "--expert", "5"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("promoted"), std::string::npos) << r.output;
  r = Moectl({"expert", "rollback", "--layer", "2", "--expert", "5"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rolled back"), std::string::npos) << r.output;
  r = Moectl({"expert", "rollback", "--layer", "2", "--expert", "6"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("refused: invalid_argument: no update of that expert"), std::string::npos)
      << r.output;
  ASSERT_EQ(router_.actions.size(), 4u);
  EXPECT_EQ(router_.actions[0].action(), "status");
  EXPECT_EQ(router_.actions[0].layer(), -1);
  EXPECT_EQ(router_.actions[0].expert(), -1);
  EXPECT_EQ(router_.actions[1].action(), "promote");
  EXPECT_EQ(router_.actions[1].layer(), 2);
  EXPECT_EQ(router_.actions[1].expert(), 5);
  EXPECT_EQ(router_.actions[2].action(), "rollback");
}

TEST_F(ControlCommandsTest, RequestsAreCountedByCommand) {
  ASSERT_EQ(Moectl({"placement", "apply", PlacementFile(), "--wait"}).exit_code, 0);
  ASSERT_EQ(Moectl({"expert", "status"}).exit_code, 0);
  const std::string text = metrics_.Render();
  EXPECT_NE(text.find("moerun_control_requests_total{command=\"apply\"} 1"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_control_requests_total{command=\"progress\"} 2"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_control_requests_total{command=\"expert_action\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_control_requests_total{command=\"expert_update\"} 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_control_requests_total{command=\"malformed\"} 0"), std::string::npos)
      << text;
}

TEST_F(ControlCommandsTest, CommandsNotOfferedAreRefused) {
  ControlProvider p = router_.Provider();
  p.apply = nullptr;
  p.progress = nullptr;
  p.expert_update = nullptr;
  p.expert_action = nullptr;
  Start(std::move(p));
  const std::string weights = dir_.File("e.safetensors");
  WriteFile(weights, "x");
  const std::vector<std::vector<std::string>> cases = {
      {"placement", "apply", PlacementFile()},
      {"placement", "progress"},
      {"expert", "update", "--layer", "0", "--expert", "1", "--from", weights},
      {"expert", "status"},
  };
  for (const auto& args : cases) {
    ProcessResult r = Moectl(args);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("refused: invalid_argument: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("not offered"), std::string::npos) << r.output;
  }
}

// placement plan offline (--loads, no job) with expert caches: --cache-experts N (every expert
// rank) or one value per expert rank, and the predicted hit rates it prints.
class OfflinePlanTest : public ::testing::Test {
 protected:
  ProcessResult Plan(std::vector<std::string> extra) {
    const std::string loads = dir_.File("loads.json");
    // 9 experts over 3 expert ranks: the plain plan puts the two hottest (0 and 6) on one rank.
    WriteFile(loads, R"({"layers": {"0": [10, 8, 9, 0, 7, 8, 10, 1, 7]}})");
    std::vector<std::string> argv = {MOECTL_BIN, "placement", "plan", "--loads",
                                     loads,      "--ranks",   "4"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProcess(argv, 60);
  }
  TempDir dir_;
};

TEST_F(OfflinePlanTest, CacheExpertsShowTheHitRate) {
  ProcessResult r = Plan({"--cache-experts", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hit_rate"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("0.467"), std::string::npos) << r.output;  // 28 of 60 resident
  r = Plan({"--cache-experts", "1,1,1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_NEAR(j["layers"][0]["hit_rate_before"].get<double>(), 28.0 / 60, 1e-9);
  EXPECT_NEAR(j["layers"][0]["hit_rate_after"].get<double>(), 28.0 / 60, 1e-9);
  // Without caches: no hit rate columns, and 1 in the JSON.
  r = Plan({});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("hit_rate"), std::string::npos) << r.output;
  r = Plan({"--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["layers"][0]["hit_rate_after"].get<double>(), 1.0);
}

// The cost of the plan beside it, and the plan within a byte budget.
TEST_F(OfflinePlanTest, TheCostAndAByteBudget) {
  ProcessResult r = Plan({"--expert-bytes", "1048576", "--redundant", "3", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  const int64_t bytes = std::stoll(j["cost"]["load_bytes"].get<std::string>());
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(bytes, std::stoll(j["layers"][0]["bytes_to_move"].get<std::string>()));
  EXPECT_EQ(j["cost"]["steps"], 1);
  EXPECT_GE(j["cost"]["messages"].get<int>(), 1);
  r = Plan({"--expert-bytes", "1048576", "--redundant", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cost: 1 step(s)"), std::string::npos) << r.output;
  // A budget below one expert: nothing moves.
  r = Plan({"--expert-bytes", "1048576", "--incremental", "--max-mib", "0.5", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["cost"]["load_bytes"], "0") << r.output;
  EXPECT_EQ(j["cost"]["steps"], 0) << r.output;
  EXPECT_EQ(j["layers"][0]["experts_to_load"], 0) << r.output;
  // A budget without the expert's bytes is refused with one line.
  r = Plan({"--max-mib", "10"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--expert-bytes"), std::string::npos) << r.output;
}

TEST_F(OfflinePlanTest, BadCacheExpertsExit2WithOneLine) {
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"--cache-experts", "-1"},
           {"--cache-experts", "two"},
           {"--cache-experts", "1,,1"},
           {"--cache-experts", "1,1"},  // 3 expert ranks: one value or three
       }) {
    ProcessResult r = Plan(extra);
    EXPECT_EQ(r.exit_code, 2) << extra[1] << ": " << r.output;
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    EXPECT_EQ(out.find('\n'), std::string::npos) << "more than one line:\n" << r.output;
    EXPECT_EQ(out.rfind("moectl: ", 0), 0u) << r.output;
    EXPECT_NE(out.find("--cache-experts"), std::string::npos) << r.output;
  }
  // The flag is for the offline form only (with --loads).
  ProcessResult r = RunProcess({MOECTL_BIN, "placement", "plan", "--cache-experts", "1"}, 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--loads"), std::string::npos) << r.output;
}

// Router 0's expert update metrics (launch/serve_router.h): the result counters exist at 0, the
// per-expert series appear with the expert's first update, the canary share is the configured
// one while in canary and 0 after, and each ended update counts once.
TEST(ExpertUpdateMetricsTest, CanaryShareRowsAndResults) {
  MetricsRegistry m;
  ExpertUpdateMetrics um(&m);
  std::string text = m.Render();
  for (const char* r : {"promoted", "rolled_back", "failed"}) {
    EXPECT_NE(text.find("moerun_expert_updates_total{result=\"" + std::string(r) + "\"} 0"),
              std::string::npos)
        << text;
  }
  EXPECT_EQ(text.find("moerun_expert_update_canary_share"), std::string::npos) << text;
  ExpertUpdateView v;
  v.layer = 2;
  v.expert = 5;
  v.canary = 0.25;
  v.state = "canary";
  v.rows = 400;
  v.canary_rows = 101;
  um.Refresh({v}, {});
  text = m.Render();
  EXPECT_NE(text.find("moerun_expert_update_canary_share{layer=\"2\",expert=\"5\"} 0.25"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_update_rows{layer=\"2\",expert=\"5\"} 400"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_update_canary_rows{layer=\"2\",expert=\"5\"} 101"),
            std::string::npos)
      << text;
  v.state = "promoted";
  um.Refresh({v}, {.promoted = 1});
  um.Refresh({v}, {.promoted = 1});  // counted once
  ExpertUpdateView w = v;
  w.expert = 7;
  w.state = "failed";
  um.Refresh({v, w}, {.promoted = 1, .failed = 1});
  text = m.Render();
  EXPECT_NE(text.find("moerun_expert_update_canary_share{layer=\"2\",expert=\"5\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_update_canary_share{layer=\"2\",expert=\"7\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_updates_total{result=\"promoted\"} 1"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_updates_total{result=\"rolled_back\"} 0"), std::string::npos)
      << text;
  EXPECT_NE(text.find("moerun_expert_updates_total{result=\"failed\"} 1"), std::string::npos)
      << text;
}

}  // namespace
}  // namespace moerun
