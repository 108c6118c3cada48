// The ucx transport's UCX context and worker: opening them, this process's worker address,
// progress, and dropping messages nobody will receive. Internal to transport/ucx/.
// Thread-safety: none (the worker is UCS_THREAD_MODE_SINGLE; one thread uses the transport).
// Ownership: the worker and context live until Close (or the destructor of their owner calls it).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "base/status.h"

namespace moerun::ucx {

class UcxWorker {
 public:
  UcxWorker() = default;
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // Makes the context (tag and RMA features, and wakeup unless MOERUN_UCX_WAKEUP=off) and a
  // single-threaded worker, and takes the worker's address. When `loud`, logs whether UCX
  // handles CUDA memory (UcxCudaMemoryNote).
  // On an error, what was made stays for Close to end.
  Status Open(bool loud);
  // Ends the worker and the context (either may be missing). Endpoints, memory handles and
  // remote keys must be gone first.
  void Close();

  bool open() const { return worker_ != nullptr; }
  ucp_context_h context() const { return context_; }
  ucp_worker_h handle() const { return worker_; }
  const std::vector<uint8_t>& address() const { return address_; }

  // Progresses the worker up to 64 times, while it reports progress.
  void Progress();
  // Progresses until 64 calls in a row report nothing (at most 100000): lets what is on its way
  // land.
  void ProgressUntilIdle();
  // Blocks until the worker has an event (a message or note arrived) or `max` passes: arms the
  // worker's event fd and polls it; returns at once when events are pending (progress them).
  // Sleeps where the worker has no event fd.
  bool Wait(std::chrono::microseconds max);  // true: woken (or events pending)
  bool can_wait() const { return efd_ >= 0; }
  // Takes every message matching (tag, mask) off UCX's unexpected queue and drops it.
  void DiscardUnexpected(ucp_tag_t tag, ucp_tag_t mask);

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<uint8_t> address_;
  int efd_ = -1;  // the worker's event fd (UCP_FEATURE_WAKEUP), -1 without
  // Where discarded messages land: truncated to this size (a rendezvous message then completes
  // without its data), and alive as long as the worker, for a discard that completes late.
  alignas(8) uint8_t discard_[64] = {};
};

}  // namespace moerun::ucx
