#include "runtime/migration/router_control.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "base/log.h"
#include "runtime/ep/parked.h"
#include "runtime/migration/placement_diff.h"

namespace moerun {

using nlohmann::json;

std::vector<int> RouterControl::LayerNumbers(const std::map<int, RouterLayer*>& layers) {
  std::vector<int> out;
  for (const auto& [layer, ep] : layers) out.push_back(layer);
  return out;
}

RouterControl::RouterControl(Transport* transport, std::shared_ptr<const Placement> placement,
                             std::map<int, RouterLayer*> layers, size_t header_bytes,
                             std::chrono::milliseconds deadline)
    : t_(transport),
      deadline_(deadline),
      layers_(std::move(layers)),
      header_bytes_(header_bytes),
      placement_(std::move(placement)),
      migrations_(this, LayerNumbers(layers_), header_bytes),
      updates_(this, LayerNumbers(layers_)),
      membership_(transport, this, LayerNumbers(layers_), header_bytes),
      drain_(this) {
  const int n = t_->size();
  in_headers_.resize(static_cast<size_t>(n));
  in_reqs_.resize(static_cast<size_t>(n));
}

RouterControl::~RouterControl() {
  membership_.RefuseJoins("the job is shutting down");
  for (Request& r : in_reqs_) {
    if (r.valid()) (void)t_->Cancel(r);
  }
  // Replies and switch messages are small (sent eagerly); wait a little for them, then withdraw.
  outgoing_.Drain(t_, DeadlineIn(std::chrono::milliseconds(2000)));
  for (auto& s : shutdowns_) {  // a send that cannot be withdrawn keeps its buffer
    (void)t_->Cancel(s->req);
    if (!t_->can_withdraw_sends()) ParkForProcess(std::move(s));
  }
}

Status RouterControl::SendShutdown(int rank) {
  auto s = std::make_unique<ShutdownSend>();
  s->header.assign(header_bytes_, 0);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kShutdown);
  std::memcpy(s->header.data(), &h, sizeof h);
  MOERUN_ASSIGN_OR_RETURN(s->req, t_->Isend(rank, kTagHeader, s->header.data(), s->header.size()));
  shutdowns_.push_back(std::move(s));
  return Status::Ok();
}

void RouterControl::PollShutdowns() {
  std::erase_if(shutdowns_, [this](const std::unique_ptr<ShutdownSend>& s) {
    Result<bool> done = t_->Test(s->req);
    if (!done.ok()) {  // the retired rank left before it took this router's shutdown: fine
      spdlog::info("router {}: the shutdown of retired rank {}: {}", t_->rank(), s->req.peer,
                   done.status().ToString());
    }
    return !done.ok() || *done;
  });
}

bool RouterControl::Gone(int rank) const { return membership_.dead(rank) || t_->peer_failed(rank); }

void RouterControl::CancelReceive(int rank) {
  Request& in = in_reqs_[static_cast<size_t>(rank)];
  if (in.valid()) (void)t_->Cancel(in);
  in = Request{};
}

std::vector<int> RouterControl::dead_ranks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_.dead_ranks();
}

std::vector<int> RouterControl::retired_ranks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_.retired_ranks();
}

uint64_t RouterControl::experts_replaced() const {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_.experts_replaced();
}

std::shared_ptr<const Placement> RouterControl::placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_;
}

Status RouterControl::SendToExpert(int rank, const std::string& op, ReplyFn on_reply) {
  const uint32_t id = next_id_++;
  json j = json::parse(op);
  j["id"] = id;
  std::string body = j.dump();
  std::vector<char> header(header_bytes_, 0);
  EpHeaderFixed h;
  h.kind = static_cast<uint32_t>(EpKind::kControl);
  h.layer = j.value("layer", -1);
  h.seq = id;
  h.rows = static_cast<int64_t>(body.size());
  std::memcpy(header.data(), &h, sizeof h);
  // To a dead rank nothing is sent: the operation fails at the next Poll (ExpireSilent).
  if (!Gone(rank)) {
    MOERUN_RETURN_IF_ERROR(
        outgoing_.Send(t_, rank, kTagHeader, kTagRows, std::move(header), std::move(body)));
  }
  pending_[id] = PendingOp{std::move(on_reply), rank, std::chrono::steady_clock::now()};
  return Status::Ok();
}

