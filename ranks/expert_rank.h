// The service loop of an expert rank: receive a microbatch of rows from any router, run each
// expert the header names over its rows as one grouped pass, send the outputs back; until every
// router has said shutdown. Holds only this rank's experts. Buffers grow to the largest
// microbatch seen and are reused (no allocation in steady state). Runs on the rank's main thread.
//
// Control messages from the routers change what it holds while it serves (ep/protocol.h):
//   load     experts of a layer, loaded in the background (throttled, with progress) by the
//            loader the job sets; answered once they are in;
//   release  a router no longer sends rows for these experts; an expert is freed once every
//            router has released it (messages keep their order, so no earlier microbatch of
//            that router still needs it);
//   update   new weights for one expert from a file, beside the old ones; a canary share of the
//            expert's rows (exactly: the share of the rows seen so far, rounded down) is computed
//            with them until promote (they replace the old weights) or rollback (dropped);
//   query    the rows and canary rows of an update.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/aligned_buffer.h"
#include "ep/owned_sends.h"
#include "ep/protocol.h"
#include "experts/cpu/grouped_ffn.h"
#include "model/layer_weights.h"
#include "router/placement.h"
#include "transport/transport.h"

namespace moerun {

// Runs the grouped FFN somewhere else than this rank's CPU (a GPU: launch/ wires the CUDA layer
// in): rows [total][hidden] grouped as listed (group_expert[g] the logical expert, group_rows[g]
// its rows, empty groups left out) -> y [total][hidden]. Called on the serving thread.
using ExpertCompute =
    std::function<Status(int layer, const float* rows, const std::vector<int32_t>& group_expert,
                         const std::vector<int64_t>& group_rows, float* y)>;

// What a background load may use: a bandwidth limit, where to report bytes done, when to stop.
struct LoadThrottle {
  double bytes_per_s = 0;  // 0: unlimited
  std::atomic<uint64_t>* bytes_done = nullptr;
  const std::atomic<bool>* cancel = nullptr;
};

// Loads the experts of `mask` for `layer` (the others left empty); `files` maps experts to a
// .safetensors file that replaces their checkpoint weights (promoted updates). Runs on a
// background thread.
using ExpertLoader = std::function<Result<std::shared_ptr<MoeLayerWeights>>(
    int layer, const std::vector<bool>& mask, const std::map<int, std::string>& files,
    const LoadThrottle& throttle)>;
// Loads new weights for one expert from a file. Runs on a background thread.
using ExpertFileLoader =
    std::function<Result<ExpertWeights>(int layer, int expert, const std::string& file)>;

struct ExpertRankOptions {
  // How long a payload may take to follow its header before the router is declared gone.
  std::chrono::milliseconds deadline{30000};
};

class ExpertRank {
 public:
  // `placement` gives the router count, the header size and who uses the experts loaded at start.
  ExpertRank(Transport* transport, const Placement& placement,
             std::map<int, std::shared_ptr<MoeLayerWeights>> layers, const CpuKernels& kernels,
             ThreadPool* pool, ExpertRankOptions options);
  ~ExpertRank();  // unregisters its transfer buffers; waits for a background load to stop

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
  // Computes on a device instead of the CPU kernels, if set before Serve (control messages that
  // change the experts are then refused: the device holds its copy from the start).
  void set_compute(ExpertCompute f) { compute_ = std::move(f); }
  // Where load and update take their weights from; without them those messages are refused.
  void set_loaders(ExpertLoader load, ExpertFileLoader load_file) {
    loader_ = std::move(load);
    file_loader_ = std::move(load_file);
  }
  // Bytes of expert weights held now (every layer, canary weights included).
  size_t held_bytes() const;

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
  // New weights for one expert, beside the old ones.
  struct Variant {
    ExpertWeights weights;
    double share = 0;  // of the expert's rows
    uint64_t rows = 0, canary_rows = 0;
  };
  // A load or update running in the background, and those waiting for it.
  struct Job {
    int router = 0;
    uint64_t id = 0;
    bool update = false;
    int layer = 0;
    std::vector<int> experts;          // load
    std::map<int, std::string> files;  // load: promoted weights
    int expert = -1;                   // update
    std::string file;                  // update
    double canary = 0;                 // update: share
    double throttle = 0;               // load: bytes/s
    std::chrono::steady_clock::time_point started;
  };
  struct Loaded {
    Status status;
    std::shared_ptr<MoeLayerWeights> layer;  // load
    ExpertWeights expert;                    // update
  };

  Status Handle(int router, const EpHeaderFixed& h, const EpEntry* entries);
  // Whether the header's entry count fits this job's header (its entries can be read).
  bool SlotsFit(const EpHeaderFixed& h) const;
  // The rows a dispatch header announces, after checking its experts against what is held.
  Result<int64_t> RowsOf(const EpHeaderFixed& h, const EpEntry* entries) const;
  // Takes the router's next header if it has arrived and starts receiving its rows.
  Status LookAhead(int router);
  Status Pong(int router, uint32_t seq);
  // Canary rows of the microbatch: recomputed with the new weights, counted.
  void RunCanaries(const EpHeaderFixed& h, const EpEntry* entries, const float* in, float* out);

  // Control (expert_host_control.cc).
  Status Control(int router, const EpHeaderFixed& h);  // receives the JSON, HandleControl
  Status HandleControl(int router, uint64_t id);
  Status Reply(int router, const std::string& json);
  // Finishes sends of replies; installs a finished background job and starts the next one.
  Status PollControl();
  Status StartNextJob();
  Status Finish(Job& job, Loaded loaded);
  std::string Release(uint64_t id, int router, int layer, const std::vector<int>& experts,
                      bool all_routers);

  Transport* t_;
  std::map<int, std::shared_ptr<MoeLayerWeights>> layers_;
  // Per layer and expert: the routers that may still send it rows (freed when none).
  std::map<int, std::vector<std::vector<bool>>> users_;
  std::map<std::pair<int, int>, Variant> variants_;
  const CpuKernels& kernels_;
  ExpertRankOptions opts_;
  GroupedFfn ffn_;
  size_t header_bytes_ = 0;
  std::vector<RouterState> routers_;
  std::vector<EpEntry> entries_;
  AlignedBuffer y_;
  std::vector<int32_t> rows_;
  std::vector<ExpertGroup> groups_;
  uint64_t served_ = 0;
  uint64_t rows_served_ = 0;
  std::function<void(int, int, int64_t)> rows_observer_;
  ExpertCompute compute_;
  std::vector<int32_t> group_expert_;
  std::vector<int64_t> group_rows_;
  // Canary scratch.
  std::vector<int32_t> canary_rows_;
  AlignedBuffer canary_y_;

  ExpertLoader loader_;
  ExpertFileLoader file_loader_;
  std::deque<Job> queued_;
  std::unique_ptr<Job> running_;
  std::future<Loaded> result_;
  std::atomic<uint64_t> job_bytes_{0};
  std::atomic<bool> cancel_{false};
  std::chrono::steady_clock::time_point last_progress_;
  OwnedSends outgoing_;
  std::vector<char> control_in_;
};

}  // namespace moerun
