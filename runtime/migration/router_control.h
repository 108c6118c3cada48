// A router's side of changing what the expert ranks hold while the job serves.
//
// Router 0 runs migrations and expert weight updates; every router switches its layers to a new
// placement when router 0 says so. When router 0 dies, the lowest live router takes its part
// over (coordinator()). All transport work happens in Poll, on the router's thread
// between batches (a batch boundary: no microbatch of this router is in flight); the other
// functions may be called from any thread (moectl's control thread) and only queue work or read
// a snapshot.
//
// A migration moves one layer at a time:
//   1. loading:   each expert rank that gains experts loads them in the background (from the
//                 checkpoint or preset, throttled, with progress) while the old placement serves;
//   2. switching: once all have answered, router 0 switches the layer (the next batch uses the new
//                 table), tells the other routers to switch at their next batch boundary, and
//                 every router releases the copies it no longer uses; an expert rank frees a copy
//                 once every router has released it (after their earlier microbatches: messages
//                 keep their order);
//   3. the next layer.
// A failed load frees what the layer loaded and ends the migration; switched layers stay
// switched, the others keep the old placement. Each switched layer makes a new placement version.
//
// With a PeerHealth (set_health), an expert rank that dies gets no more control messages (the
// operations awaiting it fail at once), and router 0 recovers: once no migration runs, it
// migrates to the placement without the dead ranks (Placement::WithoutRanks: experts left with
// no copy are loaded on the survivors with the fewest slots, unthrottled; trigger "recovery").
// Placements that put experts on a dead rank are refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "runtime/ep/owned_sends.h"
#include "runtime/ep/peer_health.h"
#include "runtime/ep/protocol.h"
#include "runtime/ep/router_layer.h"
#include "runtime/migration/control_link.h"
#include "runtime/migration/control_types.h"
#include "runtime/migration/drain_relay.h"
#include "runtime/migration/expert_updates.h"
#include "runtime/migration/migration_runner.h"
#include "runtime/migration/rank_membership.h"
#include "transport/transport.h"

namespace moerun {

// The dispatcher: owns the control messages (posted receives, sends in order, answers matched to
// their operations, silent ranks' operations failed) and the layer switches, and hands the rest
// to its parts, each in its own file: MigrationRunner (migrations), ExpertUpdates (canary, promote,
// rollback), RankMembership (deaths, recovery, joins) and DrainRelay. The parts reach it through
// ControlLink only, all under its one lock.
class RouterControl : private ControlLink {
 public:
  RouterControl(Transport* transport, std::shared_ptr<const Placement> placement,
                std::map<int, RouterLayer*> layers, size_t header_bytes,
                std::chrono::milliseconds deadline);
  ~RouterControl() override;  // refuses queued joins, withdraws its posted receives

  // Router thread, between batches and when idle: moves messages and migrations on.
  Status Poll();
  // Called on the router thread after each switch with the placement now in use.
  void set_on_switch(std::function<void(std::shared_ptr<const Placement>)> f) {
    on_switch_ = std::move(f);
  }
  // The router's view of the expert ranks (deaths); before the first Poll.
  void set_health(PeerHealth* health) { membership_.set_health(health); }
  // One expert's bytes, for what a recovery's migration reports it moves.
  void set_expert_bytes(int64_t bytes) { membership_.set_expert_bytes(bytes); }

