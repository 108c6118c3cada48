// A router's side of changing what the expert ranks hold while the job serves.
//
// Router 0 runs migrations and expert weight updates; every router switches its layers to a new
// placement when router 0 says so. All transport work happens in Poll, on the router's thread
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

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"
#include "ep/owned_sends.h"
#include "ep/peer_health.h"
#include "ep/protocol.h"
#include "ep/router_layer.h"
#include "router/placement.h"
#include "transport/transport.h"

namespace moerun {

struct RouterControlReply;

struct MigrationLayerView {
  int layer = 0;
  std::string state;  // pending | loading | switching | done | unchanged | failed
  int experts_to_load = 0, experts_to_free = 0;
  int64_t bytes_to_move = 0, bytes_loaded = 0;
  int64_t bytes_freed = 0;  // by the expert ranks once every router released the old copies
  double seconds = 0;
};

struct MigrationView {
  uint64_t id = 0;
  std::string state = "none";  // none | running | done | failed
  uint64_t from_version = 0, to_version = 0;
  std::vector<MigrationLayerView> layers;
  int64_t bytes_to_move = 0, bytes_loaded = 0, bytes_freed = 0;
  double elapsed_s = 0;
  std::string error, note, trigger;
  double throttle_bytes_s = 0;
};

struct ExpertUpdateView {
  int layer = 0, expert = 0;
  std::string file;
  double canary = 0;  // share, 0..1
  std::string state;  // loading | canary | promoted | rolled back | failed
  std::vector<int> ranks;
  uint64_t rows = 0, canary_rows = 0;
  std::string error;
};

// How the expert updates ended so far (router 0): each update counts once, when it is promoted,
// rolled back, or fails (loading, promoting or rolling back).
struct ExpertUpdateResults {
  uint64_t promoted = 0, rolled_back = 0, failed = 0;
};

// What router 0 grants a process that joins the job (moerun serve --join).
struct JoinGrant {
  int rank = -1;  // the dead expert rank it takes over
  int ranks = 0, routers = 0;
  // By rank: the transport address of every router (the others left empty: the joiner talks to
  // routers only).
  std::vector<std::vector<uint8_t>> addresses;
  uint64_t placement_version = 0;
  size_t header_bytes = 0;  // the job's dispatch headers (the joiner checks its own)
};
struct JoinAsk {
  std::vector<uint8_t> address;  // the joiner's transport address
  std::string who;               // host and pid, for the log
  // What the joiner computed from its own config, checked against the job's.
  std::vector<int> layers;
  int num_experts = 0;
  // Called once on router 0's thread with the grant or why not.
  std::function<void(Result<JoinGrant>)> done;
};

struct MigrationOptions {
  double throttle_bytes_s = 0;  // per expert rank; 0: unlimited
  int64_t expert_bytes = 0;     // one expert's weights (for the bytes to move)
  std::string trigger = "moectl";
  std::string note;
};

class RouterControl {
 public:
  RouterControl(Transport* transport, std::shared_ptr<const Placement> placement,
                std::map<int, RouterLayer*> layers, size_t header_bytes,
                std::chrono::milliseconds deadline);
  ~RouterControl();  // withdraws its posted receives

  // Router thread, between batches and when idle: moves messages and migrations on.
  Status Poll();
  // Called on the router thread after each switch with the placement now in use.
  void set_on_switch(std::function<void(std::shared_ptr<const Placement>)> f) {
    on_switch_ = std::move(f);
  }
  // The router's view of the expert ranks (deaths); before the first Poll.
  void set_health(PeerHealth* health) { health_ = health; }
  // One expert's bytes, for what a recovery's migration reports it moves.
  void set_expert_bytes(int64_t bytes) { recovery_expert_bytes_ = bytes; }

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
  // Router 0's thread, when it begins to drain (SIGTERM): tells every other live router to
  // drain too (in order after what it was sent before), so that one signal stops the job.
  Status DrainOthers();
  // Any thread: router 0 asked this router to drain (seen by a Poll).
  bool drain_requested() const { return drain_requested_.load(); }
  // Any thread: the ranks known dead, and the expert copies recoveries re-placed so far.
  std::vector<int> dead_ranks() const;
  uint64_t experts_replaced() const;

