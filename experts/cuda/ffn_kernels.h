// The grouped expert FFN on the device, and the types every kernel of the CUDA layer shares
// (CUDA types stay in the cuda/ folders). Every kernel reads the batch's token count from device
// memory (`ntok`) and is launched for an upper bound of it, so a sequence of launches can be
// captured once per graph bucket and replayed for any batch of that bucket. The math contracts
// are in runtime/layer/cuda/cuda_layer.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "experts/cpu/kernels.h"
#include "experts/cuda/kernel_image.h"
#include "experts/cuda/quant_layout.h"

namespace moerun::cuda_kernels {

// One expert's (or the shared expert's) weights on the device, in the layout of tile_layout.h
// (block-scaled weights: codes and scales as quant_layout.h lays them out).
struct DevGroup {
  const void* w13 = nullptr;  // [2 * inter_pad][hidden], weight type, or codes
  const void* w2 = nullptr;   // [hidden][inter_pad], weight type or codes (zero beyond inter)
  const void* s13 = nullptr;  // block-scaled weights: the scales of w13 and w2; else null
  const void* s2 = nullptr;
  const float* bias_g = nullptr;
  const float* bias_u = nullptr;  // [inter_pad] or null
  const float* bias_d = nullptr;  // [hidden] or null
  int32_t inter = 0, inter_pad = 0;
  ActParams act;
};

// Row grouping of one batch on the device.
struct DevRows {
  int32_t* counts = nullptr;     // [groups]
  int32_t* row_off = nullptr;    // [groups + 1]
  int32_t* tile_off = nullptr;   // [groups + 1], m-tiles of the FFN kernels' tile height
  int32_t* row_token = nullptr;  // [rows]
  int32_t* slot_row = nullptr;   // [tokens * k]
};

enum class WType { kF32, kBF16, kF16 };

// Tile heights of the FFN kernels (the tile schedule depends on them).
constexpr int kExactBm = 32;
constexpr int kMmaBm = 64;

struct FfnArgs {
  const DevGroup* groups = nullptr;  // device array [n_groups]
  int n_groups = 0;
  DevRows rows;
  int64_t rows_bound = 0;  // upper bound of the rows (grid size)
  int64_t hidden = 0;
  int64_t inter_pad_max = 0;  // row stride of the hidden activations
  WType wtype = WType::kF32;  // weights (exact: any; mma: kBF16 or kF16, equal to the rows')
  // Block-scaled weights (every group's): exact math decodes them to fp32 (wtype unused), tensor
  // cores to wtype (FP8: bf16 or f16; MXFP4: bf16 only, the launch does nothing for f16).
  cuda_plan::WQuant quant = cuda_plan::WQuant::kNone;
  const void* in = nullptr;  // [rows][hidden]: f32 (exact) or wtype (mma)
  void* act = nullptr;       // [rows][inter_pad_max]: f32 (exact) or wtype (mma)
  float* y = nullptr;        // [rows][hidden]
  // Optional device flag (null: not checked): f16 tensor cores store 1 in it when a finite
  // activation does not fit f16 (rounds to inf); it is never cleared here.
  int32_t* overflow = nullptr;
};
void LaunchFfnExact(const FfnArgs& a, cudaStream_t s);
void LaunchFfnMma(const FfnArgs& a, cudaStream_t s);

// Appends the image of every kernel LaunchFfnExact and LaunchFfnMma can launch, as the current
// device would run it (kernel_image.h; the tensor-core ones need sm_80).
void AppendFfnKernelImages(std::vector<KernelImage>& out);

}  // namespace moerun::cuda_kernels
