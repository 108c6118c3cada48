// The raw-MPI baseline of `moebench transport` ("mpi_alltoallv", baselines.h): MPI_Alltoallv over
// a given byte matrix, timed. Plain types only; the MPI calls stay in this file's .cc, which is
// built only with MPI.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "launch/moebench/baselines/baselines.h"

namespace moerun {

class AlltoallvBaseline final : public RoundTripBaseline {
 public:
  // Collective over MPI_COMM_WORLD: every rank passes the bytes it sends to and receives from
  // each rank. Buffers are allocated once here.
  static Result<std::unique_ptr<AlltoallvBaseline>> Create(const std::vector<int64_t>& send_bytes,
                                                           const std::vector<int64_t>& recv_bytes);
  // One round trip (dispatch as given, then combine: the transpose), collective; the slowest
  // rank's milliseconds. Never fails (MPI's errors abort the job).
  Result<double> RoundTripMs() override;

 private:
  AlltoallvBaseline() = default;
  std::vector<int> sc_, sd_, rc_, rd_;
  std::vector<char> sbuf_, rbuf_;
};

}  // namespace moerun