  // Router 0, any thread.
  // Starts moving to `target` (checked against the job first); an error if it does not fit, or
  // a migration or an expert update is under way.
  Result<MigrationView> Apply(const Placement& target, const MigrationOptions& options);
  MigrationView Progress() const;
  bool busy() const;  // a migration or an update not yet promoted/rolled back
  std::shared_ptr<const Placement> placement() const;
  Result<ExpertUpdateView> Update(int layer, int expert, const std::string& file, double canary);
  // action: promote | rollback. The answer is the state before the action completes.
  Result<ExpertUpdateView> Act(const std::string& action, int layer, int expert);
  std::vector<ExpertUpdateView> Updates() const;
  ExpertUpdateResults update_results() const;
  // Router 0, any thread: a process outside the job asks to take over a dead expert rank. At
  // the next Poll the lowest dead expert rank that the placement in use no longer holds experts
  // on (its recovery is done) is given the joiner's address on every router, taken back by
  // PeerHealth, and granted; a rebalance then gives it experts. kUnavailable while the dead
  // ranks' experts are still being re-placed (ask again); kInvalidArgument when no rank is dead
  // or the joiner's model or placement differ from the job's; kUnsupported when the transport
  // cannot take a new process in (only ucx can).
  void Join(JoinAsk ask);
  // Router 0, any thread: retires expert rank `rank` (moectl retire; RankMembership::Retire):
  // the migration to the placement without it, then every router sends it its shutdown and
  // marks it retired. kInvalidArgument for a router, an unknown, dead or retired rank, or the
  // last live expert rank; kUnavailable while another retire, a migration or an expert update
  // runs.
  Result<MigrationView> Retire(int rank, const MigrationOptions& options);
  // Any thread: the router that coordinates: the lowest router rank that lives (router 0 until
  // it dies). When it is this router and not router 0, its first Poll takes the control plane
  // over: it tells every other live router to switch every layer to the placement this router
  // uses (one version for all: a migration the dead coordinator left half done is finished or
  // rolled back to what this router had), then has every live expert rank release, for all
  // routers, the copies that placement does not hold there (loaded for the dead coordinator's
  // migration, or used only by it). Migrations, updates, joins and retires then run here; the
  // launcher opens moectl's endpoint (serve_router.cc).
  int coordinator() const;
  // Router 0's thread, when it begins to drain (SIGTERM): tells every other live router to
  // drain too (in order after what it was sent before), so that one signal stops the job.
  Status DrainOthers();
  // Any thread: router 0 asked this router to drain (seen by a Poll).
  bool drain_requested() const { return drain_.requested(); }
  // Any thread: the ranks known dead, and the expert copies recoveries re-placed so far.
  std::vector<int> dead_ranks() const;
  std::vector<int> retired_ranks() const;
  uint64_t experts_replaced() const;

 private:
  // ControlLink, for the parts (under mu_).
  const std::shared_ptr<const Placement>& placement_in_use() const override { return placement_; }
  bool Gone(int rank) const override;  // dead here or to the transport
  Status SendToExpert(int rank, const std::string& op_json_without_id, ReplyFn on_reply) override;
  Status SendToRouter(int rank, const std::string& body) override;
  Result<int> Switch(int layer, std::shared_ptr<const Placement> next, bool tell_routers,
                     ReplyFn done) override;
  void CancelReceive(int rank) override;
  Status SendShutdown(int rank) override;
  // Frees the shutdown sends that completed (or failed to a gone rank).
  void PollShutdowns();

  static std::vector<int> LayerNumbers(const std::map<int, RouterLayer*>& layers);
  Status PollReceives();
  Status OnMessage(int from, const std::string& body);  // HandleMessage, malformed JSON caught
  Status HandleMessage(int from, const std::string& body);
  // Router 0 told this router to switch `layer` to `placement_json`: switches it and answers
  // message `id` once this router's releases are answered.
  Status HandleSwitch(uint64_t id, int layer, const std::string& placement_json);
  // Hands an expert rank's or a router's answer to the operation awaiting it.
  void HandleReply(int from, uint64_t id, const ControlReply& r);
  // Fails the operations whose rank is dead or silent past the deadline.
  void ExpireSilent();
  int Coordinator() const;  // under mu_
  Status TakeOver();        // under mu_, on the router thread, once
  // Checks that no migration or expert update runs, then starts one (under mu_).
  Result<MigrationView> StartMigration(const Placement& target, const MigrationOptions& options);

  Transport* t_;
  std::chrono::milliseconds deadline_;
  std::function<void(std::shared_ptr<const Placement>)> on_switch_;
  std::map<int, RouterLayer*> layers_;

  // Router thread only.
  std::vector<EpControlHeader> in_headers_;
  std::vector<Request> in_reqs_;
  OwnedSends outgoing_;
  struct ShutdownSend {
    std::vector<char> header;
    Request req;
  };
  std::vector<std::unique_ptr<ShutdownSend>> shutdowns_;  // to retired ranks, in flight
  size_t header_bytes_;
  // Operations awaiting answers: a rank silent for longer than the deadline (load progress comes
  // every second) fails its operation.
  struct PendingOp {
    ReplyFn fn;
    int rank = -1;
    std::chrono::steady_clock::time_point last;
  };
  std::map<uint64_t, PendingOp> pending_;
  uint32_t next_id_ = 1;

  bool took_over_ = false;  // router thread only

  mutable std::mutex mu_;  // everything below (the parts' state included)
  std::shared_ptr<const Placement> placement_;
  MigrationRunner migrations_;
  ExpertUpdates updates_;
  RankMembership membership_;
  DrainRelay drain_;  // its flag: any thread
};

}  // namespace moerun
