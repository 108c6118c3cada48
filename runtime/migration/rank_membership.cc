#include "runtime/migration/rank_membership.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <span>

#include <fmt/ranges.h>

#include "base/log.h"

namespace moerun {
namespace {

using nlohmann::json;

// "2,5": the ranks a mask marks.
std::string RankList(const std::vector<bool>& mask) {
  std::vector<int> ranks;
  for (size_t r = 0; r < mask.size(); ++r) {
    if (mask[r]) ranks.push_back(static_cast<int>(r));
  }
  return fmt::format("{}", fmt::join(ranks, ","));
}

std::string Hex(const std::vector<uint8_t>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

Result<std::vector<uint8_t>> FromHex(const std::string& text) {
  auto digit = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  if (text.size() % 2 != 0) return Status::Corrupt("an address of odd length");
  std::vector<uint8_t> out(text.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::Corrupt("an address with a non-hex digit");
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return out;
}

}  // namespace

RankMembership::RankMembership(Transport* transport, ControlLink* link, std::vector<int> served,
                               size_t header_bytes)
    : t_(transport), link_(link), served_(std::move(served)), header_bytes_(header_bytes) {
  dead_.assign(static_cast<size_t>(t_->size()), false);
  retired_.assign(static_cast<size_t>(t_->size()), false);
  spare_.assign(static_cast<size_t>(t_->size()), false);
}

void RankMembership::set_health(PeerHealth* health) {
  health_ = health;
  if (health_ == nullptr) return;
  const Placement& placement = *link_->placement_in_use();
  std::vector<int> spare;
  for (int r = placement.num_routers(); r < placement.num_ranks(); ++r) {
    std::vector<bool> only(dead_.size(), false);
    only[static_cast<size_t>(r)] = true;
    if (!t_->peer_failed(r) || placement.UsesAny(only)) continue;
    health_->Retire(r, /*spare=*/true);
    dead_[static_cast<size_t>(r)] = true;
    retired_[static_cast<size_t>(r)] = true;
    spare_[static_cast<size_t>(r)] = true;
    spare.push_back(r);
  }
  dead_generation_ = health_->dead_generation();
  recovered_generation_ = dead_generation_;
  if (!spare.empty() && t_->rank() == 0) {
    spdlog::info("spare expert rank(s) {}: no process yet, free for moerun serve --join",
                 fmt::join(spare, ","));
  }
}

std::vector<int> RankMembership::dead_ranks() const {
  std::vector<int> out;
  for (size_t r = 0; r < dead_.size(); ++r) {
    if (dead_[r] && !retired_[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

std::vector<int> RankMembership::retired_ranks() const {
  std::vector<int> out;
  for (size_t r = 0; r < retired_.size(); ++r) {
    if (retired_[r] && !spare_[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

std::vector<int> RankMembership::spare_ranks() const {
  std::vector<int> out;
  for (size_t r = 0; r < spare_.size(); ++r) {
    if (spare_[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

void RankMembership::TakeInDeaths() {
  if (health_ == nullptr || health_->dead_generation() == dead_generation_) return;
  dead_generation_ = health_->dead_generation();
  const std::vector<bool>& dead = health_->dead_mask();
  for (size_t r = 0; r < dead.size() && r < dead_.size(); ++r) dead_[r] = dead_[r] || dead[r];
}

void RankMembership::MarkLost(int rank, const Status& why) {
  if (health_ != nullptr) {
    health_->MarkDead(rank, "its control channel failed: " + why.ToString());
  }
  dead_[static_cast<size_t>(rank)] = true;
}

std::vector<int> RankMembership::Capacities() const {
  std::vector<int> capacity;
  if (health_ == nullptr || expert_bytes_ <= 0) return capacity;
  for (const PeerView& p : health_->Snapshot()) {
    if (p.memory_budget_bytes == 0) continue;
    if (capacity.size() <= static_cast<size_t>(p.rank)) {
      capacity.resize(static_cast<size_t>(p.rank) + 1, -1);
    }
    capacity[static_cast<size_t>(p.rank)] = static_cast<int>(std::min<uint64_t>(
        ExpertsPerLayer(p.memory_budget_bytes, expert_bytes_, served_.size()), INT32_MAX));
  }
  return capacity;
}

Status RankMembership::CheckAlive(const Placement& target) const {
  if (target.UsesAny(dead_, served_)) {
    return Status::InvalidArgument("the placement puts experts on dead or retired rank(s) " +
                                   RankList(dead_) + ": leave them out");
  }
  return Status::Ok();
}

void RankMembership::Join(JoinAsk ask) { joins_.push_back(std::move(ask)); }

void RankMembership::RefuseJoins(const std::string& why) {
  for (JoinAsk& ask : joins_) {
    if (ask.done) ask.done(Status::Unavailable(why));
  }
  joins_.clear();
}

void RankMembership::StepJoins() {
  while (!joins_.empty()) {
    JoinAsk ask = std::move(joins_.front());
    joins_.pop_front();
    Result<JoinGrant> grant = Grant(ask);
    if (!grant.ok()) {
      spdlog::warn("join of {} refused: {}", ask.who, grant.status().ToString());
    }
    if (ask.done) ask.done(std::move(grant));
  }
}

Result<JoinGrant> RankMembership::Grant(const JoinAsk& ask) {
  if (health_ == nullptr) {
    return Status::Unsupported("this job does not watch its ranks' health: nothing can join it");
  }
  if (t_->peer_address(t_->rank()).empty()) {
    return Status::Unsupported(std::string("the ") + t_->name() +
                               " transport cannot take a new process in (run the job with "
                               "--transport ucx)");
  }
  if (ask.address.empty()) return Status::InvalidArgument("the joiner sent no address");
  const Placement& placement = *link_->placement_in_use();
  std::vector<int> layers = ask.layers;
  std::sort(layers.begin(), layers.end());
  if (ask.num_experts != placement.num_experts() || layers != served_) {
    return Status::InvalidArgument(fmt::format(
        "the joining process's model differs from this job's: {} experts, layers {} "
        "(this job: {} experts, layers {}); start it with the job's config",
        ask.num_experts, fmt::join(layers, ","), placement.num_experts(), fmt::join(served_, ",")));
  }
  int rank = -1;
  int busy = -1;
  for (int r = placement.num_routers(); r < placement.num_ranks(); ++r) {
    if (!dead_[static_cast<size_t>(r)]) continue;
    // A retired rank's slot is free once its process is gone (one launched by mpirun stays
    // until the job ends).
    if (retired_[static_cast<size_t>(r)] && !t_->peer_failed(r)) continue;
    std::vector<bool> only(dead_.size(), false);
    only[static_cast<size_t>(r)] = true;
    if (placement.UsesAny(only, served_)) {
      if (busy < 0) busy = r;
      continue;
    }
    rank = r;
    break;
  }
  if (rank < 0 && busy >= 0) {
    return Status::Unavailable("rank " + std::to_string(busy) +
                               " is dead but its experts are still being re-placed: ask again "
                               "once the recovery migration is done");
  }
  if (rank < 0) {
    return Status::InvalidArgument(
        "no expert rank of this job is dead (nor retired with its process gone): a process can "
        "only take over a dead or retired one (the job's rank count is fixed)");
  }
  // Every router takes the new endpoint; router 0 now, the others when its message comes (in
  // order before anything that gives the rank work).
  MOERUN_RETURN_IF_ERROR(TakeBack(rank, ask.address));
  const std::string body =
      json{{"id", 0}, {"op", "peer"}, {"rank", rank}, {"address", Hex(ask.address)}}.dump();
  for (int r = 1; r < placement.num_routers(); ++r) {
    if (!link_->Gone(r)) MOERUN_RETURN_IF_ERROR(link_->SendToRouter(r, body));
  }
  JoinGrant g;
  g.rank = rank;
  g.ranks = t_->size();
  g.routers = placement.num_routers();
  g.addresses.resize(static_cast<size_t>(t_->size()));
  for (int r = 0; r < g.routers; ++r) {
    if (!link_->Gone(r)) g.addresses[static_cast<size_t>(r)] = t_->peer_address(r);
  }
  g.placement_version = placement.version();
  g.header_bytes = header_bytes_;
  spdlog::warn(
      "rank {}: {} joined the job as rank {} (placement v{} holds nothing on it: a rebalance, "
      "moectl rebalance or the automatic one, gives it experts)",
      rank, ask.who, rank, g.placement_version);
  return g;
}

Status RankMembership::OnPeer(int rank, const std::string& address_hex) {
  Result<std::vector<uint8_t>> address = FromHex(address_hex);
  MOERUN_RETURN_IF_ERROR(address.status());
  return TakeBack(rank, *address);
}

Status RankMembership::TakeBack(int rank, const std::vector<uint8_t>& address) {
  const Placement& placement = *link_->placement_in_use();
  if (rank < placement.num_routers() || rank >= placement.num_ranks()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is no expert rank");
  }
  // What is still posted with the old process (its control channel here, probes and stranded
  // transfers in PeerHealth) is withdrawn before the endpoint goes.
  link_->CancelReceive(rank);
  if (health_ != nullptr) health_->Revive(rank);
  const Status replaced =
      t_->ReplacePeer(rank, std::span<const uint8_t>(address.data(), address.size()));
  if (!replaced.ok()) {
    if (health_ != nullptr)
      health_->MarkDead(rank, "taking it back failed: " + replaced.ToString());
    return replaced;
  }
  dead_[static_cast<size_t>(rank)] = false;
  retired_[static_cast<size_t>(rank)] = false;
  spare_[static_cast<size_t>(rank)] = false;
  if (health_ != nullptr) {
    // Deaths PeerHealth saw meanwhile are taken in with the revival.
    const std::vector<bool>& dead = health_->dead_mask();
    for (size_t r = 0; r < dead.size() && r < dead_.size(); ++r) {
      if (static_cast<int>(r) != rank) dead_[r] = dead_[r] || dead[r];
    }
    dead_generation_ = health_->dead_generation();
  }
  return Status::Ok();
}

void RankMembership::RecoveryEnded(const MigrationView& last) {
  if (last.state == "done") {
    experts_replaced_ += static_cast<uint64_t>(recovery_replaced_);
    recovery_id_ = 0;
    return;
  }
  // Failed (a load error, a rank that died meanwhile): tried again shortly.
  recovered_generation_ = dead_generation_ - 1;
  recovery_retry_at_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  spdlog::error("recovery: migration {} {}: trying again in 1 s", recovery_id_, last.state);
  recovery_id_ = 0;
}

Status RankMembership::Recover(const MigrationView* last, const StartMigration& start) {
  if (recovery_id_ != 0 && last != nullptr && last->id == recovery_id_ &&
      last->state != "running") {
    RecoveryEnded(*last);
  }
  if (health_ == nullptr) return Status::Ok();
  if (recovered_generation_ == dead_generation_) return Status::Ok();
  if (last != nullptr && last->state == "running") return Status::Ok();  // it fails first
  if (std::chrono::steady_clock::now() < recovery_retry_at_) return Status::Ok();
  const Placement& placement = *link_->placement_in_use();
  if (!placement.UsesAny(dead_, served_)) {
    recovered_generation_ = dead_generation_;
    return Status::Ok();
  }
  int replaced = 0;
  Result<Placement> target =
      placement.WithoutRanks(dead_, placement.version() + 1, &replaced, Capacities());
  if (!target.ok()) {
    recovered_generation_ = dead_generation_;
    spdlog::error("recovery: {}", target.status().ToString());
    return Status::Ok();  // the job serves what it still can; requests for the rest fail
  }
  const std::string ranks = RankList(dead_);
  MigrationOptions o;
  o.trigger = "recovery";
  o.note = "dead rank(s) " + ranks + ": " + std::to_string(replaced) + " expert cop" +
           (replaced == 1 ? "y" : "ies") + " re-placed on the survivors";
  o.expert_bytes = expert_bytes_;
  Result<MigrationView> started = start(*target, o);
  if (!started.ok()) {  // an expert update in progress: tried again at the next Poll
    if (recovery_blocked_ != dead_generation_) {
      recovery_blocked_ = dead_generation_;
      spdlog::error("recovery waits: {}", started.status().ToString());
    }
    return Status::Ok();
  }
  recovered_generation_ = dead_generation_;
  if (started->state == "done") {
    experts_replaced_ += static_cast<uint64_t>(replaced);
  } else {
    recovery_id_ = started->id;
    recovery_replaced_ = replaced;
  }
  spdlog::warn("recovery: migration {} to the placement without rank(s) {}: {}", started->id, ranks,
               o.note);
  return Status::Ok();
}

Result<MigrationView> RankMembership::Retire(int rank, const MigrationOptions& options,
                                             const StartMigration& start) {
  if (health_ == nullptr) {
    return Status::Unsupported("this job does not watch its ranks' health: no rank can be retired");
  }
  const Placement& placement = *link_->placement_in_use();
  if (rank < 0 || rank >= placement.num_ranks()) {
    return Status::InvalidArgument(
        fmt::format("no rank {} in this job (ranks 0..{})", rank, placement.num_ranks() - 1));
  }
  if (rank < placement.num_routers()) {
    return Status::InvalidArgument(
        fmt::format("rank {} is a router: only expert ranks (ranks {}..{}) can be retired", rank,
                    placement.num_routers(), placement.num_ranks() - 1));
  }
  const auto r = static_cast<size_t>(rank);
  if (spare_[r]) {
    return Status::InvalidArgument(
        fmt::format("rank {} is a spare slot: no process has joined it", rank));
  }
  if (retired_[r]) return Status::InvalidArgument(fmt::format("rank {} is already retired", rank));
  if (dead_[r]) {
    return Status::InvalidArgument(
        fmt::format("rank {} is dead: the recovery re-places its experts already", rank));
  }
  if (retiring_ >= 0) {
    return Status::Unavailable(
        fmt::format("rank {} is being retired: ask again once its migration is done", retiring_));
  }
  int others = 0;
  for (int d = placement.num_routers(); d < placement.num_ranks(); ++d) {
    if (d != rank && !dead_[static_cast<size_t>(d)]) ++others;
  }
  if (others == 0) {
    return Status::InvalidArgument(
        fmt::format("rank {} is the last live expert rank: it cannot be retired", rank));
  }
  std::vector<bool> only(dead_.size(), false);
  only[r] = true;
  if (!placement.UsesAny(only, served_)) {  // nothing to move: it leaves now
    MigrationView v;
    v.state = "done";
    v.trigger = "retire";
    v.from_version = v.to_version = placement.version();
    v.note = fmt::format("rank {} holds no experts: it is retired without a migration", rank);
    retiring_ = rank;  // at the next StepRetire, on the router thread
    retire_id_ = 0;
    return v;
  }
  std::vector<bool> out = dead_;
  out[r] = true;
  MOERUN_ASSIGN_OR_RETURN(Placement target, placement.WithoutRanks(out, placement.version() + 1,
                                                                   nullptr, Capacities()));
  MigrationOptions o = options;
  o.trigger = "retire";
  o.note = fmt::format("retire rank {}: its experts re-placed on the other expert ranks", rank);
  MOERUN_ASSIGN_OR_RETURN(MigrationView started, start(target, o));
  int loads = 0;
  for (const MigrationLayerView& l : started.layers) loads += l.experts_to_load;
  spdlog::warn(
      "retire: migration {} to the placement without rank {} ({} expert cop{} to load on the "
      "others); the rank leaves once it is done",
      started.id, rank, loads, loads == 1 ? "y" : "ies");
  retiring_ = rank;
  retire_id_ = started.id;
  return started;
}

Status RankMembership::StepRetire(const MigrationView* last) {
  if (retiring_ < 0) return Status::Ok();
  const int rank = retiring_;
  if (retire_id_ == 0) {  // nothing to move
    retiring_ = -1;
    return CompleteRetire(rank);
  }
  if (last == nullptr || last->id != retire_id_ || last->state == "running") return Status::Ok();
  retiring_ = -1;
  retire_id_ = 0;
  if (last->state != "done") {
    spdlog::error("retire of rank {} failed: migration {} {}{}: the rank stays in the job", rank,
                  last->id, last->state, last->error.empty() ? "" : ": " + last->error);
    return Status::Ok();
  }
  return CompleteRetire(rank);
}

Status RankMembership::CompleteRetire(int rank) {
  const Placement& placement = *link_->placement_in_use();
  const std::string body = json{{"id", 0}, {"op", "retire"}, {"rank", rank}}.dump();
  for (int r = 1; r < placement.num_routers(); ++r) {
    if (!link_->Gone(r)) MOERUN_RETURN_IF_ERROR(link_->SendToRouter(r, body));
  }
  return OnRetire(rank);
}

Status RankMembership::OnRetire(int rank) {
  const Placement& placement = *link_->placement_in_use();
  if (rank < placement.num_routers() || rank >= placement.num_ranks()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is no expert rank");
  }
  const auto r = static_cast<size_t>(rank);
  if (retired_[r]) return Status::Ok();
  std::vector<bool> only(dead_.size(), false);
  only[r] = true;
  if (placement.UsesAny(only, served_)) {
    return Status::Internal(
        fmt::format("rank {} cannot retire: placement v{} in use here still holds experts on it",
                    rank, placement.version()));
  }
  // Its shutdown goes after everything this router sent it (the releases of its last copies).
  if (!link_->Gone(rank)) MOERUN_RETURN_IF_ERROR(link_->SendShutdown(rank));
  if (health_ != nullptr) health_->Retire(rank);
  dead_[r] = true;
  retired_[r] = true;
  spdlog::warn("rank {} retired: it holds no experts and was sent this router's shutdown", rank);
  return Status::Ok();
}

}  // namespace moerun
