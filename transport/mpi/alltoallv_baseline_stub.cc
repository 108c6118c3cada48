#include "transport/mpi/alltoallv_baseline.h"

namespace moerun {

Result<std::unique_ptr<AlltoallvBaseline>> AlltoallvBaseline::Create(const std::vector<int64_t>&,
                                                                     const std::vector<int64_t>&) {
  return Status::Unsupported("this build has no MPI: no MPI_Alltoallv baseline");
}

double AlltoallvBaseline::RoundTripMs() { return 0.0; }

}  // namespace moerun
