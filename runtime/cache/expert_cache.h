// The expert cache of an expert rank: the rank hosts more experts than its memory budget holds;
// the hot ones are resident in packed form (in the layer's expert vector, where the grouped FFN
// reads them), the others stay in their source (the checkpoint's mapped files, or a preset's
// seed) and are loaded on demand.
//
//   Need(layer, expert)   a microbatch whose header has arrived will compute this expert: a hit if
//                         it is resident, else a miss and its load is queued at once (before the
//                         rows arrive); it is held (not evicted) until Done.
//   Poll()                on the serving thread between steps: finished loads go in place, queued
//                         loads start (at most `loaders` at a time and `max_inflight_bytes` in
//                         flight), experts are evicted to make room before a load starts.
//   WaitForLoad(until)    blocks until some load finishes (or `until`).
//
// Eviction (`policy`): the resident, unpinned experts no microbatch holds, the lowest score first.
//   lfu: a use count that halves every `half_life` microbatches (exponentially decayed frequency),
//        ties by recency. Routing is skewed and changes slowly: a cold expert that one microbatch
//        needed has a count near 1 and leaves first, instead of pushing out a hot one (moebench
//        cache replays the gate's routing through both policies; see docs/operator-guide.md, "the
//        expert cache").
//   lru:  the least recently used.
//   cycle: for an expert rank that serves the layers in turn (every batch goes through layer 0,
//        1, ..., so an expert of layer l is needed again no sooner than layer l's next turn):
//        evicts the expert whose next use is expected furthest away, estimated as the ticks until
//        its layer's next turn (each layer's period: the ticks between its last two microbatches)
//        plus (1/p - 1) periods, p the expert's use probability per turn of its layer (its use
//        count decayed over `half_life` as in lfu, but aged only from its layer's last turn, so
//        that experts are not judged by where their layer sits in the cycle). lfu and lru favour
//        the layers just served, whose turn is furthest away: on real routing replayed through
//        all layers they evict what the next layers need (moebench cache-replay).
//   adaptive (the default): evicts as whichever of cycle, lru and lfu would have hit most lately.
//        The cache keeps three shadow caches of its budget (which experts each policy would hold,
//        no weights) beside the real one, counts their hits over the last few thousand needs
//        (a decayed count), and follows the leader (one that leads by 1 % or more). No policy
//        wins on every routing: cycle keeps what the next layers need where batches go through
//        the layers in turn with a skew that holds (prefill), lru wins where a decode stream
//        keeps reusing its last experts (moebench cache-replay on recorded routing).
// Resident bytes stay within the budget, except while the experts held by microbatches in flight
// need more (then the rank holds exactly those, and says so once in the log). With a spill file,
// up to `loaders` evicted experts' buffers are kept for the next reads (no new allocation and no
// page faults per miss): memory is at most the budget plus those and the loads in flight.
//
// Threads: every method on the serving thread; the loads run on `loaders` threads of their own
// that call `fetch` and touch nothing else. stats() may be read from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "experts/cpu/expert_weights.h"
#include "runtime/cache/spill_file.h"

