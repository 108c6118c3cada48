// Grouping a batch's assignments by expert on the device (the CPU's router/expert_groups.h
// order), gathering the rows, and the fixed-order combine (router/combine.h). Launchers of
// router/cuda/group_kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "experts/cuda/ffn_kernels.h"
#include "experts/cuda/kernel_image.h"

namespace moerun::cuda_kernels {

// Groups the tokens' assignments by expert (then token, then slot: the CPU's ExpertGroups
// order), the shared expert's rows (token order) last; fills counts, offsets, tile offsets for
// tile height bm, row_token and slot_row.
void LaunchGroupRows(const int32_t* ids, int64_t tokens_bound, int k, int experts, bool shared,
                     int bm, const DevRows& r, const int32_t* ntok, cudaStream_t s);
// rows[r][:] = x[row_token[r]][:] converted to the row type, for r < row_off[groups].
// `overflow` (device flag, optional): set to 1 when a finite f32 value does not fit f16 (rounds
// to inf) converting to f16 rows; never cleared here.
void LaunchGather(const float* x, int64_t hidden, const DevRows& r, int groups, int64_t rows_bound,
                  WType row_type, void* rows, cudaStream_t s, int32_t* overflow = nullptr);
// rows (f32) -> rows of row_type, for r < n (host-known count); `overflow` as LaunchGather's.
void LaunchConvertRows(const float* in, int64_t n, WType row_type, void* out, cudaStream_t s,
                       int32_t* overflow = nullptr);
// out[t][h] = sum over slots in order of w * y[slot_row], then + c * y[shared row]: CombineToken.
void LaunchCombine(const float* y, int64_t hidden, const DevRows& r, int experts, bool shared,
                   const float* weights, const float* shared_scale, int k, int64_t tokens_bound,
                   float* out, const int32_t* ntok, cudaStream_t s);

// Appends the image of every kernel above, as the current device would run it (kernel_image.h).
void AppendGroupKernelImages(std::vector<KernelImage>& out);

}  // namespace moerun::cuda_kernels
