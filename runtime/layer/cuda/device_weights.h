// The expert weights of the CUDA layer as the device holds them, built on the host in plain C++
// (so that the format choice, the sizes and the repacking are tested on machines without a GPU):
//   plain formats (f32, bf16, f16): W13 [2 * inter_pad][hidden] and W2 [hidden][inter_pad] values
//     in the row order of experts/cuda/tile_layout.h;
//   block-scaled formats (FP8 e4m3, MXFP4): the same rows as codes, 1 or 0.5 byte a weight, plus
//     their scales (experts/cuda/quant_layout.h): FP8 one f32 per 64 rows x 128 inputs, MXFP4 one
//     e8m0 byte per row and 32 inputs. They stay quantized; the kernels decode them in their loads.
// Nothing is converted silently: a weight of another type than the layer's is an error (except
// f32 weights rounded to the tensor cores' type, as the options ask). Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "experts/cpu/expert_weights.h"
#include "experts/cuda/quant_layout.h"

namespace moerun::cuda_plan {

enum class WeightFormat : uint8_t { kF32, kBF16, kF16, kFp8, kMxfp4 };
const char* WeightFormatName(WeightFormat f);  // "f32", "bf16", "f16", "fp8", "mxfp4"
WQuant QuantOf(WeightFormat f);
inline bool IsQuantized(WeightFormat f) { return QuantOf(f) != WQuant::kNone; }

// The device format of a layer whose experts hold `source` weights. Exact math keeps the type
// (F32, BF16, F16, FP8 as F8_E4M3, MXFP4 as F4). Tensor cores multiply `mma` (BF16 or F16): F32
// weights are rounded to it, BF16/F16 weights must be of that type (else rounded twice), FP8 runs
// on either (its codes are exact in both), MXFP4 on BF16 only (its e8m0 scales exceed F16's range).
Result<WeightFormat> ChooseWeightFormat(DType source, bool tensor_cores, DType mma);

// Device bytes of one expert (inter is padded to kColBlock; scales of the block-scaled formats).
struct ExpertBytes {
  size_t w13 = 0, w2 = 0, s13 = 0, s2 = 0;
  size_t total() const { return w13 + w2 + s13 + s2; }
};
ExpertBytes DeviceExpertBytes(WeightFormat f, int64_t hidden, int64_t inter);
// Device bytes per weight of an expert of that shape (scales and padding included).
double DeviceBytesPerWeight(WeightFormat f, int64_t hidden, int64_t inter);

// One expert's device image: what Upload copies, buffer for buffer.
struct ExpertImage {
  WeightFormat format = WeightFormat::kF32;
  int64_t hidden = 0, inter = 0;
  std::vector<uint8_t> w13, w2;  // values or codes
  std::vector<uint8_t> s13, s2;  // scales (block-scaled formats), else empty
  size_t bytes() const { return w13.size() + w2.size() + s13.size() + s2.size(); }
};

// Repacks one CPU-packed expert (experts/cpu/packed_matrix.h: any kernel variant's packing) into
// format f. `what` names it in errors ("expert 3"). Errors: weights of another type than f's
// (F32 weights are rounded to a 16-bit f only when `round_f32`: tensor cores), FP8 scales that
// differ within one 64-row x 128-input block, MXFP4 scales that are not powers of two.
Result<ExpertImage> BuildExpertImage(const ExpertWeights& ew, WeightFormat f, bool round_f32,
                                     const std::string& what);

}  // namespace moerun::cuda_plan
