// The inproc transport: the ranks of a job are threads of one process. A fabric connects them;
// each rank holds its own InprocTransport endpoint. A send completes when a matching receive has
// taken its bytes (one memcpy, sender buffer to receiver buffer, counted in the receiving
// endpoint's counters().copied_bytes). Used by unit tests and by
// `--transport inproc` runs. After warm-up it allocates nothing (operations come from a
// preallocated pool). Endpoints of different ranks may be used concurrently; the fabric must
// outlive its endpoints.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/transport.h"

namespace moerun {

class InprocFabric : public std::enable_shared_from_this<InprocFabric> {
 public:
  static std::shared_ptr<InprocFabric> Create(int ranks);
  int size() const { return ranks_; }
  std::unique_ptr<Transport> Endpoint(int rank);

  // Fault injection for tests: messages from `rank` are held back forever, as from a frozen peer.
  void Freeze(int rank);
  // Lets the held-back messages of `rank` go, in order, and new ones flow again.
  void Thaw(int rank);

 private:
  friend class InprocTransport;
  enum class State : uint8_t { kFree, kPending, kDone, kFailed };
  struct Op {
    uint32_t generation = 0;
    State state = State::kFree;
    bool send = false;
    int src = 0, dst = 0, tag = 0;
    const void* sbuf = nullptr;
    void* rbuf = nullptr;
    size_t bytes = 0;
    size_t other_bytes = 0;  // size of the mismatched peer message, for the error
  };
  // A matched send and receive: copies (counted for the receiving rank), or fails both on a
  // size mismatch (lock held).
  void Complete(Op& send, Op& recv);
  // Bytes copied into `rank`'s receive buffers so far (any thread may read).
  uint64_t copied_bytes(int rank) const {
    return copied_[static_cast<size_t>(rank)].load(std::memory_order_relaxed);
  }

  // Each rank's bell: rung when a message is posted to it or one of its sends is matched; a rank
  // with nothing to do waits on it (WaitForActivity). `seen`: the rank's last rung count.
  struct Bell {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t rung = 0;
  };
  void Ring(int rank);
  bool WaitForRing(int rank, uint64_t* seen, std::chrono::microseconds max);

  explicit InprocFabric(int ranks);
  Result<Request> Post(bool send, int me, int peer, int tag, const void* sbuf, void* rbuf,
                       size_t bytes);
  Result<Request> PostLocked(bool send, int me, int peer, int tag, const void* sbuf, void* rbuf,
                             size_t bytes, bool* matched);
  void ThawLocked(int rank);
  Result<bool> Test(int me, Request r);
  Status Cancel(int me, Request r);
  Op* Find(Request r);
  void Release(uint32_t index);

  const int ranks_;
  std::mutex mu_;
  std::vector<Op> ops_;
  std::vector<uint32_t> free_;
  std::vector<std::vector<uint32_t>> pending_sends_;  // by destination rank, in posting order
  std::vector<std::vector<uint32_t>> pending_recvs_;  // by receiving rank, in posting order
  std::vector<bool> frozen_;
  std::unique_ptr<std::atomic<uint64_t>[]> copied_;  // by receiving rank
  std::unique_ptr<Bell[]> bells_;                    // by rank
};

}  // namespace moerun
