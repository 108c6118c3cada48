#include "runtime/migration/expert_updates.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include <fmt/ranges.h>

#include "base/log.h"

namespace moerun {

using nlohmann::json;

ExpertUpdates::ExpertUpdates(ControlLink* link, std::vector<int> served)
    : link_(link), served_(std::move(served)) {}

Result<ExpertUpdateView> ExpertUpdates::Update(int layer, int expert, const std::string& file,
                                               double canary, bool migration_running) {
  const Placement& placement = *link_->placement_in_use();
  if (std::find(served_.begin(), served_.end(), layer) == served_.end()) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is not served");
  }
  if (expert < 0 || expert >= placement.num_experts()) {
    return Status::InvalidArgument("no expert " + std::to_string(expert) + " (the model has " +
                                   std::to_string(placement.num_experts()) + ")");
  }
  if (!(canary >= 0.0 && canary <= 1.0)) {
    return Status::InvalidArgument("the canary share must be within 0..100 %");
  }
  if (file.empty()) return Status::InvalidArgument("no weights file given");
  if (migration_running) {
    return Status::Unavailable("a migration is running: update experts once it is done");
  }
  const Key key = std::make_pair(layer, expert);
  const auto it = updates_.find(key);
  if (it != updates_.end() &&
      (it->second.view.state == "loading" || it->second.view.state == "canary")) {
    return Status::Unavailable("layer " + std::to_string(layer) + " expert " +
                               std::to_string(expert) +
                               " already has an update: promote or roll it back first");
  }
  UpdateState st;
  st.view.layer = layer;
  st.view.expert = expert;
  st.view.file = file;
  st.view.canary = canary;
  st.view.state = "loading";
  const LayerPlacement* lp = placement.Layer(layer);
  std::set<int> ranks;
  for (int s : lp->replicas[static_cast<size_t>(expert)]) {
    ranks.insert(lp->slots[static_cast<size_t>(s)].rank);
  }
  st.view.ranks.assign(ranks.begin(), ranks.end());
  updates_[key] = st;
  actions_.push_back({"update", key});
  spdlog::info("layer {} expert {}: new weights from {} on rank(s) {}, canary {:.2f}%", layer,
               expert, file, fmt::join(st.view.ranks, ","), canary * 100);
  return st.view;
}

Result<ExpertUpdateView> ExpertUpdates::Act(const std::string& action, int layer, int expert) {
  const auto it = updates_.find({layer, expert});
  if (it == updates_.end()) {
    return Status::NotFound("layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
                            " has no update");
  }
  UpdateState& u = it->second;
  if (action != "promote" && action != "rollback") {
    return Status::InvalidArgument("unknown action '" + action + "'");
  }
  if (u.view.state != "canary" || !u.pending_action.empty()) {
    return Status::Unavailable(
        "the update of layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
        " is " + (u.pending_action.empty() ? u.view.state : u.pending_action + "ing") +
        ", not in canary");
  }
  u.pending_action = action;
  actions_.push_back({action, {layer, expert}});
  return u.view;
}

std::vector<ExpertUpdateView> ExpertUpdates::views() const {
  std::vector<ExpertUpdateView> out;
  for (const auto& [key, u] : updates_) out.push_back(u.view);
  return out;
}

bool ExpertUpdates::in_progress() const {
  for (const auto& [key, u] : updates_) {
    if (u.view.state == "loading" || u.view.state == "canary") return true;
  }
  return false;
}

Status ExpertUpdates::CheckIdle() const {
  for (const auto& [key, u] : updates_) {
    if (u.view.state == "loading" || u.view.state == "canary") {
      return Status::Unavailable("layer " + std::to_string(key.first) + " expert " +
                                 std::to_string(key.second) +
                                 " has an update in progress: promote or roll it back first");
    }
  }
  return Status::Ok();
}

