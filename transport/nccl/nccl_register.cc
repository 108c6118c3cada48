// Registers the nccl transport (registry.h); compiled only in builds with NCCL.
#include <utility>

#include "transport/nccl/nccl_transport.h"
#include "transport/registry.h"

namespace moerun {

void RegisterNcclTransport(TransportRegistry& registry) {
  TransportBackend b;
  b.name = "nccl";
  b.offers = "rows and results over NCCL between GPUs, one GPU per rank; the rest over mpi";
  b.needs_bootstrap = true;
  b.needs_mpi_launcher = true;
  b.create = [](TransportRequest r) {
    NcclTransportOptions o;
    o.device = r.device;
    o.bulk_tags = std::move(r.bulk_tags);
    o.deadline = r.deadline;
    return CreateNcclTransport(std::move(r.bootstrap), std::move(o));
  };
  registry.Add(std::move(b));
}

}  // namespace moerun
