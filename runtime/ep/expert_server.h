// The expert half of the expert-parallel protocol (runtime/ep/protocol.h; the router half is
// RouterLayer, router_layer.h): its service loop receives a microbatch of rows from any router,
// runs each expert the header names over its rows as one grouped pass, and sends the outputs
// back, until every router has said shutdown. Buffers grow to the largest microbatch seen and are
// reused (no allocation in steady state). Pings are answered in order with the microbatches.
//
// What it computes with is a ServedWeights handle (served_weights.h), set by the control plane
// whenever what the rank serves changes: per microbatch the server reads only that handle. The
// control plane itself (runtime/migration's ExpertControl) is reached through ExpertControlPort:
// control messages go to it, it is polled between microbatches, and while an update is in canary
// it names the canary rows. The expert rank (runtime/ranks/expert_rank.h) wires the two.
//
// Threads: one, the serving thread, runs Serve, and with it the port's calls, so the handle
// changes only between microbatches.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/clock.h"
#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "router/placement.h"
#include "runtime/ep/expert_control_port.h"
#include "runtime/ep/protocol.h"
#include "runtime/ep/served_weights.h"
#include "transport/transport.h"

namespace moerun {

// Page-locking of the rank's receive and send buffers for a device's copies (cudaHostRegister):
// `pin` is called when such a buffer is (re)allocated, `unpin` before it is freed. Called on the
// serving thread (and in the destructor).
struct HostPinning {
  std::function<Status(void* p, size_t bytes)> pin;
  std::function<void(void* p)> unpin;
};

// Runs the grouped FFN somewhere else than this rank's CPU (a GPU: launch/ wires the CUDA layer
// in): rows [total][hidden] grouped as listed (group_expert[g] the logical expert, group_rows[g]
// its rows, empty groups left out) -> y [total][hidden]. Called on the serving thread, after the
// next microbatch's receive is posted (its rows land while this one computes). `pinning`
// (optional) pins the buffers `rows` and `y` point into.
class ExpertCompute {
 public:
  using Fn =
      std::function<Status(int layer, const float* rows, const std::vector<int32_t>& group_expert,
                           const std::vector<int64_t>& group_rows, float* y)>;
  ExpertCompute() = default;
  ExpertCompute(std::nullptr_t) {}  // NOLINT: no device
  template <typename F>
  requires(std::is_constructible_v<Fn, F> && !std::is_same_v<std::decay_t<F>, ExpertCompute> &&
           !std::is_same_v<std::decay_t<F>, std::nullptr_t>)
      ExpertCompute(F f, HostPinning pinning = {})  // NOLINT: a callable is a compute
      : run_(std::move(f)), pinning_(std::move(pinning)) {}

  explicit operator bool() const { return static_cast<bool>(run_); }
  Status operator()(int layer, const float* rows, const std::vector<int32_t>& group_expert,
                    const std::vector<int64_t>& group_rows, float* y) const {
    return run_(layer, rows, group_expert, group_rows, y);
  }
  const HostPinning& pinning() const { return pinning_; }

 private:
  Fn run_;
  HostPinning pinning_;
};

struct ExpertServerOptions {
  // How long a payload may take to follow its header before the router is declared gone.
  std::chrono::milliseconds deadline{30000};
  // The most expert weights the rank may hold (expert_memory_mib; 0: no limit): told to the
  // routers in every pong, so that router 0's planner gives it no more slots than fit.
  uint64_t memory_budget_bytes = 0;
};

class ExpertServer {
 public:
  // `placement` gives the router count and, with `layer_ids` (the layers served here), the
  // header size; `control` (not owned) outlives the server.
  ExpertServer(Transport* transport, const Placement& placement, const std::vector<int>& layer_ids,
               const CpuKernels& kernels, ThreadPool* pool, ExpertServerOptions options,
               ExpertControlPort* control);
  ~ExpertServer();  // withdraws its transfers and unregisters their buffers

  // What the rank serves from now on (the control plane's change callback sets it).
  void set_served(const ServedWeights& s) { serving_ = s; }
  // Serves until every router has sent shutdown; an error if a message is malformed or a router
  // stops mid-microbatch.
  Status Serve();
  int rank() const { return t_->rank(); }
  uint64_t microbatches_served() const { return served_; }
  uint64_t rows_served() const { return rows_served_; }
  // Rows computed per (layer, logical expert), if set before Serve (e.g. a metrics counter);
  // called on the serving thread, once per expert per microbatch.
  void set_rows_observer(std::function<void(int layer, int expert, int64_t rows)> f) {
    rows_observer_ = std::move(f);
  }
  // Computes on a device instead of the CPU kernels, if set before Serve.
  void set_compute(ExpertCompute f) { compute_ = std::move(f); }
  // Seconds each microbatch that missed the cache waited for its loads (e.g. a histogram).
  void set_cache_wait_observer(std::function<void(double)> f) { cache_wait_ = std::move(f); }

