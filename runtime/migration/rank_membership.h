// Which expert ranks are in the job (RouterControl's part): the ranks known dead, the recovery
// that re-places a dead rank's experts on the survivors (router 0: a migration to
// Placement::WithoutRanks once none runs, trigger "recovery"), processes that join the job in a
// dead or retired rank's place (moerun serve --join: router 0 grants it, every router takes the
// new process's endpoint), and ranks retired on purpose (moectl retire: router 0 migrates to the
// placement without the rank, trigger "retire"; once that is done every router marks it retired
// in PeerHealth and sends it its shutdown, so the rank leaves; no answer is lost since the rank
// holds nothing any more when it stops).
//
// Thread-safety: none of its own; RouterControl calls it under its lock.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "runtime/ep/peer_health.h"
#include "runtime/migration/control_link.h"
#include "runtime/migration/control_types.h"
#include "transport/transport.h"

namespace moerun {

class RankMembership {
 public:
  // Starts a migration as moectl's would (refused while a migration or an expert update runs).
  using StartMigration =
      std::function<Result<MigrationView>(const Placement&, const MigrationOptions&)>;

  // `served`: the layers this router serves, ascending; `header_bytes`: the job's dispatch
  // headers (told to a joiner).
  RankMembership(Transport* transport, ControlLink* link, std::vector<int> served,
                 size_t header_bytes);

  // The router's view of the expert ranks (deaths); before the first Poll. Null: no recovery,
  // no joins. The expert ranks the transport has no endpoint for and the placement holds nothing
  // on are spare slots (spare_expert_ranks: no process yet): retired from the start (PeerHealth
  // neither probes them nor counts them dead), free for a joiner.
  void set_health(PeerHealth* health);
  PeerHealth* health() const { return health_; }
  // One expert's bytes, for what a recovery's migration reports it moves.
  void set_expert_bytes(int64_t bytes) { expert_bytes_ = bytes; }

  // Marked dead here (the transport may know more: ControlLink::Gone).
  bool dead(int rank) const {
    return rank >= 0 && static_cast<size_t>(rank) < dead_.size() &&
           dead_[static_cast<size_t>(rank)];
  }
  // Dead ranks (retired ones are not: retired_ranks).
  std::vector<int> dead_ranks() const;
  bool retired(int rank) const {
    return rank >= 0 && static_cast<size_t>(rank) < retired_.size() &&
           retired_[static_cast<size_t>(rank)];
  }
  std::vector<int> retired_ranks() const;  // spare slots not counted
  std::vector<int> spare_ranks() const;
  // The rank a retire is moving experts off now (-1: none).
  int retiring() const { return retiring_; }
  uint64_t experts_replaced() const { return experts_replaced_; }

  // Router thread: takes in the deaths PeerHealth saw since the last call.
  void TakeInDeaths();
  // Router thread: the control channel of `rank`, a gone rank, failed: it is dead.
  void MarkLost(int rank, const Status& why);
  // kInvalidArgument when `target` puts experts on a dead rank.
  Status CheckAlive(const Placement& target) const;

  // Router 0, any thread: queues a join (RouterControl::Join says what it grants).
  void Join(JoinAsk ask);
  // Answers every queued join with `why`.
  void RefuseJoins(const std::string& why);
  // Router 0's thread: answers the queued joins.
  void StepJoins();
  // Any router, told by router 0: `rank` is a new process at the hex transport address.
  Status OnPeer(int rank, const std::string& address_hex);

  // Router 0's thread: starts the recovery of the deaths taken in, once `last` (the running or
  // last migration, null: none) is not running; notes a recovery migration's end.
  Status Recover(const MigrationView* last, const StartMigration& start);

  // Router 0 (under RouterControl's lock): retires expert rank `rank`: checks it (a live expert
  // rank, not the last one, no migration running: `start` refuses then), then starts the
  // migration to the placement without it (trigger "retire"); the retire completes at a later
  // StepRetire (the router thread: every transport send happens there) once that migration is
  // done, or at the next one when the rank holds nothing. The answer is the migration started
  // (state "done" and id 0 when there is nothing to move).
  Result<MigrationView> Retire(int rank, const MigrationOptions& options,
                               const StartMigration& start);
  // Router 0's thread: completes the retire in progress once its migration (`last`) is done
  // (fails it, logged, when the migration failed).
  Status StepRetire(const MigrationView* last);
  // Any router, told by router 0 (or router 0 itself): `rank` holds nothing any more; it is
  // marked retired and sent this router's shutdown.
  Status OnRetire(int rank);

 private:
  Result<JoinGrant> Grant(const JoinAsk& ask);
  // `rank` is a new process at `address` from now on (the transport's endpoint replaced,
  // PeerHealth reviving it).
  Status TakeBack(int rank, const std::vector<uint8_t>& address);
  // The recovery migration `last` ended: counts the copies it re-placed, or tries again soon.
  void RecoveryEnded(const MigrationView& last);
  // Router 0: every router marks `rank` retired and sends it its shutdown.
  Status CompleteRetire(int rank);
  // By rank: the most slots per layer its memory holds (its probes' budget ÷ one expert's bytes ÷
  // the layers served; -1: no limit or not known), for the copies a recovery or retire adds.
  std::vector<int> Capacities() const;

  Transport* t_;
  ControlLink* link_;
  PeerHealth* health_ = nullptr;
  std::vector<int> served_;
  size_t header_bytes_;
  std::deque<JoinAsk> joins_;
  std::vector<bool> dead_;             // by rank: dead or retired (out of the job)
  std::vector<bool> retired_;          // by rank: retired on purpose, or spare
  std::vector<bool> spare_;            // by rank: a spare slot (retired from the start)
  int retiring_ = -1;                  // router 0: the rank a retire migration empties
  uint64_t retire_id_ = 0;             // ... and its migration (0: none needed)
  uint64_t dead_generation_ = 0;       // PeerHealth's, when dead_ was taken
  uint64_t recovered_generation_ = 0;  // the deaths the last recovery covered
  uint64_t recovery_blocked_ = 0;      // the generation whose recovery had to wait (logged)
  uint64_t experts_replaced_ = 0;      // by recovery migrations that are done
  // The recovery migration in progress (0: none), the copies it re-places, and when a failed one
  // is tried again.
  uint64_t recovery_id_ = 0;
  int recovery_replaced_ = 0;
  std::chrono::steady_clock::time_point recovery_retry_at_{};
  int64_t expert_bytes_ = 0;
};

}  // namespace moerun
