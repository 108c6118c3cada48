// The start-up check that this binary holds code the device can run for every kernel of the
// CUDA layer (experts/cuda/kernel_image.h). Plain C++ interface (no CUDA types); built only with
// CUDA, and called only by the CUDA layer (cuda_context.cc, when a context is made).
#pragma once

#include "base/status.h"

namespace moerun {

// Ok when every kernel the CUDA layer launches has an image for device `device` compiled for its
// architecture; otherwise InvalidArgument (exit 2) with one line: the device, what the binary
// holds, and the configure flag that fixes it. Reads the kernels' attributes on that device
// (the calling thread's current device is restored afterwards).
Status CheckKernelImagesFor(int device);

}  // namespace moerun
