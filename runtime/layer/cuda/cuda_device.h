// Run-time probe for CUDA devices. Plain C++ interface (no CUDA types), so callers build
// whether or not this build has CUDA. With no GPU or no driver, the probe reports why
// (cudaGetDeviceCount's error) instead of failing later.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  size_t memory_bytes = 0;
};

struct CudaProbe {
  bool built = false;  // this build has the CUDA runtime linked in
  std::vector<CudaDeviceInfo> devices;
  std::string error;  // why there are no devices, when there are none
};

CudaProbe ProbeCuda();

// The probe, or why --device cuda cannot run here (InvalidArgument: a bad argument for this
// machine or build, exit 2): every entry point checks this before any work.
inline Result<CudaProbe> RequireCuda() {
  CudaProbe probe = ProbeCuda();
  if (probe.devices.empty()) {
    return Status::InvalidArgument(
        "--device cuda: no usable GPU: " +
        (probe.built ? probe.error : std::string("this build has no CUDA backend")));
  }
  return probe;
}

}  // namespace moerun
