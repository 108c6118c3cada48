// NcclExchange: one all-to-all-v of device (GPU) buffers over NCCL point-to-point, the GPU data
// path of expert parallelism. No NCCL or CUDA type appears here (pimpl). Built only with NCCL
// (MOERUN_WITH_NCCL).
//
// Setup (Create, collective over every rank of `bootstrap`): rank 0 makes the NCCL unique id and
// sends it to all over the bootstrap transport (mpi in a real job, inproc in tests; it is used
// only during Create). Every rank selects its GPU (cudaSetDevice) and opens a non-blocking
// communicator (ncclConfig_t.blocking = 0), whose initialisation is polled under a watchdog: at
// the deadline or on an error the communicator is aborted (ncclCommAbort) and Create fails with
// kDeadlineExceeded / kUnavailable instead of hanging on a rank that never joined. A rank that
// cannot select its device or make the id tells the others during the id exchange, so all fail
// at once naming it. NCCL refuses two ranks of one communicator on one GPU: ranks sharing a GPU
// (launch/local_device.h) must move device data host-staged (mpi/ucx) instead.
//
// Exchange (collective over the ranks that exchange bytes with each other): inside one NCCL
// group, an ncclSend / ncclRecv of exactly the planned bytes to / from every peer with bytes in
// that direction (self included; nccl_plan.h), on the exchange's own CUDA stream; then it waits
// for completion under the watchdog (an event on that stream and ncclCommGetAsyncError). On an
// asynchronous NCCL error or at the deadline the communicator is aborted and the exchange is
// unusable from then on: every later call fails at once (kUnavailable). Both sides of a pair
// must take their sizes from the same plan: NCCL cannot detect a mismatch, which shows as a
// missed deadline. Bad offsets fail with kInvalidArgument before anything is posted, and leave the
// exchange usable.
//
// Buffers: device pointers on this exchange's GPU, owned by the caller. The send buffer must hold
// its data when Exchange is called (synchronise the stream that produced it first); when Exchange
// returns Ok the receive buffer holds the data. Exchange blocks the calling thread until then.
// Thread-safety: one thread at a time; it sets the calling thread's current device.
// Allocation: none in Exchange after the first call with the largest number of peers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "transport/transport.h"

namespace moerun {

class NcclExchange {
 public:
  // Collective over `bootstrap`'s ranks; `device` is an ordinal among the visible devices
  // (launch/local_device.h chooses it).
  static Result<std::unique_ptr<NcclExchange>> Create(Transport& bootstrap, int device,
                                                      Deadline deadline);
  // The NCCL library's version ("2.28.9").
  static std::string LibraryVersion();

  ~NcclExchange();
  NcclExchange(const NcclExchange&) = delete;
  NcclExchange& operator=(const NcclExchange&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  // False after an aborted exchange: the communicator is gone.
  bool usable() const;

  // send_offset_bytes / recv_offset_bytes: size() + 1 non-decreasing byte offsets into send_dev /
  // recv_dev; peer p's bytes are [offset[p], offset[p + 1]). A pointer may be null when its
  // direction moves no bytes.
  Status Exchange(const void* send_dev, std::span<const int64_t> send_offset_bytes, void* recv_dev,
                  std::span<const int64_t> recv_offset_bytes, Deadline deadline);

 private:
  struct Impl;
  explicit NcclExchange(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerun
