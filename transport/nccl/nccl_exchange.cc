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
#include "transport/nccl/nccl_plan.h"

namespace moerun {
namespace {

// The bootstrap's reserved tags for the unique id (ucx uses + 200/201, its baseline + 300..302).
constexpr int kTagUniqueId = kReservedTagBase + 400;  // and + 401
constexpr size_t kMaxBootstrapBytes = 4096;
constexpr auto kDestroyTimeout = std::chrono::seconds(10);

std::string CudaError(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

// An NCCL error as a Status: usage errors are the caller's, everything else (system, remote,
// internal, CUDA) means the communicator or a peer is gone.
Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  std::string msg = what + ": " + ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') {
    msg += std::string(" (") + last + ")";
  }
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) {
    return Status::InvalidArgument(std::move(msg));
  }
  return Status::Unavailable(std::move(msg));
}

// Polls a non-blocking communicator's state: true when idle, false while an operation is in
// progress, an error when it failed.
Result<bool> CommIdle(ncclComm_t comm, const char* what) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
  if (r != ncclSuccess) return NcclStatus(r, comm, std::string(what) + ": ncclCommGetAsyncError");
  if (state == ncclInProgress) return false;
  if (state != ncclSuccess) return NcclStatus(state, comm, what);
  return true;
}

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

  void Abort() {
    if (comm != nullptr) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
  }

  ~Impl() {
    if (device >= 0) (void)cudaSetDevice(device);
    if (comm != nullptr) {
      // A graceful end, under a watchdog: a peer that is gone must not hang the destructor.
      const ncclResult_t r = ncclCommFinalize(comm);
      Status s = Status::Ok();
      if (r == ncclSuccess || r == ncclInProgress) {
        s = WaitWithWatchdog([&] { return CommIdle(comm, "nccl: finalising the communicator"); },
                             std::chrono::steady_clock::now() + kDestroyTimeout, [&] { Abort(); },
                             "nccl: finalising the communicator");
      } else {
        Abort();
        s = Status::Unavailable("nccl: ncclCommFinalize: " + std::string(ncclGetErrorString(r)));
      }
      if (comm != nullptr) (void)ncclCommDestroy(comm);
      comm = nullptr;
      if (!s.ok()) spdlog::warn("{} (communicator aborted)", s.ToString());
    }
    if (done != nullptr) (void)cudaEventDestroy(done);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

NcclExchange::NcclExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclExchange::~NcclExchange() = default;

bool NcclExchange::built() { return true; }

std::string NcclExchange::LibraryVersion() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
         std::to_string(v % 100);
}

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
  ncclUniqueId id{};
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
    } else if (impl->rank == 0) {
      if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
        local_error = std::string("ncclGetUniqueId: ") + ncclGetErrorString(r);
      }
    }
  }

  // Byte 0: 0 ready, 1 failed; then rank 0's unique id, or the failure's text.
  const void* payload = nullptr;
  size_t payload_bytes = 0;
  if (!local_error.empty()) {
    payload = local_error.data();
    payload_bytes = std::min(local_error.size(), kMaxBootstrapBytes - 1);
  } else if (impl->rank == 0) {
    payload = &id;
    payload_bytes = sizeof(id);
  }
  std::vector<uint8_t> mine(1 + payload_bytes);
  mine[0] = local_error.empty() ? 0 : 1;
  if (payload_bytes > 0) std::memcpy(mine.data() + 1, payload, payload_bytes);
  MOERUN_ASSIGN_OR_RETURN(const std::vector<std::vector<uint8_t>> all,
                          AllGatherBytes(bootstrap, mine, kTagUniqueId, kMaxBootstrapBytes,
                                         deadline, "nccl bootstrap (unique id)"));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty() || all[r][0] != 0) {
      const std::string why = all[r].size() > 1 ? std::string(all[r].begin() + 1, all[r].end())
                                                : std::string("no reason given");
      return Status::Unavailable("nccl: rank " + std::to_string(r) +
                                 " could not prepare its GPU: " + why);
    }
  }
  if (all[0].size() != 1 + sizeof(id)) {
    return Status::Corrupt("nccl bootstrap: rank 0 sent " + std::to_string(all[0].size()) +
                           " bytes, not a unique id of " + std::to_string(sizeof(id)));
  }
  std::memcpy(&id, all[0].data() + 1, sizeof(id));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; progress is polled under the watchdog
  const ncclResult_t init =
      ncclCommInitRankConfig(&impl->comm, impl->size, id, impl->rank, &config);
  if (init != ncclSuccess && init != ncclInProgress) {
    Status s = NcclStatus(init, impl->comm, me + ": ncclCommInitRankConfig");
    impl->Abort();
    return s;
  }
  ncclComm_t comm = impl->comm;
  Impl* raw = impl.get();
  MOERUN_RETURN_IF_ERROR(WaitWithWatchdog(
      [&] { return CommIdle(comm, "nccl: communicator initialisation"); }, deadline,
      [&] { raw->Abort(); },
      "nccl: communicator initialisation (" + std::to_string(impl->size) + " ranks)"));
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
