#include <cuda_runtime.h>

#include "runtime/layer/cuda/cuda_backend.h"

namespace moerun {

// ProbeCuda (cuda_device.h) in builds with CUDA (cuda_backend.cc forwards it here).
CudaProbe cuda_backend::Probe() {
  CudaProbe p;
  p.built = true;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    p.error = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + " (" +
              cudaGetErrorString(err) + ")";
    cudaGetLastError();  // clear the sticky error
    return p;
  }
  if (count == 0) p.error = "no CUDA device";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    p.devices.push_back(CudaDeviceInfo{i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  return p;
}

}  // namespace moerun
