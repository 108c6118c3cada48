// The CUDA layer's kernels and their launchers (CUDA types: only inside experts/cuda and
// router/cuda). Every kernel reads the batch's token count from device memory (`ntok`) and is
// launched for an upper bound of it, so a sequence of launches can be captured once per graph
// bucket and replayed for any batch of that bucket. See cuda_layer.h for the math contracts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "experts/cpu/kernels.h"
#include "router/gate.h"

namespace moerun::cuda_kernels {

// One expert's (or the shared expert's) weights on the device, in the layout of device_plan.h.
struct DevGroup {
  const void* w13 = nullptr;  // [2 * inter_pad][hidden], weight type
  const void* w2 = nullptr;   // [hidden][inter_pad], weight type (zero beyond inter)
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

// --- router/cuda/gate_kernels.cu ---
// logits[t][r] = fma chain over h (in order) of x[t][h] * gate[r][h], r < gate_rows: the CPU
// GEMM's contract, so the logits are bitwise the CPU's.
void LaunchGateLogits(const float* x, const float* gate, int64_t tokens_bound, int64_t hidden,
                      int gate_rows, float* logits, const int32_t* ntok, cudaStream_t s);
// The gate function per token (router/gate.h semantics, bit for bit), the shared-expert scale,
// and a flag set when a token is routed to an expert that is not loaded (present[e] == 0).
void LaunchRoute(const GateSpec& g, const float* logits, int gate_rows, const float* gate_bias,
                 const float* selection_bias, bool shared_gated, const uint8_t* present,
                 int64_t tokens_bound, int32_t* ids, float* weights, float* shared_scale,
                 int32_t* error_flag, const int32_t* ntok, cudaStream_t s);

// --- experts/cuda/group_kernels.cu ---
// Groups the tokens' assignments by expert (then token, then slot: the CPU's ExpertGroups
// order), the shared expert's rows (token order) last; fills counts, offsets, tile offsets for
// tile height bm, row_token and slot_row.
void LaunchGroupRows(const int32_t* ids, int64_t tokens_bound, int k, int experts, bool shared,
                     int bm, const DevRows& r, const int32_t* ntok, cudaStream_t s);
// rows[r][:] = x[row_token[r]][:] converted to the row type, for r < row_off[groups].
void LaunchGather(const float* x, int64_t hidden, const DevRows& r, int groups, int64_t rows_bound,
                  WType row_type, void* rows, cudaStream_t s);
// rows (f32) -> rows of row_type, for r < n (host-known count).
void LaunchConvertRows(const float* in, int64_t n, WType row_type, void* out, cudaStream_t s);
// out[t][h] = sum over slots in order of w * y[slot_row], then + c * y[shared row]: CombineToken.
void LaunchCombine(const float* y, int64_t hidden, const DevRows& r, int experts, bool shared,
                   const float* weights, const float* shared_scale, int k, int64_t tokens_bound,
                   float* out, const int32_t* ntok, cudaStream_t s);

// --- experts/cuda/ffn_kernels.cu ---
struct FfnArgs {
  const DevGroup* groups = nullptr;  // device array [n_groups]
  int n_groups = 0;
  DevRows rows;
  int64_t rows_bound = 0;  // upper bound of the rows (grid size)
  int64_t hidden = 0;
  int64_t inter_pad_max = 0;  // row stride of the hidden activations
  WType wtype = WType::kF32;  // weights (exact: any; mma: kBF16 or kF16, equal to the rows')
  const void* in = nullptr;   // [rows][hidden]: f32 (exact) or wtype (mma)
  void* act = nullptr;        // [rows][inter_pad_max]: f32 (exact) or wtype (mma)
  float* y = nullptr;         // [rows][hidden]
};
void LaunchFfnExact(const FfnArgs& a, cudaStream_t s);
void LaunchFfnMma(const FfnArgs& a, cudaStream_t s);

// --- experts/cuda/preset_gen.cu ---
// Fills a preset expert's device weights (cuda_layer.h FromPreset): W13 rows from tensors 1/2,
// W2 from tensor 3, each value preset_hash::Element(...) * scale rounded to wtype.
void LaunchPresetExpert(uint64_t seed, int layer, int expert, int64_t hidden, int64_t inter,
                        int64_t inter_pad, WType wtype, float scale13, float scale2, void* w13,
                        void* w2, cudaStream_t s);

}  // namespace moerun::cuda_kernels
