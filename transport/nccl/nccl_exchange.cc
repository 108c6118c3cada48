#include "transport/nccl/nccl_exchange.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/log.h"
#include "base/watchdog.h"
#include "transport/nccl/nccl_common.h"
#include "transport/nccl/nccl_plan.h"

namespace moerun {
namespace {

// The bootstrap's reserved tags for the unique id (ucx uses + 200/201, its baseline + 300..302,
// the nccl transport + 410/411).
constexpr int kTagUniqueId = kReservedTagBase + 400;  // and + 401
constexpr auto kDestroyTimeout = std::chrono::seconds(10);

}  // namespace

struct NcclExchange::Impl {
  int rank = 0;
  int size = 0;
  int device = -1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  Status broken;  // why the communicator was aborted
  std::vector<PeerTransfer> plan;

  void Abort() { AbortComm(comm); }

  ~Impl() {
    if (device >= 0) (void)cudaSetDevice(device);
    FinalizeComm(comm, kDestroyTimeout);
    if (done != nullptr) (void)cudaEventDestroy(done);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

NcclExchange::NcclExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclExchange::~NcclExchange() = default;

std::string NcclExchange::LibraryVersion() { return NcclVersionString(); }

int NcclExchange::rank() const { return impl_->rank; }
int NcclExchange::size() const { return impl_->size; }
int NcclExchange::device() const { return impl_->device; }
bool NcclExchange::usable() const { return impl_->broken.ok() && impl_->comm != nullptr; }

Result<std::unique_ptr<NcclExchange>> NcclExchange::Create(Transport& bootstrap, int device,
                                                           Deadline deadline) {
  auto impl = std::make_unique<Impl>();
  impl->rank = bootstrap.rank();
  impl->size = bootstrap.size();
  const std::string me = "nccl: rank " + std::to_string(impl->rank);

  // Local preparation; a failure is announced to the other ranks in the id exchange.
  std::string local_error;
  if (device < 0) {
    local_error = "no device " + std::to_string(device);
  } else if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    local_error = "cudaSetDevice(" + std::to_string(device) + "): " + CudaError(e);
    (void)cudaGetLastError();
  } else {
    impl->device = device;
    if (const cudaError_t e1 = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
        e1 != cudaSuccess) {
      local_error = "cudaStreamCreate: " + CudaError(e1);
    } else if (const cudaError_t e2 = cudaEventCreateWithFlags(&impl->done, cudaEventDisableTiming);
               e2 != cudaSuccess) {
      local_error = "cudaEventCreate: " + CudaError(e2);
    }
  }
  MOERUN_ASSIGN_OR_RETURN(const ncclUniqueId id,
                          ExchangeUniqueId(bootstrap, kTagUniqueId, local_error, deadline));
  MOERUN_ASSIGN_OR_RETURN(impl->comm,
                          InitNonBlockingComm(impl->size, impl->rank, id, deadline, me));
  spdlog::info("nccl: rank {} of {} on GPU {}, NCCL {} (non-blocking communicator)", impl->rank,
               impl->size, device, LibraryVersion());
  return std::unique_ptr<NcclExchange>(new NcclExchange(std::move(impl)));
}

Status NcclExchange::Exchange(const void* send_dev, std::span<const int64_t> send_offset_bytes,
                              void* recv_dev, std::span<const int64_t> recv_offset_bytes,
                              Deadline deadline) {
  Impl& m = *impl_;
  if (!m.broken.ok() || m.comm == nullptr) {
    return Status::Unavailable("nccl exchange: unusable since an earlier failure (" +
                               m.broken.ToString() + ")");
  }
  MOERUN_RETURN_IF_ERROR(
      PlanGroupedTransfers(m.size, send_offset_bytes, recv_offset_bytes, m.plan));
  if (m.plan.empty()) return Status::Ok();
  for (const PeerTransfer& t : m.plan) {
    if ((t.kind == PeerTransfer::Kind::kSend ? send_dev : recv_dev) == nullptr) {
      return Status::InvalidArgument(std::string("nccl exchange: ") +
                                     (t.kind == PeerTransfer::Kind::kSend ? "send" : "receive") +
                                     " buffer is null but " + std::to_string(t.bytes) +
                                     " bytes move with rank " + std::to_string(t.peer));
    }
  }
  const auto fail = [&](Status err) {
    m.Abort();
    m.broken = err;
    return Status(err.code(), err.message() + " (rank " + std::to_string(m.rank) + " of " +
                                  std::to_string(m.size) +
                                  "; the communicator was aborted: later exchanges fail)");
  };
  if (const cudaError_t e = cudaSetDevice(m.device); e != cudaSuccess) {
    return fail(Status::Unavailable("nccl exchange: cudaSetDevice(" + std::to_string(m.device) +
                                    "): " + CudaError(e)));
  }

  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return fail(NcclStatus(r, m.comm, "nccl exchange: ncclGroupStart"));
  const auto* send = static_cast<const uint8_t*>(send_dev);
  auto* recv = static_cast<uint8_t*>(recv_dev);
  for (const PeerTransfer& t : m.plan) {
    const auto bytes = static_cast<size_t>(t.bytes);
    r = t.kind == PeerTransfer::Kind::kSend
            ? ncclSend(send + t.offset, bytes, ncclUint8, t.peer, m.comm, m.stream)
            : ncclRecv(recv + t.offset, bytes, ncclUint8, t.peer, m.comm, m.stream);
    if (r != ncclSuccess && r != ncclInProgress) {
      (void)ncclGroupEnd();
      return fail(NcclStatus(
          r, m.comm,
          std::string("nccl exchange: ") +
              (t.kind == PeerTransfer::Kind::kSend ? "ncclSend to rank " : "ncclRecv from rank ") +
              std::to_string(t.peer)));
    }
  }
  r = ncclGroupEnd();
  if (r != ncclSuccess && r != ncclInProgress) {
    return fail(NcclStatus(r, m.comm, "nccl exchange: ncclGroupEnd"));
  }

  // With a non-blocking communicator the group may still be being enqueued (ncclInProgress):
  // wait for that, then record the event behind it and wait for the event.
  bool recorded = false;
  const auto poll = [&]() -> Result<bool> {
    MOERUN_ASSIGN_OR_RETURN(const bool idle, CommIdle(m.comm, "nccl exchange"));
    if (!idle) return false;
    if (!recorded) {
      if (const cudaError_t e = cudaEventRecord(m.done, m.stream); e != cudaSuccess) {
        return Status::Unavailable("nccl exchange: cudaEventRecord: " + CudaError(e));
      }
      recorded = true;
    }
    const cudaError_t q = cudaEventQuery(m.done);
    if (q == cudaSuccess) return true;
    if (q == cudaErrorNotReady) return false;
    return Status::Unavailable("nccl exchange: cudaEventQuery: " + CudaError(q));
  };
  Status s = WaitWithWatchdog(
      poll, deadline, [] {}, "nccl exchange");
  if (!s.ok()) return fail(std::move(s));
  return Status::Ok();
}

}  // namespace moerun
