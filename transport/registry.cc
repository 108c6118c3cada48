// The transport registry (registry.h): filled once, on first use, by the Register function of
// each backend this build has.
#include "transport/registry.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "moerun/build_info.h"

namespace moerun {
namespace {

const TransportRegistry& Registry() {
  static const TransportRegistry registry = [] {
    TransportRegistry r;
#if MOERUN_HAVE_MPI
    RegisterMpiTransport(r);
#endif
#if MOERUN_HAVE_UCX
    RegisterUcxTransport(r);
#endif
#if MOERUN_HAVE_NCCL
    RegisterNcclTransport(r);
#endif
    return r;
  }();
  return registry;
}

// How to build a backend this build lacks.
std::string HowToBuild(std::string_view name) {
  if (name == "mpi") return "configure with MOERUN_WITH_MPI=ON and Open MPI installed";
  if (name == "ucx") return "configure with MOERUN_WITH_UCX=ON and UCX (libucx-dev) installed";
  if (name == "nccl") {
    return "configure with MOERUN_WITH_CUDA=ON and MOERUN_WITH_NCCL=ON, with the CUDA toolkit "
           "and NCCL installed";
  }
  return "the transports are mpi, ucx, nccl and inproc";
}

}  // namespace

void TransportRegistry::Add(TransportBackend backend) {
  if (Find(backend.name) != nullptr) {
    std::fprintf(stderr, "moerun: transport '%s' registered twice\n", backend.name.c_str());
    std::abort();
  }
  backends_.push_back(std::move(backend));
}

const TransportBackend* TransportRegistry::Find(std::string_view name) const {
  for (const TransportBackend& b : backends_) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

const TransportBackend* FindTransport(std::string_view name) { return Registry().Find(name); }

std::vector<std::string> BuiltTransports() {
  std::vector<std::string> names = {"inproc"};
  for (const TransportBackend& b : Registry().backends()) names.push_back(b.name);
  return names;
}

Result<const TransportBackend*> RequireTransport(std::string_view name) {
  if (const TransportBackend* b = FindTransport(name)) return b;
  std::string built;
  for (const std::string& n : BuiltTransports()) built += (built.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("this build of moerun has no '" + std::string(name) +
                                 "' transport (built: " + built + "); " + HowToBuild(name));
}

Result<std::unique_ptr<Transport>> CreateTransport(std::string_view name,
                                                   TransportRequest request) {
  MOERUN_ASSIGN_OR_RETURN(const TransportBackend* b, RequireTransport(name));
  if (b->needs_bootstrap && request.bootstrap == nullptr) {
    return Status::InvalidArgument("the " + b->name +
                                   " transport needs a bootstrap transport (an mpi endpoint)");
  }
  return b->create(std::move(request));
}

}  // namespace moerun