namespace moerun {

enum class EvictionPolicy { kLfu, kLru, kCycle, kAdaptive };
// "lfu", "lru", "cycle", "adaptive"
const char* EvictionPolicyName(EvictionPolicy p);
Result<EvictionPolicy> ParseEvictionPolicy(const std::string& name);

struct ExpertCacheOptions {
  size_t budget_bytes = 0;        // resident expert weights of this rank (every layer)
  int loaders = 1;                // loads in parallel
  size_t max_inflight_bytes = 0;  // bytes of loads in flight; 0: two experts' worth
  EvictionPolicy policy = EvictionPolicy::kAdaptive;
  double half_life = 256;  // lfu, cycle: microbatches over which a use counts half
  // Bandwidth of the loads in all (every loader, spill reads too), in bytes/s; 0: unlimited.
  // A load of B bytes finishes no sooner than B / rate after the previous one did (or after it
  // started): a shared disk or network filesystem keeps room for the rest of the machine.
  double load_bytes_per_s = 0;
};

// Loads one expert from its source (`file`: a promoted update's weights file, else empty: the
// checkpoint or preset). Runs on a loader thread.
using ExpertFetch =
    std::function<Result<ExpertWeights>(int layer, int expert, const std::string& file)>;

// Counters since the start (atomics: read from any thread).
struct ExpertCacheStats {
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> misses{0};
  std::atomic<uint64_t> evictions{0};
  std::atomic<uint64_t> loaded_bytes{0};
  std::atomic<uint64_t> loads{0};
  std::atomic<uint64_t> spill_reads{0};  // loads served by the spill file
  std::atomic<uint64_t> resident_bytes{0};
  std::atomic<uint64_t> resident_experts{0};
  std::atomic<uint64_t> hosted_experts{0};
  // The policy evictions follow now (an EvictionPolicy; for adaptive, the shadow it follows).
  std::atomic<int> following{0};
};

class ExpertCache {
 public:
  // `layers`: per served layer, the expert vector the rank computes from (empty weights = not
  // resident); the cache fills and empties its entries. Experts resident in them now count as
  // hosted and resident.
  // `spill` (may be null): where loaded experts are also written, and later misses read from.
  ExpertCache(ExpertCacheOptions options, ExpertFetch fetch,
              std::map<int, std::vector<ExpertWeights>*> layers,
              std::unique_ptr<SpillFile> spill = nullptr);
  ~ExpertCache();  // stops the loaders (a load in progress finishes first)
  ExpertCache(const ExpertCache&) = delete;
  // An expert that may be evicted, with its score (the lowest goes first).
  struct Victim {
    double score;
    int layer, expert;
  };
  ExpertCache& operator=(const ExpertCache&) = delete;

  const ExpertCacheOptions& options() const { return opts_; }
  const ExpertCacheStats& stats() const { return *stats_; }
  // The same counters, for readers that may outlive the cache (metrics callbacks).
  std::shared_ptr<const ExpertCacheStats> shared_stats() const { return stats_; }

  // Whether the rank hosts the expert (it may get rows for it), resident or not.
  bool hosted(int layer, int expert) const;
  bool resident(int layer, int expert) const;
  // The rank hosts the expert from now on (not loaded until needed or warmed), or no longer (it
  // is evicted at once, a load of it dropped when it finishes).
  void Host(int layer, int expert, bool on);
  // Pinned experts are never evicted (load them with Warm).
  void Pin(int layer, int expert);
  // Queues loads of hosted, non-resident experts (a migration moving the hot set here), in the
  // order given: loaded only into free room (nothing is evicted for them).
  void Warm(int layer, const std::vector<int>& experts);
  // Loads of `experts` queued or in flight.
  bool Loading(int layer, const std::vector<int>& experts) const;
  // A promoted update: later loads of the expert read `file`; `weights` are its new resident
  // weights (already in the layer's vector).
  void SetFile(int layer, int expert, const std::string& file);
  // The weights in the layer's vector changed size or appeared (promote, a migration's load).
  void Resized(int layer, int expert);

  // Counts a hit or a miss (queuing the load), and holds the expert until Done. `tick` once per
  // microbatch, before its Need calls.
  void Tick() {
    if (!shadow_pending_.empty()) ShadowStep();
    ++tick_;
  }
  void Need(int layer, int expert);
  void Done(int layer, int expert);
  // Error of a failed load of an expert a microbatch needs (names the expert and the reason).
  Status Failed(int layer, int expert) const;

  Status Poll();
  // Until a load finishes or `until`; false on timeout.
  bool WaitForLoad(Deadline until);

  uint64_t resident_bytes() const { return resident_bytes_; }
  // The policy that decides evictions now: `policy`, or for adaptive the one it follows.
  EvictionPolicy following() const;
  // Bytes of one expert of `layer` (0 until one has been seen).
  size_t expert_bytes(int layer) const;

