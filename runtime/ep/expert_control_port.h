// What the expert half of the protocol (ExpertServer, runtime/ep/expert_server.h) asks of the
// expert rank's control plane: the control messages routers send between microbatches, time to
// move its own work on, and the rows of an expert whose update is in canary. The control plane
// (ExpertControl, runtime/migration/expert_control.h) implements it, a floor above; the data path
// itself reads only the ServedWeights handle the control plane hands it (served_weights.h).
//
// Threads: every call comes from the expert rank's serving thread, between microbatches (but
// CanaryRows, which comes while one is computed and changes only the canary counts).
#pragma once

#include <cstdint>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "experts/cpu/expert_weights.h"
#include "runtime/ep/protocol.h"

namespace moerun {

class ExpertControlPort {
 public:
  // A control message from `router` (its header `h`; its body follows on kTagRows).
  virtual Status OnMessage(int router, const EpHeaderFixed& h) = 0;
  // Moves replies and background work on; called on every turn of the serving loop.
  virtual Status Poll() = 0;
  // Once every router has stopped: waits until the replies are sent, at most until `deadline`.
  virtual void Drain(Deadline deadline) = 0;
  // For `n` rows of `expert` in a microbatch, rows [first, first + n): appends to *rows those the
  // canary takes and returns the new weights, or null when the expert has no update. Asked only
  // while ServedWeights::has_updates is true.
  virtual const ExpertWeights* CanaryRows(int layer, int expert, int64_t first, int64_t n,
                                          std::vector<int32_t>* rows) = 0;

 protected:
  ~ExpertControlPort() = default;  // not owned through this interface
};

}  // namespace moerun
