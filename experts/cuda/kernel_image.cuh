// Fills a KernelImage (kernel_image.h) from a kernel, as the CUDA runtime reports it for the
// current device. Used by the .cu files that list their kernels (Append*KernelImages).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "experts/cuda/kernel_image.h"

namespace moerun::cuda_kernels {

// The image of `kernel` for the current device. When the binary holds none it can run,
// cudaFuncGetAttributes fails: the error goes into the image and the thread's sticky error is
// cleared, so the check does not poison the next CUDA call.
template <typename... Args>
KernelImage ImageOf(void (*kernel)(Args...), std::string name, int min_arch) {
  KernelImage im;
  im.name = std::move(name);
  im.min_arch = min_arch;
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
  if (e != cudaSuccess) {
    im.error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    (void)cudaGetLastError();
    return im;
  }
  im.ptx_version = attr.ptxVersion;
  im.binary_version = attr.binaryVersion;
  return im;
}

}  // namespace moerun::cuda_kernels
