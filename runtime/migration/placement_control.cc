#include "runtime/migration/placement_control.h"

#include <fmt/format.h>

#include "base/log.h"
#include "runtime/migration/file_allow.h"

namespace moerun {

moerun::v1::MigrationStatus MigrationToProto(const MigrationView& v) {
  moerun::v1::MigrationStatus m;
  m.set_id(v.id);
  m.set_state(v.state);
  m.set_from_version(v.from_version);
  m.set_to_version(v.to_version);
  for (const MigrationLayerView& l : v.layers) {
    moerun::v1::MigrationLayer* ml = m.add_layers();
    ml->set_layer(l.layer);
    ml->set_state(l.state);
    ml->set_experts_to_load(l.experts_to_load);
    ml->set_experts_to_free(l.experts_to_free);
    ml->set_bytes_to_move(l.bytes_to_move);
    ml->set_bytes_loaded(l.bytes_loaded);
    ml->set_seconds(l.seconds);
    ml->set_bytes_freed(l.bytes_freed);
  }
  m.set_bytes_to_move(v.bytes_to_move);
  m.set_bytes_loaded(v.bytes_loaded);
  m.set_bytes_freed(v.bytes_freed);
  m.set_elapsed_s(v.elapsed_s);
  m.set_error(v.error);
  m.set_note(v.note);
  m.set_throttle_mib_s(v.throttle_bytes_s / (1 << 20));
  m.set_trigger(v.trigger);
  return m;
}

moerun::v1::ExpertVariant UpdateToProto(const ExpertUpdateView& v) {
  moerun::v1::ExpertVariant e;
  e.set_layer(v.layer);
  e.set_expert(v.expert);
  e.set_file(v.file);
  e.set_canary_percent(v.canary * 100);
  e.set_state(v.state);
  for (int r : v.ranks) e.add_ranks(r);
  e.set_rows(v.rows);
  e.set_canary_rows(v.canary_rows);
  e.set_error(v.error);
  return e;
}

PlacementControl::PlacementControl(const PlanSource* plans, RouterControl* control,
                                   RebalanceConfig config, std::vector<std::string> update_dirs)
    : plans_(plans),
      control_(control),
      config_(std::move(config)),
      update_dirs_(std::move(update_dirs)),
      next_auto_(std::chrono::steady_clock::now() + std::chrono::seconds(config_.interval_s)) {}

Result<moerun::v1::MigrationStatus> PlacementControl::ApplyPlan(
    const moerun::v1::PlanRequest& request, double min_gain, double throttle_mib_s,
    const std::string& trigger) {
  MOERUN_ASSIGN_OR_RETURN(moerun::v1::PlanResponse plan, plans_->Plan(request));
  double gain = 0;
  for (const auto& l : plan.layers()) gain += l.balancedness_after() - l.balancedness_before();
  if (plan.layers_size() > 0) gain /= plan.layers_size();
  if (plan.placement_json().empty() || gain < min_gain) {
    moerun::v1::MigrationStatus m = MigrationToProto(control_->Progress());
    m.set_state("skipped");
    m.set_trigger(trigger);
    m.set_note(plan.placement_json().empty()
                   ? "the planner made no placement: " + plan.note()
                   : fmt::format("predicted balancedness gain {:.3f} is below the minimum {:.3f}",
                                 gain, min_gain));
    *m.mutable_plan() = plan;
    return m;
  }
  MOERUN_ASSIGN_OR_RETURN(Placement target, Placement::FromJson(plan.placement_json(), "the plan"));
  MigrationOptions o;
  o.throttle_bytes_s = throttle_mib_s * (1 << 20);
  o.expert_bytes = plans_->expert_bytes();
  o.trigger = trigger;
  o.note = fmt::format("{} plan, predicted balancedness gain {:.3f}",
                       plan.policy().empty() ? "default" : plan.policy(), gain);
  MOERUN_ASSIGN_OR_RETURN(MigrationView v, control_->Apply(target, o));
  moerun::v1::MigrationStatus m = MigrationToProto(v);
  *m.mutable_plan() = plan;
  std::lock_guard<std::mutex> lock(mu_);
  plan_for_ = v.id;
  plan_ = plan;
  return m;
}

Result<moerun::v1::MigrationStatus> PlacementControl::Apply(const moerun::v1::ApplyRequest& r) {
  if (r.throttle_mib_s() < 0) return Status::InvalidArgument("the throttle must not be negative");
  const double throttle = r.throttle_mib_s() > 0 ? r.throttle_mib_s() : config_.throttle_mib_s;
  if (r.has_retire_rank()) {
    if (r.from_plan() || !r.placement_json().empty()) {
      return Status::InvalidArgument("a retire names no placement and no plan");
    }
    MigrationOptions o;
    o.throttle_bytes_s = throttle * (1 << 20);
    o.expert_bytes = plans_->expert_bytes();
    MOERUN_ASSIGN_OR_RETURN(MigrationView v, control_->Retire(r.retire_rank(), o));
    return MigrationToProto(v);
  }
  if (r.from_plan()) return ApplyPlan(r.plan(), r.min_gain(), throttle, "moectl");
  if (r.placement_json().empty()) {
    return Status::InvalidArgument("give a placement (apply FILE) or --plan");
  }
  MOERUN_ASSIGN_OR_RETURN(Placement target,
                          Placement::FromJson(r.placement_json(), "the placement given"));
  MigrationOptions o;
  o.throttle_bytes_s = throttle * (1 << 20);
  o.expert_bytes = plans_->expert_bytes();
  o.trigger = "moectl";
  MOERUN_ASSIGN_OR_RETURN(MigrationView v, control_->Apply(target, o));
  return MigrationToProto(v);
}

moerun::v1::MigrationStatus PlacementControl::Progress() const {
  moerun::v1::MigrationStatus m = MigrationToProto(control_->Progress());
  std::lock_guard<std::mutex> lock(mu_);
  if (m.id() != 0 && m.id() == plan_for_) *m.mutable_plan() = plan_;
  return m;
}

Result<moerun::v1::ExpertResponse> PlacementControl::Update(
    const moerun::v1::ExpertUpdateRequest& r) {
  if (!(r.canary_percent() >= 0 && r.canary_percent() <= 100)) {
    return Status::InvalidArgument("--canary must be within 0..100");
  }
  // The expert ranks read the resolved path, checked here against the allowed directories.
  MOERUN_ASSIGN_OR_RETURN(std::string file,
                          ResolveAllowedFile(r.file(), update_dirs_, "expert update file"));
  MOERUN_ASSIGN_OR_RETURN(ExpertUpdateView v,
                          control_->Update(r.layer(), r.expert(), file, r.canary_percent() / 100));
  moerun::v1::ExpertResponse out;
  *out.add_variants() = UpdateToProto(v);
  return out;
}

Result<moerun::v1::ExpertResponse> PlacementControl::Action(
    const moerun::v1::ExpertActionRequest& r) {
  moerun::v1::ExpertResponse out;
  if (r.action() == "status") {
    for (const ExpertUpdateView& v : control_->Updates()) {
      if ((r.layer() >= 0 && v.layer != r.layer()) || (r.expert() >= 0 && v.expert != r.expert())) {
        continue;
      }
      *out.add_variants() = UpdateToProto(v);
    }
    return out;
  }
  MOERUN_ASSIGN_OR_RETURN(ExpertUpdateView v, control_->Act(r.action(), r.layer(), r.expert()));
  *out.add_variants() = UpdateToProto(v);
  return out;
}

void PlacementControl::Tick() {
  if (!config_.automatic) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_auto_) return;
  next_auto_ = now + std::chrono::seconds(config_.interval_s);
  if (control_->busy()) return;
  if (plans_->WindowAssignments() < static_cast<uint64_t>(config_.min_assignments)) return;
  moerun::v1::PlanRequest req;
  req.set_redundant(config_.redundant);
  req.set_policy(config_.policy);
  auto m = ApplyPlan(req, config_.min_gain, config_.throttle_mib_s, "auto");
  if (!m.ok()) {
    spdlog::warn("automatic rebalance: {}", m.status().ToString());
  } else if (m->state() == "skipped") {
    spdlog::info("automatic rebalance skipped: {}", m->note());
  } else {
    spdlog::info("automatic rebalance started: migration {} ({})", m->id(), m->note());
  }
}

void PlacementControl::Join(const moerun::v1::JoinRequest& request,
                            std::function<void(Result<moerun::v1::JoinResponse>)> done) {
  JoinAsk ask;
  ask.address.assign(request.address().begin(), request.address().end());
  ask.who = "a process on " + (request.host().empty() ? std::string("?") : request.host()) +
            " (pid " + std::to_string(request.pid()) + ")";
  ask.layers.assign(request.layers().begin(), request.layers().end());
  ask.num_experts = request.num_experts();
  ask.done = [done = std::move(done)](Result<JoinGrant> grant) {
    if (!grant.ok()) return done(grant.status());
    moerun::v1::JoinResponse r;
    r.set_rank(grant->rank);
    r.set_ranks(grant->ranks);
    r.set_routers(grant->routers);
    for (const std::vector<uint8_t>& a : grant->addresses) r.add_addresses(a.data(), a.size());
    r.set_placement_version(grant->placement_version);
    r.set_header_bytes(grant->header_bytes);
    done(std::move(r));
  };
  control_->Join(std::move(ask));
}

}  // namespace moerun
