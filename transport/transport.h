// Transport: moving byte buffers (token shards) between the ranks of one job.
//
// A table of non-blocking operations, as NCCL's net plugins and MPI's point-to-point layer:
// Isend/Irecv start a transfer and return a Request; Test polls it; completion means the send
// buffer may be reused / the receive buffer holds the message. Messages between one pair of
// ranks with one tag are matched in the order they were posted (non-overtaking). A receive names
// its exact size; a message of another size fails it. Nothing blocks without a deadline:
// WaitAll gives up at its deadline with kDeadlineExceeded naming the peer that did not answer.
//
// Thread-safety: one Transport object is used by one thread at a time (the rank's main thread);
// the inproc backend's objects of different ranks may be used from different threads.
// Buffers: the caller owns them and keeps them valid until their request completes or is
// cancelled. RegisterMemory is a hint for RDMA backends (a no-op here).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/idle_backoff.h"
#include "base/status.h"

namespace moerun {

// What a backend reports of its own data movement (`moebench transport`, zero-copy checks).
struct TransportCounters {
  uint64_t put_bytes = 0;    // written straight into a peer's registered memory (RDMA put)
  uint64_t eager_bytes = 0;  // sent through the library's own bounce buffers (small messages)
  // Payload bytes the transport's own code copied, once per copy (a memcpy or staging copy of a
  // message: inproc's sender-to-receiver memcpy, counted by the receiver; nccl's host staging).
  // Not the copies made inside a library that is handed the caller's buffer: UCX's (eager_bytes
  // counts what went through its bounce buffers) and MPI's are the library's, not seen here.
  // Control notes and envelopes of the transport's own protocol are not payload.
  uint64_t copied_bytes = 0;
  uint64_t registrations = 0;            // memory registrations made (RegisterMemory and on demand)
  uint64_t on_demand_registrations = 0;  // of which for receive buffers that were not registered
};

struct Request {
  uint64_t id = 0;  // 0: no request
  int peer = -1;
  bool valid() const { return id != 0; }
};

// A Transport is the IdleWaiter of the loops that wait on it (base/idle_backoff.h): its
// WaitForActivity blocks until a message for this rank may have arrived, where the backend can
// tell (wakes_on_arrival), and sleeps otherwise.
class Transport : public IdleWaiter {
 public:
  ~Transport() override = default;

  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) = 0;
  virtual Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) = 0;
  // true: completed (and released); false: still in flight; error: failed (and released).
  virtual Result<bool> Test(Request r) = 0;
  // Withdraws a request that has not completed. A cancelled receive never writes its buffer
  // again. A cancelled send is withdrawn where the backend can (can_withdraw_sends); elsewhere
  // (mpi) a peer may still read it: keep its buffer valid until the transport is destroyed, and
  // treat the (peer, tag) channel as unusable (the runtime ends the job after such a failure).
  virtual Status Cancel(Request r) = 0;
  virtual bool can_withdraw_sends() const { return true; }
  // True once the backend knows `peer` is gone (ucx: its endpoint failed: the process died or
  // its connection broke); its requests then fail with kUnavailable. Backends that cannot tell
  // (mpi, inproc) say false: there a dead peer shows only as a missed deadline.
  virtual bool peer_failed(int /*peer*/) const { return false; }
  // Where `peer` can be reached, as bytes only this backend reads (ucx: its UCX worker address;
  // this rank's own for rank()). Empty where the backend has none (mpi, inproc) or knows none.
  virtual std::vector<uint8_t> peer_address(int /*peer*/) const { return {}; }
  // Takes `peer` back at a new address (a new process joined the job as that rank): the old
  // endpoint is closed and everything still held of the old process is dropped (its unmatched
  // messages, remote keys, ready-to-receive notes, revokes); peer_failed(peer) is false again.
  // Requests to or from `peer` must have completed or been cancelled first. kUnsupported where
  // the backend cannot (mpi, inproc).
  virtual Status ReplacePeer(int peer, std::span<const uint8_t> address);
  // RDMA backends (ucx) register [p, p + bytes) once so that receives into it are written
  // directly by the peer; others treat it as a no-op. The memory stays registered until
  // UnregisterMemory(p) (call it before freeing the memory), a registration that overlaps it, or
  // the transport's end.
  virtual Status RegisterMemory(void* /*p*/, size_t /*bytes*/) { return Status::Ok(); }
  virtual void UnregisterMemory(void* /*p*/) {}
  virtual TransportCounters counters() const { return {}; }
  // Polling passes without progress after which a waiting rank starts yielding its core. Backends
  // whose progress needs the peer's process to run (UCX's shared-memory and TCP puts) use few, so
  // that oversubscribed ranks hand the core to the peer they wait for.
  virtual int idle_spins() const { return 2000; }
  // Ends the whole job now (after a fatal error such as a peer that stopped answering).
  [[noreturn]] virtual void Abort(int exit_code) = 0;

  // Waits for every request (invalid ones are skipped); completed ones become invalid. On a
  // failure or at the deadline the remaining ones are cancelled (with cancel_late; otherwise they
  // stay valid for the caller) and the error names the peer (at the deadline the lowest late
  // one); `what` says what was awaited.
  // `done_at`, when not empty (one per request), gets the time each request was seen complete.
  Status WaitAll(std::span<Request> reqs, Deadline deadline, const char* what = "transfer",
                 bool cancel_late = true, std::span<SteadyClock::time_point> done_at = {});
  // Waits for one request.
  Status Wait(Request r, Deadline deadline, const char* what = "transfer");
  // Blocking send/recv with a deadline.
  Status Send(int peer, int tag, const void* buf, size_t bytes, Deadline deadline);
  Status Recv(int peer, int tag, void* buf, size_t bytes, Deadline deadline);
  // All ranks reach this point (a dissemination barrier over Isend/Irecv); with `among` > 0,
  // only ranks [0, among) take part (the others have no process yet: spare ranks).
  Status Barrier(Deadline deadline, int among = 0);

  // Bytes this rank has posted to `peer` with Isend since it started (any thread may read;
  // peers beyond kCountedPeers are not counted).
  static constexpr int kCountedPeers = 1024;
  uint64_t sent_bytes(int peer) const {
    return peer >= 0 && peer < kCountedPeers
               ? sent_[static_cast<size_t>(peer)].load(std::memory_order_relaxed)
               : 0;
  }

 protected:
  // Backends call this from Isend.
  void CountSent(int peer, size_t bytes) {
    if (peer >= 0 && peer < kCountedPeers) {
      sent_[static_cast<size_t>(peer)].fetch_add(bytes, std::memory_order_relaxed);
    }
  }

 private:
  std::array<std::atomic<uint64_t>, kCountedPeers> sent_{};
};

// Tags at and above this value are reserved for the transport's own collectives.
inline constexpr int kReservedTagBase = 1 << 20;

// Every rank's `mine` (1 to max_bytes bytes each), indexed by rank, this rank's own included:
// sizes, then the bytes, exchanged with every peer on the reserved tags `tag` and `tag + 1`.
// Collective; used to bootstrap one transport (UCX worker addresses) over another. With `among`
// > 0 only ranks [0, among) take part (the others have no process yet: spare ranks; their
// entries stay empty).
Result<std::vector<std::vector<uint8_t>>> AllGatherBytes(Transport& t,
                                                         const std::vector<uint8_t>& mine, int tag,
                                                         size_t max_bytes, Deadline deadline,
                                                         const char* what, int among = 0);

}  // namespace moerun
