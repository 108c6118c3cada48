// Registers the mpi transport (registry.h); compiled only in builds with MPI.
#include "transport/mpi/mpi_transport.h"
#include "transport/registry.h"

namespace moerun {

void RegisterMpiTransport(TransportRegistry& registry) {
  registry.Add({.name = "mpi",
                .offers = "host memory point-to-point over MPI (Open MPI's ob1/vader/tcp, or its "
                          "UCX pml)",
                .needs_mpi_launcher = true,
                .create = [](TransportRequest) { return CreateMpiTransport(); }});
}

}  // namespace moerun
