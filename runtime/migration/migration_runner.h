// Router 0's migrations between placements, one layer at a time (RouterControl's part; the
// steps are described in runtime/migration/router_control.h): plans what each expert rank loads and
// frees per layer, has them load, switches the layer once all have answered and reports the
// progress.
//
// Thread-safety: none of its own; RouterControl calls it under its lock (Step and the reply
// callbacks on the router thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "router/placement.h"
#include "runtime/migration/control_link.h"
#include "runtime/migration/control_types.h"

namespace moerun {

class MigrationRunner {
 public:
  // `served`: the layers this router serves, ascending; `header_bytes`: the job's dispatch
  // headers (a placement must fit them).
  MigrationRunner(ControlLink* link, std::vector<int> served, size_t header_bytes);

  bool running() const { return migration_ && migration_->view.state == "running"; }
  // The running or last migration's view as of its last step (null: none yet).
  const MigrationView* last() const { return migration_ ? &migration_->view : nullptr; }
  // kUnavailable while a migration runs.
  Status CheckIdle() const;
  // Starts moving to `target` once it is checked against the job (no migration may run: see
  // CheckIdle). A target equal to the placement in use makes a migration that is done at once.
  Result<MigrationView> Start(const Placement& target, const MigrationOptions& options);
  // Router thread: moves the running migration on. `promoted`: the weights files that replaced
  // the checkpoint's, by (layer, expert) (the loads use them).
  Status Step(const std::map<std::pair<int, int>, std::string>& promoted);
  // The running or last migration, with the bytes loaded so far.
  MigrationView Progress() const;

 private:
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

  // The step of `layer` from `old` (null: none) to `nw`; an error if `nw` does not fit.
  Result<LayerStep> PlanLayer(int layer, const LayerPlacement* old, const LayerPlacement* nw,
                              const MigrationOptions& options) const;
  // Sends the loads of a pending layer.
  Status StartLayer(LayerStep& step, const std::map<std::pair<int, int>, std::string>& promoted);
  // A layer whose loads all answered: frees what it loaded after a failure, else switches it.
  Status Loaded(LayerStep& step, size_t index);
  void Fail(const std::string& why);

  ControlLink* link_;
  std::vector<int> served_;
  size_t header_bytes_;
  std::unique_ptr<Migration> migration_;  // running or last
  uint64_t migrations_ = 0;
};

}  // namespace moerun
