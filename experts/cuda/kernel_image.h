// What the binary holds for each kernel the CUDA layer launches, as the CUDA runtime reports it
// for one device (cudaFuncGetAttributes: the PTX and SASS versions of the image it would run),
// and the check that refuses a device the binary was not built for. A kernel body compiled for
// an architecture below its minimum traps (it never returns silently with nothing computed), so
// this check is what turns a wrong build into one clear line before any work.
// Plain C++ (no CUDA type): the check is a pure function, tested on machines without a GPU.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace moerun::cuda_kernels {

struct KernelImage {
  std::string name;        // "MmaGemm1<bf16,fp8>"
  int min_arch = 0;        // the oldest compute capability its code is written for (80 = sm_80)
  int ptx_version = 0;     // cudaFuncAttributes::ptxVersion (the virtual arch it was built for)
  int binary_version = 0;  // cudaFuncAttributes::binaryVersion
  std::string error;       // non-empty: cudaFuncGetAttributes failed (no image for the device)
};

// Ok when every kernel has an image for the device (`device_sm` = major * 10 + minor) that was
// compiled for at least its min_arch; otherwise InvalidArgument with one line naming the device
// and its architecture, what the binary holds, and the configure flag that fixes it.
// The code a kernel runs was compiled with __CUDA_ARCH__ = ptx_version * 10 (a JIT-compiled PTX
// image keeps its PTX version), so ptx_version < min_arch is a body built for too old an
// architecture (a trap). A kernel whose min_arch is above the device's own SM is skipped: it can
// never run there, and the layer refuses the math that needs it on its own.
// `device_index` (>= 0) is named in the message.
Status CheckKernelImages(const std::vector<KernelImage>& images, int device_sm,
                         const std::string& device_name, int device_index = -1);

}  // namespace moerun::cuda_kernels
