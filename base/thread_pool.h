// A fixed pool of worker threads for data-parallel loops.
//
// ParallelFor(n, fn) runs fn(task, worker) for every task in [0, n), on the calling thread and
// the workers, and returns when all are done. Tasks are handed out dynamically (an atomic
// counter), so which worker runs a task varies from run to run: callers make each task write
// its own outputs, so results never depend on scheduling. One ParallelFor at a time per pool
// (calls are serialised by a mutex); fn must not throw. Allocates nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "base/function_ref.h"

namespace moerun {

class ThreadPool {
 public:
  // threads <= 0: one per hardware thread. The caller counts as one: threads - 1 are spawned.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, FunctionRef<void(int64_t task, int worker)> fn);

 private:
  void WorkerLoop(int worker);
  void RunTasks(int worker);

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const FunctionRef<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int active_ = 0;
};

}  // namespace moerun
