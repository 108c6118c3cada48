// What a router knows of each expert rank's liveness, and the transfers it had to give up on.
//
// A router probes every expert rank (EpKind::kPing -> EpPong) when a probe is due, at most one in
// flight per rank. A rank is "answering" while its last probe came back within probe_deadline
// and no abandoned transfer to or from it is outstanding. When a microbatch misses its deadline,
// its transfers are not cancelled (MPI cannot withdraw a send, and a cancelled receive would
// leave the late answer to be matched by the next one): they stay posted, with their buffers,
// here ("stranded") until they complete, so that a rank that wakes up drains them in order and
// the channel stays in step (its late answers land in the stranded buffers and are dropped).
//
// A rank is "dead" once the transport says its endpoint failed (ucx: the process died), once a
// probe has gone unanswered for dead_after, or once a caller says so (MarkDead: a microbatch
// missed the expert-parallel deadline). A dead rank gets no more work, probes or control
// messages, and answers it sends later are discarded. Its experts are served by their other
// copies, or re-placed (the router's control does that). It comes back only as a new process
// that joined the job as that rank (moerun serve --join): Revive, once the transport reaches the
// new process.
//
// A rank is "retired" once the operator took it out of the job on purpose (moectl retire: its
// experts were re-placed first, then it was sent its shutdown): like a dead rank it gets nothing
// more and its slot can be joined, but it is no failure: it counts in retired_count, not in
// dead_count, and its PeerView says retired (and dead: out of the job). dead() and dead_mask mark
// both.
//
// Threads: Poll, Strand, MarkDead, dead and usable belong to the router thread (it owns the
// transport); Snapshot, all_answering and dead_count may be called from any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "router/placement.h"
#include "runtime/ep/protocol.h"
#include "runtime/ep/stranded.h"
#include "transport/transport.h"

namespace moerun {

struct PeerHealthOptions {
  std::chrono::milliseconds probe_interval{1000};
  std::chrono::milliseconds probe_deadline{2000};
  // A probe unanswered for this long marks the rank dead (0: never; deaths then come from the
  // transport and MarkDead only).
  std::chrono::milliseconds dead_after{0};
};

// Experts of every served layer that a budget of `budget_bytes` holds: budget ÷ one expert's
// bytes (> 0) ÷ the layers (at least 1).
inline uint64_t ExpertsPerLayer(uint64_t budget_bytes, int64_t expert_bytes, size_t layers) {
  return budget_bytes / static_cast<uint64_t>(expert_bytes) / std::max<uint64_t>(1, layers);
}

struct PeerView {
  int rank = 0;
  bool answering = true;
  bool stranded = false;      // transfers of a missed deadline still outstanding
  bool dead = false;          // given up on for the rest of the job
  bool retired = false;       // taken out of the job on purpose (moectl retire): dead is true
                              // too (it gets nothing), but it is no failure
  bool spare = false;         // retired from the start: a slot with no process yet
  double last_seen_s = 0;     // since its last pong (or since start, before the first)
  uint64_t microbatches = 0;  // as it reported
  uint64_t rows = 0;
  uint64_t busy_us = 0;              // its time computing them (EpPong::busy_us)
  uint64_t memory_budget_bytes = 0;  // the most expert weights it may hold (0: no limit)
  uint64_t resident_bytes = 0;
  uint64_t pid = 0;
  std::string host;
  uint64_t cache_budget_bytes = 0;  // its expert cache (0: none)
  uint64_t cache_resident_bytes = 0;
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
  uint32_t cache_hosted = 0;
  uint32_t cache_resident = 0;
};

class PeerHealth {
 public:
  PeerHealth(Transport* transport, const Placement& placement, size_t header_bytes,
             PeerHealthOptions options);
  ~PeerHealth();
  PeerHealth(const PeerHealth&) = delete;
  PeerHealth& operator=(const PeerHealth&) = delete;

  // Keeps requests (that missed their deadline) posted, and the buffers they use alive, until
  // every one completes. Their peers are not answering meanwhile.
  void Strand(std::vector<Request> requests, std::vector<AlignedBuffer> buffers);
  // Tests stranded transfers and probes in flight; sends probes that are due. Cheap; call it
  // between batches and when idle.
  void Poll();
  // Sends no more probes (before shutdown); idle() once nothing is in flight.
  void StopProbing() { probing_ = false; }
  bool idle() const;
  // false while `rank` has stranded transfers or a late probe.
  bool usable(int rank) const { return state_[static_cast<size_t>(rank)].usable; }
  // The first expert rank among `ranks_with_rows` (per rank row counts) that is not usable, or -1.
  int FirstUnusable(const int64_t* rows_per_rank) const;

  // Marks `rank` dead for the rest of the job (logged with `why`); true if it was not yet.
  bool MarkDead(int rank, const std::string& why);
  // Takes `rank` out of the job on purpose (see above); true if it was live. `spare`: a slot that
  // never had a process (spare_expert_ranks), waiting for a joiner: retired from the start, and
  // counted in spare_count instead.
  bool Retire(int rank, bool spare = false);
  int spare_count() const { return spare_count_.load(std::memory_order_relaxed); }
  bool retired(int rank) const {
    return rank >= 0 && static_cast<size_t>(rank) < retired_.size() &&
           retired_[static_cast<size_t>(rank)];
  }
  int retired_count() const { return retired_count_.load(std::memory_order_relaxed); }
  // Dead or retired: out of the job.
  bool dead(int rank) const {
    return rank >= 0 && static_cast<size_t>(rank) < dead_.size() &&
           dead_[static_cast<size_t>(rank)];
  }
  // Takes `rank` back once a new process has joined the job as it (the transport's endpoint is
  // the new process's): what was still outstanding with the old process is withdrawn, and the
  // rank is probed and given work again. false if it was neither dead nor retired.
  bool Revive(int rank);
  // Indexed by rank: which are dead or retired.
  const std::vector<bool>& dead_mask() const { return dead_; }
  // Grows by one with every death and every revival (what callers compare to notice a change).
  uint64_t dead_generation() const { return dead_generation_; }
  int dead_count() const { return dead_count_.load(std::memory_order_relaxed); }

  // Every expert rank that is not dead answers.
  bool all_answering() const { return all_answering_.load(std::memory_order_relaxed); }
  std::vector<PeerView> Snapshot() const;
  // The same into *out, reusing its memory (no allocation once it has held a view).
  void CopyView(std::vector<PeerView>* out) const;

 private:
  struct State {
    Request ping_send, pong_recv;
    EpPong pong_in, pong;  // pong_in is the transport's until the receive completes
    Deadline ping_deadline{};
    SteadyClock::time_point last_pong{}, next_probe{};
    int stranded = 0;
    SteadyClock::time_point ping_sent{};
    bool late = false;
    bool usable = true;
  };
  Status SendProbe(int rank);
  void Refresh();

  Transport* t_;
  const Placement& placement_;
  const size_t header_bytes_;
  const PeerHealthOptions opts_;
  std::vector<State> state_;
  std::vector<AlignedBuffer> ping_headers_;
  StrandedTransfers strands_;
  uint32_t seq_ = 0;
  bool probing_ = true;
  std::vector<bool> dead_;
  uint64_t dead_generation_ = 0;
  std::atomic<int> dead_count_{0};
  std::vector<bool> retired_, spare_;
  std::atomic<int> retired_count_{0}, spare_count_{0};
  const SteadyClock::time_point started_;
  std::atomic<bool> all_answering_{true};
  mutable std::mutex view_mu_;
  std::vector<PeerView> view_;
};

}  // namespace moerun
