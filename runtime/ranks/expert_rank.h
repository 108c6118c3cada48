// An expert rank once its job is ready: the expert half of the expert-parallel protocol
// (ExpertServer, runtime/ep/expert_server.h), which receives microbatches, computes and answers,
// wired to the rank's control plane (ExpertControl, runtime/migration/expert_control.h), which
// holds this rank's experts and changes them while it serves (migrations, expert updates, the
// cache). The control plane hands the server a ServedWeights handle whenever what the rank serves
// changes; the server passes control messages to it, polls it between microbatches and asks it
// for the canary rows while an update is in canary.
//
// Threads: one, the serving thread, runs Serve and with it every call into the control plane;
// the background loads of ExpertControl and the cache's loads touch neither the handle nor the
// server.
#pragma once

#include <functional>
#include <map>
#include <memory>

#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "router/placement.h"
#include "runtime/ep/expert_server.h"
#include "runtime/migration/expert_control.h"
#include "runtime/model/layer_weights.h"
#include "transport/transport.h"

namespace moerun {

using ExpertRankOptions = ExpertServerOptions;

class ExpertRank {
 public:
  // `placement` gives the router count, the header size and who uses the experts loaded at start.
  ExpertRank(Transport* transport, const Placement& placement,
             std::map<int, std::shared_ptr<MoeLayerWeights>> layers, const CpuKernels& kernels,
             ThreadPool* pool, ExpertRankOptions options);
  // The server first (its transfers withdrawn, their buffers unregistered), then the control
  // plane (it waits for a background load to stop).
  ~ExpertRank() = default;

  // Serves until every router has sent shutdown; an error if a message is malformed or a router
  // stops mid-microbatch.
  Status Serve() { return server_.Serve(); }
  int rank() const { return server_.rank(); }
  uint64_t microbatches_served() const { return server_.microbatches_served(); }
  uint64_t rows_served() const { return server_.rows_served(); }
  // Rows computed per (layer, logical expert), if set before Serve (e.g. a metrics counter);
  // called on the serving thread, once per expert per microbatch.
  void set_rows_observer(std::function<void(int layer, int expert, int64_t rows)> f) {
    server_.set_rows_observer(std::move(f));
  }
  // Computes on a device instead of the CPU kernels, if set before Serve (control messages that
  // change the experts are then refused: the device holds its copy from the start).
  void set_compute(ExpertCompute f);
  // Where load and update take their weights from; without them those messages are refused.
  void set_loaders(ExpertLoader load, ExpertFileLoader load_file) {
    control_.set_loaders(std::move(load), std::move(load_file));
  }
  // The control plane (e.g. ExpertControl::EnableCache before Serve).
  ExpertControl& control() { return control_; }
  // The expert cache, or null when every hosted expert is resident.
  const ExpertCache* cache() const { return control_.cache(); }
  // Seconds each microbatch that missed the cache waited for its loads (e.g. a histogram).
  void set_cache_wait_observer(std::function<void(double)> f) {
    server_.set_cache_wait_observer(std::move(f));
  }
  // Bytes of expert weights held now (every layer, canary weights included).
  size_t held_bytes() const { return control_.held_bytes(); }

 private:
  ExpertControl control_;  // declared first: the server reaches it until its own end
  ExpertServer server_;
};

}  // namespace moerun
