#include "base/idle_backoff.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace moerun {
namespace {

constexpr int64_t kOversubscribedCapUs = 1000;
constexpr uint64_t kOversubscribedYields = 64;
constexpr uint64_t kOversubscribedSpins = 16;
constexpr std::chrono::microseconds kOversubscribedBusyFor{500};

int EnvInt(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (*end == '\0' && n > 0 && n < 1'000'000) ? static_cast<int>(n) : 0;
}

// The cores this process may run on (its affinity mask), at least 1.
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

IdlePolicy IdlePolicyFor(int local_ranks, int cores, const char* override_us) {
  IdlePolicy p;
  if (local_ranks > cores) {
    p.sleep_cap = std::chrono::microseconds(kOversubscribedCapUs);
    p.yields = kOversubscribedYields;
    p.max_spins = kOversubscribedSpins;
    p.busy_for = kOversubscribedBusyFor;
  }
  if (override_us != nullptr && *override_us != '\0') {
    char* end = nullptr;
    const long us = std::strtol(override_us, &end, 10);
    if (*end == '\0' && us >= IdleBackoff::kFirstSleep.count() && us <= 100000) {
      p.sleep_cap = std::chrono::microseconds(us);
    }
  }
  return p;
}

const IdlePolicy& ProcessIdlePolicy() {
  static const IdlePolicy policy = [] {
    int local = EnvInt("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local == 0) local = EnvInt("SLURM_NTASKS_PER_NODE");
    if (local == 0) local = EnvInt("MPI_LOCALNRANKS");
    return IdlePolicyFor(local, UsableCores(), std::getenv("MOERUN_IDLE_SLEEP_MAX_US"));
  }();
  return policy;
}

bool IdleWaiter::WaitForActivity(std::chrono::microseconds max) {
  std::this_thread::sleep_for(max);
  return false;
}

void IdleBackoff::Idle() {
  ++idle_;
  if (!sleeping_) {
    const bool timed = policy_.busy_for != std::chrono::microseconds::max();
    if (idle_ == 1 && timed) idle_since_ = std::chrono::steady_clock::now();
    const bool long_idle =
        timed && std::chrono::steady_clock::now() - idle_since_ >= policy_.busy_for;
    if (!long_idle) {
      if (idle_ <= spins_) return;
      if (idle_ <= spins_ + policy_.yields) {
        sched_yield();
        return;
      }
    }
    sleeping_ = true;
  }
  if (waiter_ != nullptr) {
    // Woken: spin again, as after progress (MPI moves a message off its queues during a poll
    // that found nothing yet, so the next poll sees it).
    if (waiter_->WaitForActivity(sleep_)) {
      Progress();
      return;
    }
    sleep_ = std::min(sleep_ * 2, policy_.sleep_cap);
    return;
  }
  std::this_thread::sleep_for(sleep_);
  sleep_ = std::min(sleep_ * 2, policy_.sleep_cap);
}

}  // namespace moerun
