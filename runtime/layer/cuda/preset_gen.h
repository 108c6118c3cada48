// Preset weights generated on the device, from the same hash as the host's presets
// (runtime/model/preset_hash.h). Launcher of runtime/layer/cuda/preset_gen.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "experts/cuda/ffn_kernels.h"
#include "experts/cuda/kernel_image.h"

namespace moerun::cuda_kernels {

// Fills a preset expert's device weights (cuda_layer.h FromPreset): W13 rows from tensors 1/2,
// W2 from tensor 3, each value preset_hash::Element(...) * scale rounded to wtype.
void LaunchPresetExpert(uint64_t seed, int layer, int expert, int64_t hidden, int64_t inter,
                        int64_t inter_pad, WType wtype, float scale13, float scale2, void* w13,
                        void* w2, cudaStream_t s);

// Appends the images of the kernels above, as the current device would run them (kernel_image.h).
void AppendPresetKernelImages(std::vector<KernelImage>& out);

}  // namespace moerun::cuda_kernels