void ExpertUpdates::OnAnswer(const Key& key, const std::string& action, int rank,
                             const ControlReply& r) {
  if (!r.final) return;
  UpdateState& st = updates_.at(key);
  if (!r.ok && st.view.error.empty()) {
    st.view.error = "rank " + std::to_string(rank) + ": " + r.error;
  }
  if (r.ok && action != "update") st.counts[rank] = {r.rows, r.canary_rows};
  if (--st.awaiting > 0) return;
  if (action != "update") {
    st.view.rows = st.view.canary_rows = 0;
    for (const auto& [from, c] : st.counts) {
      st.view.rows += c.first;
      st.view.canary_rows += c.second;
    }
  }
  st.pending_action.clear();
  if (action == "update") {
    if (st.view.error.empty()) {
      st.view.state = "canary";
      st.last_query = std::chrono::steady_clock::now();
      spdlog::info("layer {} expert {}: canary of {:.2f}% on", key.first, key.second,
                   st.view.canary * 100);
    } else {
      st.view.state = "failed";
      ++results_.failed;
      spdlog::error("layer {} expert {}: update failed: {}", key.first, key.second, st.view.error);
      for (int d2 : st.view.ranks) {  // those that did load drop their copy
        (void)link_->SendToExpert(
            d2, json{{"op", "rollback"}, {"layer", key.first}, {"expert", key.second}}.dump(),
            nullptr);
      }
    }
  } else if (action == "promote") {
    st.view.state = st.view.error.empty() ? "promoted" : "failed";
    if (st.view.error.empty()) promoted_[key] = st.view.file;
    ++(st.view.error.empty() ? results_.promoted : results_.failed);
    spdlog::info("layer {} expert {}: {}", key.first, key.second, st.view.state);
  } else {
    st.view.state = st.view.error.empty() ? "rolled back" : "failed";
    ++(st.view.error.empty() ? results_.rolled_back : results_.failed);
    spdlog::info("layer {} expert {}: {}", key.first, key.second, st.view.state);
  }
}

Status ExpertUpdates::Step() {
  while (!actions_.empty()) {
    const std::string action = actions_.front().first;
    const Key key = actions_.front().second;
    actions_.pop_front();
    UpdateState& u = updates_.at(key);
    u.awaiting = static_cast<int>(u.view.ranks.size());
    u.view.error.clear();
    json op{{"op", action}, {"layer", key.first}, {"expert", key.second}};
    if (action == "update") {
      op["file"] = u.view.file;
      op["canary"] = u.view.canary;
    }
    for (int d : u.view.ranks) {
      MOERUN_RETURN_IF_ERROR(
          link_->SendToExpert(d, op.dump(), [this, key, action](int rank, const ControlReply& r) {
            OnAnswer(key, action, rank, r);
          }));
    }
  }
  return QueryCanaries();
}

Status ExpertUpdates::QueryCanaries() {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [key, u] : updates_) {
    if (u.view.state != "canary" || u.querying > 0 || !u.pending_action.empty() ||
        now - u.last_query < std::chrono::seconds(1)) {
      continue;
    }
    u.last_query = now;
    u.querying = static_cast<int>(u.view.ranks.size());
    const Key k = key;
    for (int d : u.view.ranks) {
      MOERUN_RETURN_IF_ERROR(link_->SendToExpert(
          d, json{{"op", "query"}, {"layer", key.first}, {"expert", key.second}}.dump(),
          [this, k](int rank, const ControlReply& r) {
            if (!r.final) return;
            UpdateState& st = updates_.at(k);
            if (r.ok) st.counts[rank] = {r.rows, r.canary_rows};
            if (--st.querying > 0 || !st.pending_action.empty()) return;
            st.view.rows = st.view.canary_rows = 0;
            for (const auto& [from, c] : st.counts) {
              st.view.rows += c.first;
              st.view.canary_rows += c.second;
            }
          }));
    }
  }
  return Status::Ok();
}

}  // namespace moerun
