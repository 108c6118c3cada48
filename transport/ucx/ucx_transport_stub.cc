// CreateUcxTransport and CreateUcxJoiner for builds without UCX.
#include <cstdlib>

#include "transport/ucx/ucx_transport.h"

namespace moerun {

Result<UcxOptions> UcxOptionsFromEnvironment() { return UcxOptions{}; }

Result<bool> UcxSupportsCudaMemory() {
  return Status::Unsupported("this build of moerun has no UCX support");
}

const char* UcxCudaMemoryNote(bool /*supported*/) { return "ucx: not built"; }

Result<std::unique_ptr<Transport>> CreateUcxTransport(std::unique_ptr<Transport> /*bootstrap*/,
                                                      UcxOptions /*options*/) {
  return Status::Unsupported(
      "this build of moerun has no UCX support (install libucx-dev and configure with "
      "MOERUN_WITH_UCX=ON)");
}

Result<std::unique_ptr<UcxJoiner>> CreateUcxJoiner(UcxOptions /*options*/) {
  return Status::Unsupported(
      "this build of moerun has no UCX support (install libucx-dev and configure with "
      "MOERUN_WITH_UCX=ON)");
}

}  // namespace moerun
