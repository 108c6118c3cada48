#include "transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/log.h"
#include "base/watchdog.h"
#include "transport/nccl/nccl_bulk.h"
#include "transport/nccl/nccl_common.h"

namespace moerun {
namespace {

// The bootstrap's reserved tags (the exchange uses + 400/401, ucx + 200/201).
constexpr int kTagUniqueId = kReservedTagBase + 410;  // and + 411
constexpr int kTagEnvelope = kReservedTagBase + 420;
constexpr auto kDestroyTimeout = std::chrono::seconds(10);
constexpr auto kPollInterval = std::chrono::microseconds(5);
// Operations in one NCCL group at most (NCCL has capped a group at 2048 operations).
constexpr size_t kMaxGroupOps = 1024;

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
  Status Flush();
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

std::string NcclTransport::Prepare() {
  if (device_ < 0) return "no GPU chosen for this rank (device " + std::to_string(device_) + ")";
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    (void)cudaGetLastError();
    return "cudaSetDevice(" + std::to_string(device_) + "): " + CudaError(e);
  }
  for (cudaStream_t* s : {&stream_[0], &stream_[1], &copy_stream_}) {
    if (const cudaError_t e = cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return "cudaStreamCreate: " + CudaError(e);
    }
  }
  return "";
}

Status NcclTransport::Open(const std::string& local_error, Deadline deadline) {
  const std::string me = "nccl transport: rank " + std::to_string(rank_);
  MOERUN_ASSIGN_OR_RETURN(const ncclUniqueId id,
                          ExchangeUniqueId(*bootstrap_, kTagUniqueId, local_error, deadline));
  MOERUN_ASSIGN_OR_RETURN(comm_[0], InitNonBlockingComm(size_, rank_, id, deadline, me));
  // The second direction's communicator: same ranks, same order.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommSplit(comm_[0], 0, rank_, &comm_[1], &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    Status err = NcclStatus(r, comm_[0], me + ": ncclCommSplit");
    AbortComm(comm_[1]);
    AbortComm(comm_[0]);  // the peers may be gone: no graceful end that waits for them
    return err;
  }
  MOERUN_RETURN_IF_ERROR(WaitWithWatchdog(
      [&]() -> Result<bool> {
        MOERUN_ASSIGN_OR_RETURN(const bool a, CommIdle(comm_[0], "nccl: ncclCommSplit"));
        if (comm_[1] == nullptr) return false;
        MOERUN_ASSIGN_OR_RETURN(const bool b, CommIdle(comm_[1], "nccl: ncclCommSplit"));
        return a && b;
      },
      deadline,
      [&] {
        AbortComm(comm_[1]);
        AbortComm(comm_[0]);
      },
      me + ": the second communicator (ncclCommSplit)"));
  // Every peer's envelopes, from now on.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const auto i = static_cast<size_t>(p);
    MOERUN_ASSIGN_OR_RETURN(envelope_req_[i], bootstrap_->Irecv(p, kTagEnvelope, &envelope_in_[i],
                                                                sizeof(BulkEnvelope)));
  }
  spdlog::info("nccl: rank {} of {} on GPU {}, NCCL {}: {} tag(s) over NCCL, the rest over {}",
               rank_, size_, device_, NcclVersionString(), bulk_tags_.size(), bootstrap_->name());
  return Status::Ok();
}

NcclTransport::~NcclTransport() {
  if (device_ >= 0) (void)cudaSetDevice(device_);
  if (broken_.ok()) {
    FinalizeComm(comm_[1], kDestroyTimeout);
    FinalizeComm(comm_[0], kDestroyTimeout);
  }
  for (Request& r : envelope_req_) {
    if (r.valid()) (void)bootstrap_->Cancel(r);
  }
  const Deadline until = DeadlineIn(std::chrono::seconds(5));
  for (EnvelopeOut& e : envelope_out_) {
    if (e.req.valid() && !bootstrap_->Wait(e.req, until, "nccl envelope").ok()) {
      e.req = Request{};
    }
  }
  for (cudaStream_t s : {stream_[0], stream_[1], copy_stream_}) {
    if (s != nullptr) (void)cudaStreamSynchronize(s);
  }
  for (auto& pool : staging_) {
    for (void* p : pool) {
      if (p != nullptr) (void)cudaFree(p);
    }
  }
  for (cudaEvent_t e : all_events_) (void)cudaEventDestroy(e);
  for (cudaStream_t s : {stream_[0], stream_[1], copy_stream_}) {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
  for (const auto& [p, bytes] : registered_) (void)cudaHostUnregister(p);
}

Status NcclTransport::CheckPeer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_) {
    return Status::InvalidArgument(std::string("nccl: ") + what + " rank " + std::to_string(peer) +
                                   " of a job of " + std::to_string(size_) + " ranks");
  }
  return Status::Ok();
}

