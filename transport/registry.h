// The transport backends this build has, by name. "inproc" (ranks as threads of one process,
// InprocFabric) is always built; "mpi", "ucx" and "nccl" register themselves when their library
// was found at configure time (MOERUN_WITH_MPI / _UCX / _NCCL). A backend that was not built is
// absent: asking for it by name gives one line that names it, what was built, and how to build
// it. Callers outside transport/ make transports through this file only; the backends' own
// headers stay for their tests.
//
// Registration: registry.cc, compiled with build_info.h's MOERUN_HAVE_*, calls the Register
// function of each backend that was built (declared below, defined in the backend's folder), so
// no static registrar object can be dropped by the linker. Thread-safety: the registry is built
// once, on first use (a function-local static), and only read afterwards.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "transport/transport.h"

namespace moerun {

// What a factory gets. A layered backend (ucx, nccl) rides on a bootstrap host transport (an mpi
// endpoint) for its set-up and its small messages, and owns it from then on.
struct TransportRequest {
  std::unique_ptr<Transport> bootstrap;  // ucx, nccl: required; mpi: unused
  int device = -1;                       // nccl: this rank's GPU (launch/local_device.h)
  std::vector<int> bulk_tags;            // nccl: tags that travel over NCCL
  Deadline deadline{};                   // nccl: for creating the communicators (collective)
};

// A process that takes over a dead rank's number in a running job (moerun serve --join): the
// first half of a transport, whose address the job's ranks take in (ReplacePeer), then Connect.
class TransportJoiner {
 public:
  virtual ~TransportJoiner() = default;
  virtual const std::vector<uint8_t>& address() const = 0;
  // The transport of rank `rank` among addresses.size() ranks (addresses[rank] is ignored).
  // Consumes the joiner.
  virtual Result<std::unique_ptr<Transport>> Connect(
      int rank, const std::vector<std::vector<uint8_t>>& addresses) = 0;
};

// One built backend: its name, what it offers, and its factories.
struct TransportBackend {
  std::string name;                 // "mpi", "ucx", "nccl"
  std::string offers;               // one line: what it moves and how ("host memory over UCX: ...")
  bool needs_bootstrap = false;     // TransportRequest::bootstrap must be set (ucx, nccl)
  bool needs_mpi_launcher = false;  // its ranks must come from mpirun/srun
  std::function<Result<std::unique_ptr<Transport>>(TransportRequest)> create;
  // Empty when the backend cannot join a running job (only ucx can).
  std::function<Result<std::unique_ptr<TransportJoiner>>()> create_joiner;
};

// The backend called `name`, or nullptr when this build does not have it ("inproc" included:
// InprocFabric makes its endpoints, not this registry).
const TransportBackend* FindTransport(std::string_view name);

// The backend, or InvalidArgument (exit 2): "this build of moerun has no 'ucx' transport (built:
// inproc, mpi); configure with MOERUN_WITH_UCX=ON and UCX installed".
Result<const TransportBackend*> RequireTransport(std::string_view name);

// Makes a transport of backend `name` (RequireTransport's error when it was not built).
Result<std::unique_ptr<Transport>> CreateTransport(std::string_view name,
                                                   TransportRequest request = {});

// The names of every built transport, "inproc" first, then in registration order.
std::vector<std::string> BuiltTransports();

// The registry the Register functions fill (only registry.cc makes one).
class TransportRegistry {
 public:
  // A second backend of the same name replaces nothing: it is a programming error (aborts).
  void Add(TransportBackend backend);
  const TransportBackend* Find(std::string_view name) const;
  const std::vector<TransportBackend>& backends() const { return backends_; }

 private:
  std::vector<TransportBackend> backends_;
};

// Each built backend's registration, defined in its folder (transport/mpi, transport/ucx,
// transport/nccl) and compiled only when that backend is built.
void RegisterMpiTransport(TransportRegistry& registry);
void RegisterUcxTransport(TransportRegistry& registry);
void RegisterNcclTransport(TransportRegistry& registry);

}  // namespace moerun
