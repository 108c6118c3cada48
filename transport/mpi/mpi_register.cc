// Registers the mpi transport (registry.h); compiled only in builds with MPI.
#include "transport/mpi/mpi_transport.h"
#include "transport/registry.h"

namespace moerun {

void RegisterMpiTransport(TransportRegistry& registry) {
  TransportBackend b;
  b.name = "mpi";
  b.offers = "host memory point-to-point over MPI (Open MPI's ob1/vader/tcp, or its UCX pml)";
  b.needs_mpi_launcher = true;
  b.create = [](TransportRequest) { return CreateMpiTransport(); };
  registry.Add(std::move(b));
}

}  // namespace moerun
