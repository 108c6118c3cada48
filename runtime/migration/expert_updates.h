// Router 0's expert weight updates with a canary (RouterControl's part): the expert ranks that
// hold copies of the expert load the new weights and serve a share of its rows with them; the
// update is then promoted (the new weights replace the old, and later migrations load them) or
// rolled back. While in canary, the rows each side served are asked for once a second.
//
// Thread-safety: none of its own; RouterControl calls it under its lock (Step and the reply
// callbacks on the router thread).
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "runtime/migration/control_link.h"
#include "runtime/migration/control_types.h"

namespace moerun {

class ExpertUpdates {
 public:
  // `served`: the layers this router serves.
  ExpertUpdates(ControlLink* link, std::vector<int> served);

  // Queues an update (sent at the next Step); an error for a bad argument, while a migration
  // runs, or while the expert already has one in progress.
  Result<ExpertUpdateView> Update(int layer, int expert, const std::string& file, double canary,
                                  bool migration_running);
  // action: promote | rollback, of an update in canary. The answer is the state before the
  // action completes.
  Result<ExpertUpdateView> Act(const std::string& action, int layer, int expert);
  std::vector<ExpertUpdateView> views() const;
  ExpertUpdateResults results() const { return results_; }
  // An update is loading or in canary.
  bool in_progress() const;
  // kUnavailable naming the first update in progress (a migration must wait for it).
  Status CheckIdle() const;
  // The weights files that replaced the checkpoint's, by (layer, expert).
  const std::map<std::pair<int, int>, std::string>& promoted() const { return promoted_; }
  // Router thread: sends the queued actions and the canaries' queries.
  Status Step();

 private:
  using Key = std::pair<int, int>;  // layer, expert
  struct UpdateState {
    ExpertUpdateView view;
    int awaiting = 0;            // answers to update / promote / rollback
    int querying = 0;            // answers to the last query
    std::string pending_action;  // promote | rollback while their answers come
    std::map<int, std::pair<uint64_t, uint64_t>> counts;  // per rank: rows, canary rows
    std::chrono::steady_clock::time_point last_query;
  };

  // One rank's answer to `action` (update | promote | rollback); the last one ends the action.
  void OnAnswer(const Key& key, const std::string& action, int rank, const ControlReply& r);
  // Asks the ranks of every update in canary for their rows, once a second.
  Status QueryCanaries();

  ControlLink* link_;
  std::vector<int> served_;
  std::map<Key, UpdateState> updates_;
  std::deque<std::pair<std::string, Key>> actions_;  // (action, (layer, expert))
  std::map<Key, std::string> promoted_;              // weights that replaced the checkpoint's
  ExpertUpdateResults results_;
};

}  // namespace moerun
