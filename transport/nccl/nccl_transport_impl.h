// The nccl transport's class (nccl_transport.h describes its protocol), declared for the files
// that implement it, one duty each:
//   nccl_transport.cc  creating it: the GPU and streams, the two communicators, the end, Break;
//   nccl_requests.cc   the requests: Isend, Irecv, Test, Cancel;
//   nccl_flush.cc      progress: the envelopes, the grouped flush of the decided operations, the
//                      reaping of finished internal work;
//   nccl_staging.cc    device memory: staging buffers, CUDA events, host memory registration.
// The vendor-free bookkeeping it relies on (paths, envelopes, matching, the flush plan, staging
// sizes) is in nccl_bulk.h. Internal to transport/nccl/ (it names CUDA and NCCL types): the rest
// of moerun uses nccl_transport.h. Thread-safety: one thread at a time.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/nccl/nccl_bulk.h"
#include "transport/nccl/nccl_transport.h"
#include "transport/transport.h"

namespace moerun::nccl {

// The bootstrap's reserved tags (the exchange uses + 400/401, ucx + 200/201).
inline constexpr int kTagUniqueId = kReservedTagBase + 410;  // and + 411
inline constexpr int kTagEnvelope = kReservedTagBase + 420;

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::unique_ptr<Transport> bootstrap, NcclTransportOptions options)
      : bootstrap_(std::move(bootstrap)),
        rank_(bootstrap_->rank()),
        size_(bootstrap_->size()),
        device_(options.device),
        bulk_tags_(std::move(options.bulk_tags)),
        matchers_(static_cast<size_t>(size_)),
        send_seq_(static_cast<size_t>(size_), 0),
        recv_seq_(static_cast<size_t>(size_), 0),
        envelope_in_(static_cast<size_t>(size_)),
        envelope_req_(static_cast<size_t>(size_)) {}
  ~NcclTransport() override;

  // Local preparation (device, streams); an error is announced to the other ranks.
  std::string Prepare();
  Status Open(const std::string& local_error, Deadline deadline);

  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<Request> Isend(int peer, int tag, const void* buf, size_t bytes) override;
  Result<Request> Irecv(int peer, int tag, void* buf, size_t bytes) override;
  Result<bool> Test(Request r) override;
  Status Cancel(Request r) override;
  bool can_withdraw_sends() const override { return false; }
  bool peer_failed(int peer) const override {
    return failed_peers_.count(peer) > 0 || bootstrap_->peer_failed(peer);
  }
  Status RegisterMemory(void* p, size_t bytes) override;
  void UnregisterMemory(void* p) override;
  TransportCounters counters() const override { return counters_; }
  int idle_spins() const override { return bootstrap_->idle_spins(); }
  [[noreturn]] void Abort(int exit_code) override {
    bootstrap_->Abort(exit_code);
    std::_Exit(exit_code);  // not reached: the bootstrap's Abort does not return
  }

 private:
  enum class State : uint8_t {
    kBootstrap,       // a request of the bootstrap transport (`inner`)
    kQueued,          // send: until the next flush; receive: its envelope came, until the flush
    kAwaitEnvelope,   // receive: posted, no envelope yet
    kWaitUnexpected,  // receive: takes its bytes from a staged unexpected message
    kIssued,          // in the group whose enqueueing is still in progress
    kRecorded,        // its event is recorded: done when the event is
    kDone,
    kFailed,
  };
  struct Op {
    State state = State::kQueued;
    Request inner;
    bool send = false;
    bool internal = false;  // received without a user receive: unexpected, or drained
    bool drop = false;      // internal: nobody takes it; released when done
    int peer = -1;
    int tag = 0;
    const void* src = nullptr;
    void* dst = nullptr;  // null: into staging (internal)
    uint64_t bytes = 0;
    bool device_buf = false;
    int comm = 0;
    int pool = -1;  // staging: pools_[pool], slot `slot`
    int slot = -1;
    cudaEvent_t event = nullptr;
    uint64_t unexpected = 0;  // kWaitUnexpected: the internal op holding the bytes
    Status error;
  };
  struct EnvelopeOut {
    BulkEnvelope env;
    Request req;
  };

  uint64_t Add(Op op) {
    const uint64_t id = next_id_++;
    ops_.emplace(id, std::move(op));
    return id;
  }
  Status CheckPeer(int peer, const char* what) const;
  Result<bool> IsDevicePointer(const void* p) const;
  Status Broken() const {
    return Status::Unavailable("nccl: the communicators were aborted earlier (" +
                               broken_.ToString() + "); NCCL messages cannot move any more");
  }
  void* StagingPtr(const Op& o) const {
    return staging_[static_cast<size_t>(o.pool)][static_cast<size_t>(o.slot)];
  }
  Status AcquireStaging(Op& o, int pool);
  void ReleaseStaging(Op& o);
  Result<cudaEvent_t> TakeEvent();
  void ReturnEvent(cudaEvent_t& e);

  // Progress: envelopes, the flush, asynchronous errors, finished internal work.
  void Progress();
  Status PollEnvelopes();
  Status OnEnvelope(int peer, const BulkEnvelope& env);
  // The flush (nccl_flush.cc): every decided operation as one group per communicator (further
  // groups past kMaxGroupOps), then one envelope per message; a group whose enqueueing is still
  // in progress (ncclInProgress) gets its events recorded by a later flush.
  Status Flush();
  Result<bool> FinishPendingGroup();  // false while the last group is still being enqueued
  Status AnnounceSelfSends();
  Status StageHostSends();
  Result<bool> EnqueueGroups(int comm);  // true: some ncclGroupEnd returned ncclInProgress
  Status SendEnvelopes();
  Status PostGroup();
  Status ReapEnvelopeSends();
  void ReapInternal();
  // Aborts both communicators: every NCCL request fails with kUnavailable. peer_failed then
  // reports `culprit` when known (the peer of a cancelled transfer), else (an NCCL error, which
  // names no peer) every peer that had a transfer in flight.
  void Break(const Status& why, int culprit = -1);
  // The calling thread may be another than the last one (one thread at a time): its device.
  void UseDevice() const { (void)cudaSetDevice(device_); }
  Status MismatchError(int peer, int tag, uint64_t sent, uint64_t posted) const {
    return Status::InvalidArgument(
        "nccl: a message of " + std::to_string(sent) + " bytes from rank " + std::to_string(peer) +
        " on tag " + std::to_string(tag) + " met a receive of " + std::to_string(posted) +
        " bytes (sizes must be equal: both sides take them from the "
        "same plan)");
  }

  std::unique_ptr<Transport> bootstrap_;  // first: destroyed last
  int rank_ = 0, size_ = 1;
  int device_ = -1;
  std::vector<int> bulk_tags_;
  std::array<ncclComm_t, 2> comm_{};      // 0: to higher ranks, 1: to lower ranks (NcclCommOf)
  std::array<cudaStream_t, 2> stream_{};  // one per communicator
  cudaStream_t copy_stream_ = nullptr;    // unexpected messages copied out to their receive
  std::array<StagingPool, 2> pools_;      // one per stream, so a slot is only used on its stream
  std::array<std::vector<void*>, 2> staging_;
  std::vector<cudaEvent_t> free_events_;
  std::vector<cudaEvent_t> all_events_;

  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, Op> ops_;
  std::vector<uint64_t> issue_;  // decided NCCL operations, in order, for the next flush
  std::vector<uint64_t> group_;  // the last group, while its enqueueing is in progress
  bool group_pending_ = false;
  SteadyClock::time_point next_poll_{};
  std::vector<BulkOp> queued_;
  std::vector<GroupedBulkOp> plan_;
  std::vector<BulkMatcher> matchers_;
  std::vector<uint64_t> send_seq_, recv_seq_;
  std::vector<BulkEnvelope> envelope_in_;
  std::vector<Request> envelope_req_;
  std::deque<EnvelopeOut> envelope_out_;
  Status broken_;
  std::set<int> failed_peers_;
  std::vector<std::pair<void*, size_t>> registered_;
  TransportCounters counters_;
  bool warned_register_ = false;
};

}  // namespace moerun::nccl
