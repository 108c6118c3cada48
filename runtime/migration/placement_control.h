// Router 0's answers to moectl's placement and expert commands (apply, rebalance, progress,
// expert update / promote / rollback) on top of its RouterControl, and the automatic mode: every
// interval, a plan on the window's loads, applied when its predicted gain is worth it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "moerun/v1/control.pb.h"
#include "runtime/migration/router_control.h"

namespace moerun {

// Online migrations (moectl placement apply / rebalance) and the automatic mode.
struct RebalanceConfig {
  double throttle_mib_s = 0;  // loading bandwidth per expert rank (0: unlimited)
  bool automatic = false;     // plan on the window's loads every interval and apply when worth it
  int64_t interval_s = 300;
  double min_gain = 0.05;  // predicted balancedness gain (mean over layers) needed to apply
  int redundant = 0;       // redundant expert slots per layer the planner may add
  std::string policy = "default";
  int64_t min_assignments = 1000;  // assignments the window must hold before a plan is made
};

// Where router 0's plans come from: the loads its router measured (the serving rank's window,
// or the totals since the start). Any thread.
class PlanSource {
 public:
  virtual ~PlanSource() = default;
  // A planner dry run on the measured loads.
  virtual Result<moerun::v1::PlanResponse> Plan(const moerun::v1::PlanRequest& request) const = 0;
  // Assignments the window holds now, over every layer (the automatic mode waits for enough).
  virtual uint64_t WindowAssignments() const = 0;
  // One expert's weights (for the bytes a migration moves).
  virtual int64_t expert_bytes() const = 0;
};

moerun::v1::MigrationStatus MigrationToProto(const MigrationView& v);
moerun::v1::ExpertVariant UpdateToProto(const ExpertUpdateView& v);

class PlacementControl {
 public:
  // `update_dirs`: the only directories expert update files are read from (migration/
  // file_allow.h); empty: expert updates are refused.
  PlacementControl(const PlanSource* plans, RouterControl* control, RebalanceConfig config,
                   std::vector<std::string> update_dirs);

  // Any thread (the control endpoint's). With retire_rank: RouterControl::Retire.
  Result<moerun::v1::MigrationStatus> Apply(const moerun::v1::ApplyRequest& request);
  moerun::v1::MigrationStatus Progress() const;
  Result<moerun::v1::ExpertResponse> Update(const moerun::v1::ExpertUpdateRequest& request);
  Result<moerun::v1::ExpertResponse> Action(const moerun::v1::ExpertActionRequest& request);
  // A process taking over a dead expert rank (RouterControl::Join); `done` is called once, on
  // router 0's thread.
  void Join(const moerun::v1::JoinRequest& request,
            std::function<void(Result<moerun::v1::JoinResponse>)> done);
  // Router 0's thread, between batches: the automatic mode.
  void Tick();

 private:
  Result<moerun::v1::MigrationStatus> ApplyPlan(const moerun::v1::PlanRequest& plan,
                                                double min_gain, double throttle_mib_s,
                                                const std::string& trigger);

  const PlanSource* plans_;
  RouterControl* control_;
  RebalanceConfig config_;
  std::vector<std::string> update_dirs_;
  std::chrono::steady_clock::time_point next_auto_;
  mutable std::mutex mu_;
  uint64_t plan_for_ = 0;  // the migration the plan below made
  moerun::v1::PlanResponse plan_;
};

}  // namespace moerun
