// A preset's expert weights generated on the device, value for value those of
// runtime/model/preset.cc (the same preset_hash functions, rounded to nearest even), in the device
// layout of device_plan.h.
#include "experts/cuda/convert.cuh"
#include "experts/cuda/kernel_image.cuh"
#include "experts/cuda/tile_layout.h"
#include "runtime/layer/cuda/preset_gen.h"
#include "runtime/model/preset_hash.h"

namespace moerun::cuda_kernels {
namespace {

constexpr int kGateTensor = 1, kUpTensor = 2, kDownTensor = 3;

// Block x = one row of W13 [2 * inter_pad][hidden] (x: no 65535 limit), y = a chunk of it.
template <typename T>
__global__ void PresetW13(uint64_t seed, int layer, int expert, int64_t hidden, int64_t inter,
                          float scale, T* w13) {
  const int64_t rr = blockIdx.x;
  const int64_t within = rr % (2 * cuda_plan::kColBlock);
  const bool up = within >= cuda_plan::kColBlock;
  const int64_t j = (rr / (2 * cuda_plan::kColBlock)) * cuda_plan::kColBlock +
                    (up ? within - cuda_plan::kColBlock : within);
  const uint64_t row_seed =
      preset_hash::RowSeed(seed, layer, up ? kUpTensor : kGateTensor, expert, j);
  T* out = w13 + rr * hidden;
  for (int64_t k = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; k < hidden;
       k += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    out[k] = FromFloat<T>(j < inter ? preset_hash::Element(row_seed, k, scale) : 0.0f);
  }
}

// Block x = one row of W2 [hidden][inter_pad].
template <typename T>
__global__ void PresetW2(uint64_t seed, int layer, int expert, int64_t inter, int64_t inter_pad,
                         float scale, T* w2) {
  const int64_t n = blockIdx.x;
  const uint64_t row_seed = preset_hash::RowSeed(seed, layer, kDownTensor, expert, n);
  T* out = w2 + n * inter_pad;
  for (int64_t k = threadIdx.x; k < inter_pad; k += blockDim.x) {
    out[k] = FromFloat<T>(k < inter ? preset_hash::Element(row_seed, k, scale) : 0.0f);
  }
}

template <typename T>
void Launch(uint64_t seed, int layer, int expert, int64_t hidden, int64_t inter, int64_t inter_pad,
            float scale13, float scale2, void* w13, void* w2, cudaStream_t s) {
  const unsigned kx = static_cast<unsigned>((hidden + 255) / 256 < 8 ? (hidden + 255) / 256 : 8);
  PresetW13<T><<<dim3(static_cast<unsigned>(2 * inter_pad), kx), 256, 0, s>>>(
      seed, layer, expert, hidden, inter, scale13, static_cast<T*>(w13));
  PresetW2<T><<<dim3(static_cast<unsigned>(hidden), 1), 256, 0, s>>>(
      seed, layer, expert, inter, inter_pad, scale2, static_cast<T*>(w2));
}

}  // namespace

void LaunchPresetExpert(uint64_t seed, int layer, int expert, int64_t hidden, int64_t inter,
                        int64_t inter_pad, WType wtype, float scale13, float scale2, void* w13,
                        void* w2, cudaStream_t s) {
  switch (wtype) {
    case WType::kF32:
      Launch<float>(seed, layer, expert, hidden, inter, inter_pad, scale13, scale2, w13, w2, s);
      break;
    case WType::kBF16:
      Launch<__nv_bfloat16>(seed, layer, expert, hidden, inter, inter_pad, scale13, scale2, w13, w2,
                            s);
      break;
    case WType::kF16:
      Launch<__half>(seed, layer, expert, hidden, inter, inter_pad, scale13, scale2, w13, w2, s);
      break;
  }
}

void AppendPresetKernelImages(std::vector<KernelImage>& out) {
  // Plain CUDA-core code: no architecture of its own.
  out.push_back(ImageOf(PresetW13<float>, "PresetW13<f32>", 0));
  out.push_back(ImageOf(PresetW13<__nv_bfloat16>, "PresetW13<bf16>", 0));
  out.push_back(ImageOf(PresetW13<__half>, "PresetW13<f16>", 0));
  out.push_back(ImageOf(PresetW2<float>, "PresetW2<f32>", 0));
  out.push_back(ImageOf(PresetW2<__nv_bfloat16>, "PresetW2<bf16>", 0));
  out.push_back(ImageOf(PresetW2<__half>, "PresetW2<f16>", 0));
}

}  // namespace moerun::cuda_kernels