Status RouterControl::SendToRouter(int rank, const std::string& body) {
  if (rank == t_->rank() || Gone(rank)) return Status::Ok();  // a dead router serves nothing
  return outgoing_.Send(t_, rank, kTagControl, kTagControlBody, ControlHeaderFor(body), body);
}

Status RouterControl::PollReceives() {
  const int me = t_->rank();
  // A failure on a dead rank's channel only closes that channel.
  auto lost = [&](int p, const Status& why) {
    if (!Gone(p)) return false;
    membership_.MarkLost(p, why);
    return true;
  };
  for (int p = 0; p < t_->size(); ++p) {
    if (p == me) continue;
    Request& r = in_reqs_[static_cast<size_t>(p)];
    EpControlHeader& h = in_headers_[static_cast<size_t>(p)];
    if (Gone(p)) {
      if (r.valid()) (void)t_->Cancel(r);
      r = Request{};
      continue;
    }
    if (!r.valid()) {
      Result<Request> posted = t_->Irecv(p, kTagControl, &h, sizeof h);
      if (!posted.ok() && lost(p, posted.status())) continue;
      MOERUN_ASSIGN_OR_RETURN(r, std::move(posted));
    }
    Result<bool> tested = t_->Test(r);
    if (!tested.ok() && lost(p, tested.status())) {
      r = Request{};
      continue;
    }
    MOERUN_ASSIGN_OR_RETURN(const bool done, std::move(tested));
    if (!done) continue;
    r = Request{};
    if (h.magic != kEpMagic || h.bytes == 0 || h.bytes > kMaxControlBytes) {
      return Status::Corrupt("router " + std::to_string(me) + ": bad control message from rank " +
                             std::to_string(p));
    }
    std::string body(static_cast<size_t>(h.bytes), '\0');
    const Status got =
        t_->Recv(p, kTagControlBody, body.data(), body.size(), DeadlineIn(deadline_));
    if (!got.ok() && lost(p, got)) continue;
    MOERUN_RETURN_IF_ERROR(got);
    MOERUN_ASSIGN_OR_RETURN(r, t_->Irecv(p, kTagControl, &h, sizeof h));
    MOERUN_RETURN_IF_ERROR(OnMessage(p, body));
  }
  PollShutdowns();
  return outgoing_.Poll(t_, [this](int peer) { return Gone(peer); });
}

Status RouterControl::OnMessage(int from, const std::string& body) {
  try {
    return HandleMessage(from, body);
  } catch (const json::exception& e) {  // a field of the wrong type
    return Status::Corrupt("router " + std::to_string(t_->rank()) +
                           ": malformed control message from rank " + std::to_string(from) + ": " +
                           e.what());
  }
}

