// The mpi transport: host-memory point-to-point over MPI (Open MPI's ob1/vader/tcp, or UCX as
// its pml). No MPI type appears outside transport/mpi/. Built only with MPI (MOERUN_WITH_MPI);
// the runtime makes it through transport/registry.h.
#pragma once

#include <memory>

#include "transport/launcher_env.h"
#include "transport/transport.h"

namespace moerun {

// Initialises MPI (once per process; MPI_THREAD_FUNNELED: only the calling thread may use the
// transport) and returns this rank's endpoint on a private duplicate of MPI_COMM_WORLD. MPI is
// finalised when the last endpoint is destroyed.
Result<std::unique_ptr<Transport>> CreateMpiTransport();

}  // namespace moerun