Result<bool> NcclTransport::IsDevicePointer(const void* p) const {
  if (p == nullptr) return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (a.type != cudaMemoryTypeDevice) return false;
  if (a.device != device_) {
    return Status::InvalidArgument("nccl: a device buffer on GPU " + std::to_string(a.device) +
                                   ", but this rank's GPU is " + std::to_string(device_));
  }
  return true;
}

Result<Request> NcclTransport::Isend(int peer, int tag, const void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(CheckPeer(peer, "send to"));
  CountSent(peer, bytes);
  Op o;
  o.send = true;
  o.peer = peer;
  o.tag = tag;
  o.src = buf;
  o.bytes = bytes;
  if (PathOf(bulk_tags_, rank_, peer, tag) == NcclPath::kBootstrap) {
    MOERUN_ASSIGN_OR_RETURN(o.inner, bootstrap_->Isend(peer, tag, buf, bytes));
    o.state = State::kBootstrap;
    return Request{Add(std::move(o)), peer};
  }
  if (!broken_.ok()) return Broken();
  if (buf == nullptr && bytes > 0) return Status::InvalidArgument("nccl: send of a null buffer");
  UseDevice();
  MOERUN_ASSIGN_OR_RETURN(o.device_buf, IsDevicePointer(buf));
  o.state = State::kQueued;
  const uint64_t id = Add(std::move(o));
  issue_.push_back(id);
  return Request{id, peer};
}

Result<Request> NcclTransport::Irecv(int peer, int tag, void* buf, size_t bytes) {
  MOERUN_RETURN_IF_ERROR(CheckPeer(peer, "receive from"));
  Op o;
  o.peer = peer;
  o.tag = tag;
  o.dst = buf;
  o.bytes = bytes;
  if (PathOf(bulk_tags_, rank_, peer, tag) == NcclPath::kBootstrap) {
    MOERUN_ASSIGN_OR_RETURN(o.inner, bootstrap_->Irecv(peer, tag, buf, bytes));
    o.state = State::kBootstrap;
    return Request{Add(std::move(o)), peer};
  }
  if (!broken_.ok()) return Broken();
  if (buf == nullptr && bytes > 0) {
    return Status::InvalidArgument("nccl: receive into a null buffer");
  }
  UseDevice();
  MOERUN_ASSIGN_OR_RETURN(o.device_buf, IsDevicePointer(buf));
  const uint64_t id = next_id_++;
  const std::optional<BulkMatcher::Unexpected> u =
      matchers_[static_cast<size_t>(peer)].Post(id, tag, bytes);
  if (!u) {
    o.state = State::kAwaitEnvelope;
  } else if (u->bytes != bytes) {
    o.state = State::kFailed;
    o.error = MismatchError(peer, tag, u->bytes, bytes);
    ops_.at(u->handle).drop = true;
  } else if (bytes == 0) {
    o.state = State::kDone;
    ops_.at(u->handle).drop = true;
  } else {
    o.state = State::kWaitUnexpected;
    o.unexpected = u->handle;
  }
  ops_.emplace(id, std::move(o));
  return Request{id, peer};
}

