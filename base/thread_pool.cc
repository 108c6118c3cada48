#include "base/thread_pool.h"

namespace moerun {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads <= 0) threads = 1;
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunTasks(int worker) {
  for (int64_t t = next_.fetch_add(1); t < n_; t = next_.fetch_add(1)) (*fn_)(t, worker);
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunTasks(worker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, FunctionRef<void(int64_t, int)> fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  RunTasks(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace moerun
