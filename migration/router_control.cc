#include "migration/router_control.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include <fmt/ranges.h>

#include "base/log.h"

namespace moerun {
namespace {

using nlohmann::json;

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Logical experts of `rank` in a layer placement.
std::set<int> ExpertsOn(const LayerPlacement& lp, int rank) {
  std::set<int> out;
  for (int s : lp.rank_slots[static_cast<size_t>(rank)]) {
    out.insert(lp.slots[static_cast<size_t>(s)].expert);
  }
  return out;
}

// "2,5": the ranks a mask marks.
std::string RankList(const std::vector<bool>& mask) {
  std::vector<int> ranks;
  for (size_t r = 0; r < mask.size(); ++r) {
    if (mask[r]) ranks.push_back(static_cast<int>(r));
  }
  return fmt::format("{}", fmt::join(ranks, ","));
}

std::vector<int> Minus(const std::set<int>& a, const std::set<int>& b) {
  std::vector<int> out;
  for (int x : a) {
    if (b.count(x) == 0) out.push_back(x);
  }
  return out;
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

struct RouterControlReply {
  bool final = true;
  bool ok = true;
  std::string error;
  int64_t bytes = 0;
  int64_t freed = 0;  // release: bytes freed (switch: by the releases of that router)
  uint64_t rows = 0, canary_rows = 0;
};

RouterControl::RouterControl(Transport* transport, std::shared_ptr<const Placement> placement,
                             std::map<int, RouterLayer*> layers, size_t header_bytes,
                             std::chrono::milliseconds deadline)
    : t_(transport),
      layers_(std::move(layers)),
      header_bytes_(header_bytes),
      deadline_(deadline),
      placement_(std::move(placement)) {
  const int n = t_->size();
  in_headers_.resize(static_cast<size_t>(n));
  in_reqs_.resize(static_cast<size_t>(n));
  dead_.assign(static_cast<size_t>(n), false);
  for (const auto& [layer, ep] : layers_) served_.push_back(layer);
}

bool RouterControl::Gone(int rank) const {
  return (rank >= 0 && static_cast<size_t>(rank) < dead_.size() &&
          dead_[static_cast<size_t>(rank)]) ||
         t_->peer_failed(rank);
}

std::vector<int> RouterControl::dead_ranks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (size_t r = 0; r < dead_.size(); ++r) {
    if (dead_[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

uint64_t RouterControl::experts_replaced() const {
  std::lock_guard<std::mutex> lock(mu_);
  return experts_replaced_;
}

RouterControl::~RouterControl() {
  for (JoinAsk& ask : joins_) {
    if (ask.done) ask.done(Status::Unavailable("the job is shutting down"));
  }
  for (Request& r : in_reqs_) {
    if (r.valid()) (void)t_->Cancel(r);
  }
  // Replies and switch messages are small (sent eagerly); wait a little for them, then withdraw.
  outgoing_.Drain(t_, DeadlineIn(std::chrono::milliseconds(2000)));
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
  return outgoing_.Send(t_, rank, kTagControl, kTagControlBody, ControlHeaderFor(body), body);
}

Status RouterControl::PollReceives() {
  const int me = t_->rank();
  // A failure on a dead rank's channel only closes that channel.
  auto lost = [&](int p, const Status& why) {
    if (!Gone(p)) return false;
    if (health_ != nullptr) health_->MarkDead(p, "its control channel failed: " + why.ToString());
    dead_[static_cast<size_t>(p)] = true;
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
  if (j.contains("op") && j["op"] == "peer" && from == 0) {  // a process joined as "rank"
    const int rank = j.value("rank", -1);
    Result<std::vector<uint8_t>> address = FromHex(j.value("address", std::string()));
    Status s = address.status();
    if (s.ok()) s = TakeBack(rank, *address);
    if (!s.ok()) {
      spdlog::error("router {}: rank {} joined, but this router cannot reach it: {}", me, rank,
                    s.ToString());
    }
    return Status::Ok();
  }
  if (j.contains("op") && j["op"] == "drain" && from == 0) {
    drain_requested_.store(true);
    return Status::Ok();
  }
  if (j.contains("op")) {  // router 0 to this router
    if (j["op"] != "switch" || from != 0) {
      return Status::Corrupt("router " + std::to_string(me) + ": unexpected control request");
    }
    // Answered once this router's releases are answered: router 0's "done" means freed.
    const int layer = j.value("layer", -1);
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
    auto next = Placement::FromJson(j.value("placement", std::string()), "router 0's placement");
    Result<int> sent = next.status();
    if (next.ok()) {
      sent = Switch(layer, std::make_shared<const Placement>(std::move(*next)), false,
                    [me, layer, p, answer](int rank, const RouterControlReply& r) {
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
      spdlog::error("router {}: switching layer {} failed: {}", me, layer,
                    sent.status().ToString());
      p->error = sent.status().ToString();
      return answer();
    }
    p->awaiting = *sent;
    if (*sent == 0) return answer();
    return Status::Ok();
  }
  const auto it = pending_.find(id);
  if (it == pending_.end()) return Status::Ok();  // a late answer to something abandoned
  RouterControlReply r;
  r.final = j.value("final", true);
  r.ok = j.value("ok", false);
  r.error = j.value("error", std::string());
  r.bytes = j.value("bytes", int64_t{0});
  r.freed = j.value("freed_bytes", int64_t{0});
  r.rows = j.value("rows", uint64_t{0});
  r.canary_rows = j.value("canary_rows", uint64_t{0});
  if (it->second.rank != from) return Status::Ok();  // not the rank it was sent to
  it->second.last = std::chrono::steady_clock::now();
  ReplyFn fn = it->second.fn;
  if (r.final) pending_.erase(it);
  if (fn) fn(from, r);
  return Status::Ok();
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
        fn = [me, d, layer](int, const RouterControlReply& r) {
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
    for (int r = 1; r < next->num_routers(); ++r) {
      if (Gone(r)) continue;  // a router that died serves no layer
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
    RouterControlReply r;
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
  if (health_ != nullptr && health_->dead_generation() != dead_generation_) {
    dead_generation_ = health_->dead_generation();
    const std::vector<bool>& dead = health_->dead_mask();
    for (size_t r = 0; r < dead.size() && r < dead_.size(); ++r) dead_[r] = dead_[r] || dead[r];
  }
  MOERUN_RETURN_IF_ERROR(PollReceives());
  ExpireSilent();
  if (t_->rank() != 0) return Status::Ok();
  StepJoins();
  MOERUN_RETURN_IF_ERROR(StepUpdates());
  MOERUN_RETURN_IF_ERROR(StepMigration());
  return Recover();
}

Status RouterControl::DrainOthers() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string body = json{{"id", 0}, {"op", "drain"}}.dump();
  for (int r = 1; r < placement_->num_routers(); ++r) {
    if (!Gone(r)) MOERUN_RETURN_IF_ERROR(SendToRouter(r, body));
  }
  return Status::Ok();
}

void RouterControl::Join(JoinAsk ask) {
  std::lock_guard<std::mutex> lock(mu_);
  joins_.push_back(std::move(ask));
}

void RouterControl::StepJoins() {
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

Result<JoinGrant> RouterControl::Grant(const JoinAsk& ask) {
  if (health_ == nullptr) {
    return Status::Unsupported("this job does not watch its ranks' health: nothing can join it");
  }
  if (t_->peer_address(t_->rank()).empty()) {
    return Status::Unsupported(std::string("the ") + t_->name() +
                               " transport cannot take a new process in (run the job with "
                               "--transport ucx)");
  }
  if (ask.address.empty()) return Status::InvalidArgument("the joiner sent no address");
  std::vector<int> layers = ask.layers;
  std::sort(layers.begin(), layers.end());
  if (ask.num_experts != placement_->num_experts() || layers != served_) {
    return Status::InvalidArgument(
        fmt::format("the joining process's model differs from this job's: {} experts, layers {} "
                    "(this job: {} experts, layers {}); start it with the job's config",
                    ask.num_experts, fmt::join(layers, ","), placement_->num_experts(),
                    fmt::join(served_, ",")));
  }
  int rank = -1;
  int busy = -1;
  for (int r = placement_->num_routers(); r < placement_->num_ranks(); ++r) {
    if (!dead_[static_cast<size_t>(r)]) continue;
    std::vector<bool> only(dead_.size(), false);
    only[static_cast<size_t>(r)] = true;
    if (placement_->UsesAny(only, served_)) {
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
        "no expert rank of this job is dead: a process can only take over a dead one (adding "
        "ranks to a job is not supported)");
  }
  // Every router takes the new endpoint; router 0 now, the others when its message comes (in
  // order before anything that gives the rank work).
  MOERUN_RETURN_IF_ERROR(TakeBack(rank, ask.address));
  const std::string body =
      json{{"id", 0}, {"op", "peer"}, {"rank", rank}, {"address", Hex(ask.address)}}.dump();
  for (int r = 1; r < placement_->num_routers(); ++r) {
    if (!Gone(r)) MOERUN_RETURN_IF_ERROR(SendToRouter(r, body));
  }
  JoinGrant g;
  g.rank = rank;
  g.ranks = t_->size();
  g.routers = placement_->num_routers();
  g.addresses.resize(static_cast<size_t>(t_->size()));
  for (int r = 0; r < g.routers; ++r) {
    if (!Gone(r)) g.addresses[static_cast<size_t>(r)] = t_->peer_address(r);
  }
  g.placement_version = placement_->version();
  g.header_bytes = header_bytes_;
  spdlog::warn(
      "rank {}: {} joined the job as rank {} (placement v{} holds nothing on it: a rebalance, "
      "moectl rebalance or the automatic one, gives it experts)",
      rank, ask.who, rank, g.placement_version);
  return g;
}

Status RouterControl::TakeBack(int rank, const std::vector<uint8_t>& address) {
  if (rank < placement_->num_routers() || rank >= placement_->num_ranks()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is no expert rank");
  }
  // What is still posted with the old process (its control channel here, probes and stranded
  // transfers in PeerHealth) is withdrawn before the endpoint goes.
  Request& in = in_reqs_[static_cast<size_t>(rank)];
  if (in.valid()) (void)t_->Cancel(in);
  in = Request{};
  if (health_ != nullptr) health_->Revive(rank);
  const Status replaced =
      t_->ReplacePeer(rank, std::span<const uint8_t>(address.data(), address.size()));
  if (!replaced.ok()) {
    if (health_ != nullptr)
      health_->MarkDead(rank, "taking it back failed: " + replaced.ToString());
    return replaced;
  }
  dead_[static_cast<size_t>(rank)] = false;
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

Status RouterControl::Recover() {
  if (health_ == nullptr) return Status::Ok();
  if (recovery_id_ != 0 && migration_ && migration_->view.id == recovery_id_ &&
      migration_->view.state != "running") {
    // Failed (a load error, a rank that died meanwhile): tried again shortly. (Done: counted
    // where it is marked done.)
    recovered_generation_ = dead_generation_ - 1;
    recovery_retry_at_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    spdlog::error("recovery: migration {} {}: trying again in 1 s", recovery_id_,
                  migration_->view.state);
    recovery_id_ = 0;
  }
  if (recovered_generation_ == dead_generation_) return Status::Ok();
  if (migration_ && migration_->view.state == "running") return Status::Ok();  // it fails first
  if (std::chrono::steady_clock::now() < recovery_retry_at_) return Status::Ok();
  if (!placement_->UsesAny(dead_, served_)) {
    recovered_generation_ = dead_generation_;
    return Status::Ok();
  }
  int replaced = 0;
  Result<Placement> target = placement_->WithoutRanks(dead_, placement_->version() + 1, &replaced);
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
  o.expert_bytes = recovery_expert_bytes_;
  Result<MigrationView> started = ApplyLocked(*target, o);
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

void RouterControl::Fail(const std::string& why) {
  migration_->view.state = "failed";
  migration_->view.error = why;
  migration_->view.elapsed_s = Since(migration_->started);
  spdlog::error("migration {} failed: {}", migration_->view.id, why);
}

Status RouterControl::StartLayer(LayerStep& step) {
  Migration* m = migration_.get();
  const int layer = step.view.layer;
  step.started = std::chrono::steady_clock::now();
  step.view.state = "loading";
  std::map<int, std::string> files;
  for (const auto& [key, file] : promoted_) {
    if (key.first == layer) files[key.second] = file;
  }
  json jfiles = json::object();
  for (const auto& [e, f] : files) jfiles[std::to_string(e)] = f;
  for (const auto& [d, add] : step.add) {
    if (add.empty()) continue;
    ++step.awaiting;
    const size_t index = static_cast<size_t>(&step - m->steps.data());
    MOERUN_RETURN_IF_ERROR(SendToExpert(d,
                                        json{{"op", "load"},
                                             {"layer", layer},
                                             {"experts", add},
                                             {"files", jfiles},
                                             {"throttle_bytes_s", m->view.throttle_bytes_s}}
                                            .dump(),
                                        [this, m, index](int rank, const RouterControlReply& r) {
                                          if (migration_.get() != m) return;
                                          LayerStep& s = m->steps[index];
                                          if (r.ok || !r.final) s.loaded[rank] = r.bytes;
                                          if (!r.final) return;
                                          if (!r.ok && s.error.empty())
                                            s.error =
                                                "rank " + std::to_string(rank) + ": " + r.error;
                                          --s.awaiting;
                                        }));
  }
  spdlog::info("migration {}: layer {}: loading {} expert cop{} on {} rank(s)", m->view.id, layer,
               step.view.experts_to_load, step.view.experts_to_load == 1 ? "y" : "ies",
               step.awaiting);
  return Status::Ok();
}

Status RouterControl::StepMigration() {
  if (!migration_ || migration_->view.state != "running") return Status::Ok();
  Migration& m = *migration_;
  while (m.current < m.steps.size()) {
    LayerStep& s = m.steps[m.current];
    const size_t index = m.current;
    if (s.view.state == "unchanged") {
      ++m.current;
      continue;
    }
    if (s.view.state == "pending") MOERUN_RETURN_IF_ERROR(StartLayer(s));
    if (s.view.state == "loading") {
      if (s.awaiting > 0) return Status::Ok();
      if (!s.error.empty()) {
        // Nobody sends rows to the copies this layer added: free them on every rank.
        for (const auto& [d, add] : s.add) {
          if (add.empty()) continue;
          MOERUN_RETURN_IF_ERROR(SendToExpert(d,
                                              json{{"op", "release"},
                                                   {"layer", s.view.layer},
                                                   {"experts", add},
                                                   {"all_routers", true}}
                                                  .dump(),
                                              nullptr));
        }
        s.view.state = "failed";
        s.view.seconds = Since(s.started);
        Fail("layer " + std::to_string(s.view.layer) + ": " + s.error);
        return Status::Ok();
      }
      MOERUN_ASSIGN_OR_RETURN(Placement next, placement_->WithLayer(s.view.layer, *m.target,
                                                                    placement_->version() + 1));
      s.view.state = "switching";
      Migration* mp = &m;
      MOERUN_ASSIGN_OR_RETURN(
          s.awaiting, Switch(s.view.layer, std::make_shared<const Placement>(std::move(next)), true,
                             [this, mp, index](int rank, const RouterControlReply& r) {
                               if (migration_.get() != mp || !r.final) return;
                               LayerStep& st = mp->steps[index];
                               st.view.bytes_freed += r.freed;
                               if (!r.ok && st.error.empty()) {
                                 st.error = "rank " + std::to_string(rank) + ": " + r.error;
                               }
                               --st.awaiting;
                             }));
    }
    if (s.view.state == "switching") {
      if (s.awaiting > 0) return Status::Ok();
      s.view.seconds = Since(s.started);
      if (!s.error.empty()) {
        s.view.state = "failed";
        Fail("layer " + std::to_string(s.view.layer) + " (switched): " + s.error);
        return Status::Ok();
      }
      s.view.state = "done";
      spdlog::info("migration {}: layer {} done in {:.2f} s ({:.1f} MiB loaded)", m.view.id,
                   s.view.layer, s.view.seconds, [&] {
                     int64_t b = 0;
                     for (const auto& [d, n] : s.loaded) b += n;
                     return static_cast<double>(b) / (1 << 20);
                   }());
      ++m.current;
    }
  }
  m.view.state = "done";
  m.view.elapsed_s = Since(m.started);
  if (m.view.id == recovery_id_) {
    experts_replaced_ += static_cast<uint64_t>(recovery_replaced_);
    recovery_id_ = 0;
  }
  spdlog::info("migration {} done: placement v{} in {:.2f} s", m.view.id, placement_->version(),
               m.view.elapsed_s);
  return Status::Ok();
}

Result<MigrationView> RouterControl::Apply(const Placement& target,
                                           const MigrationOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  if (target.UsesAny(dead_, served_)) {
    return Status::InvalidArgument("the placement puts experts on dead rank(s) " + RankList(dead_) +
                                   ": leave them out");
  }
  return ApplyLocked(target, options);
}

Result<MigrationView> RouterControl::ApplyLocked(const Placement& target,
                                                 const MigrationOptions& options) {
  if (migration_ && migration_->view.state == "running") {
    return Status::Unavailable("migration " + std::to_string(migration_->view.id) +
                               " is still running (moectl placement progress)");
  }
  for (const auto& [key, u] : updates_) {
    if (u.view.state == "loading" || u.view.state == "canary") {
      return Status::Unavailable("layer " + std::to_string(key.first) + " expert " +
                                 std::to_string(key.second) +
                                 " has an update in progress: promote or roll it back first");
    }
  }
  const Placement& cur = *placement_;
  if (target.num_ranks() != cur.num_ranks() || target.num_routers() != cur.num_routers() ||
      target.num_experts() != cur.num_experts()) {
    return Status::InvalidArgument("the placement is for " + std::to_string(target.num_ranks()) +
                                   " ranks, " + std::to_string(target.num_routers()) +
                                   " router(s), " + std::to_string(target.num_experts()) +
                                   " experts; this job has " + std::to_string(cur.num_ranks()) +
                                   ", " + std::to_string(cur.num_routers()) + ", " +
                                   std::to_string(cur.num_experts()));
  }
  const size_t capacity = (header_bytes_ - sizeof(EpHeaderFixed)) / sizeof(EpEntry);
  auto m = std::make_unique<Migration>();
  m->target = std::make_shared<const Placement>(target);
  m->started = std::chrono::steady_clock::now();
  m->view.id = ++migrations_;
  m->view.state = "running";
  m->view.trigger = options.trigger;
  m->view.note = options.note;
  m->view.throttle_bytes_s = options.throttle_bytes_s;
  m->view.from_version = cur.version();
  uint64_t changed = 0;
  for (const auto& [layer, ep] : layers_) {
    const LayerPlacement* nw = target.Layer(layer);
    const LayerPlacement* old = cur.Layer(layer);
    if (nw == nullptr) {
      return Status::InvalidArgument("the placement has no entry for layer " +
                                     std::to_string(layer) + " (nor a \"*\" entry)");
    }
    if (static_cast<size_t>(nw->MaxSlotsPerRank()) > capacity) {
      return Status::InvalidArgument("layer " + std::to_string(layer) + ": the placement puts " +
                                     std::to_string(nw->MaxSlotsPerRank()) +
                                     " slots on a rank; this job's headers hold " +
                                     std::to_string(capacity) + " (apply it with a restart)");
    }
    LayerStep step;
    step.view.layer = layer;
    step.view.state = "pending";
    if (old != nullptr && Placement::SameSlots(*old, *nw)) {
      step.view.state = "unchanged";
    } else {
      ++changed;
      for (int d = cur.num_routers(); d < cur.num_ranks(); ++d) {
        const std::set<int> was = old ? ExpertsOn(*old, d) : std::set<int>();
        const std::set<int> will = ExpertsOn(*nw, d);
        step.add[d] = Minus(will, was);
        step.remove[d] = Minus(was, will);
        step.view.experts_to_load += static_cast<int>(step.add[d].size());
        step.view.experts_to_free += static_cast<int>(step.remove[d].size());
      }
      step.view.bytes_to_move = step.view.experts_to_load * options.expert_bytes;
      m->view.bytes_to_move += step.view.bytes_to_move;
    }
    m->steps.push_back(std::move(step));
  }
  m->view.to_version = cur.version() + changed;
  if (changed == 0) {
    m->view.state = "done";
    m->view.note = "every layer already has this placement";
  } else {
    spdlog::info(
        "migration {} ({}): v{} -> v{}, {} layer(s), {} expert copies to load ({:.1f} MiB)",
        m->view.id, options.trigger, m->view.from_version, m->view.to_version, changed,
        [&] {
          int n = 0;
          for (const auto& s : m->steps) n += s.view.experts_to_load;
          return n;
        }(),
        static_cast<double>(m->view.bytes_to_move) / (1 << 20));
  }
  migration_ = std::move(m);
  MigrationView v = migration_->view;
  for (const auto& s : migration_->steps) v.layers.push_back(s.view);
  return v;
}

MigrationView RouterControl::Progress() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!migration_) return MigrationView{};
  MigrationView v = migration_->view;
  v.bytes_loaded = 0;
  for (const auto& s : migration_->steps) {
    MigrationLayerView lv = s.view;
    for (const auto& [d, n] : s.loaded) lv.bytes_loaded += n;
    if (s.view.state == "loading" || s.view.state == "switching") lv.seconds = Since(s.started);
    v.bytes_loaded += lv.bytes_loaded;
    v.bytes_freed += lv.bytes_freed;
    v.layers.push_back(lv);
  }
  if (v.state == "running") v.elapsed_s = Since(migration_->started);
  return v;
}

bool RouterControl::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (migration_ && migration_->view.state == "running") return true;
  for (const auto& [key, u] : updates_) {
    if (u.view.state == "loading" || u.view.state == "canary") return true;
  }
  return false;
}

Result<ExpertUpdateView> RouterControl::Update(int layer, int expert, const std::string& file,
                                               double canary) {
  std::lock_guard<std::mutex> lock(mu_);
  if (layers_.count(layer) == 0) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is not served");
  }
  if (expert < 0 || expert >= placement_->num_experts()) {
    return Status::InvalidArgument("no expert " + std::to_string(expert) + " (the model has " +
                                   std::to_string(placement_->num_experts()) + ")");
  }
  if (!(canary >= 0.0 && canary <= 1.0)) {
    return Status::InvalidArgument("the canary share must be within 0..100 %");
  }
  if (file.empty()) return Status::InvalidArgument("no weights file given");
  if (migration_ && migration_->view.state == "running") {
    return Status::Unavailable("a migration is running: update experts once it is done");
  }
  const auto key = std::make_pair(layer, expert);
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
  const LayerPlacement* lp = placement_->Layer(layer);
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

Result<ExpertUpdateView> RouterControl::Act(const std::string& action, int layer, int expert) {
  std::lock_guard<std::mutex> lock(mu_);
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

ExpertUpdateResults RouterControl::update_results() const {
  std::lock_guard<std::mutex> lock(mu_);
  return update_results_;
}

std::vector<ExpertUpdateView> RouterControl::Updates() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ExpertUpdateView> out;
  for (const auto& [key, u] : updates_) out.push_back(u.view);
  return out;
}

Status RouterControl::StepUpdates() {
  while (!actions_.empty()) {
    const std::string action = actions_.front().first;
    const std::pair<int, int> key = actions_.front().second;
    actions_.pop_front();
    UpdateState& u = updates_.at(key);
    const int layer = key.first, expert = key.second;
    u.awaiting = static_cast<int>(u.view.ranks.size());
    u.view.error.clear();
    json op{{"op", action}, {"layer", layer}, {"expert", expert}};
    if (action == "update") {
      op["file"] = u.view.file;
      op["canary"] = u.view.canary;
    }
    for (int d : u.view.ranks) {
      MOERUN_RETURN_IF_ERROR(
          SendToExpert(d, op.dump(), [this, key, action](int rank, const RouterControlReply& r) {
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
                ++update_results_.failed;
                spdlog::error("layer {} expert {}: update failed: {}", key.first, key.second,
                              st.view.error);
                for (int d2 : st.view.ranks) {  // those that did load drop their copy
                  (void)SendToExpert(
                      d2,
                      json{{"op", "rollback"}, {"layer", key.first}, {"expert", key.second}}.dump(),
                      nullptr);
                }
              }
            } else if (action == "promote") {
              st.view.state = st.view.error.empty() ? "promoted" : "failed";
              if (st.view.error.empty()) promoted_[key] = st.view.file;
              ++(st.view.error.empty() ? update_results_.promoted : update_results_.failed);
              spdlog::info("layer {} expert {}: {}", key.first, key.second, st.view.state);
            } else {
              st.view.state = st.view.error.empty() ? "rolled back" : "failed";
              ++(st.view.error.empty() ? update_results_.rolled_back : update_results_.failed);
              spdlog::info("layer {} expert {}: {}", key.first, key.second, st.view.state);
            }
          }));
    }
    (void)layer;
    (void)expert;
  }
  // Canary counts, once a second.
  const auto now = std::chrono::steady_clock::now();
  for (auto& [key, u] : updates_) {
    if (u.view.state != "canary" || u.querying > 0 || !u.pending_action.empty() ||
        now - u.last_query < std::chrono::seconds(1)) {
      continue;
    }
    u.last_query = now;
    u.querying = static_cast<int>(u.view.ranks.size());
    const auto k = key;
    for (int d : u.view.ranks) {
      MOERUN_RETURN_IF_ERROR(SendToExpert(
          d, json{{"op", "query"}, {"layer", key.first}, {"expert", key.second}}.dump(),
          [this, k](int rank, const RouterControlReply& r) {
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