Status NcclTransport::AcquireStaging(Op& o, int pool) {
  const StagingPool::Grant g = pools_[static_cast<size_t>(pool)].Acquire(o.bytes);
  o.pool = pool;
  o.slot = g.slot;
  auto& ptrs = staging_[static_cast<size_t>(pool)];
  if (ptrs.size() < static_cast<size_t>(pools_[static_cast<size_t>(pool)].slots())) {
    ptrs.resize(static_cast<size_t>(pools_[static_cast<size_t>(pool)].slots()), nullptr);
  }
  if (g.allocate) {
    // Stream-ordered on the slot's own stream: no device-wide synchronisation, which could wait
    // on an NCCL kernel that waits for a peer that waits for this thread.
    void*& p = ptrs[static_cast<size_t>(g.slot)];
    cudaStream_t s = stream_[static_cast<size_t>(pool)];
    if (p != nullptr) (void)cudaFreeAsync(p, s);
    p = nullptr;
    if (const cudaError_t e = cudaMallocAsync(&p, g.capacity, s); e != cudaSuccess) {
      pools_[static_cast<size_t>(pool)].Release(g.slot);
      o.slot = -1;
      return Status::ResourceExhausted("nccl: staging buffer of " + std::to_string(g.capacity) +
                                       " bytes on GPU " + std::to_string(device_) + ": " +
                                       CudaError(e));
    }
  }
  return Status::Ok();
}

void NcclTransport::ReleaseStaging(Op& o) {
  if (o.slot >= 0) pools_[static_cast<size_t>(o.pool)].Release(o.slot);
  o.slot = -1;
}

Result<cudaEvent_t> NcclTransport::TakeEvent() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (const cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      r != cudaSuccess) {
    return Status::Unavailable("nccl: cudaEventCreate: " + CudaError(r));
  }
  all_events_.push_back(e);
  return e;
}

void NcclTransport::ReturnEvent(cudaEvent_t& e) {
  if (e != nullptr) free_events_.push_back(e);
  e = nullptr;
}

void NcclTransport::Break(const Status& why, int culprit) {
  if (!broken_.ok()) return;
  broken_ = why;
  AbortComm(comm_[0]);
  AbortComm(comm_[1]);
  // The aborted kernels end; wait for the streams so that no buffer is touched after this.
  for (cudaStream_t s : {stream_[0], stream_[1], copy_stream_}) {
    if (s != nullptr) (void)cudaStreamSynchronize(s);
  }
  (void)cudaGetLastError();
  spdlog::error("nccl: rank {}: {}: the communicators were aborted", rank_, why.ToString());
  for (auto& [id, o] : ops_) {
    if (o.state == State::kBootstrap || o.state == State::kDone || o.state == State::kFailed) {
      continue;
    }
    if (culprit < 0 && (o.state == State::kIssued || o.state == State::kRecorded)) {
      failed_peers_.insert(o.peer);
    }
    o.state = State::kFailed;
    o.error =
        Status::Unavailable("nccl: the message " + std::string(o.send ? "to" : "from") + " rank " +
                            std::to_string(o.peer) + " (tag " + std::to_string(o.tag) + ", " +
                            std::to_string(o.bytes) + " bytes) is lost: " + why.ToString());
  }
  issue_.clear();
  group_.clear();
  group_pending_ = false;
  for (BulkMatcher& m : matchers_) m = BulkMatcher();
}

Status NcclTransport::OnEnvelope(int peer, const BulkEnvelope& env) {
  const auto i = static_cast<size_t>(peer);
  MOERUN_RETURN_IF_ERROR(CheckEnvelope(env, peer, recv_seq_[i], bulk_tags_));
  ++recv_seq_[i];
  const uint64_t handle = next_id_++;
  const std::optional<BulkMatcher::Posted> posted = matchers_[i].Arrive(env.tag, env.bytes, handle);
  if (posted) {
    Op& r = ops_.at(posted->id);
    if (posted->bytes == env.bytes) {
      r.state = env.bytes == 0 ? State::kDone : State::kQueued;
      if (env.bytes > 0) issue_.push_back(posted->id);
      return Status::Ok();
    }
    r.state = State::kFailed;
    r.error = MismatchError(peer, env.tag, env.bytes, posted->bytes);
  }
  // Unexpected (kept for a later receive), or drained after a mismatch: into staging.
  Op u;
  u.internal = true;
  u.drop = posted.has_value();
  u.peer = peer;
  u.tag = env.tag;
  u.bytes = env.bytes;
  u.state = env.bytes == 0 ? State::kDone : State::kQueued;
  ops_.emplace(handle, std::move(u));
  if (env.bytes > 0) issue_.push_back(handle);
  return Status::Ok();
}

