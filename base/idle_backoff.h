// IdleBackoff: how a polling loop waits while nothing happens. A rank polls its transport for
// latency, but a job may run more ranks on a host than it has cores (mpirun --oversubscribe, a
// test machine, a CPU-only cluster node), and there an idle rank that keeps polling takes the
// core from the rank that has work: 60 idle expert ranks polling every 50 µs on 2 cores served
// 2 requests in 9 s. So the loop spins `spins` passes, then yields its core (sched_yield) for a
// while, then sleeps, each sleep twice the last, from 50 µs up to a cap:
//   - 50 µs (no growth) when the host has a core for each of its ranks (the latency-first case);
//   - 1 ms when it does not (the ranks this launcher put on this host, OMPI_COMM_WORLD_LOCAL_SIZE
//     or SLURM_NTASKS_PER_NODE, outnumber the cores this process may run on), where the spin and
//     yield phases are short too, and it sleeps once idle for 500 µs whatever the passes (a pass
//     of a loop over MPI may itself yield inside Open MPI, so 2000 spins there kept 60 ranks
//     runnable and never asleep);
//   - MOERUN_IDLE_SLEEP_MAX_US=N (50..100000) decides instead, for any job.
// Any progress (Progress()) starts over at spinning. A loop with a deadline checks it between
// passes, so it overshoots by at most one sleep (the cap).
//
// A loop that waits for messages gives its transport as the IdleWaiter. Where the transport can
// be woken by an arrival (wakes_on_arrival: ucx's worker event fd, mpi's doorbell, inproc's
// condition variable), the sleeps become blocking waits that end as soon as a message may have
// arrived, and the loop spins again: an idle rank answers a dispatch in microseconds instead of
// after the rest of its sleep (1 ms sleeps made a lone token's p99 17 x its p50 over mpi). The
// spin and yield phases stay as they are: blocking sooner (after 20 µs idle instead of 500)
// doubled the p50 of a lone token on 2 cores, where a wake-up costs more than a yield.
// Thread-safety: an IdleBackoff belongs to one loop on one thread; IdleSleepCap() is computed
// once per process and is safe to call from any thread.
#pragma once

#include <chrono>
#include <cstdint>

namespace moerun {

struct IdlePolicy {
  std::chrono::microseconds sleep_cap{50};  // the longest sleep between two polls
  uint64_t yields = 18000;                  // sched_yield passes after the spins, before sleeping
  uint64_t max_spins = UINT64_MAX;          // caps the loop's own spin count
  // Sleeping starts after the spins and yields, or once the loop has been idle this long, if
  // sooner: where each pass yields inside the transport and every core is taken, 80 passes can
  // take longer than the gap between two pings.
  std::chrono::microseconds busy_for = std::chrono::microseconds::max();
};

// What a waiting loop blocks in (a transport). Thread-safety: the waiting loop's thread only.
class IdleWaiter {
 public:
  virtual ~IdleWaiter() = default;
  // Blocks until something may have arrived for this waiter, or `max` has passed. True when it
  // was woken (something may have arrived: the caller should poll a while before waiting again,
  // since a message may take more than one poll to show), false when it timed out. May return
  // early for no reason.
  virtual bool WaitForActivity(std::chrono::microseconds max);
  // True when WaitForActivity returns on an arrival; false when it only sleeps.
  virtual bool wakes_on_arrival() const { return false; }
};

// This process's policy (environment and cores, as above; read once).
const IdlePolicy& ProcessIdlePolicy();

// The policy for `local_ranks` ranks on a host whose process may use `cores` cores, with the
// MOERUN_IDLE_SLEEP_MAX_US value `override_us` (empty or null: none; a value out of range is
// ignored). Pure: what ProcessIdlePolicy() computes from the environment.
IdlePolicy IdlePolicyFor(int local_ranks, int cores, const char* override_us);

class IdleBackoff {
 public:
  // `spins`: passes without progress before the loop starts giving up its core.
  // `waiter`: where the sleeps happen (null: a plain sleep); it must outlive the loop.
  explicit IdleBackoff(uint64_t spins, const IdlePolicy& policy = ProcessIdlePolicy(),
                       IdleWaiter* waiter = nullptr)
      : spins_(spins < policy.max_spins ? spins : policy.max_spins),
        policy_(policy),
        waiter_(waiter != nullptr && waiter->wakes_on_arrival() ? waiter : nullptr) {}
  IdleBackoff(uint64_t spins, IdleWaiter* waiter)
      : IdleBackoff(spins, ProcessIdlePolicy(), waiter) {}

  // Something happened: spin again.
  void Progress() {
    idle_ = 0;
    sleeping_ = false;
    sleep_ = kFirstSleep;
  }
  // One more pass without progress: returns at once while spinning, else yields or sleeps.
  void Idle();

  // The sleep the next sleeping pass takes (for tests).
  std::chrono::microseconds next_sleep() const { return sleep_; }

  static constexpr std::chrono::microseconds kFirstSleep{50};

 private:
  uint64_t spins_;
  IdlePolicy policy_;
  IdleWaiter* waiter_;  // null unless it wakes on arrival
  uint64_t idle_ = 0;
  bool sleeping_ = false;
  std::chrono::steady_clock::time_point idle_since_{};
  std::chrono::microseconds sleep_ = kFirstSleep;
};

}  // namespace moerun
