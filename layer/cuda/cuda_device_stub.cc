// ProbeCuda for builds without CUDA: reports that CUDA is not built in.
#include "layer/cuda/cuda_device.h"

namespace moerun {

CudaProbe ProbeCuda() {
  CudaProbe p;
  p.error =
      "this build of moerun has no CUDA support (configure with MOERUN_WITH_CUDA=ON on a "
      "machine with the CUDA toolkit)";
  return p;
}

}  // namespace moerun
