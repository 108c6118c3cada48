// CreateBaseline (baselines.h): dispatches by name to the baselines this build has.
#include "launch/moebench/baselines/baselines.h"

#include "moerun/build_info.h"
#if MOERUN_HAVE_MPI
#include "launch/moebench/baselines/mpi_alltoallv.h"
#endif
#if MOERUN_HAVE_UCX
#include "launch/moebench/baselines/ucx_raw_put.h"
#include "transport/ucx/ucx_transport.h"
#endif

namespace moerun {

std::vector<std::string> BuiltBaselines() {
  std::vector<std::string> names;
  if (MOERUN_HAVE_MPI) names.push_back("mpi_alltoallv");
  if (MOERUN_HAVE_UCX) names.push_back("ucx_raw_put");
  return names;
}

Result<size_t> UcxPutMinFromEnvironment() {
#if MOERUN_HAVE_UCX
  MOERUN_ASSIGN_OR_RETURN(const UcxOptions opts, UcxOptionsFromEnvironment());
  return opts.put_min;
#else
  return Status::Unsupported("this build of moebench has no 'ucx' transport");
#endif
}

Result<std::unique_ptr<RoundTripBaseline>> CreateBaseline(std::string_view name,
                                                          Transport* bootstrap,
                                                          const std::vector<int64_t>& send_bytes,
                                                          const std::vector<int64_t>& recv_bytes) {
#if MOERUN_HAVE_MPI
  if (name == "mpi_alltoallv") {
    MOERUN_ASSIGN_OR_RETURN(auto b, AlltoallvBaseline::Create(send_bytes, recv_bytes));
    return std::unique_ptr<RoundTripBaseline>(std::move(b));
  }
#endif
#if MOERUN_HAVE_UCX
  if (name == "ucx_raw_put") {
    if (bootstrap == nullptr) {
      return Status::InvalidArgument("the ucx_raw_put baseline needs a bootstrap transport");
    }
    MOERUN_ASSIGN_OR_RETURN(auto b, RawPutBaseline::Create(bootstrap, send_bytes, recv_bytes));
    return std::unique_ptr<RoundTripBaseline>(std::move(b));
  }
#endif
  (void)bootstrap, (void)send_bytes, (void)recv_bytes;
  std::string built;
  for (const std::string& n : BuiltBaselines()) built += (built.empty() ? "" : ", ") + n;
  const std::string how = name == "mpi_alltoallv" ? "configure with MOERUN_WITH_MPI=ON and Open MPI"
                          : name == "ucx_raw_put"
                              ? "configure with MOERUN_WITH_UCX=ON and UCX"
                              : "the baselines are mpi_alltoallv and ucx_raw_put";
  return Status::Unsupported("this build of moebench has no '" + std::string(name) +
                             "' baseline (built: " + (built.empty() ? "none" : built) + "); " +
                             how);
}

}  // namespace moerun
