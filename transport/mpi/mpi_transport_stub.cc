// CreateMpiTransport for builds without MPI.
#include <cstdlib>

#include "transport/mpi/mpi_transport.h"

namespace moerun {

bool LaunchedByMpiLauncher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

Result<std::unique_ptr<Transport>> CreateMpiTransport() {
  return Status::Unsupported(
      "this build of moerun has no MPI support (configure with MOERUN_WITH_MPI=ON and Open MPI)");
}

}  // namespace moerun