Status NcclTransport::PollEnvelopes() {
  for (int p = 0; p < size_; ++p) {
    const auto i = static_cast<size_t>(p);
    while (envelope_req_[i].valid()) {
      Result<bool> done = bootstrap_->Test(envelope_req_[i]);
      if (!done.ok()) {
        envelope_req_[i] = Request{};
        failed_peers_.insert(p);
        return done.status().WithContext("nccl: envelopes from rank " + std::to_string(p));
      }
      if (!*done) break;
      envelope_req_[i] = Request{};
      const BulkEnvelope env = envelope_in_[i];
      MOERUN_ASSIGN_OR_RETURN(envelope_req_[i], bootstrap_->Irecv(p, kTagEnvelope, &envelope_in_[i],
                                                                  sizeof(BulkEnvelope)));
      MOERUN_RETURN_IF_ERROR(OnEnvelope(p, env));
    }
  }
  return Status::Ok();
}

Status NcclTransport::Flush() {
  if (group_pending_) {
    for (ncclComm_t c : comm_) {
      MOERUN_ASSIGN_OR_RETURN(const bool idle, CommIdle(c, "nccl: enqueueing a group"));
      if (!idle) return Status::Ok();
    }
    group_pending_ = false;
    MOERUN_RETURN_IF_ERROR(PostGroup());
  }
  if (issue_.empty()) return Status::Ok();
  // Sends to this rank itself are announced here, not over the bootstrap, so that the receive
  // they meet (posted, or into staging) joins the same group: NCCL pairs a rank's send to
  // itself only with a receive in the same group.
  const size_t decided = issue_.size();
  for (size_t k = 0; k < decided; ++k) {
    const Op& o = ops_.at(issue_[k]);
    if (!o.send || o.peer != rank_) continue;
    BulkEnvelope env;
    env.tag = o.tag;
    env.bytes = o.bytes;
    env.seq = send_seq_[static_cast<size_t>(rank_)]++;
    MOERUN_RETURN_IF_ERROR(OnEnvelope(rank_, env));
  }
  queued_.clear();
  for (const uint64_t id : issue_) {
    const Op& o = ops_.at(id);
    queued_.push_back({o.send ? BulkOp::Kind::kSend : BulkOp::Kind::kRecv, o.peer, o.bytes, id});
  }
  PlanFlush(rank_, queued_, plan_);
  if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return Status::Unavailable("nccl: cudaSetDevice(" + std::to_string(device_) +
                               "): " + CudaError(e));
  }
  // Staging: host sends are copied in before the group, on their communicator's stream.
  for (const GroupedBulkOp& g : plan_) {
    Op& o = ops_.at(g.op.id);
    o.comm = g.comm;
    if (o.device_buf) continue;
    MOERUN_RETURN_IF_ERROR(AcquireStaging(o, g.comm));
    if (o.send) {
      const cudaError_t e = cudaMemcpyAsync(StagingPtr(o), o.src, o.bytes, cudaMemcpyHostToDevice,
                                            stream_[static_cast<size_t>(g.comm)]);
      if (e != cudaSuccess) return Status::Unavailable("nccl: staging copy: " + CudaError(e));
      counters_.copied_bytes += o.bytes;
    }
  }
  // One group per communicator (so that NCCL never joins the two directions' streams), the
  // operations in their decided order; past kMaxGroupOps operations (NCCL caps a group) the
  // next ones go in a further group on the same communicator.
  bool in_progress = false;
  for (int c = 0; c < 2; ++c) {
    const auto ci = static_cast<size_t>(c);
    size_t in_group = 0;
    ncclResult_t r = ncclSuccess;
    const auto end_group = [&]() -> Status {
      in_group = 0;
      r = ncclGroupEnd();
      if (r == ncclInProgress) {
        in_progress = true;
      } else if (r != ncclSuccess) {
        return NcclStatus(r, comm_[ci], "nccl: ncclGroupEnd");
      }
      return Status::Ok();
    };
    for (const GroupedBulkOp& g : plan_) {
      if (g.comm != c) continue;
      if (in_group == 0) {
        r = ncclGroupStart();
        if (r != ncclSuccess) return NcclStatus(r, comm_[ci], "nccl: ncclGroupStart");
      }
      Op& o = ops_.at(g.op.id);
      if (o.send) {
        const void* p = o.device_buf ? o.src : StagingPtr(o);
        r = ncclSend(p, o.bytes, ncclUint8, o.peer, comm_[ci], stream_[ci]);
      } else {
        void* p = o.device_buf ? o.dst : StagingPtr(o);
        r = ncclRecv(p, o.bytes, ncclUint8, o.peer, comm_[ci], stream_[ci]);
      }
      if (r != ncclSuccess && r != ncclInProgress) {
        (void)ncclGroupEnd();
        failed_peers_.insert(o.peer);
        return NcclStatus(r, comm_[ci],
                          std::string("nccl: ") +
                              (o.send ? "ncclSend to rank " : "ncclRecv from rank ") +
                              std::to_string(o.peer));
      }
      if (++in_group == kMaxGroupOps) MOERUN_RETURN_IF_ERROR(end_group());
    }
    if (in_group > 0) MOERUN_RETURN_IF_ERROR(end_group());
  }
  group_.clear();
  for (const GroupedBulkOp& g : plan_) {
    ops_.at(g.op.id).state = State::kIssued;
    group_.push_back(g.op.id);
  }
  // The envelopes, in posting order per peer; zero-byte sends are complete with theirs.
  for (const uint64_t id : issue_) {
    Op& o = ops_.at(id);
    if (!o.send) continue;
    if (o.bytes == 0) o.state = State::kDone;
    if (o.peer == rank_) continue;  // announced above
    const auto i = static_cast<size_t>(o.peer);
    EnvelopeOut& out = envelope_out_.emplace_back();
    out.env.tag = o.tag;
    out.env.bytes = o.bytes;
    out.env.seq = send_seq_[i]++;
    MOERUN_ASSIGN_OR_RETURN(out.req,
                            bootstrap_->Isend(o.peer, kTagEnvelope, &out.env, sizeof out.env));
  }
  issue_.clear();
  if (in_progress) {
    group_pending_ = true;
    return Status::Ok();
  }
  return PostGroup();
}