Status RouterControl::HandleMessage(int from, const std::string& body) {
  const int me = t_->rank();
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("id") || !j["id"].is_number_unsigned()) {
    return Status::Corrupt("router " + std::to_string(me) +
                           ": malformed control message from rank " + std::to_string(from));
  }
  const uint64_t id = j["id"].get<uint64_t>();
  // The coordinator's messages: a process joined as "rank", "rank" was retired, drain.
  if (j.contains("op") && j["op"] == "peer" && from == Coordinator()) {
    const int rank = j.value("rank", -1);
    const Status s = membership_.OnPeer(rank, j.value("address", std::string()));
    if (!s.ok()) {
      spdlog::error("router {}: rank {} joined, but this router cannot reach it: {}", me, rank,
                    s.ToString());
    }
    return Status::Ok();
  }
  if (j.contains("op") && j["op"] == "retire" && from == Coordinator()) {
    const int rank = j.value("rank", -1);
    const Status s = membership_.OnRetire(rank);
    if (!s.ok()) {
      spdlog::error("router {}: rank {} was retired, but not here: {}", me, rank, s.ToString());
    }
    return Status::Ok();
  }
  if (j.contains("op") && j["op"] == "drain" && from == Coordinator()) {
    drain_.Requested();
    return Status::Ok();
  }
  if (j.contains("op")) {  // router 0 to this router
    if (j["op"] != "switch" || from != Coordinator()) {
      return Status::Corrupt("router " + std::to_string(me) + ": unexpected control request");
    }
    return HandleSwitch(id, j.value("layer", -1), j.value("placement", std::string()));
  }
  if (pending_.count(id) == 0) return Status::Ok();  // a late answer to something abandoned
  ControlReply r;
  r.final = j.value("final", true);
  r.ok = j.value("ok", false);
  r.error = j.value("error", std::string());
  r.bytes = j.value("bytes", int64_t{0});
  r.freed = j.value("freed_bytes", int64_t{0});
  r.rows = j.value("rows", uint64_t{0});
  r.canary_rows = j.value("canary_rows", uint64_t{0});
  HandleReply(from, id, r);
  return Status::Ok();
}

Status RouterControl::HandleSwitch(uint64_t id, int layer, const std::string& placement_json) {
  const int me = t_->rank();
  // Answered once this router's releases are answered: router 0's "done" means freed.
  struct Pending {
    int awaiting = 0;
    int64_t freed = 0;
    std::string error;
  };
  auto p = std::make_shared<Pending>();
  auto answer = [this, id, p] {
    json reply{{"id", id}, {"final", true}, {"ok", p->error.empty()}, {"freed_bytes", p->freed}};
    if (!p->error.empty()) reply["error"] = p->error;
    return SendToRouter(0, reply.dump());
  };
  auto next = Placement::FromJson(placement_json, "router 0's placement");
  Result<int> sent = next.status();
  if (next.ok()) {
    sent = Switch(layer, std::make_shared<const Placement>(std::move(*next)), false,
                  [me, layer, p, answer](int rank, const ControlReply& r) {
                    if (!r.final) return;
                    p->freed += r.freed;
                    if (!r.ok && p->error.empty()) {
                      p->error = "rank " + std::to_string(rank) + ": " + r.error;
                      spdlog::error("router {}: layer {}: release: {}", me, layer, p->error);
                    }
                    if (--p->awaiting == 0) (void)answer();
                  });
  }
  if (!sent.ok()) {
    spdlog::error("router {}: switching layer {} failed: {}", me, layer, sent.status().ToString());
    p->error = sent.status().ToString();
    return answer();
  }
  p->awaiting = *sent;
  if (*sent == 0) return answer();
  return Status::Ok();
}

void RouterControl::HandleReply(int from, uint64_t id, const ControlReply& r) {
  const auto it = pending_.find(id);
  if (it == pending_.end() || it->second.rank != from) return;  // not the rank it was sent to
  it->second.last = std::chrono::steady_clock::now();
  ReplyFn fn = it->second.fn;
  if (r.final) pending_.erase(it);
  if (fn) fn(from, r);
}

