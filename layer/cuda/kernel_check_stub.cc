// CheckKernelImagesFor for builds without CUDA: there is no kernel to check, and no device.
#include "layer/cuda/kernel_check.h"

namespace moerun {

Status CheckKernelImagesFor(int device) {
  (void)device;
  return Status::InvalidArgument(
      "CUDA: this build of moerun has no CUDA support (configure with MOERUN_WITH_CUDA=ON on a "
      "machine with the CUDA toolkit)");
}

}  // namespace moerun
