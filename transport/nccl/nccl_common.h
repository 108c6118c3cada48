// Shared pieces of the NCCL code (nccl_exchange.cc, nccl_transport.cc): CUDA and NCCL errors as
// Status, the polled state of a non-blocking communicator, and the collective set-up of one
// communicator over a bootstrap transport. Internal to transport/nccl/ (it names vendor types).
// Thread-safety: no shared state.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "transport/transport.h"

namespace moerun {

std::string CudaError(cudaError_t e);

// An NCCL error as a Status: usage errors are the caller's (kInvalidArgument), everything else
// (system, remote, internal, CUDA) means the communicator or a peer is gone (kUnavailable).
Status NcclStatus(ncclResult_t r, ncclComm_t comm, const std::string& what);

// Polls a non-blocking communicator's state: true when idle, false while an operation is in
// progress, an error when it failed.
Result<bool> CommIdle(ncclComm_t comm, const char* what);

// "2.28.9", or "unknown".
std::string NcclVersionString();

// Collective over `bootstrap`: rank 0 makes the unique id and every rank learns it (reserved tags
// `tag` and `tag + 1`). A rank with a `local_error` (it could not select or prepare its GPU)
// sends that instead, and every rank fails naming it (kUnavailable).
Result<ncclUniqueId> ExchangeUniqueId(Transport& bootstrap, int tag, std::string local_error,
                                      Deadline deadline);

// Opens this rank's non-blocking communicator (ncclConfig_t.blocking = 0) and polls its
// initialisation under a watchdog; on an error or at the deadline it is aborted (ncclCommAbort)
// and the error returned. `what` names it in errors.
Result<ncclComm_t> InitNonBlockingComm(int size, int rank, const ncclUniqueId& id,
                                       Deadline deadline, const std::string& what);

// Aborts `comm` if set and clears it.
void AbortComm(ncclComm_t& comm);

// Ends `comm` gracefully (ncclCommFinalize, polled for at most `timeout`, then ncclCommDestroy);
// a peer that is gone makes it abort instead (logged as a warning).
void FinalizeComm(ncclComm_t& comm, std::chrono::steady_clock::duration timeout);

}  // namespace moerun