Status NcclTransport::PostGroup() {
  // The group is enqueued on the streams: copies out of staging, then each operation's event.
  for (const uint64_t id : group_) {
    auto it = ops_.find(id);
    if (it == ops_.end() || it->second.state != State::kIssued) continue;
    Op& o = it->second;
    cudaStream_t s = stream_[static_cast<size_t>(o.comm)];
    if (!o.send && !o.device_buf && o.dst != nullptr) {
      const cudaError_t e =
          cudaMemcpyAsync(o.dst, StagingPtr(o), o.bytes, cudaMemcpyDeviceToHost, s);
      if (e != cudaSuccess) return Status::Unavailable("nccl: staging copy: " + CudaError(e));
      counters_.copied_bytes += o.bytes;
    }
    MOERUN_ASSIGN_OR_RETURN(o.event, TakeEvent());
    if (const cudaError_t e = cudaEventRecord(o.event, s); e != cudaSuccess) {
      return Status::Unavailable("nccl: cudaEventRecord: " + CudaError(e));
    }
    o.state = State::kRecorded;
  }
  group_.clear();
  return Status::Ok();
}

Status NcclTransport::ReapEnvelopeSends() {
  while (!envelope_out_.empty()) {
    EnvelopeOut& front = envelope_out_.front();
    if (front.req.valid()) {
      Result<bool> done = bootstrap_->Test(front.req);
      if (!done.ok()) {
        front.req = Request{};
        return done.status().WithContext("nccl: an envelope");
      }
      if (!*done) break;
    }
    envelope_out_.pop_front();
  }
  return Status::Ok();
}

