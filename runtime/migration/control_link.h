// What the parts of a RouterControl (migrations, expert updates, membership and recovery, drain)
// use of it: the control messages to expert ranks and routers, the switch of a layer, the
// placement in use and which ranks are gone. RouterControl implements it; the parts never see
// the transport's receives or each other's state.
//
// Thread-safety: router thread, or any thread holding RouterControl's lock; every part is called
// under that lock only, and so are the reply callbacks.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "router/placement.h"

namespace moerun {

// An answer to a control message (an expert rank's or a router's).
struct ControlReply {
  bool final = true;  // false: progress (a load's bytes so far); more answers follow
  bool ok = true;
  std::string error;
  int64_t bytes = 0;
  int64_t freed = 0;  // release: bytes freed (switch: by the releases of that router)
  uint64_t rows = 0, canary_rows = 0;
};

class ControlLink {
 public:
  // Called with every answer to one message (a failed one when the rank is dead or silent past
  // the deadline).
  using ReplyFn = std::function<void(int rank, const ControlReply&)>;

  virtual ~ControlLink() = default;

  // The placement this router uses now (Switch replaces it).
  virtual const std::shared_ptr<const Placement>& placement_in_use() const = 0;
  // A rank known dead (PeerHealth's or the transport's word).
  virtual bool Gone(int rank) const = 0;
  // Sends an operation (JSON without "id") to an expert rank, in order with its microbatches.
  virtual Status SendToExpert(int rank, const std::string& op_json_without_id,
                              ReplyFn on_reply) = 0;
  // Sends a message (JSON with its "id") to a router.
  virtual Status SendToRouter(int rank, const std::string& body) = 0;
  // Switches this router's layer, releases the copies it no longer uses and, on router 0 with
  // tell_routers, tells the other routers; `done` gets every answer; returns how many to expect.
  virtual Result<int> Switch(int layer, std::shared_ptr<const Placement> next, bool tell_routers,
                             ReplyFn done) = 0;
  // Withdraws the control receive posted for `rank` (its process is being replaced).
  virtual void CancelReceive(int rank) = 0;
  // Sends expert rank `rank` this router's shutdown (a kShutdown header), in order after what it
  // was sent before: the rank leaves once every router has sent its own (moectl retire).
  virtual Status SendShutdown(int rank) = 0;
};

}  // namespace moerun