Result<int> RouterControl::Switch(int layer, std::shared_ptr<const Placement> next,
                                  bool tell_routers, ReplyFn done) {
  const int me = t_->rank();
  std::shared_ptr<const Placement> old = placement_;
  for (auto& [l, ep] : layers_) {
    if (l == layer) MOERUN_RETURN_IF_ERROR(ep->SetPlacement(next));
  }
  placement_ = next;
  if (on_switch_) on_switch_(next);
  int sent = 0;
  const LayerPlacement* before = old->Layer(layer);
  const LayerPlacement* after = next->Layer(layer);
  if (before != nullptr && after != nullptr) {
    for (int d = next->num_routers(); d < next->num_ranks(); ++d) {
      const std::vector<int> gone = Minus(ExpertsOn(*before, d), ExpertsOn(*after, d));
      if (gone.empty() || Gone(d)) continue;  // a dead rank's copies went with it
      ReplyFn fn = done;
      if (!fn) {
        fn = [me, d, layer](int, const ControlReply& r) {
          if (!r.ok)
            spdlog::error("router {}: rank {} layer {}: release: {}", me, d, layer, r.error);
        };
      }
      MOERUN_RETURN_IF_ERROR(SendToExpert(
          d, json{{"op", "release"}, {"layer", layer}, {"experts", gone}}.dump(), std::move(fn)));
      ++sent;
    }
  }
  if (tell_routers) {
    for (int r = 0; r < next->num_routers(); ++r) {
      if (r == me || Gone(r)) continue;  // a router that died serves no layer
      const uint32_t id = next_id_++;
      pending_[id] = PendingOp{done, r, std::chrono::steady_clock::now()};
      MOERUN_RETURN_IF_ERROR(SendToRouter(
          r, json{{"id", id}, {"op", "switch"}, {"layer", layer}, {"placement", next->ToJson()}}
                 .dump()));
      ++sent;
    }
  }
  spdlog::info("router {}: layer {} now uses placement v{}", me, layer, next->version());
  return sent;
}

void RouterControl::ExpireSilent() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = pending_.begin(); it != pending_.end();) {
    const bool gone = Gone(it->second.rank);
    if (now - it->second.last < deadline_ && !gone) {
      ++it;
      continue;
    }
    ControlReply r;
    r.ok = false;
    r.error = gone ? std::string("the rank is dead")
                   : "no answer for " +
                         std::to_string(
                             std::chrono::duration_cast<std::chrono::seconds>(deadline_).count()) +
                         " s";
    const int rank = it->second.rank;
    ReplyFn fn = std::move(it->second.fn);
    it = pending_.erase(it);
    spdlog::warn("router {}: rank {} did not answer a control message: {}", t_->rank(), rank,
                 r.error);
    if (fn) fn(rank, r);
  }
}

Status RouterControl::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  membership_.TakeInDeaths();
  MOERUN_RETURN_IF_ERROR(PollReceives());
  ExpireSilent();
  if (Coordinator() != t_->rank()) return Status::Ok();
  if (t_->rank() != 0 && !took_over_) MOERUN_RETURN_IF_ERROR(TakeOver());
  membership_.StepJoins();
  MOERUN_RETURN_IF_ERROR(updates_.Step());
  MOERUN_RETURN_IF_ERROR(migrations_.Step(updates_.promoted()));
  MOERUN_RETURN_IF_ERROR(membership_.StepRetire(migrations_.last()));
  return membership_.Recover(migrations_.last(),
                             [this](const Placement& target, const MigrationOptions& options) {
                               return StartMigration(target, options);
                             });
}

int RouterControl::Coordinator() const {
  const int me = t_->rank();
  for (int r = 0; r < placement_->num_routers(); ++r) {
    if (r == me || !Gone(r)) return r;
  }
  return me;
}

int RouterControl::coordinator() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Coordinator();
}

