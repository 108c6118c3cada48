// Registers the ucx transport (registry.h); compiled only in builds with UCX. Its options come
// from the environment (MOERUN_UCX_PUT_MIN, MOERUN_UCX_PROTOCOL: ucx_transport.h).
#include <utility>

#include "transport/registry.h"
#include "transport/ucx/ucx_transport.h"

namespace moerun {

void RegisterUcxTransport(TransportRegistry& registry) {
  auto create = [](TransportRequest r) -> Result<std::unique_ptr<Transport>> {
    MOERUN_ASSIGN_OR_RETURN(const UcxOptions opts, UcxOptionsFromEnvironment());
    return CreateUcxTransport(std::move(r.bootstrap), opts);
  };
  auto create_joiner = []() -> Result<std::unique_ptr<TransportJoiner>> {
    MOERUN_ASSIGN_OR_RETURN(const UcxOptions opts, UcxOptionsFromEnvironment());
    return CreateUcxJoiner(opts);  // a UcxJoiner is a TransportJoiner
  };
  registry.Add({.name = "ucx",
                .offers = "host memory over UCX (verbs, shared memory, TCP), large messages by "
                          "zero-copy put",
                .needs_bootstrap = true,
                .needs_mpi_launcher = true,
                .create = std::move(create),
                .create_joiner = std::move(create_joiner)});
}

}  // namespace moerun
