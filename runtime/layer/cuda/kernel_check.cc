// CheckKernelImagesFor (kernel_check.h): gathers the images of every .cu file's kernels for the
// device and checks them (experts/cuda/kernel_image.h).
#include "runtime/layer/cuda/kernel_check.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "experts/cuda/ffn_kernels.h"
#include "experts/cuda/kernel_image.h"
#include "router/cuda/gate_kernels.h"
#include "router/cuda/group_kernels.h"
#include "runtime/layer/cuda/preset_gen.h"

namespace moerun {

Status CheckKernelImagesFor(int device) {
  cudaDeviceProp prop{};
  const cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::InvalidArgument("CUDA: device " + std::to_string(device) + ": " +
                                   cudaGetErrorString(e));
  }
  // cudaFuncGetAttributes answers for the current device.
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    (void)cudaGetLastError();
    previous = -1;
  }
  if (previous != device && cudaSetDevice(device) != cudaSuccess) {
    const cudaError_t set = cudaGetLastError();
    return Status::InvalidArgument("CUDA: device " + std::to_string(device) + ": " +
                                   cudaGetErrorString(set));
  }
  std::vector<cuda_kernels::KernelImage> images;
  cuda_kernels::AppendFfnKernelImages(images);
  cuda_kernels::AppendGroupKernelImages(images);
  cuda_kernels::AppendPresetKernelImages(images);
  cuda_kernels::AppendGateKernelImages(images);
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
  return cuda_kernels::CheckKernelImages(images, prop.major * 10 + prop.minor, prop.name, device);
}

}  // namespace moerun