void NcclTransport::ReapInternal() {
  for (auto it = ops_.begin(); it != ops_.end();) {
    Op& o = it->second;
    if (o.internal && o.state == State::kRecorded) {
      const cudaError_t q = cudaEventQuery(o.event);
      if (q == cudaSuccess) {
        ReturnEvent(o.event);
        o.state = State::kDone;
      } else if (q != cudaErrorNotReady) {
        Break(Status::Unavailable("nccl: cudaEventQuery: " + CudaError(q)));
        return;
      }
    }
    if (o.internal && o.drop && (o.state == State::kDone || o.state == State::kFailed)) {
      ReleaseStaging(o);
      it = ops_.erase(it);
    } else {
      ++it;
    }
  }
}

void NcclTransport::Progress() {
  if (!broken_.ok()) return;
  UseDevice();
  // Polling every peer's envelope and both communicators costs one bootstrap Test per peer: done
  // at most every kPollInterval, however many requests a WaitAll pass tests. A flush of what is
  // decided costs nothing when there is none, and is not delayed.
  Status s = Status::Ok();
  const SteadyClock::time_point now = SteadyClock::now();
  const bool poll = now >= next_poll_;
  if (poll) {
    next_poll_ = now + kPollInterval;
    s = PollEnvelopes();
  }
  if (s.ok()) s = Flush();
  if (s.ok() && poll) s = ReapEnvelopeSends();
  if (s.ok() && poll) {
    for (ncclComm_t c : comm_) {
      Result<bool> idle = CommIdle(c, "nccl");
      if (!idle.ok()) {
        s = idle.status();
        break;
      }
    }
  }
  if (!s.ok()) {
    Break(s);
    return;
  }
  if (poll) ReapInternal();
}

Result<bool> NcclTransport::Test(Request r) {
  if (ops_.find(r.id) == ops_.end()) {
    return Status::InvalidArgument("nccl: unknown request " + std::to_string(r.id));
  }
  Progress();
  auto it = ops_.find(r.id);
  Op& o = it->second;
  switch (o.state) {
    case State::kBootstrap: {
      Result<bool> done = bootstrap_->Test(o.inner);
      if (!done.ok() || *done) ops_.erase(it);
      return done;
    }
    case State::kDone:
      ReleaseStaging(o);
      ops_.erase(it);
      return true;
    case State::kFailed: {
      Status e = o.error;
      ReleaseStaging(o);
      ops_.erase(it);
      return e;
    }
    case State::kRecorded: {
      const cudaError_t q = cudaEventQuery(o.event);
      if (q == cudaErrorNotReady) return false;
      if (q != cudaSuccess) {
        Break(Status::Unavailable("nccl: cudaEventQuery: " + CudaError(q)));
        Status e = ops_.at(r.id).error;
        ops_.erase(r.id);
        return e;
      }
      ReturnEvent(o.event);
      ReleaseStaging(o);
      ops_.erase(it);
      return true;
    }
    case State::kWaitUnexpected: {
      Op& u = ops_.at(o.unexpected);
      if (u.state == State::kFailed) {
        o.state = State::kFailed;
        o.error = u.error;
        u.drop = true;
        return false;
      }
      if (u.state != State::kDone) return false;
      // The staged bytes are complete: copy them to the receive on the copy stream.
      const cudaError_t e =
          cudaMemcpyAsync(o.dst, StagingPtr(u), o.bytes, cudaMemcpyDefault, copy_stream_);
      if (e != cudaSuccess) {
        Break(Status::Unavailable("nccl: staging copy: " + CudaError(e)));
        return false;
      }
      counters_.copied_bytes += o.bytes;
      Result<cudaEvent_t> ev = TakeEvent();
      if (!ev.ok()) {
        Break(ev.status());
        return false;
      }
      o.event = *ev;
      (void)cudaEventRecord(o.event, copy_stream_);
      o.pool = u.pool;
      o.slot = u.slot;
      u.slot = -1;
      ops_.erase(o.unexpected);
      o.state = State::kRecorded;
      return false;
    }
    default:
      return false;
  }
}

