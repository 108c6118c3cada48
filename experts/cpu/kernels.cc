#include "experts/cpu/kernels.h"

namespace moerun {

const CpuKernels& KernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return kernels_internal::Avx512Kernels();
    case Isa::kAvx2:
      return kernels_internal::Avx2Kernels();
    case Isa::kScalar:
      break;
  }
  return kernels_internal::ScalarKernels();
}

}  // namespace moerun
