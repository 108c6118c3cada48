// Run-time probe for CUDA devices. Plain C++ interface (no CUDA types), so callers build
// whether or not this build has CUDA. With no GPU or no driver, the probe reports why
// (cudaGetDeviceCount's error) instead of failing later.
#pragma once

#include <string>
#include <vector>

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

}  // namespace moerun