 private:
  using ReplyFn = std::function<void(int rank, const struct RouterControlReply&)>;
  struct LayerStep {
    MigrationLayerView view;
    std::map<int, std::vector<int>> add, remove;  // per expert rank
    std::map<int, int64_t> loaded;                // bytes per rank so far
    int awaiting = 0;
    std::string error;
    std::chrono::steady_clock::time_point started;
  };
  struct Migration {
    MigrationView view;
    std::shared_ptr<const Placement> target;
    std::vector<LayerStep> steps;
    size_t current = 0;
    std::chrono::steady_clock::time_point started;
  };
  struct UpdateState {
    ExpertUpdateView view;
    int awaiting = 0;            // answers to update / promote / rollback
    int querying = 0;            // answers to the last query
    std::string pending_action;  // promote | rollback while their answers come
    std::map<int, std::pair<uint64_t, uint64_t>> counts;  // per rank: rows, canary rows
    std::chrono::steady_clock::time_point last_query;
  };

  // Sends an operation to an expert rank (in order with its microbatches) or a router.
  Status SendToExpert(int rank, const std::string& op_json_without_id, ReplyFn on_reply);
  Status SendToRouter(int rank, const std::string& body);
  Status PollReceives();
  Status OnMessage(int from, const std::string& body);  // HandleMessage, malformed JSON caught
  Status HandleMessage(int from, const std::string& body);
  // Switches this router's layer, releases the copies it no longer uses and, on router 0 with
  // tell_routers, tells the other routers; `done` gets every answer; returns how many to expect.
  Result<int> Switch(int layer, std::shared_ptr<const Placement> next, bool tell_routers,
                     ReplyFn done);
  Status StepMigration();
  Status StartLayer(LayerStep& step);
  Status StepUpdates();
  void Fail(const std::string& why);  // the migration (under mu_)
  Result<MigrationView> ApplyLocked(const Placement& target, const MigrationOptions& options);
  // Router thread: takes in the deaths PeerHealth saw; on router 0 starts the recovery.
  Status Recover();
  bool Gone(int rank) const;  // dead (under mu_)
  // Router thread: answers the queued joins (router 0).
  void StepJoins();
  Result<JoinGrant> Grant(const JoinAsk& ask);
  // Any router: `rank` is a new process at `address` from now on (the transport's endpoint
  // replaced, PeerHealth reviving it).
  Status TakeBack(int rank, const std::vector<uint8_t>& address);

  Transport* t_;
  PeerHealth* health_ = nullptr;
  std::map<int, RouterLayer*> layers_;
  std::vector<int> served_;  // the layer numbers of layers_
  size_t header_bytes_;
  std::chrono::milliseconds deadline_;
  std::function<void(std::shared_ptr<const Placement>)> on_switch_;

  // Router thread only.
  std::vector<EpControlHeader> in_headers_;
  std::vector<Request> in_reqs_;
  OwnedSends outgoing_;
  std::atomic<bool> drain_requested_{false};
  // Operations awaiting answers: a rank silent for longer than the deadline (load progress comes
  // every second) fails its operation.
  struct PendingOp {
    ReplyFn fn;
    int rank = -1;
    std::chrono::steady_clock::time_point last;
  };
  std::map<uint64_t, PendingOp> pending_;
  void ExpireSilent();
  uint32_t next_id_ = 1;

  mutable std::mutex mu_;  // everything below
  std::shared_ptr<const Placement> placement_;
  std::unique_ptr<Migration> migration_;  // running or last
  std::deque<std::unique_ptr<Migration>> queued_;
  uint64_t migrations_ = 0;
  std::map<std::pair<int, int>, UpdateState> updates_;
  std::deque<std::pair<std::string, std::pair<int, int>>> actions_;  // (action, (layer, expert))
  std::deque<JoinAsk> joins_;
  std::map<std::pair<int, int>, std::string> promoted_;  // weights that replaced the checkpoint's
  std::vector<bool> dead_;                               // by rank
  uint64_t dead_generation_ = 0;                         // PeerHealth's, when dead_ was taken
  uint64_t recovered_generation_ = 0;                    // the deaths the last recovery covered
  uint64_t recovery_blocked_ = 0;  // the generation whose recovery had to wait (logged)
  uint64_t experts_replaced_ = 0;  // by recovery migrations that are done
  ExpertUpdateResults update_results_;
  // The recovery migration in progress (0: none), the copies it re-places, and when a failed one
  // is tried again.
  uint64_t recovery_id_ = 0;
  int recovery_replaced_ = 0;
  std::chrono::steady_clock::time_point recovery_retry_at_{};
  int64_t recovery_expert_bytes_ = 0;
};

}  // namespace moerun
