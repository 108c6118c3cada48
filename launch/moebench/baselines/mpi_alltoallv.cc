#include "launch/moebench/baselines/mpi_alltoallv.h"

#include <mpi.h>

#include <algorithm>
#include <limits>

namespace moerun {

Result<std::unique_ptr<AlltoallvBaseline>> AlltoallvBaseline::Create(
    const std::vector<int64_t>& send_bytes, const std::vector<int64_t>& recv_bytes) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (static_cast<int>(send_bytes.size()) != size || static_cast<int>(recv_bytes.size()) != size) {
    return Status::InvalidArgument("alltoallv baseline: one entry per rank is needed");
  }
  std::unique_ptr<AlltoallvBaseline> b(new AlltoallvBaseline());
  b->sc_.resize(size), b->sd_.resize(size), b->rc_.resize(size), b->rd_.resize(size);
  int64_t stotal = 0, rtotal = 0;
  for (int i = 0; i < size; ++i) {
    if (send_bytes[i] > std::numeric_limits<int>::max() ||
        recv_bytes[i] > std::numeric_limits<int>::max()) {
      return Status::InvalidArgument("alltoallv baseline: over 2 GiB to one peer");
    }
    b->sc_[i] = static_cast<int>(send_bytes[i]);
    b->rc_[i] = static_cast<int>(recv_bytes[i]);
    b->sd_[i] = static_cast<int>(stotal);
    b->rd_[i] = static_cast<int>(rtotal);
    stotal += send_bytes[i];
    rtotal += recv_bytes[i];
    if (stotal > std::numeric_limits<int>::max() || rtotal > std::numeric_limits<int>::max()) {
      return Status::InvalidArgument("alltoallv baseline: over 2 GiB per rank");
    }
  }
  b->sbuf_.assign(static_cast<size_t>(std::max<int64_t>(stotal, 1)), 1);
  b->rbuf_.assign(static_cast<size_t>(std::max<int64_t>(rtotal, 1)), 0);
  return b;
}

Result<double> AlltoallvBaseline::RoundTripMs() {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  MPI_Alltoallv(sbuf_.data(), sc_.data(), sd_.data(), MPI_BYTE, rbuf_.data(), rc_.data(),
                rd_.data(), MPI_BYTE, MPI_COMM_WORLD);
  MPI_Alltoallv(rbuf_.data(), rc_.data(), rd_.data(), MPI_BYTE, sbuf_.data(), sc_.data(),
                sd_.data(), MPI_BYTE, MPI_COMM_WORLD);
  double dt = (MPI_Wtime() - t0) * 1e3;
  MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return dt;
}

}  // namespace moerun
