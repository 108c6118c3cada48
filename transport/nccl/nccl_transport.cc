// Creating and ending the nccl transport (nccl_transport_impl.h): this rank's GPU and streams,
// the unique id over the bootstrap, the two communicators (the second by ncclCommSplit), the
// envelope receives; the graceful end; Break, which aborts both communicators.
#include "transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "base/log.h"
#include "base/watchdog.h"
#include "transport/nccl/nccl_common.h"
#include "transport/nccl/nccl_transport_impl.h"

namespace moerun {
namespace nccl {
namespace {

constexpr auto kDestroyTimeout = std::chrono::seconds(10);

}  // namespace

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

}  // namespace nccl

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
  auto t = std::make_unique<nccl::NcclTransport>(std::move(bootstrap), std::move(options));
  const std::string local_error = t->Prepare();
  MOERUN_RETURN_IF_ERROR(t->Open(local_error, deadline));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace moerun