Status NcclTransport::Cancel(Request r) {
  auto it = ops_.find(r.id);
  if (it == ops_.end()) return Status::Ok();
  Op& o = it->second;
  if (o.state != State::kBootstrap) UseDevice();
  switch (o.state) {
    case State::kBootstrap: {
      const Status s = bootstrap_->Cancel(o.inner);
      ops_.erase(it);
      return s;
    }
    case State::kAwaitEnvelope:
      matchers_[static_cast<size_t>(o.peer)].Withdraw(r.id);
      ops_.erase(it);
      return Status::Ok();
    case State::kQueued:
      if (o.send) {  // never announced: withdrawn
        issue_.erase(std::remove(issue_.begin(), issue_.end(), r.id), issue_.end());
        ops_.erase(it);
      } else {  // announced: its message is still received, into staging, and dropped
        o.internal = true;
        o.drop = true;
        o.dst = nullptr;
        o.device_buf = false;
      }
      return Status::Ok();
    case State::kWaitUnexpected:
      ops_.at(o.unexpected).drop = true;
      ops_.erase(it);
      return Status::Ok();
    case State::kRecorded:
      if (cudaEventQuery(o.event) == cudaSuccess) {
        ReturnEvent(o.event);
        ReleaseStaging(o);
        ops_.erase(it);
        return Status::Ok();
      }
      [[fallthrough]];
    case State::kIssued: {
      const int peer = o.peer;
      Break(Status::Unavailable("a transfer with rank " + std::to_string(peer) +
                                " was cancelled before it completed (a missed deadline?); NCCL "
                                "cannot withdraw an enqueued operation"),
            peer);
      if (peer != rank_) failed_peers_.insert(peer);
      ops_.erase(r.id);
      return Status::Ok();
    }
    default:
      ops_.erase(it);
      return Status::Ok();
  }
}

Status NcclTransport::RegisterMemory(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return Status::Ok();
  UseDevice();
  MOERUN_ASSIGN_OR_RETURN(const bool device, IsDevicePointer(p));
  if (device) return Status::Ok();
  const auto* lo = static_cast<const char*>(p);
  for (auto it = registered_.begin(); it != registered_.end();) {
    const auto* a = static_cast<const char*>(it->first);
    if (a < lo + bytes && lo < a + it->second) {
      (void)cudaHostUnregister(it->first);
      it = registered_.erase(it);
    } else {
      ++it;
    }
  }
  if (const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault); e != cudaSuccess) {
    (void)cudaGetLastError();
    // Page-locked already by another user of this process (the CUDA layer's host pinning of the
    // same buffer): pinned all the same, and that user unregisters it.
    if (e == cudaErrorHostMemoryAlreadyRegistered) return Status::Ok();
    // Pinning is an optimisation: unpinned memory is staged all the same, only slower.
    if (!warned_register_) {
      spdlog::warn("nccl: cudaHostRegister of {} bytes: {} (staging copies run unpinned)", bytes,
                   CudaError(e));
      warned_register_ = true;
    }
    return Status::Ok();
  }
  registered_.emplace_back(p, bytes);
  ++counters_.registrations;
  return Status::Ok();
}

void NcclTransport::UnregisterMemory(void* p) {
  UseDevice();
  for (auto it = registered_.begin(); it != registered_.end(); ++it) {
    if (it->first == p) {
      (void)cudaHostUnregister(p);
      registered_.erase(it);
      return;
    }
  }
}

}  // namespace

Result<std::unique_ptr<Transport>> CreateNcclTransport(std::unique_ptr<Transport> bootstrap,
                                                       NcclTransportOptions options) {
  if (bootstrap == nullptr) return Status::InvalidArgument("nccl: no bootstrap transport");
  for (const int tag : options.bulk_tags) {
    if (tag < 0 || tag >= kReservedTagBase) {
      return Status::InvalidArgument("nccl: tag " + std::to_string(tag) +
                                     " cannot go over NCCL (tags are 0 .. " +
                                     std::to_string(kReservedTagBase - 1) + ")");
    }
  }
  const Deadline deadline = options.deadline;
  auto t = std::make_unique<NcclTransport>(std::move(bootstrap), std::move(options));
  const std::string local_error = t->Prepare();
  MOERUN_RETURN_IF_ERROR(t->Open(local_error, deadline));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace moerun
