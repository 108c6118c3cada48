// The expert rank's side of migrations and expert updates: the expert weights this rank holds,
// which routers may still send rows to each of them, new weights beside old ones with their
// canary share, and the one load that runs in the background. The routers' control messages
// (runtime/ep/protocol.h, JSON bodies) change what it holds while the rank serves:
//   load     experts of a layer, loaded in the background (throttled, with progress every second)
//            by the loader the job sets; answered once they are in;
//   release  a router no longer sends rows for these experts; an expert is freed once every
//            router has released it (messages keep their order, so no earlier microbatch of
//            that router still needs it);
//   update   new weights for one expert from a file, beside the old ones; a canary share of the
//            expert's rows (exactly: the share of the rows seen so far, rounded down) is computed
//            with them until promote (they replace the old weights) or rollback (dropped);
//   query    the rows and canary rows of an update.
//
// What the rank's data path reads per microbatch (the layers' weights, which experts it may
// compute, the cache, whether an update is in canary) is handed to it as a ServedWeights
// (runtime/ep/served_weights.h) through set_on_change, whenever that changes.
//
// Threads: the expert rank's serving thread calls everything (OnMessage and Poll run between
// microbatches, so the handle never changes while one is computed; set_on_change and
// EnableCache before Serve starts), and the change callback runs inside those calls, on their
// thread. The loaders run on one background thread (std::async) and
// touch nothing here but the throttle's atomics: what they load is moved in by Poll.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "experts/cpu/expert_weights.h"
#include "runtime/cache/expert_cache.h"
#include "runtime/ep/expert_control_port.h"
#include "runtime/ep/owned_sends.h"
#include "runtime/ep/protocol.h"
#include "runtime/ep/served_weights.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/weight_source.h"
#include "transport/transport.h"

namespace moerun {

// Loads the experts of `mask` for `layer` (the others left empty); `files` maps experts to a
// .safetensors file that replaces their checkpoint weights (promoted updates). Runs on a
// background thread.
using ExpertLoader = std::function<Result<std::shared_ptr<MoeLayerWeights>>(
    int layer, const std::vector<bool>& mask, const std::map<int, std::string>& files,
    const LoadThrottle& throttle)>;
// Loads new weights for one expert from a file. Runs on a background thread.
using ExpertFileLoader =
    std::function<Result<ExpertWeights>(int layer, int expert, const std::string& file)>;

class ExpertControl final : public ExpertControlPort {
 public:
  // `layers`: what the rank loaded at start, every loaded expert used by every one of `routers`.
  // `deadline`: how long a control message's body may take to follow its header.
  ExpertControl(Transport* transport, int routers,
                std::map<int, std::shared_ptr<MoeLayerWeights>> layers,
                std::chrono::milliseconds deadline);
  ~ExpertControl();  // stops and waits for a background load; withdraws unsent replies

  // Where load and update take their weights from; without them those messages are refused.
  void set_loaders(ExpertLoader load, ExpertFileLoader load_file);
  // The rank computes on a device holding its own copy of the experts, made at start: loads and
  // updates are refused with the reason.
  void set_device_copy(bool on) { device_copy_ = on; }

  // From now on the rank hosts the experts of `hosted` (per layer) with an expert cache: those
  // resident now stay (pinned where `pinned` says, per layer), the others load when a
  // microbatch needs them; loads (migrations) warm the cache, releases evict.
  void EnableCache(ExpertCacheOptions options, ExpertFetch fetch,
                   const std::map<int, std::vector<bool>>& hosted,
                   const std::map<int, std::vector<bool>>& pinned,
                   std::unique_ptr<SpillFile> spill = nullptr);
  // The cache, or null when every hosted expert is resident.
  ExpertCache* cache() { return cache_.get(); }
  const ExpertCache* cache() const { return cache_.get(); }
  // Whether a router may send rows for the expert (resident, or in the cache's source).
  bool hosts(int layer, int expert) const;

  // `f` gets what the rank serves now, and again after every change of it (see ServedWeights);
  // called on the serving thread, inside this call, EnableCache, OnMessage and Poll.
  void set_on_change(std::function<void(const ServedWeights&)> f);

  // The weights of `layer` held here, or null when the rank does not serve it.
  const MoeLayerWeights* layer(int layer) const;
  std::vector<int> layer_ids() const;

  // A control message from `router` (its header `h`; the JSON body follows on kTagRows).
  Status OnMessage(int router, const EpHeaderFixed& h) override;
  // Moves replies and the background load on; call often (between microbatches and when idle).
  Status Poll() override;
  // Waits until the replies are sent, at most until `deadline` (then they are withdrawn).
  void Drain(Deadline deadline) override;

  // Whether any expert has an update with a canary share (the compute path then asks below;
  // ServedWeights::has_updates says the same).
  bool has_updates() const { return !variants_.empty(); }
  // For `n` rows of `expert` in a microbatch, rows [first, first + n): appends to *rows those the
  // canary takes (counting them) and returns the new weights, or null when the expert has no
  // update.
  const ExpertWeights* CanaryRows(int layer, int expert, int64_t first, int64_t n,
                                  std::vector<int32_t>* rows) override;
  // Bytes of expert weights held now (every layer, update weights included).
  size_t held_bytes() const;

 private:
  // New weights for one expert, beside the old ones.
  struct Variant {
    ExpertWeights weights;
    double share = 0;  // of the expert's rows
    std::string file;  // where they came from
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
    bool warming = false;              // load into the cache: done when its loads are
    std::chrono::steady_clock::time_point started;
  };
  struct Loaded {
    Status status;
    std::shared_ptr<MoeLayerWeights> layer;  // load
    ExpertWeights expert;                    // update
  };
  Status Handle(int router, uint64_t id);  // the JSON in body_
  Status Reply(int router, const std::string& json);
  std::string Release(uint64_t id, int router, int layer, const std::vector<int>& experts,
                      bool all_routers);
  Status StartNextJob();
  Status Finish(Job& job, Loaded loaded);
  // Remakes served_ from the layers, their users, the cache and the updates; tells on_change_.
  void Publish();

  Transport* t_;
  std::chrono::milliseconds deadline_;
  std::map<int, std::shared_ptr<MoeLayerWeights>> layers_;
  // Per layer and expert: the routers that may still send it rows (freed when none).
  std::map<int, std::vector<std::vector<bool>>> users_;
  std::map<std::pair<int, int>, Variant> variants_;
  bool device_copy_ = false;
  ExpertLoader loader_;
  ExpertFileLoader file_loader_;
  std::deque<Job> queued_;
  std::unique_ptr<Job> running_;
  std::future<Loaded> result_;
  std::atomic<uint64_t> job_bytes_{0};
  std::atomic<bool> cancel_{false};
  std::chrono::steady_clock::time_point last_progress_;
  OwnedSends outgoing_;
  std::unique_ptr<ExpertCache> cache_;
  std::vector<char> body_;
  ServedWeights served_;
  std::function<void(const ServedWeights&)> on_change_;
};

}  // namespace moerun
