// The vendor baselines `moebench transport` times our transports against, by name:
//   "mpi_alltoallv"  MPI_Alltoallv over MPI_COMM_WORLD (mpi_alltoallv.h), built with MPI;
//   "ucx_raw_put"    a bare ucp_put_nbx loop on a UCX worker of its own (ucx_raw_put.h), built
//                    with UCX.
// They live here, in moebench's own library, not in the product's: only the benchmark uses them.
// A baseline this build lacks is absent, and CreateBaseline says so by name. baselines.cc is
// compiled with build_info.h's MOERUN_HAVE_* and calls only the ones that were built.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "transport/transport.h"

namespace moerun {

// One timed round trip of a byte matrix: the dispatch (each rank's bytes to every rank) and the
// combine (its transpose). Collective: every rank calls it the same number of times.
class RoundTripBaseline {
 public:
  virtual ~RoundTripBaseline() = default;
  // Milliseconds of one round trip (whose: see each baseline's header; the caller takes rank 0's).
  virtual Result<double> RoundTripMs() = 0;
};

// Collective over the job's ranks. send_bytes / recv_bytes: the bytes this rank sends to and
// receives from each rank in the dispatch. `bootstrap`: a host transport the baseline may use
// for its set-up and barriers (ucx_raw_put needs one; it must outlive the baseline). A name this
// build lacks: kUnsupported naming it, what was built and how to build it.
Result<std::unique_ptr<RoundTripBaseline>> CreateBaseline(std::string_view name,
                                                          Transport* bootstrap,
                                                          const std::vector<int64_t>& send_bytes,
                                                          const std::vector<int64_t>& recv_bytes);

// The names of the baselines this build has.
std::vector<std::string> BuiltBaselines();

// The ucx transport's put threshold as the environment sets it (MOERUN_UCX_PUT_MIN:
// transport/ucx/ucx_transport.h), for the report of a ucx run; kUnsupported without UCX.
Result<size_t> UcxPutMinFromEnvironment();

}  // namespace moerun