Status RouterControl::TakeOver() {
  took_over_ = true;
  const int me = t_->rank();
  spdlog::warn(
      "router {} takes over the control plane (the routers below it are gone): every live "
      "router is told to use its placement v{}, and copies it does not use are released",
      me, placement_->version());
  // The switches first (a router answers once it uses the layer's table), then the releases
  // with all_routers: no live router sends rows for an expert this placement does not hold on
  // that rank, and the dead coordinator's half-done migration leaves no copy behind.
  struct Pending {
    int awaiting = 0;
    bool sent_all = false;
  };
  auto p = std::make_shared<Pending>();
  auto release = [this, me] {
    for (const auto& [layer, ep] : layers_) {
      const LayerPlacement* lp = placement_->Layer(layer);
      if (lp == nullptr) continue;
      for (int d = placement_->num_routers(); d < placement_->num_ranks(); ++d) {
        if (Gone(d)) continue;
        const std::set<int> held = ExpertsOn(*lp, d);
        std::vector<int> unused;
        for (int e = 0; e < placement_->num_experts(); ++e) {
          if (held.count(e) == 0) unused.push_back(e);
        }
        if (unused.empty()) continue;
        const Status s = SendToExpert(
            d,
            json{{"op", "release"}, {"layer", layer}, {"experts", unused}, {"all_routers", true}}
                .dump(),
            [me, d, layer](int, const ControlReply& r) {
              if (!r.ok) {
                spdlog::error("router {}: rank {} layer {}: release after the takeover: {}", me, d,
                              layer, r.error);
              }
            });
        if (!s.ok()) spdlog::error("router {}: release to rank {}: {}", me, d, s.ToString());
      }
    }
  };
  ReplyFn switched = [p, release, me](int from, const ControlReply& r) {
    if (!r.ok) spdlog::error("router {}: router {} did not switch: {}", me, from, r.error);
    if (--p->awaiting == 0 && p->sent_all) release();
  };
  for (const auto& [layer, ep] : layers_) {
    for (int r = 0; r < placement_->num_routers(); ++r) {
      if (r == me || Gone(r)) continue;
      const uint32_t id = next_id_++;
      pending_[id] = PendingOp{switched, r, std::chrono::steady_clock::now()};
      ++p->awaiting;
      MOERUN_RETURN_IF_ERROR(SendToRouter(
          r,
          json{{"id", id}, {"op", "switch"}, {"layer", layer}, {"placement", placement_->ToJson()}}
              .dump()));
    }
  }
  p->sent_all = true;
  if (p->awaiting == 0) release();
  return Status::Ok();
}

Status RouterControl::DrainOthers() {
  std::lock_guard<std::mutex> lock(mu_);
  return drain_.TellOthers(placement_->num_routers());
}

void RouterControl::Join(JoinAsk ask) {
  std::lock_guard<std::mutex> lock(mu_);
  membership_.Join(std::move(ask));
}

Result<MigrationView> RouterControl::StartMigration(const Placement& target,
                                                    const MigrationOptions& options) {
  MOERUN_RETURN_IF_ERROR(migrations_.CheckIdle());
  MOERUN_RETURN_IF_ERROR(updates_.CheckIdle());
  return migrations_.Start(target, options);
}

Result<MigrationView> RouterControl::Apply(const Placement& target,
                                           const MigrationOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  MOERUN_RETURN_IF_ERROR(membership_.CheckAlive(target));
  return StartMigration(target, options);
}

Result<MigrationView> RouterControl::Retire(int rank, const MigrationOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  return membership_.Retire(rank, options,
                            [this](const Placement& target, const MigrationOptions& o) {
                              return StartMigration(target, o);
                            });
}

MigrationView RouterControl::Progress() const {
  std::lock_guard<std::mutex> lock(mu_);
  return migrations_.Progress();
}

bool RouterControl::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return migrations_.running() || updates_.in_progress();
}

Result<ExpertUpdateView> RouterControl::Update(int layer, int expert, const std::string& file,
                                               double canary) {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_.Update(layer, expert, file, canary, migrations_.running());
}

Result<ExpertUpdateView> RouterControl::Act(const std::string& action, int layer, int expert) {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_.Act(action, layer, expert);
}

ExpertUpdateResults RouterControl::update_results() const {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_.results();
}

std::vector<ExpertUpdateView> RouterControl::Updates() const {
  std::lock_guard<std::mutex> lock(mu_);
  return updates_.views();
}

}  // namespace moerun
