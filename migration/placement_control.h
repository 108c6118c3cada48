// Router 0's answers to moectl's placement and expert commands (apply, rebalance, progress,
// expert update / promote / rollback) on top of its RouterControl, and the automatic mode: every
// interval, a plan on the window's loads, applied when its predicted gain is worth it.
#pragma once

#include <chrono>
#include <mutex>

#include "launch/rank_services.h"
#include "launch/serve_config.h"
#include "migration/router_control.h"
#include "moerun/v1/control.pb.h"

namespace moerun {

moerun::v1::MigrationStatus MigrationToProto(const MigrationView& v);
moerun::v1::ExpertVariant UpdateToProto(const ExpertUpdateView& v);

class PlacementControl {
 public:
  PlacementControl(RankServices* services, RouterControl* control, RebalanceConfig config);

  // Any thread (the control endpoint's).
  Result<moerun::v1::MigrationStatus> Apply(const moerun::v1::ApplyRequest& request);
  moerun::v1::MigrationStatus Progress() const;
  Result<moerun::v1::ExpertResponse> Update(const moerun::v1::ExpertUpdateRequest& request);
  Result<moerun::v1::ExpertResponse> Action(const moerun::v1::ExpertActionRequest& request);
  // Router 0's thread, between batches: the automatic mode.
  void Tick();

 private:
  Result<moerun::v1::MigrationStatus> ApplyPlan(const moerun::v1::PlanRequest& plan,
                                                double min_gain, double throttle_mib_s,
                                                const std::string& trigger);

  RankServices* rs_;
  RouterControl* control_;
  RebalanceConfig config_;
  std::chrono::steady_clock::time_point next_auto_;
  mutable std::mutex mu_;
  uint64_t plan_for_ = 0;  // the migration the plan below made
  moerun::v1::PlanResponse plan_;
};

}  // namespace moerun
