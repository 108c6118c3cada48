// The nccl transport for builds without NCCL: Create says why; nothing else can be reached.
#include "transport/nccl/nccl_transport.h"

namespace moerun {

Result<std::unique_ptr<Transport>> CreateNcclTransport(std::unique_ptr<Transport> /*bootstrap*/,
                                                       NcclTransportOptions /*options*/) {
  return Status::Unsupported(
      "--transport nccl: this build of moerun has no NCCL support (configure with the CUDA "
      "toolkit and NCCL, MOERUN_WITH_CUDA=ON and MOERUN_WITH_NCCL=ON)");
}

bool NcclTransportBuilt() { return false; }

}  // namespace moerun
