// The nccl transport's progress (nccl_transport_impl.h): polling the peers' envelopes and
// matching them, the flush of the decided operations as one NCCL group per communicator followed
// by their envelopes, the events recorded behind a group, and the reaping of finished work.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "transport/nccl/nccl_common.h"
#include "transport/nccl/nccl_transport_impl.h"

namespace moerun::nccl {
namespace {

constexpr auto kPollInterval = std::chrono::microseconds(5);
// Operations in one NCCL group at most (NCCL has capped a group at 2048 operations).
constexpr size_t kMaxGroupOps = 1024;

}  // namespace

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

Status NcclTransport::Flush() {
  MOERUN_ASSIGN_OR_RETURN(const bool ready, FinishPendingGroup());
  if (!ready || issue_.empty()) return Status::Ok();
  MOERUN_RETURN_IF_ERROR(AnnounceSelfSends());
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
  MOERUN_RETURN_IF_ERROR(StageHostSends());
  // One group per communicator, so that NCCL never joins the two directions' streams.
  bool in_progress = false;
  for (int c = 0; c < 2; ++c) {
    MOERUN_ASSIGN_OR_RETURN(const bool pending, EnqueueGroups(c));
    in_progress = in_progress || pending;
  }
  group_.clear();
  for (const GroupedBulkOp& g : plan_) {
    ops_.at(g.op.id).state = State::kIssued;
    group_.push_back(g.op.id);
  }
  MOERUN_RETURN_IF_ERROR(SendEnvelopes());
  issue_.clear();
  if (in_progress) {
    group_pending_ = true;
    return Status::Ok();
  }
  return PostGroup();
}

Result<bool> NcclTransport::FinishPendingGroup() {
  if (!group_pending_) return true;
  for (ncclComm_t c : comm_) {
    MOERUN_ASSIGN_OR_RETURN(const bool idle, CommIdle(c, "nccl: enqueueing a group"));
    if (!idle) return false;
  }
  group_pending_ = false;
  MOERUN_RETURN_IF_ERROR(PostGroup());
  return true;
}

Status NcclTransport::AnnounceSelfSends() {
  // Sends to this rank itself are announced here, not over the bootstrap, so that the receive
  // they meet (posted, or into staging) joins the same group: NCCL pairs a rank's send to
  // itself only with a receive in the same group. OnEnvelope appends that receive to issue_.
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
  return Status::Ok();
}

Status NcclTransport::StageHostSends() {
  // Every planned operation learns its communicator; a host buffer gets a staging slot on that
  // communicator's stream, and a host send is copied in there before the group.
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
  return Status::Ok();
}

Result<bool> NcclTransport::EnqueueGroups(int comm) {
  // The plan's operations on communicator `comm`, in their decided order; past kMaxGroupOps
  // operations (NCCL caps a group) the next ones go in a further group on the same communicator.
  const auto ci = static_cast<size_t>(comm);
  bool in_progress = false;
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
    if (g.comm != comm) continue;
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
  return in_progress;
}

Status NcclTransport::SendEnvelopes() {
  // The envelopes, in posting order per peer; zero-byte sends are complete with theirs. Sends to
  // this rank itself were announced by AnnounceSelfSends.
  for (const uint64_t id : issue_) {
    Op& o = ops_.at(id);
    if (!o.send) continue;
    if (o.bytes == 0) o.state = State::kDone;
    if (o.peer == rank_) continue;
    const auto i = static_cast<size_t>(o.peer);
    EnvelopeOut& out = envelope_out_.emplace_back();
    out.env.tag = o.tag;
    out.env.bytes = o.bytes;
    out.env.seq = send_seq_[i]++;
    MOERUN_ASSIGN_OR_RETURN(out.req,
                            bootstrap_->Isend(o.peer, kTagEnvelope, &out.env, sizeof out.env));
  }
  return Status::Ok();
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

}  // namespace moerun::nccl
