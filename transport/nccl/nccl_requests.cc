// The nccl transport's requests (nccl_transport_impl.h): Isend and Irecv choose the path (the
// bootstrap, or NCCL: queued for the next flush, or matched to an envelope or a staged unexpected
// message); Test drives progress and completes them; Cancel withdraws or, once enqueued, aborts.
#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "transport/nccl/nccl_common.h"
#include "transport/nccl/nccl_transport_impl.h"

namespace moerun::nccl {

Status NcclTransport::CheckPeer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_) {
    return Status::InvalidArgument(std::string("nccl: ") + what + " rank " + std::to_string(peer) +
                                   " of a job of " + std::to_string(size_) + " ranks");
  }
  return Status::Ok();
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

}  // namespace moerun::nccl
