// Draining the whole job on one signal (RouterControl's part): router 0, when it begins to drain,
// tells every other live router; a router that router 0 told notes it for its serving loop.
//
// Thread-safety: TellOthers runs under RouterControl's lock; Requested and requested() from any
// thread.
#pragma once

#include <atomic>

#include "base/status.h"
#include "runtime/migration/control_link.h"

namespace moerun {

class DrainRelay {
 public:
  explicit DrainRelay(ControlLink* link) : link_(link) {}

  // Router 0: sends "drain" to routers 1..routers-1 that are not gone (in order after what each
  // was sent before).
  Status TellOthers(int routers);
  // Router 0 asked this router to drain.
  void Requested() { requested_.store(true); }
  bool requested() const { return requested_.load(); }

 private:
  ControlLink* link_;
  std::atomic<bool> requested_{false};
};

}  // namespace moerun
