#include "transport/nccl/nccl_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "base/log.h"
#include "base/watchdog.h"

namespace moerun {
namespace {
constexpr size_t kMaxBootstrapBytes = 4096;
}  // namespace

std::string CudaError(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

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

Result<bool> CommIdle(ncclComm_t comm, const char* what) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
  if (r != ncclSuccess) return NcclStatus(r, comm, std::string(what) + ": ncclCommGetAsyncError");
  if (state == ncclInProgress) return false;
  if (state != ncclSuccess) return NcclStatus(state, comm, what);
  return true;
}

std::string NcclVersionString() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
         std::to_string(v % 100);
}

Result<ncclUniqueId> ExchangeUniqueId(Transport& bootstrap, int tag, std::string local_error,
                                      Deadline deadline) {
  ncclUniqueId id{};
  if (local_error.empty() && bootstrap.rank() == 0) {
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      local_error = std::string("ncclGetUniqueId: ") + ncclGetErrorString(r);
    }
  }
  // Byte 0: 0 ready, 1 failed; then rank 0's unique id, or the failure's text.
  const void* payload = nullptr;
  size_t payload_bytes = 0;
  if (!local_error.empty()) {
    payload = local_error.data();
    payload_bytes = std::min(local_error.size(), kMaxBootstrapBytes - 1);
  } else if (bootstrap.rank() == 0) {
    payload = &id;
    payload_bytes = sizeof(id);
  }
  std::vector<uint8_t> mine(1 + payload_bytes);
  mine[0] = local_error.empty() ? 0 : 1;
  if (payload_bytes > 0) std::memcpy(mine.data() + 1, payload, payload_bytes);
  MOERUN_ASSIGN_OR_RETURN(const std::vector<std::vector<uint8_t>> all,
                          AllGatherBytes(bootstrap, mine, tag, kMaxBootstrapBytes, deadline,
                                         "nccl bootstrap (unique id)"));
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
  return id;
}

Result<ncclComm_t> InitNonBlockingComm(int size, int rank, const ncclUniqueId& id,
                                       Deadline deadline, const std::string& what) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; progress is polled under the watchdog
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (init != ncclSuccess && init != ncclInProgress) {
    Status s = NcclStatus(init, comm, what + ": ncclCommInitRankConfig");
    AbortComm(comm);
    return s;
  }
  MOERUN_RETURN_IF_ERROR(WaitWithWatchdog(
      [&] { return CommIdle(comm, "nccl: communicator initialisation"); }, deadline,
      [&] { AbortComm(comm); },
      what + ": communicator initialisation (" + std::to_string(size) + " ranks)"));
  return comm;
}

void AbortComm(ncclComm_t& comm) {
  if (comm != nullptr) {
    (void)ncclCommAbort(comm);
    comm = nullptr;
  }
}

void FinalizeComm(ncclComm_t& comm, std::chrono::steady_clock::duration timeout) {
  if (comm == nullptr) return;
  // A graceful end, under a watchdog: a peer that is gone must not hang the caller.
  const ncclResult_t r = ncclCommFinalize(comm);
  Status s = Status::Ok();
  if (r == ncclSuccess || r == ncclInProgress) {
    s = WaitWithWatchdog([&] { return CommIdle(comm, "nccl: finalising the communicator"); },
                         std::chrono::steady_clock::now() + timeout, [&] { AbortComm(comm); },
                         "nccl: finalising the communicator");
  } else {
    AbortComm(comm);
    s = Status::Unavailable("nccl: ncclCommFinalize: " + std::string(ncclGetErrorString(r)));
  }
  if (comm != nullptr) (void)ncclCommDestroy(comm);
  comm = nullptr;
  if (!s.ok()) spdlog::warn("{} (communicator aborted)", s.ToString());
}

}  // namespace moerun