 private:
  enum class State { kCold, kQueued, kLoading, kResident, kFailed };
  struct Entry {
    State state = State::kCold;
    bool hosted = false;
    bool pinned = false;
    bool warm = false;             // queued by Warm: admitted only where room can be made
    int held = 0;                  // microbatches that need it
    size_t bytes = 0;              // resident
    size_t loading_bytes = 0;      // counted in flight
    double uses = 0;               // lfu: decayed use count as of `last`
    uint64_t last = 0;             // tick of the last use
    std::array<bool, 3> shadow{};  // adaptive: held by the shadow cache of lfu, lru, cycle
    Status error;
    std::string file;
  };
  struct Finished {
    int layer, expert;
    Result<ExpertWeights> weights;
  };
  using Key = std::pair<int, int>;

  Entry* Find(int layer, int expert);
  const Entry* Find(int layer, int expert) const;
  void Queue(int layer, int expert, bool warm);
  void Touch(Entry& e);
  // Eviction order: the lowest score goes first (under `following()`, or policy `p`).
  double Score(int layer, const Entry& e) const { return ScoreAs(following(), layer, e); }
  double ScoreAs(EvictionPolicy p, int layer, const Entry& e) const;
  // adaptive: the shadow caches see the needs since the last call as one step (hits first, then
  // the misses inserted, evicting what their policy would), and the leader is chosen again.
  void ShadowStep();
  // Evicts until `need` more bytes fit in the budget (`strict`: evicts nothing, only says whether
  // they fit); false if the experts left cannot go.
  bool MakeRoom(size_t need, bool strict);
  void Evict(int layer, int expert, Entry& e);
  void Install(Finished& d);
  size_t Bytes(int layer) const;
  void LoaderMain();
  void Publish();

  ExpertCacheOptions opts_;
  ExpertFetch fetch_;
  std::unique_ptr<SpillFile> spill_;
  bool warned_spill_ = false;  // (loader threads, under mu_)
  std::map<int, std::vector<ExpertWeights>*> layers_;
  std::map<int, std::vector<Entry>> entries_;
  std::map<int, size_t> expert_bytes_;
  // cycle: per layer, the tick of its last microbatch and the ticks between its last two (0:
  // not yet seen twice).
  struct LayerTurn {
    uint64_t last = 0;
    uint64_t period = 0;
    bool seen = false;
  };
  std::map<int, LayerTurn> turns_;
  double mean_period_ = 0;  // of the layers seen twice (a layer not yet seen twice uses it)
  // adaptive: per shadow (lfu, lru, cycle) the bytes it holds and its hits, decayed per need.
  struct Shadow {
    size_t bytes = 0;
    double hits = 0;
  };
  std::array<Shadow, 3> shadows_{};
  EvictionPolicy leader_ = EvictionPolicy::kCycle;
  std::vector<Key> shadow_pending_;  // needs the shadows have not seen yet
  std::vector<Victim> victims_;      // ShadowStep's scratch
  // MakeRoom's eviction order (a heap: GoesLater in the .cc), valid for order_tick_.
  std::vector<Victim> order_;
  bool order_valid_ = false;
  uint64_t order_tick_ = 0;
  std::deque<Key> demand_, warm_;  // loads not started yet
  uint64_t tick_ = 0;
  uint64_t resident_bytes_ = 0;
  size_t inflight_bytes_ = 0;
  int inflight_ = 0;
  bool warned_over_ = false;
  bool dirty_ = true;  // the published counts are out of date
  std::shared_ptr<ExpertCacheStats> stats_ = std::make_shared<ExpertCacheStats>();

  // The loaders' queue and results.
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::pair<Key, std::string>> work_;
  std::deque<Finished> done_;
  std::vector<ExpertWeights> spare_;  // evicted weights whose memory a spill read reuses
  bool stop_ = false;
  SteadyClock::time_point paced_until_{};  // load_bytes_per_s: when the last paced load is due
  std::vector<std::thread> threads_;
};

}  // namespace moerun
