// The service loop of an expert rank: receive a microbatch of rows from any router, run each
// local expert over its rows as one grouped pass, send the outputs back; until every router has
// said shutdown. Holds only this rank's experts. Buffers grow to the largest microbatch seen and
// are reused (no allocation in steady state). Runs on the rank's main thread.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "experts/cpu/aligned_buffer.h"
#include "experts/cpu/grouped_ffn.h"
#include "router/placement.h"
#include "runtime/ep_protocol.h"
#include "runtime/moe_layer.h"
#include "transport/transport.h"

namespace moerun {

// Runs the grouped FFN somewhere else than this rank's CPU (a GPU: launch/ wires the CUDA layer
// in): rows [total][hidden] grouped as listed (group_expert[g] the logical expert, group_rows[g]
// its rows, empty groups left out) -> y [total][hidden]. Called on the serving thread.
using ExpertCompute =
    std::function<Status(int layer, const float* rows, const std::vector<int32_t>& group_expert,
                         const std::vector<int64_t>& group_rows, float* y)>;

struct ExpertHostOptions {
  // How long a payload may take to follow its header before the router is declared gone.
  std::chrono::milliseconds deadline{30000};
};

class ExpertHost {
 public:
  ExpertHost(Transport* transport, const Placement& placement,
             std::map<int, std::shared_ptr<const MoeLayerWeights>> layers,
             const CpuKernels& kernels, ThreadPool* pool, ExpertHostOptions options);
  ~ExpertHost();  // unregisters its transfer buffers

  // Serves until every router has sent shutdown; an error if a message is malformed or a router
  // stops mid-microbatch.
  Status Serve();
  uint64_t microbatches_served() const { return served_; }
  uint64_t rows_served() const { return rows_served_; }
  // Rows computed per (layer, logical expert), if set before Serve (e.g. a metrics counter);
  // called on the serving thread, once per expert per microbatch.
  void set_rows_observer(std::function<void(int layer, int expert, int64_t rows)> f) {
    rows_observer_ = std::move(f);
  }
  // Computes on a device instead of the CPU kernels, if set before Serve.
  void set_compute(ExpertCompute f) { compute_ = std::move(f); }

 private:
  struct RouterState {
    AlignedBuffer header;
    Request header_req;
    // The next header, taken while the previous microbatch was computed, and its rows already
    // being received into in[pre] (two registered input buffers per router, so that microbatch
    // i+1's rows land while i is computed).
    AlignedBuffer ahead;
    bool have_ahead = false;
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
  };
  Status Handle(int router, const EpHeaderFixed& h, const int32_t* counts);
  // Whether the header's slot count fits this job's header (its counts can be read).
  bool SlotsFit(const EpHeaderFixed& h) const;
  // The rows a dispatch header announces, after checking it against this rank's placement.
  Result<int64_t> RowsOf(const EpHeaderFixed& h, const int32_t* counts) const;
  // Takes the router's next header if it has arrived and starts receiving its rows.
  Status LookAhead(int router);
  Status Pong(int router, uint32_t seq);

  Transport* t_;
  const Placement& placement_;
  std::map<int, std::shared_ptr<const MoeLayerWeights>> layers_;
  ExpertHostOptions opts_;
  GroupedFfn ffn_;
  size_t header_bytes_ = 0;
  std::vector<RouterState> routers_;
  std::vector<int32_t> counts_;
  AlignedBuffer y_;
  std::vector<int32_t> rows_;
  std::vector<ExpertGroup> groups_;
  uint64_t served_ = 0;
  uint64_t rows_served_ = 0;
  std::function<void(int, int, int64_t)> rows_observer_;
  ExpertCompute compute_;
  std::vector<int32_t> group_expert_;
  std::vector<int64_t> group_rows_;
};

}  // namespace moerun