 private:
  struct RouterState {
    AlignedBuffer header;
    Request header_req;
    // The next header, taken while the previous microbatch was computed, and its rows already
    // being received into in[pre] (two registered input buffers per router, so that microbatch
    // i+1's rows land while i is computed).
    AlignedBuffer ahead;
    bool have_ahead = false;
    bool ahead_needed = false;            // its experts were asked of the cache
    SteadyClock::time_point ahead_at{};   // when it came
    SteadyClock::time_point header_at{};  // when the header being handled came
    AlignedBuffer in[2];
    int next_in = 0;
    Request rows_req;
    int pre = -1;
    size_t pre_bytes = 0;
    AlignedBuffer out[2];
    Request out_req[2];
    EpPong pong;
    Request pong_req;
    int next_out = 0;
    bool done = false;
    // The experts of a microbatch answered "still loading" (layer, expert), and its layer and
    // seq: held in the cache until the router sends it again (same seq) or has moved on (a
    // later layer, or a seq past the one microbatch that may be in flight behind it), so that
    // what loaded meanwhile is not evicted before the retry computes with it.
    struct Kept {
      int layer, expert;
      uint32_t seq;
    };
    std::vector<Kept> kept;
  };

  // One step of the serving loop for `router`: its next header, if one has come, handled.
  Status ServeRouter(int router, bool* progressed);
  // A router whose process died: its transfers are withdrawn and it is served no more.
  void DropRouter(int router, const Status& why);
  Status Handle(int router, const EpHeaderFixed& h, const EpEntry* entries, bool needed);
  // Asks the cache for the experts a dispatch header names (their loads start now).
  void NeedExperts(const EpHeaderFixed& h, const EpEntry* entries);
  // The grouped pass over groups_: with a cache, the resident experts first, then each of the
  // others as its load finishes. An expert still loading after half the deadline, or whose load
  // failed, makes *answer the reason (the microbatch is answered so, the rank goes on).
  // The experts of such a microbatch go to *kept instead of being let go.
  Status RunGroups(int layer, const float* in, int64_t hidden, float* y, int64_t ldy,
                   EpResultTrailer* answer, std::vector<RouterState::Kept>* kept,
                   SteadyClock::time_point header_at);
  // Lets go of a router's kept experts (with a header: once it is their retry or past it).
  void ReleaseKept(RouterState& rs);
  void ReleaseKeptFor(RouterState& rs, const EpHeaderFixed& h);
  // Whether the header's entry count fits this job's header (its entries can be read).
  bool SlotsFit(const EpHeaderFixed& h) const;
  // The rows a dispatch header announces, after checking its experts against what is held.
  Result<int64_t> RowsOf(const EpHeaderFixed& h, const EpEntry* entries) const;
  // Grows a receive or send buffer (registered with the transport, and pinned for the device
  // when the compute asks for it).
  Status ReserveIo(AlignedBuffer& b, size_t bytes);
  void ReleaseIo(AlignedBuffer& b);
  // Takes the router's next header if it has arrived and starts receiving its rows.
  Status LookAhead(int router);
  Status Pong(int router, uint32_t seq);
  // kEcho: receives the header's rows and sends them back with a trailer (no compute).
  Status Echo(int router, const EpHeaderFixed& h);
  // The next of the two result buffers of `router` (its previous send from it waited for).
  Result<float*> ResultBuffer(int router, size_t bytes);
  // Canary rows of the microbatch: recomputed with the new weights, counted.
  void RunCanaries(const EpHeaderFixed& h, const EpEntry* entries, const float* in, float* out);

  Transport* t_;
  ExpertServerOptions opts_;
  GroupedFfn ffn_;
  size_t header_bytes_ = 0;
  std::vector<RouterState> routers_;
  std::vector<EpEntry> entries_;
  AlignedBuffer y_;
  std::vector<int32_t> rows_;
  std::vector<ExpertGroup> groups_;
  std::vector<int32_t> group_ids_;  // the expert of each entry of groups_
  std::vector<ExpertGroup> ready_;
  std::vector<size_t> pending_;
  std::function<void(double)> cache_wait_;
  int64_t last_cache_wait_us_ = 0;  // the microbatch being handled: its wait for cache loads
  uint64_t served_ = 0;
  uint64_t rows_served_ = 0;
  uint64_t busy_us_ = 0;  // computing those rows (their microbatches' compute less cache waits)
  std::function<void(int, int, int64_t)> rows_observer_;
  ExpertCompute compute_;
  std::vector<int32_t> group_expert_;
  std::vector<int64_t> group_rows_;
  // Canary scratch.
  std::vector<int32_t> canary_rows_;
  AlignedBuffer canary_y_;
  ExpertControlPort* control_;
  // What the rank serves, as the control plane last handed it.
  ServedWeights serving_;
};

}  // namespace moerun
